"""Forward + backward of linear_logp (grads for hidden and weight) at D=4096, V=151936 against cuBLAS +
log_softmax, measured in the same run. Liger and CCE are reported as absent when they are not installed.
Prints one table and writes JSON (GPU, date, versions) to --out."""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch

from fused_logp import linear_logp

D, V = 4096, 151936


def _bench(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def _peak(fn, base):
    """Peak bytes above `base` during fn, in MiB (fn starts by dropping the previous gradients)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "backward.json"))
    p.add_argument("--n", type=int, nargs="*", default=[2048, 8192])
    args = p.parse_args()
    rows = []
    for n in args.n:
        h = torch.randn(n, D, device="cuda").bfloat16().requires_grad_()
        w = (torch.randn(V, D, device="cuda") * D ** -0.5).bfloat16().requires_grad_()
        t = torch.randint(0, V, (n,), device="cuda")

        def ours():
            h.grad = w.grad = None
            linear_logp(h, w, t).logp.sum().backward()

        def cublas_ls():
            h.grad = w.grad = None
            z = torch.mm(h, w.T).float()
            torch.log_softmax(z, -1).gather(1, t[:, None]).sum().backward()

        def gemm():
            torch.mm(h.detach(), w.detach().T)

        ours()
        cublas_ls()
        h.grad = w.grad = None
        base = torch.cuda.memory_allocated()
        # inputs plus the gradients of hidden and weight (allocated during the call) are the floor
        grads = (h.numel() + w.numel()) * 2 / 2 ** 20
        r = {"N": n, "gemm_fwd_ms": _bench(gemm), "ours_ms": _bench(ours), "cublas_log_softmax_ms": _bench(cublas_ls),
             "ours_extra_MiB": _peak(ours, base) - grads, "cublas_log_softmax_extra_MiB": _peak(cublas_ls, base) - grads,
             "ours_backend": linear_logp(h.detach(), w.detach(), t).provenance.backend}
        r["ours_over_gemm"] = r["ours_ms"] / r["gemm_fwd_ms"]
        rows.append(r)
        del h, w, t
        torch.cuda.empty_cache()
    peers = {}
    for mod in ("liger_kernel", "cut_cross_entropy"):
        try:
            __import__(mod)
            peers[mod] = "installed but not wired in this script"
        except ImportError:
            peers[mod] = "not installed on this machine: not measured"
    print(f"{'N':>6} {'GEMM fwd':>9} {'ours f+b':>9} {'x GEMM':>7} {'cuBLAS+LS f+b':>14} {'ours/cuBLAS+LS':>15} {'ours extra MiB':>15} {'cuBLAS+LS extra MiB':>20}")
    for r in rows:
        print(f"{r['N']:6d} {r['gemm_fwd_ms']:9.2f} {r['ours_ms']:9.2f} {r['ours_over_gemm']:7.2f} {r['cublas_log_softmax_ms']:14.2f} "
              f"{r['ours_ms'] / r['cublas_log_softmax_ms']:15.2f} {r['ours_extra_MiB']:15.0f} {r['cublas_log_softmax_extra_MiB']:20.0f}")
    print("peers:", peers)
    out = {"gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "cuda": torch.version.cuda, "D": D, "V": V, "rows": rows, "peers": peers}
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
