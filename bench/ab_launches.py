"""Interleaved A/B of forward launch configurations on one GPU: per N, `--rounds` rounds; each round times every
configuration (2 warm-up calls, then `--iters` calls between two CUDA events), the order reversed every other round,
so that a drift of the machine falls on all of them (bench/interleave.py). The name `gemm` times cuBLAS's bf16 GEMM of
the same shape (torch.mm, bf16 out) in the same rounds: the H200 runs these at its power limit, and its clock differs
between the first rounds of a size and the later ones, so a ratio to the GEMM is fairest taken this way. Prints and
writes (OUT/ab.json) the per-configuration medians and every round's figure. Single runs of the forward benchmark
differ by up to ~4% on the H200 machine; this is the comparison to use for differences of that size. Defaults: D=4096,
V=151936, T=1, bf16 random inputs.
A name NAME+mainloop times configuration NAME's mainloop alone (the timing hook, no statistics); NAME+late, a
ping-pong configuration with its order barrier signalled once a mainloop's wgmmas complete (the timing hook; the
kernels signal once they are issued). Suffixes combine: NAME+late+mainloop.
Usage: PYTHONPATH=src python -P bench/ab_launches.py [--n 2048,8192] [--launches gemm,a,b] [--rounds 7] [--iters 10]
       [--temperature 0.7] [--return-logits] [--tag t07]   (writes OUT/ab.json, or OUT/ab-TAG.json)"""
import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/profile_forward.py (scripts run with -P)
from interleave import interleaved_rounds  # noqa: E402
from profile_forward import backend, forward_inputs  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="2048,8192")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--launches", default="cta-128x256")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--return-logits", action="store_true", help="time the rollout path (FP32 logits written)")
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    be = backend("ab_launches")
    names = [x for x in args.launches.split(",") if x]
    for name in names:
        unknown = set(name.split("+")[1:]) - {"late", "mainloop"}
        if unknown:
            raise SystemExit(f"ab_launches: --launches {name!r} has unknown suffixes {sorted(unknown)}; "
                             "accepted: +late, +mainloop")
    res = {"d": args.d, "vocab": args.vocab, "temperature": args.temperature, "return_logits": args.return_logits,
           "rounds": args.rounds, "iters": args.iters, "n": {}}
    for n in [int(x) for x in args.n.split(",")]:
        h, w, t, temp = forward_inputs(n, args.d, args.vocab, args.temperature)
        def ours():
            be.linear_logp(h, w, t, bias=None, temperature=temp, return_logits=args.return_logits,
                           vocab_size=args.vocab)

        def gemm():
            torch.mm(h, w.t())

        def set_launch(name):
            if name != "gemm":     # NAME[+late][+mainloop]: the timing hooks
                base, *hooks = name.split("+")
                be.launch, be.mainloop_only, be.late_order_signal = base, "mainloop" in hooks, "late" in hooks

        times = interleaved_rounds({name: gemm if name == "gemm" else ours for name in names}, args.rounds,
                                   args.iters, before=set_launch)
        res["n"][n] = {name: {"median_ms": round(statistics.median(v), 3), "all": [round(x, 3) for x in v]}
                       for name, v in times.items()}
        print(n, json.dumps(res["n"][n]), flush=True)
    be.launch, be.mainloop_only, be.late_order_signal = "auto", False, False
    with open(os.path.join(args.out, f"ab-{args.tag}.json" if args.tag else "ab.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
