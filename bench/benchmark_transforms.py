"""Trainer-side cost of replaying a sampling-transform program (CONTRACT.md section 13) against the plain op, at
the Qwen3-8B lm_head shape (D=4096, V=151936), plus the lm_head weight fingerprint's time. Prints one table and
writes JSON to --out (default $OUT)."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import time

import torch

from fused_logp import linear_logp, weight_fingerprint
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transforms import TransformProgram, kept_mask

D, V = 4096, 151936
PROGRAMS = {"top_p=0.9": TransformProgram(1.0, top_p=0.9), "top_k=50,top_p=0.9": TransformProgram(1.0, top_k=50, top_p=0.9),
            "min_p=0.1": TransformProgram(1.0, min_p=0.1)}


def _time(fn, reps=3):
    fn()
    out = []
    for _ in range(reps):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2] * 1e3


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, nargs="*", default=[64, 512])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    w = (torch.randn(V, D, device=dev) * D ** -0.5).bfloat16()
    rows = []
    for n in args.rows:
        h = (torch.randn(n, D, device=dev) * 2).bfloat16()
        z = linear_logp(h, w, torch.zeros(n, dtype=torch.long, device=dev), return_logits=True).logits
        r = {"N": n, "plain_ms": _time(lambda: linear_logp(h, w, torch.zeros(n, dtype=torch.long, device=dev)))}
        for name, prog in PROGRAMS.items():
            keep = kept_mask(z, prog)
            t = keep.float().argmax(dim=1)                     # a kept id per row
            r[f"{name}_ms"] = _time(lambda: linear_logp_program(h, w, t, prog), reps=1)
        rows.append(r)
    fp_ms = _time(lambda: weight_fingerprint(w))
    print(f"device {dev}; lm_head fingerprint of [{V}, {D}] bf16: {fp_ms:.2f} ms")
    names = ["plain"] + list(PROGRAMS)
    print(f"{'N':>6} " + " ".join(f"{n + ' ms':>22}" for n in names))
    for r in rows:
        print(f"{r['N']:6d} " + " ".join(f"{r[(n if n != 'plain' else 'plain') + '_ms']:22.2f}" for n in names))
    out = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "date": datetime.date.today().isoformat(),
           "torch": torch.__version__, "fingerprint_ms": fp_ms, "rows": rows,
           "note": "the kept set is computed with numpy on the host, in chunks of 64 rows"}
    with open(os.path.join(args.out, "transforms.json"), "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
