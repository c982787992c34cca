"""Where the time of one forward + backward goes (D=4096, V=151936): host time of each phase and the GPU timeline
from torch.profiler (kernel time per name, and the GPU idle time inside the step). Prints a summary; writes the
table and a Chrome trace under --out. `--seconds S` instead repeats the step for S seconds and prints the time a step
(for power and clock sampling, `make gpu-power`); `--gemms` makes the step the backward's four cuBLAS bf16 GEMMs of the
same shapes (the forward's logits, their recomputation, dh and dw from a bf16 dz), the reference workload."""
from __future__ import annotations

import argparse
import os
import time

import torch

from fused_logp import linear_logp

D, V = 4096, 151936


def repeat(fn, seconds: float, n: int, what: str):
    """fn repeated for `seconds` (synchronised every 4 calls, after 3 warm-up calls); prints the calls and ms a call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    calls, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        fn()
        calls += 1
        if calls % 4 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    dt = time.time() - t0
    print(f"profile_linear_logp_backward: {calls} calls of {what} at N={n} in {dt:.1f} s, "
          f"{1e3 * dt / calls:.2f} ms a call")


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--seconds", type=float, default=0.0)
    p.add_argument("--gemms", action="store_true")
    args = p.parse_args()
    n = args.n
    h = torch.randn(n, D, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(V, D, device="cuda") * D ** -0.5).bfloat16().requires_grad_()
    t = torch.randint(0, V, (n,), device="cuda")

    def step():
        h.grad = w.grad = None
        r = linear_logp(h, w, t)
        r.logp.sum().backward()

    def gemms():
        with torch.no_grad():
            torch.matmul(h, w.t())
            dz = torch.matmul(h, w.t())
            torch.matmul(dz, w)
            torch.matmul(dz.t(), h)

    if args.seconds:
        return repeat(gemms if args.gemms else step, args.seconds, n, "four cuBLAS GEMMs" if args.gemms else
                      "linear_logp forward + backward")
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    # host time of the two phases with the GPU idle before each (what a synchronised call pays up front)
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h.grad = w.grad = None
        r = linear_logp(h, w, t)
        t1 = time.perf_counter()
        r.logp.sum().backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        print(f"host: forward call {1e3 * (t1 - t0):.3f} ms, backward call {1e3 * (t2 - t1):.3f} ms, "
              f"wall to done {1e3 * (t3 - t0):.3f} ms")
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    print(table)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels.sort(key=lambda e: e.time_range.start)
    busy, gaps, last = 0.0, [], None
    for e in kernels:
        s, f = e.time_range.start, e.time_range.end
        if last is not None and s > last:
            gaps.append((s - last, e.name))
        busy += f - s
        last = f if last is None else max(last, f)
    span = (kernels[-1].time_range.end - kernels[0].time_range.start) if kernels else 0
    gaps.sort(reverse=True)
    print(f"GPU span {span / 1e3:.3f} ms for 2 steps, kernel time {busy / 1e3:.3f} ms, idle {sum(g for g, _ in gaps) / 1e3:.3f} ms")
    print("largest idle gaps (us, next kernel):", [(round(g, 1), nm[:60]) for g, nm in gaps[:12]])
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"profile-backward-n{n}.txt"), "w") as f:
        f.write(table)
    prof.export_chrome_trace(os.path.join(args.out, f"profile-backward-n{n}.json"))


if __name__ == "__main__":
    main()
