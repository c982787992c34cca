"""CPU oracle throughput: the numpy oracle (`oracle`) against the compiled one (`oracle-fast`), same run, same inputs.

Cases (rows/s of the whole op, linear_logp: GEMM, tile statistics, merge):
  * the embedded default of `fused-logp demo`: N=12, D=256, V=4000 (weight padded to 4096 rows), T=0.7;
  * the Qwen3-8B head: D=4096, V=151936, T=0.7. The numpy oracle is timed on 1 row over the first
    --numpy-qwen-cols columns of the vocabulary and extrapolated linearly to V (its cost is per (row, column));
    the fast one runs the whole vocabulary at N=1, 8 and 64 rows per call.

Each figure is the median of --reps calls after one warm-up call. The machine is shared, so besides wall time the
script records the process CPU seconds of each call and the load average: CPU seconds / threads is what the call
would take on otherwise idle cores. Before timing, both backends' logp/lse bytes are compared on the timed inputs.
Writes JSON (and prints a table); `--log` names a copy of the printed table.
"""
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
from fused_logp.kernel.backends import get_backend


def _time(fn, reps):
    fn()                                                  # warm-up (and the first-use build of the extension)
    walls, cpus = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _same(a, b):
    return torch.equal(a.logp.view(torch.int32), b.logp.view(torch.int32)) and \
        torch.equal(a.lse.view(torch.int32), b.lse.view(torch.int32))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench/results/oracle-cpu-2026-12-01.json")
    p.add_argument("--log", default=None, help="also write the printed table here")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--reps-small", type=int, default=21, help="repetitions of the fast oracle's ms-long calls")
    p.add_argument("--numpy-qwen-cols", type=int, default=9728, help="columns the numpy oracle computes at Qwen3-8B")
    p.add_argument("--qwen-rows", default="1,8,64", help="rows per call for the fast oracle at Qwen3-8B")
    p.add_argument("--skip-qwen", action="store_true")
    args = p.parse_args()
    threads = torch.get_num_threads()
    fast = get_backend("oracle-fast")
    ok, why = fast.available()
    if not ok:
        raise SystemExit(f"oracle-fast is unavailable: {why}")
    rows = []
    lines = []

    def record(case, backend, n_rows, wall, cpu, note=""):
        r = {"case": case, "backend": backend, "rows": n_rows, "seconds": wall, "cpu_seconds": cpu,
             "rows_per_s": n_rows / wall, "ms_per_row": 1e3 * wall / n_rows,
             "rows_per_s_idle_cores": n_rows / (cpu / threads), "note": note}
        rows.append(r)
        return r

    # --- embedded default ------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(20261130)
    n, d, v, vp = 12, 256, 4000, 4096
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(vp, d, generator=g) * 0.05).bfloat16()
    w[v:] = 0
    t = torch.randint(0, v, (n,), generator=g)
    ref = linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle")
    got = linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle-fast")
    equal_default = _same(ref, got)
    a = record("embedded default N=12 D=256 V=4000", "oracle",
               n, *_time(lambda: linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle"), args.reps))
    b = record("embedded default N=12 D=256 V=4000", "oracle-fast",
               n, *_time(lambda: linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle-fast"),
                     args.reps_small))
    ratios = {"embedded default": b["rows_per_s"] / a["rows_per_s"]}
    audits = {}

    def audit_case(name, hh, ww, tt, vv, rows_per_batch):
        """`fused-logp audit` throughput (fused_logp.audit.audit, no progress bar) on a capture recorded here."""
        from fused_logp.audit import audit
        rec = linear_logp(hh, ww, tt, temperature=0.7, vocab_size=vv, backend="oracle-fast")
        cap = {"hidden": hh, "targets": tt, "logp": rec.logp, "lse": rec.lse,
               "temperature": torch.full((hh.shape[0],), 0.7), "programs": [None] * hh.shape[0]}
        rep = audit(cap, ww, vocab_size=vv, rows_per_batch=rows_per_batch, progress=False)
        audits[name] = {k: rep[k] for k in ("rows", "values_checked", "logp_mismatches", "lse_mismatches",
                                            "seconds", "rows_per_s")}

    hb = torch.randn(240, 256, generator=g).bfloat16()
    audit_case("embedded default head, 240 rows", hb, w, torch.randint(0, v, (240,), generator=g), v, 64)

    # --- Qwen3-8B head ---------------------------------------------------------------------------------------
    equal_qwen = None
    if not args.skip_qwen:
        d, v = 4096, 151936
        wq = (torch.randn(v, d, generator=g) * 0.02).bfloat16()
        hq = torch.randn(64, d, generator=g).bfloat16()
        tq = torch.randint(0, v, (64,), generator=g)
        cols = args.numpy_qwen_cols
        tcol = torch.randint(0, cols, (1,), generator=g)
        # bytes first: both backends on the numpy fraction (1 row, `cols` columns)
        ref = linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle")
        got = linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle-fast")
        equal_qwen = _same(ref, got)
        wall, cpu = _time(lambda: linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle"), args.reps)
        scale = v / cols
        a = record("Qwen3-8B head D=4096 V=151936", "oracle", 1, wall * scale, cpu * scale,
                   f"1 row over {cols} of {v} columns, extrapolated x{scale:.2f}")
        best = None
        for nr in (int(x) for x in args.qwen_rows.split(",")):
            r = record("Qwen3-8B head D=4096 V=151936", "oracle-fast", nr,
                       *_time(lambda: linear_logp(hq[:nr], wq, tq[:nr], temperature=0.7, backend="oracle-fast"),
                              args.reps), f"{nr} rows per call")
            if nr == 1:
                ratios["Qwen3-8B, 1 row per call"] = r["rows_per_s"] / a["rows_per_s"]
            best = r if best is None or r["rows_per_s"] > best["rows_per_s"] else best
        ratios[f"Qwen3-8B, {best['rows']} rows per call"] = best["rows_per_s"] / a["rows_per_s"]
        audit_case("Qwen3-8B head, 64 rows", hq, wq, tq, v, 64)

    load = os.getloadavg()
    lines.append(f"threads {threads}, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} (1/5/15 min), "
                 f"extension {fast.describe()['build']}")
    lines.append(f"bytes equal (logp, lse): embedded default {equal_default}, Qwen3-8B fraction {equal_qwen}")
    lines.append(f"{'case':34s} {'backend':12s} {'rows':>5s} {'wall s':>9s} {'cpu s':>9s} {'rows/s':>10s} "
                 f"{'ms/row':>10s} {'rows/s idle':>12s}  note")
    for r in rows:
        lines.append(f"{r['case']:34s} {r['backend']:12s} {r['rows']:5d} {r['seconds']:9.3f} {r['cpu_seconds']:9.3f} "
                     f"{r['rows_per_s']:10.3f} {r['ms_per_row']:10.1f} {r['rows_per_s_idle_cores']:12.3f}  {r['note']}")
    for k, x in ratios.items():
        lines.append(f"ratio oracle-fast / oracle rows/s, {k}: {x:.0f}x")
    for k, x in audits.items():
        lines.append(f"audit ({k}): {x['rows']} rows, {x['logp_mismatches']} logp / {x['lse_mismatches']} lse "
                     f"mismatches, {x['rows_per_s']:.2f} rows/s")
    text = "\n".join(lines)
    print(text)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "cpu": _cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
              "load_average": load, "bytes_equal": {"embedded_default": equal_default, "qwen_fraction": equal_qwen},
              "rows": rows, "ratios": ratios, "audit": audits, "extension": fast.describe()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if args.log:
        with open(args.log, "w") as f:
            f.write(text + "\n")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
