"""The device time of each kernel a forward call launches (torch.profiler, CUDA activity), per call, for cuBLAS's
bf16 GEMM, our call and its mainloop alone (the timing hook), at each N: where the call's time goes between the
fused kernel, the row merge and anything else. Writes OUT/kernel-split.json.
Usage: PYTHONPATH=src python -P bench/kernel_split.py [--n 256,2048,8192] [--calls 20]"""
import argparse
import collections
import json
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/profile_forward.py (scripts run with -P)
from profile_forward import backend, forward_inputs  # noqa: E402


def split(fn, calls: int) -> dict:
    """{kernel name (first 80 characters): device microseconds a call} over `calls` calls after 3 warm ones."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    acc = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            acc[e.name[:80]] += e.device_time / calls
    return {k: round(v, 1) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="256,2048,8192")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    be = backend("kernel_split")
    res = {}
    for n in [int(x) for x in args.n.split(",")]:
        h, w, t, temp = forward_inputs(n, 4096, args.vocab)

        def ours(mainloop=False):
            be.mainloop_only = mainloop
            try:
                be.linear_logp(h, w, t, bias=None, temperature=temp, return_logits=False, vocab_size=args.vocab)
            finally:
                be.mainloop_only = False
        res[n] = {"gemm": split(lambda: torch.mm(h, w.t()), args.calls), "ours": split(ours, args.calls),
                  "mainloop": split(lambda: ours(True), args.calls)}
        print(n, json.dumps(res[n]), flush=True)
    with open(os.path.join(args.out, "kernel-split.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
