"""A forward call of the fused kernel to profile (Nsight Compute): `--warm` untimed calls, then `--calls` more, of one
launch configuration at one shape; `--mainloop-only` runs the timing hook (the mainloop without statistics),
`--return-logits` the rollout path, `--temperature` the division, `--gemm` cuBLAS's bf16 GEMM of the same shape
instead, `--peer NAME` that peer's forward instead (bench/peers.py: quack, liger or cce, loss only, no_grad; it must
be installed). The calls after the `--warm` ones run in the NVTX range "profiled" (`ncu --nvtx --nvtx-include
profiled/` takes their kernels alone). `--seconds S` repeats the calls for S seconds (for power and clock sampling).
Used by `make gpu-kernel-profile`, which profiles the last call, `make gpu-power` and bench/run_mainloop_vs_quack.sh.
Usage: PYTHONPATH=src python -P bench/profile_forward.py [--n 8192] [--launch cta-128x256] ..."""
import argparse
import os
import sys
import time

import torch

from fused_logp.kernel.sm90 import SM90Backend


def backend(who: str) -> SM90Backend:
    """The SM90 backend, or exit naming why it is unavailable."""
    be = SM90Backend()
    ok, why = be.available()
    if not ok:
        raise SystemExit(f"{who}: sm90 backend unavailable: {why}")
    return be


def forward_inputs(n: int, d: int, vocab: int, temperature: float = 1.0, seed: int = 1):
    """hidden [n, d] and weight [vocab, d] bf16, targets [n], temperatures [n], random on the GPU."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n, d, device="cuda", generator=g).bfloat16()
    w = (torch.randn(vocab, d, device="cuda", generator=g) * 0.02).bfloat16()
    t = torch.randint(0, vocab, (n,), device="cuda", generator=g)
    return h, w, t, torch.full((n,), temperature, device="cuda")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--launch", default="auto")
    ap.add_argument("--mainloop-only", action="store_true")
    ap.add_argument("--return-logits", action="store_true")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--warm", type=int, default=2)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--peer", default="", choices=("", "quack", "liger", "cce"))
    ap.add_argument("--seconds", type=float, default=0.0)
    args = ap.parse_args()
    be = backend("profile_forward")
    be.launch = args.launch
    be.mainloop_only = args.mainloop_only
    h, w, t, temp = forward_inputs(args.n, args.d, args.vocab, args.temperature)
    peer = None
    if args.peer:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/peers.py (scripts run with -P)
        import peers
        peer, info = peers.load("sum", no_grad=True, names=(args.peer,))[args.peer]
        if peer is None:
            raise SystemExit(f"profile_forward: --peer {args.peer}: {info['status']}")

    def call():
        if args.gemm:
            torch.matmul(h, w.t())
        elif peer is not None:
            peer(h, w, t)
        else:
            be.linear_logp(h, w, t, bias=None, temperature=temp, return_logits=args.return_logits,
                           vocab_size=args.vocab)

    for _ in range(args.warm):   # (a peer's first call compiles its kernel)
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_push("profiled")   # ncu --nvtx --nvtx-include profiled/ : these calls' kernels only
    calls = 0
    t0 = time.time()
    while calls < args.calls or time.time() - t0 < args.seconds:
        call()
        calls += 1
        if args.seconds and calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()
    took = time.time() - t0
    what = "cuBLAS GEMM" if args.gemm else args.peer or args.launch
    print(f"profile_forward: {calls} calls of {what} at N={args.n} in {took:.1f} s ({1e3 * took / calls:.3f} ms a call)"
          f"{' (mainloop only)' if args.mainloop_only else ''}{' with logits' if args.return_logits else ''}"
          f" T={args.temperature}")


if __name__ == "__main__":
    main()
