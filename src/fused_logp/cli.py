"""The `fused-logp` command. The library's own subcommands are `golden` and `audit` (recompute recorded logprobs
on a CPU, fused_logp.audit); `demo`, `agreement`, `rl` and `ladder`
are jobs of the harness (src/fused_logp_jobs), which runs from a source checkout and is not part of the wheel."""
from __future__ import annotations

import argparse
import json
import sys

JOBS = ("demo", "agreement", "rl", "ladder")


def _golden(argv) -> int:
    from .golden import golden_digests, write_golden
    p = argparse.ArgumentParser(prog="fused-logp golden",
                                description="print (or --write) the golden fingerprints of a backend")
    p.add_argument("--backend", default="oracle")
    p.add_argument("--write", action="store_true", help="store them in fused_logp/golden/golden.json")
    args = p.parse_args(argv)
    print(json.dumps(golden_digests(args.backend), indent=2))
    if args.write:
        write_golden(args.backend)
    return 0


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    cmd = next((a for a in argv if not a.startswith("-")), None)
    if cmd == "golden":
        argv.remove("golden")
        return _golden(argv)
    if cmd == "audit":
        from .audit import main as audit_main
        argv.remove("audit")
        return audit_main(argv)
    try:
        from fused_logp_jobs.cli import main as jobs_main
    except ImportError:
        print(f"fused-logp: {' / '.join(JOBS)} are jobs of the source checkout (src/fused_logp_jobs), which is not "
              "installed here; run `make demo` in a checkout. This installation has: fused-logp golden, fused-logp audit",
              file=sys.stderr)
        return 2
    return jobs_main(argv)


if __name__ == "__main__":
    sys.exit(main())
