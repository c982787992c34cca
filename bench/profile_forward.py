"""A forward call of the fused kernel to profile (Nsight Compute): `--warm` untimed calls, then `--calls` more, of one
launch configuration at one shape; `--mainloop-only` runs the timing hook (the mainloop without statistics),
`--return-logits` the rollout path, `--temperature` the division, `--gemm` cuBLAS's bf16 GEMM of the same shape
instead. `--seconds S` repeats the calls for S seconds (for power and clock sampling). Used by
`make gpu-kernel-profile`, which profiles the last call, and `make gpu-power`.
Usage: PYTHONPATH=src python -P bench/profile_forward.py [--n 8192] [--launch cta-128x256] ..."""
import argparse
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
    ap.add_argument("--seconds", type=float, default=0.0)
    args = ap.parse_args()
    be = backend("profile_forward")
    be.launch = args.launch
    be.mainloop_only = args.mainloop_only
    h, w, t, temp = forward_inputs(args.n, args.d, args.vocab, args.temperature)

    def call():
        if args.gemm:
            torch.matmul(h, w.t())
        else:
            be.linear_logp(h, w, t, bias=None, temperature=temp, return_logits=args.return_logits,
                           vocab_size=args.vocab)

    calls = 0
    t0 = time.time()
    while calls < args.warm + args.calls or time.time() - t0 < args.seconds:
        call()
        calls += 1
        if args.seconds and calls % 8 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    what = "cuBLAS GEMM" if args.gemm else args.launch
    print(f"profile_forward: {calls} calls of {what} at N={args.n} in {time.time() - t0:.1f} s"
          f"{' (mainloop only)' if args.mainloop_only else ''}{' with logits' if args.return_logits else ''}"
          f" T={args.temperature}")


if __name__ == "__main__":
    main()
