"""Stack dumps for start-up probes (tools/vllm_gpu_mp_probe.sh): with FUSED_LOGP_FH_DIR set, every Python process
started with this directory on PYTHONPATH (and every child it forks) writes its threads' stacks to
FUSED_LOGP_FH_DIR/tb-<pid>.txt on SIGUSR1 and every FUSED_LOGP_FH_AFTER seconds (default 60)."""
import faulthandler
import os
import signal
import sys

_dir = os.environ.get("FUSED_LOGP_FH_DIR")
_file = None


def _arm():
    global _file
    os.makedirs(_dir, exist_ok=True)
    _file = open(os.path.join(_dir, f"tb-{os.getpid()}.txt"), "w")
    _file.write(f"pid {os.getpid()} ppid {os.getppid()} argv {sys.argv}\n")
    _file.flush()
    faulthandler.register(signal.SIGUSR1, file=_file, all_threads=True)
    faulthandler.dump_traceback_later(float(os.environ.get("FUSED_LOGP_FH_AFTER", "60")), repeat=True, file=_file)


if _dir:
    _arm()
    os.register_at_fork(after_in_child=_arm)
