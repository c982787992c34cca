"""Start-up of the SM90 backend with a cold and a warm extension cache (kernel/extension_build.py), on an SM90 GPU.

Each measurement is a fresh Python process that imports the library and makes its first linear_logp call on the GPU
(then a second one, and a first forward + backward), as an engine's first step does; the parent times the whole
process too. Phases, each written to <out>/startup_cold_warm.json as soon as it is done:

  cold        one process on an empty cache: it compiles the extension (the old behaviour of every engine start)
  warm        WARM_RUNS processes one after another on that cache: each loads it, compiling nothing
  build_warm  `fused-logp build` and `fused-logp build --check` on the warm cache
  interrupted `fused-logp build` on a second empty cache, killed (SIGKILL, its process group) part-way
  together    PROCS processes started at once on that cache, right after the kill: one builds, the others wait on
              its lock and load; none is blocked by the killed build
  warm_after  one more process on the second cache

    PYTHONPATH=src python -P bench/startup_cold_warm.py --out $OUT
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, logging, os, sys, time
t0 = time.perf_counter()
lines = []
class Keep(logging.Handler):
    def emit(self, record):
        lines.append(record.getMessage())
logging.getLogger("fused_logp").addHandler(Keep())
logging.getLogger("fused_logp").setLevel(logging.INFO)
import torch
from fused_logp import linear_logp
t_import = time.perf_counter() - t0
out = {"import_s": t_import}
try:
    torch.cuda.init()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    n, d, v = 512, 4096, 32768
    h = torch.randn(n, d, device=dev, generator=g).bfloat16()
    w = (torch.randn(v, d, device=dev, generator=g) * d ** -0.5).bfloat16()
    t = torch.randint(0, v, (n,), device=dev, generator=g)
    torch.cuda.synchronize()
    out["inputs_s"] = time.perf_counter() - t0 - t_import
    t1 = time.perf_counter()
    r = linear_logp(h, w, t, backend="sm90")
    torch.cuda.synchronize()
    out["first_call_s"] = time.perf_counter() - t1
    out["backend"] = r.provenance.backend
    t1 = time.perf_counter()
    linear_logp(h, w, t, backend="sm90")
    torch.cuda.synchronize()
    out["second_call_s"] = time.perf_counter() - t1
    t1 = time.perf_counter()
    hg = h.clone().requires_grad_(True)
    linear_logp(hg, w, t, backend="sm90").logp.sum().backward()
    torch.cuda.synchronize()
    out["first_forward_backward_s"] = time.perf_counter() - t1
except Exception as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
out["to_first_call_done_s"] = time.perf_counter() - t0
out["log"] = [x for x in lines if "extension" in x]
text = " ".join(out["log"])
out["action"] = ("built-by-another" if "after another process built it" in text else
                 "loaded" if "loaded from the cache" in text else "built" if "built into the cache" in text else "?")
print("RESULT " + json.dumps(out))
"""


def _env(cache: Path) -> dict:
    env = dict(os.environ)
    env["FUSED_LOGP_CACHE"] = str(cache)
    env.pop("FUSED_LOGP_NO_BUILD", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src")] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _start_child(cache: Path):
    return subprocess.Popen([sys.executable, "-P", "-c", CHILD], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(cache), cwd=str(ROOT)), time.perf_counter()


def _finish_child(proc, t0, timeout):
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        return {"error": f"timed out after {timeout} s", "tail": out[-2000:]}
    wall = time.perf_counter() - t0
    m = re.search(r"^RESULT (.*)$", out, re.M)
    res = json.loads(m.group(1)) if m else {"error": "no result", "tail": out[-3000:]}
    res["process_wall_s"] = wall
    res["rc"] = proc.returncode
    return res


def _cli(cache: Path, *args, timeout=400):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-P", "-m", "fused_logp.cli", *args], stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, env=_env(cache), cwd=str(ROOT), timeout=timeout)
    return {"args": list(args), "rc": r.returncode, "wall_s": time.perf_counter() - t0, "output": r.stdout[-1500:]}


def _machine() -> dict:
    info = {"python": sys.version.split()[0]}
    try:
        import torch
        info.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                    gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else None)
    except Exception as exc:
        info["torch_error"] = str(exc)
    try:
        from fused_logp.kernel.extension_build import cuda_toolkit
        info["nvcc"] = cuda_toolkit()[1]
    except Exception as exc:
        info["nvcc_error"] = str(exc)
    info["cpus"] = os.cpu_count()
    return info


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--warm-runs", type=int, default=3)
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--kill-after", type=float, default=15.0, help="seconds into the build at which it is killed")
    ap.add_argument("--deadline", type=float, default=560.0, help="seconds; phases that would not fit are skipped")
    ap.add_argument("--work", default=None, help="folder for the caches, kept afterwards (default: a temporary "
                    "folder, removed); <work>/cache-a is then a warm cache for later processes")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    start = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": _machine(), "shape": {"n": 512, "d": 4096, "v": 32768}, "phases": {}}
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="fl-startup-"))
    work.mkdir(parents=True, exist_ok=True)

    def save():
        tmp = out / ".startup_cold_warm.json.tmp"
        tmp.write_text(json.dumps(report, indent=2) + "\n")
        os.replace(tmp, out / "startup_cold_warm.json")

    def left():
        return args.deadline - (time.perf_counter() - start)

    def summary(name, rows):
        keys = ("process_wall_s", "to_first_call_done_s", "first_call_s", "first_forward_backward_s")
        print(f"{name}: " + "; ".join(f"{r.get('action', '?')} " + " ".join(
            f"{k.replace('_s', '')}={r[k]:.2f}" for k in keys if isinstance(r.get(k), float))
            + (f" ERROR {r['error'][:200]}" if "error" in r else "") for r in rows), flush=True)

    try:
        cold = work / "cache-a"
        p, t0 = _start_child(cold)
        report["phases"]["cold"] = [_finish_child(p, t0, timeout=max(60, left() - 60))]
        summary("cold", report["phases"]["cold"])
        save()
        warm = []
        for _ in range(args.warm_runs):
            p, t0 = _start_child(cold)
            warm.append(_finish_child(p, t0, timeout=120))
        report["phases"]["warm"] = warm
        summary("warm", warm)
        save()
        report["phases"]["build_warm"] = [_cli(cold, "build"), _cli(cold, "build", "--check")]
        print("build_warm:", [(r["rc"], round(r["wall_s"], 2)) for r in report["phases"]["build_warm"]], flush=True)
        save()
        cold_s = report["phases"]["cold"][0].get("process_wall_s", 150.0)
        if left() < 2.2 * cold_s + args.kill_after + 30:
            report["skipped"] = f"interrupted/together: {left():.0f} s left, a cold build took {cold_s:.0f} s"
            save()
            return 0
        second = work / "cache-b"
        victim = subprocess.Popen([sys.executable, "-P", "-m", "fused_logp.cli", "build"], stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, env=_env(second), cwd=str(ROOT),
                                  start_new_session=True)
        t_kill = time.perf_counter() + args.kill_after
        while time.perf_counter() < t_kill and victim.poll() is None:
            time.sleep(0.2)
        tmp_dirs = [str(x) for x in second.rglob("*.tmp-*")]
        finished_first = victim.poll() is not None
        if not finished_first:
            os.killpg(victim.pid, signal.SIGKILL)
        victim.communicate()
        report["phases"]["interrupted"] = {"killed_after_s": args.kill_after, "finished_before_kill": finished_first,
                                           "build_folders_at_kill": tmp_dirs}
        save()
        procs = [_start_child(second) for _ in range(args.procs)]
        together = [_finish_child(p, t0, timeout=max(60, left() - 30)) for p, t0 in procs]
        report["phases"]["together"] = together
        report["phases"]["together_builders"] = sum(r.get("action") == "built" for r in together)
        report["phases"]["stale_build_folders_after"] = [str(x) for x in second.rglob("*.tmp-*")]
        summary("together", together)
        save()
        p, t0 = _start_child(second)
        report["phases"]["warm_after"] = [_finish_child(p, t0, timeout=120)]
        summary("warm_after", report["phases"]["warm_after"])
        save()
    finally:
        report["total_s"] = time.perf_counter() - start
        save()
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
