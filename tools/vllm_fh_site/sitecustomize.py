"""Stack dumps for start-up probes (tools/vllm_gpu_mp_probe.sh): with FUSED_LOGP_FH_DIR set, every Python process
started with this directory on PYTHONPATH (and every child it forks) writes its threads' stacks to
FUSED_LOGP_FH_DIR/tb-<pid>.txt on SIGUSR1. Only the signal handler: faulthandler's periodic dump
(dump_traceback_later) runs a watchdog thread whose lock a fork can copy held, and a forked child that re-arms it
then blocks there, a hang of the probe's own making."""
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


if _dir:
    _arm()
    os.register_at_fork(after_in_child=_arm)
