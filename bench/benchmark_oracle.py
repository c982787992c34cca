"""CPU oracle throughput: rows per second for a small head (D=256, V=4096) and seconds for one Qwen3-8B row
(D=4096, V=151936). Prints one table and writes JSON (machine, date, figures) next to it."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

from fused_logp import linear_logp


def _time(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default="bench/results/oracle-cpu.json")
    p.add_argument("--skip-qwen", action="store_true")
    args = p.parse_args()
    g = torch.Generator().manual_seed(0)
    rows = []
    h = torch.randn(64, 256, generator=g).bfloat16()
    w = (torch.randn(4096, 256, generator=g) * 0.05).bfloat16()
    t = torch.randint(0, 4096, (64,), generator=g)
    linear_logp(h[:1], w, t[:1])
    s = _time(lambda: linear_logp(h, w, t), 3)
    rows.append({"case": "small head D=256 V=4096, 64 rows", "seconds": s, "rows_per_s": 64 / s, "ms_per_row": 1e3 * s / 64})
    if not args.skip_qwen:
        hq = torch.randn(1, 4096, generator=g).bfloat16()
        wq = (torch.randn(151936, 4096, generator=g) * 0.02).bfloat16()
        s = _time(lambda: linear_logp(hq, wq, torch.tensor([7])), 1)
        rows.append({"case": "Qwen3-8B head D=4096 V=151936, 1 row", "seconds": s, "rows_per_s": 1 / s, "ms_per_row": 1e3 * s})
    print(f"{'case':45s} {'seconds':>9s} {'rows/s':>9s} {'ms/row':>9s}")
    for r in rows:
        print(f"{r['case']:45s} {r['seconds']:9.3f} {r['rows_per_s']:9.2f} {r['ms_per_row']:9.1f}")
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(), "cpus": os.cpu_count(),
              "torch": torch.__version__, "threads": torch.get_num_threads(), "rows": rows}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
