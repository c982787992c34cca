"""The `fused-logp` command. The library's own subcommands are `build` (compile the extensions into the node's cache
ahead of time), `golden` (compare, or store, the golden fingerprints) and `audit` (recompute recorded logprobs on a
CPU, fused_logp.audit); `demo`, `agreement`, `rl` and `ladder` are jobs of the harness (src/fused_logp_jobs), which
runs from a source checkout and is not part of the wheel.

Every command exits with 0 (done; every compared byte equal), 1 (a mismatch found), 2 (bad input or environment:
one line on stderr naming the argument or file and what is accepted) or 3 (an internal error); an interrupt exits
with 130. `--debug` anywhere on the command line shows the traceback instead of the one line. docs/cli.md has the
table."""
from __future__ import annotations

import argparse
import json
import os
import sys

JOBS = ("demo", "agreement", "rl", "ladder")
COMMANDS = ("build", "golden", "audit") + JOBS

EXIT_OK, EXIT_MISMATCH, EXIT_INPUT, EXIT_INTERNAL, EXIT_INTERRUPT = 0, 1, 2, 3, 130


class CliError(Exception):
    """A command's refusal: one line for stderr and its exit code."""

    def __init__(self, message: str, code: int = EXIT_INPUT):
        super().__init__(message)
        self.code = code


class Parser(argparse.ArgumentParser):
    """argparse with its usage errors as one line (CliError, exit 2) instead of usage + message on stderr."""

    def error(self, message):
        raise CliError(f"{message} (see {self.prog} --help)")


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _input_errors() -> tuple:
    """The exception types that mean bad input or environment (exit 2), not a bug."""
    from .atomic_io import OutputPathError
    from .kernel.extension_build import BuildError
    from .shared_contract.errors import BackendUnavailableError, StrictModeError
    kinds = [ValueError, OSError, BackendUnavailableError, StrictModeError, BuildError, OutputPathError]
    try:
        import yaml
        kinds.append(yaml.YAMLError)
    except ImportError:
        pass
    return tuple(kinds)


def run_command(prog: str, fn, argv, debug: bool = False) -> int:
    """fn(argv) -> exit code, with every failure mapped to the documented exit codes and one line on stderr."""
    try:
        code = fn(argv)
        return EXIT_OK if code is None else int(code)
    except SystemExit as exc:                       # argparse's --help (0); a job's own sys.exit
        c = exc.code
        return c if isinstance(c, int) else (EXIT_OK if c is None else EXIT_INPUT)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return EXIT_INTERRUPT
    except CliError as exc:
        if debug:
            raise
        print(f"{prog}: {_one_line(exc)}", file=sys.stderr)
        return exc.code
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, _input_errors()):
            print(f"{prog}: {_one_line(exc) or type(exc).__name__}", file=sys.stderr)
            return EXIT_INPUT
        print(f"{prog}: internal error: {type(exc).__name__}: {_one_line(exc)} (run again with --debug for the "
              f"traceback)", file=sys.stderr)
        return EXIT_INTERNAL


def _split_global(argv):
    """(--debug, --config value or None, the rest) from argv; --config is taken before the command only."""
    debug = os.environ.get("FUSED_LOGP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    rest, config, i, seen_cmd = [], None, 0, False
    while i < len(argv):
        a = argv[i]
        if a == "--debug":
            debug = True
        elif not seen_cmd and a == "--config":
            if i + 1 >= len(argv):
                raise CliError("argument --config: expected a YAML file path (see fused-logp --help)")
            config, i = argv[i + 1], i + 1
        elif not seen_cmd and a.startswith("--config="):
            config = a.split("=", 1)[1]
        else:
            if not a.startswith("-"):
                seen_cmd = True
            rest.append(a)
        i += 1
    return debug, config, rest


# ---------------------------------------------------------------------------------------------------------
# build
# ---------------------------------------------------------------------------------------------------------

BUILD_TARGETS = ("sm90", "oracle-fast", "all")


def _build(argv) -> int:
    p = Parser(prog="fused-logp build", description=(
        "Compile the extensions into the node's shared cache (FUSED_LOGP_CACHE, default ~/.cache/fused_logp) ahead "
        "of time: one process builds, others wait on its lock; a process that finds its key there loads it and "
        "compiles nothing. sm90 needs nvcc (CUDA 12.0 or newer, the major version of torch's CUDA) and a CUDA build "
        "of torch, no GPU; oracle-fast needs a C++ compiler."))
    p.add_argument("target", nargs="?", default="sm90", choices=BUILD_TARGETS,
                   help="what to build (default sm90; all: sm90 and oracle-fast)")
    p.add_argument("--force", action="store_true", help="sm90: compile again even when the cache is current")
    p.add_argument("--check", action="store_true",
                   help="compile nothing: exit 0 when the cache is current for this node's sources and toolkit, 1 if not")
    args = p.parse_args(argv)
    from .kernel import extension_build as eb
    os.environ["FUSED_LOGP_NO_BUILD"] = "0"
    targets = ("sm90", "oracle-fast") if args.target == "all" else (args.target,)
    code = EXIT_OK
    for t in targets:
        if t == "sm90":
            from .kernel import sm90
            spec = eb.ExtensionSpec.from_load_kwargs(**sm90.build_arguments())
            if args.check:
                st = eb.cache_status(spec)
                print(f"sm90: {'current' if st['current'] else 'NOT in the cache'}: {st['path']}")
                code = max(code, EXIT_OK if st["current"] else EXIT_MISMATCH)
                continue
            ext, info = eb.ensure_extension(spec, what="the sm90 extension", allow_build=True, force=args.force)
            got = [int(v) for v in ext.contract_constants()]
            if got != sm90.expected_constants():
                raise CliError(f"the sm90 extension in {info['path']} carries other contract constants than "
                               f"shared_contract/constants.py: {got} != {sm90.expected_constants()}")
        else:
            from .kernel import oracle_fast
            if args.check:
                raise CliError("build --check covers sm90 only; `fused-logp build oracle-fast` loads or builds it")
            oracle_fast._build()
            if oracle_fast._ext is None:
                raise CliError(oracle_fast._ext_error or "the compiled CPU oracle is not built")
            info = next((v for k, v in eb.last_build.items() if k.startswith("fused_logp_oracle_cpu")), None)
            if info is None:
                print("oracle-fast: ready")
                continue
        how = {"loaded": "current in the cache, nothing compiled", "built": "built",
               "built-by-another": "built by another process"}[info["action"]]
        print(f"{t}: {how}: {info['path']} ({info['seconds']:.1f} s)")
    return code


# ---------------------------------------------------------------------------------------------------------
# golden
# ---------------------------------------------------------------------------------------------------------

def _golden(argv) -> int:
    from .shared_contract.constants import CONTRACT_VERSION
    p = Parser(prog="fused-logp golden", description=(
        "Compute the golden fingerprints (sha256 of the logp/lse bytes of fixed inputs) on a backend and compare "
        "them with the digests stored for this contract version (exit 0 equal, 1 different). --write stores them "
        "instead (contract-bearing backends only, and only digests equal to those already stored)."))
    p.add_argument("--backend", default="oracle", choices=("oracle", "oracle-fast", "sm90", "auto", "torch"),
                   help="default oracle; auto: the backend that auto selects here")
    p.add_argument("--write", action="store_true", help="store the digests (default: compare)")
    p.add_argument("--golden-file", default=None, help="the stored digests (default: the package's golden.json)")
    p.add_argument("--json", action="store_true", help="print the digests as JSON")
    args = p.parse_args(argv)
    from . import golden as G
    path = G.GOLDEN if args.golden_file is None else args.golden_file
    if args.write:
        from .atomic_io import check_output_file
        check_output_file(path, "--golden-file")
    stored_all = G.load_golden(path, missing_ok=args.write)
    name = G.resolve_backend(args.backend)
    from .kernel.backends import get_backend
    backend = get_backend(name)
    if args.write and not backend.contract_bearing:
        raise CliError(f"--write stores digests of contract-bearing backends only (oracle, oracle-fast, sm90); "
                       f"backend {name!r} is not one: nothing written")
    ok, why = backend.available(G.backend_device(name))
    if not ok:
        raise CliError(f"backend {name!r} is unavailable here: {why}")
    stored = stored_all.get(CONTRACT_VERSION, {})
    if not args.write and not stored:
        have = ", ".join(sorted(stored_all)) or "none"
        raise CliError(f"{path} stores no digests for contract {CONTRACT_VERSION} (it has: {have}); "
                       f"`fused-logp golden --write --backend oracle` stores them")
    got = G.golden_digests(name)
    key = G.backend_key(name)
    if args.json:
        print(json.dumps({"backend": key, "contract_version": CONTRACT_VERSION, "digests": got}, indent=2))
    ref_key = key if key in stored else next(iter(sorted(stored)), None)
    differ = [c for c in got if ref_key is not None and stored[ref_key].get(c) != got[c]]
    if args.write:
        if differ:
            print(f"golden: {key}: {len(differ)} of {len(got)} digests differ from the stored {ref_key} "
                  f"({', '.join(differ)}): not written (every contract-bearing backend stores the same digests)",
                  file=sys.stderr)
            return EXIT_MISMATCH
        G.write_golden(name, path=path, digests=got)
        print(f"golden: {key}: {len(got)} digests stored for contract {CONTRACT_VERSION} in {path}")
        return EXIT_OK
    for c in got:
        print(f"  [{'EQUAL' if c not in differ else 'DIFFERS'}] {c}")
    print(f"golden: {key} against the stored {ref_key} (contract {CONTRACT_VERSION}): "
          + ("every digest equal" if not differ else f"{len(differ)} of {len(got)} differ")
          + ("" if backend.contract_bearing else f" (backend {name!r} is not contract-bearing)"))
    return EXIT_MISMATCH if differ else EXIT_OK


# ---------------------------------------------------------------------------------------------------------
# the command
# ---------------------------------------------------------------------------------------------------------

def _top(argv) -> int:
    debug, config, argv = _split_global(argv)
    cmd = next((a for a in argv if not a.startswith("-")), None)
    if cmd is None and any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        print(f"\ncommands: {', '.join(COMMANDS)} (fused-logp COMMAND --help); global options: --config YAML, "
              f"--debug")
        return EXIT_OK
    if cmd is not None and cmd not in COMMANDS:
        raise CliError(f"unknown command {cmd!r}; the commands are {', '.join(COMMANDS)}")
    if config is not None:
        from .shared_contract.config import load_config, set_config
        set_config(load_config(config))
    if cmd in ("build", "golden", "audit"):
        argv.remove(cmd)
        if cmd == "build":
            return _build(argv)
        if cmd == "golden":
            return _golden(argv)
        from .audit import main as audit_main
        return audit_main(argv, _wrapped=True)
    try:
        from fused_logp_jobs.cli import main as jobs_main
    except ImportError:
        raise CliError(f"{' / '.join(JOBS)} are jobs of the source checkout (src/fused_logp_jobs), which is not "
                       "installed here; run `make demo` in a checkout. This installation has: fused-logp build, "
                       "fused-logp golden, fused-logp audit") from None
    return jobs_main(argv, _wrapped=True)


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv or os.environ.get("FUSED_LOGP_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")
    cmd = next((a for a in argv if a in COMMANDS), None)
    return run_command(f"fused-logp {cmd}" if cmd else "fused-logp", _top, argv, debug=debug)


if __name__ == "__main__":             # `python -m fused_logp.cli`: the package's module, so its error classes are one
    from fused_logp.cli import main as _package_main
    sys.exit(_package_main())
