"""Does loading and calling the SM90 extension slow the host side of the process that does it?

The vLLM speed runs on the H200 (docs/vllm.md) found every host function of an engine with the plugin enabled
~1.4x slower than in a plain engine, vLLM's own included. This probe measures, in one process, at each stage
(after CUDA start; after importing torch.utils.cpp_extension; after loading the extension; after 300 serving-head
calls; after a second of idle time):
- `python_ms`: a pure-Python loop (integer arithmetic and a dict), best and median of 5;
- `launch_us`: host time per launch of a small CUDA op (5,000 `torch.add` on 1-element tensors), best and median
  of 5, the GPU idle (each batch ends with a synchronise);
- `busy_threads`: CPU ticks (1/100 s) each thread of the process used during one idle second (a spinning thread
  shows here), and the number of threads.
Usage (SM90 machine): python3 -P bench/process_probe.py --out DIR   (PYTHONPATH=src)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path


def python_ms(reps: int = 5) -> dict:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        s = 0
        for i in range(1_000_000):
            s += i * i
        d = {}
        for i in range(200_000):
            d[i] = i
        ts.append(1e3 * (time.perf_counter() - t))
    return {"best": round(min(ts), 2), "median": round(statistics.median(ts), 2)}


def launch_us(torch, reps: int = 5, n: int = 5000) -> dict:
    a = torch.ones(1, device="cuda")
    b = torch.ones(1, device="cuda")
    c = torch.empty(1, device="cuda")
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        for _ in range(n):
            torch.add(a, b, out=c)
        torch.cuda.synchronize()
        ts.append(1e6 * (time.perf_counter() - t) / n)
    return {"best": round(min(ts), 3), "median": round(statistics.median(ts), 3)}


def _ticks() -> dict:
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            st = open(f"/proc/self/task/{tid}/stat").read()
        except OSError:
            continue
        name = st[st.index("(") + 1: st.rindex(")")]
        f = st[st.rindex(")") + 2:].split()
        out[tid] = (name, int(f[11]) + int(f[12]))
    return out


def busy_threads(seconds: float = 1.0) -> dict:
    t0 = _ticks()
    time.sleep(seconds)
    t1 = _ticks()
    busy = {f"{t1[k][0]}:{k}": t1[k][1] - t0.get(k, ("", 0))[1] for k in t1 if t1[k][1] - t0.get(k, ("", 0))[1] > 0}
    return {"threads": len(t1), "ticks_in_idle_second": busy}


def stage(torch, name: str, res: dict) -> None:
    res["stages"].append({"stage": name, "python_ms": python_ms(), "launch_us": launch_us(torch),
                          "busy": busy_threads()})
    print(json.dumps(res["stages"][-1]), flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    a = ap.parse_args()
    res = {"what": "host speed of one process before and after loading and calling the SM90 extension "
                   "(bench/process_probe.py)", "stages": []}
    import torch
    torch.zeros(1, device="cuda")
    res["device"] = torch.cuda.get_device_name(0)
    res["torch"] = torch.__version__
    stage(torch, "after CUDA start", res)
    import torch.utils.cpp_extension  # noqa: F401
    stage(torch, "after importing torch.utils.cpp_extension", res)
    from fused_logp.kernel.sm90 import SM90Backend
    t = time.time()
    res["sm90"] = SM90Backend().available()
    res["load_s"] = round(time.time() - t, 1)
    stage(torch, "after loading the sm90 extension", res)
    from fused_logp.kernel.op import logits_and_stats
    g = torch.Generator(device="cuda").manual_seed(1)
    h = torch.randn(64, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (0.05 * torch.randn(151936, 4096, device="cuda", generator=g)).to(torch.bfloat16)
    for _ in range(300):
        logits_and_stats(h, w, vocab_size=151936, backend="sm90", strict=True)
    torch.cuda.synchronize()
    stage(torch, "after 300 logits_and_stats calls (N=64, D=4096, V=151936)", res)
    stage(torch, "one more time", res)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "process-probe.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
