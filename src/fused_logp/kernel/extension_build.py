"""Building and loading the compiled backends (the SM90 kernel, the compiled CPU oracle) through one cache that every
process of a node shares, and one check: the contract constants compiled into an extension must be
shared_contract/constants.py's. No fallback: a failed build or a differing constant is returned as the reason the
backend is unavailable.

The cache (FUSED_LOGP_CACHE, default $XDG_CACHE_HOME/fused_logp or ~/.cache/fused_logp) holds one folder per
extension and key, `<name>/<key>/`: the shared library and `build.json`, written last. The key is a sha256 over the
bytes of every source and header, the compiler flags, the toolkit (nvcc's or the C++ compiler's version line), the
torch version and its CUDA version, the Python ABI and the contract version; a change of any of them is a new key.

- A process whose key is in the cache loads the library and compiles nothing.
- Otherwise one process builds: it holds an exclusive `flock` on `<name>/<key>.lock` while it compiles into a
  private folder, then renames that folder into place (atomic; a half-built folder is never read). Every other
  process that wants the same key waits on the lock, then loads what the builder left. The kernel drops an flock
  when its holder dies, so an interrupted build blocks nobody; its leftover folder is removed by the next builder.
- FUSED_LOGP_NO_BUILD=1: never compile; a key missing from the cache is an error that says to run
  `fused-logp build`.

`fused-logp build` (fused_logp/cli.py) fills the cache ahead of time. Each load or build logs one INFO line on the
`fused_logp` logger that says which happened, from where, and how long it took.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from ..shared_contract.constants import CONTRACT_VERSION

log = logging.getLogger("fused_logp")

# sm_90a (wgmma, setmaxnreg, the tensor-memory accelerator) is PTX ISA 8.0: CUDA 12.0 and newer.
MIN_CUDA = (12, 0)
_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")


class BuildError(RuntimeError):
    """An extension cannot be built or loaded here. The message is one line naming what is missing."""


@dataclasses.dataclass(frozen=True)
class ExtensionSpec:
    """What torch.utils.cpp_extension.load is given, plus the headers whose bytes enter the key."""
    name: str
    sources: tuple
    extra_include_paths: tuple = ()
    extra_cflags: tuple = ()
    extra_cuda_cflags: tuple = ()
    extra_ldflags: tuple = ()

    @property
    def cuda(self) -> bool:
        return any(str(s).endswith(".cu") for s in self.sources)

    @classmethod
    def from_load_kwargs(cls, **kw) -> "ExtensionSpec":
        unknown = set(kw) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"unsupported build arguments: {sorted(unknown)}")
        return cls(**{k: tuple(v) if isinstance(v, (list, tuple)) else v for k, v in kw.items()})

    def headers(self) -> list:
        seen = set()
        out = []
        for d in list(self.extra_include_paths) + sorted({str(Path(s).parent) for s in self.sources}):
            p = Path(d)
            if not p.is_dir():
                continue
            for f in sorted(p.iterdir()):
                if f.suffix in _HEADER_SUFFIXES and f not in seen:
                    seen.add(f)
                    out.append(f)
        return out


# ---------------------------------------------------------------------------------------------------------
# the toolkit
# ---------------------------------------------------------------------------------------------------------

def cache_root() -> Path:
    env = os.environ.get("FUSED_LOGP_CACHE")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "fused_logp"


def find_nvcc() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home:
        cand = Path(home) / "bin" / "nvcc"
        return str(cand) if cand.exists() else None
    found = shutil.which("nvcc")
    if found:
        return found
    cand = Path("/usr/local/cuda/bin/nvcc")
    return str(cand) if cand.exists() else None


def _run_version(cmd) -> str:
    try:
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise BuildError(f"{cmd[0]} could not be run ({type(exc).__name__}: {exc})") from None
    if r.returncode != 0:
        raise BuildError(f"`{' '.join(cmd)}` failed (exit {r.returncode}): {r.stdout.strip()[-200:]}")
    return r.stdout


def nvcc_version(nvcc: str) -> tuple[tuple[int, int], str]:
    """((major, minor), the version line) of an nvcc."""
    text = _run_version([nvcc, "--version"])
    m = re.search(r"release (\d+)\.(\d+)", text)
    if not m:
        raise BuildError(f"{nvcc} --version does not name a CUDA release: {text.strip()[-200:]}")
    line = next((x for x in text.splitlines() if "release" in x), text.strip().splitlines()[-1])
    return (int(m.group(1)), int(m.group(2))), line.strip()


def cuda_toolkit(torch_cuda: str | None = None) -> tuple[str, str]:
    """(nvcc path, its version line) fit for building the SM90 extension with this torch; BuildError naming what to
    install otherwise."""
    import torch
    torch_cuda = torch.version.cuda if torch_cuda is None else torch_cuda
    if not torch_cuda:
        raise BuildError(f"torch {torch.__version__} is a CPU build: the sm90 extension needs a CUDA build of torch "
                         f"(e.g. pip install torch --index-url https://download.pytorch.org/whl/cu130)")
    nvcc = find_nvcc()
    if nvcc is None:
        where = ("CUDA_HOME=" + (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "")
                 if (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) else "PATH and /usr/local/cuda")
        raise BuildError(f"nvcc not found ({where}): install the CUDA toolkit {torch_cuda.split('.')[0]}.x "
                         f"(torch {torch.__version__} is built with CUDA {torch_cuda}; nvcc 12.0 or newer for "
                         f"sm_90a) and put its bin/ on PATH or set CUDA_HOME")
    ver, line = nvcc_version(nvcc)
    if ver < MIN_CUDA:
        raise BuildError(f"{nvcc} is CUDA {ver[0]}.{ver[1]}; sm_90a needs CUDA {MIN_CUDA[0]}.{MIN_CUDA[1]} or newer: "
                         f"install the CUDA toolkit {torch_cuda.split('.')[0]}.x and set CUDA_HOME to it")
    if str(ver[0]) != torch_cuda.split(".")[0]:
        raise BuildError(f"{nvcc} is CUDA {ver[0]}.{ver[1]} but torch {torch.__version__} is built with CUDA "
                         f"{torch_cuda}: install the CUDA toolkit {torch_cuda.split('.')[0]}.x (or a torch built for "
                         f"CUDA {ver[0]}) and set CUDA_HOME to it")
    return nvcc, line


def cxx_toolkit() -> tuple[str, str]:
    cxx = os.environ.get("CXX", "c++")
    path = shutil.which(cxx) or shutil.which("g++")
    if path is None:
        raise BuildError(f"no C++ compiler ({cxx!r} or g++) on PATH: install one (Debian/Ubuntu: apt-get install g++)")
    return path, _run_version([path, "--version"]).strip().splitlines()[0]


def toolkit(spec: ExtensionSpec) -> str:
    """The version line of the compiler that builds spec (nvcc for CUDA sources, else the C++ compiler)."""
    if spec.cuda:
        nvcc, line = cuda_toolkit()
        cxx_line = cxx_toolkit()[1]
        return f"{line} | {cxx_line}"
    return cxx_toolkit()[1]


# ---------------------------------------------------------------------------------------------------------
# the key and the cache
# ---------------------------------------------------------------------------------------------------------

def _file_digest(path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def build_key(spec: ExtensionSpec, toolkit_line: str) -> str:
    import torch
    files = [(Path(s).name, _file_digest(s)) for s in spec.sources]
    files += [(f.name, _file_digest(f)) for f in spec.headers()]
    desc = {
        "name": spec.name, "files": files,
        "cflags": list(spec.extra_cflags), "cuda_cflags": list(spec.extra_cuda_cflags),
        "ldflags": list(spec.extra_ldflags),
        "toolkit": toolkit_line, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "python": sysconfig.get_config_var("EXT_SUFFIX") or sys.version, "contract": CONTRACT_VERSION,
    }
    return hashlib.sha256(json.dumps(desc, sort_keys=True).encode()).hexdigest()[:20]


def entry_dir(spec: ExtensionSpec, key: str, root: Path | None = None) -> Path:
    return (root or cache_root()) / spec.name / key


def _ready(folder: Path) -> dict | None:
    try:
        meta = json.loads((folder / "build.json").read_text())
    except (OSError, ValueError):
        return None
    lib = folder / str(meta.get("library", ""))
    return meta if meta.get("library") and lib.is_file() else None


def _import(folder: Path, meta: dict):
    import torch  # noqa: F401  (the library links against torch's; it must be loaded first)
    lib = folder / meta["library"]
    spec = importlib.util.spec_from_file_location(meta["module"], str(lib))
    if spec is None or spec.loader is None:
        raise BuildError(f"{lib} cannot be imported as a Python extension")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def _flock(path: Path, what: str):
    """An exclusive flock on path, waiting for its holder (logged) if there is one."""
    import fcntl
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(path), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("fused_logp: %s: another process is building it (lock %s); waiting", what, path)
            t0 = time.perf_counter()
            fcntl.flock(fd, fcntl.LOCK_EX)
            log.info("fused_logp: %s: waited %.1f s for the other build", what, time.perf_counter() - t0)
        yield
    finally:
        os.close(fd)            # releases the lock


def _torch_build(spec: ExtensionSpec, folder: Path, verbose: bool):
    """Compile spec into folder with torch's builder; -> (module, library file name)."""
    from torch.utils.cpp_extension import load
    module = load(name=spec.name, sources=[str(s) for s in spec.sources],
                  extra_include_paths=[str(p) for p in spec.extra_include_paths] or None,
                  extra_cflags=list(spec.extra_cflags) or None, extra_cuda_cflags=list(spec.extra_cuda_cflags) or None,
                  extra_ldflags=list(spec.extra_ldflags) or None, build_directory=str(folder), verbose=verbose)
    return module, Path(module.__file__).name


def ensure_extension(spec: ExtensionSpec, *, what: str | None = None, allow_build: bool | None = None,
                     force: bool = False, root: Path | None = None, builder=None) -> tuple[object, dict]:
    """Load spec's extension from the cache, building it first (one process of the node at a time) when its key is
    not there. -> (module, info) with info {"action": "loaded" | "built" | "built-by-another", "path", "key",
    "seconds"}. Raises BuildError (one line) when it cannot. `builder(spec, folder) -> (module, library name)` is the
    compile step (default: torch.utils.cpp_extension.load into folder)."""
    what = what or spec.name
    if allow_build is None:
        allow_build = os.environ.get("FUSED_LOGP_NO_BUILD", "").strip().lower() not in ("1", "true", "yes", "on")
    t0 = time.perf_counter()
    key = build_key(spec, toolkit(spec))
    folder = entry_dir(spec, key, root)
    meta = None if force else _ready(folder)
    if meta is not None:
        module = _import(folder, meta)
        info = {"action": "loaded", "path": str(folder), "key": key, "seconds": time.perf_counter() - t0}
        log.info("fused_logp: %s loaded from the cache %s (built %s; %.2f s, nothing compiled)", what, folder,
                 meta.get("built_at", "?"), info["seconds"])
        return module, info
    if not allow_build:
        raise BuildError(f"{what} is not in the cache {folder.parent} for key {key} and FUSED_LOGP_NO_BUILD is set: "
                         f"run `fused-logp build` on this node (same FUSED_LOGP_CACHE) first")
    with _flock(folder.parent / f"{key}.lock", what):
        meta = None if force else _ready(folder)
        if meta is not None:                    # another process built it while this one waited
            module = _import(folder, meta)
            info = {"action": "built-by-another", "path": str(folder), "key": key,
                    "seconds": time.perf_counter() - t0}
            log.info("fused_logp: %s loaded from the cache %s after another process built it (%.1f s)", what,
                     folder, info["seconds"])
            return module, info
        for stale in folder.parent.glob(f"{key}.tmp-*"):      # left by a build that was interrupted
            shutil.rmtree(stale, ignore_errors=True)
        tmp = folder.parent / f"{key}.tmp-{os.getpid()}"
        tmp.mkdir(parents=True)
        log.info("fused_logp: %s is not in the cache for key %s: building it into %s", what, key, folder)
        tb = time.perf_counter()
        try:
            module, library = (builder or (lambda s, f: _torch_build(
                s, f, bool(os.environ.get("FUSED_LOGP_BUILD_VERBOSE")))))(spec, tmp)
        except BaseException as exc:
            failed = folder.parent / f"{key}.failed.log"
            with contextlib.suppress(OSError):
                failed.write_text(f"{type(exc).__name__}: {exc}\n")
            shutil.rmtree(tmp, ignore_errors=True)
            if not isinstance(exc, Exception):
                raise
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise BuildError(f"building {what} failed ({type(exc).__name__}: {first}); the compiler's output is in "
                             f"{failed}") from exc
        seconds = time.perf_counter() - tb
        meta = {"name": spec.name, "module": Path(library).name.split(".")[0], "library": library, "key": key,
                "seconds": round(seconds, 2), "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "pid": os.getpid(), "contract": CONTRACT_VERSION}
        (tmp / "build.json").write_text(json.dumps(meta, indent=2) + "\n")
        if folder.exists():                     # an entry without build.json (never read): replaced
            shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
        with contextlib.suppress(OSError):
            (folder.parent / f"{key}.failed.log").unlink()
    info = {"action": "built", "path": str(folder), "key": key, "seconds": time.perf_counter() - t0,
            "compile_seconds": seconds}
    log.info("fused_logp: %s built into the cache %s in %.1f s (key %s)", what, folder, seconds, key)
    return module, info


def cache_status(spec: ExtensionSpec, root: Path | None = None) -> dict:
    """{"key", "path", "current": bool} of spec in the cache, compiling nothing (BuildError without a toolkit)."""
    key = build_key(spec, toolkit(spec))
    folder = entry_dir(spec, key, root)
    return {"key": key, "path": str(folder), "current": _ready(folder) is not None}


# the last answer of each extension built in this process, for `describe()` and the CLI
last_build: dict = {}


def build_checked(what: str, want_constants, **load_kwargs):
    """The extension of load_kwargs (torch.utils.cpp_extension.load's arguments) through the cache, then its
    contract_constants() against want_constants. -> (module, None), or (None, the reason naming `what`)."""
    try:
        spec = ExtensionSpec.from_load_kwargs(**load_kwargs)
        ext, info = ensure_extension(spec, what=what)
    except BuildError as exc:
        return None, str(exc)
    except Exception as exc:  # the reason is reported by the backend's available()
        return None, f"building {what} failed: {type(exc).__name__}: {exc}"
    last_build[spec.name] = info
    got = [int(v) for v in ext.contract_constants()]
    want = list(want_constants)
    if got != want:
        return None, (f"{what}'s contract constants differ from shared_contract/constants.py ({CONTRACT_VERSION}): "
                      f"{got} != {want}")
    return ext, None
