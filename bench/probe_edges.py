"""Probe: the SM90 kernel and cuBLAS at the edges of the tensor-core rule (CONTRACT.md section 2), on an H200.

For every case of tests/edge_inputs.py (two seeds; 64 rows x 256 columns, K = 16..256) this runs
`linear_logp(backend="sm90", return_logits=True)` at T = 1 and at a per-row temperature tensor, and cuBLAS's bf16
GEMM with FP32 output (`torch.mm(h, w.t(), out_dtype=torch.float32)`), saves inputs and output bytes to
OUT/edges.npz and prints per edge class how many logits agree bit for bit (and NaN-for-NaN) between kernel and
cuBLAS. The oracle is compared with these bytes on the CPU (tests/contract/test_contract_edges.py).

    PYTHONPATH=src:tests python -P bench/probe_edges.py --out OUT
    python bench/probe_edges.py --extract OUT/edges.npz --to tests/data/edges-h200.npz   (the committed subset)
    PYTHONPATH=src:tests python -P bench/probe_edges.py --rule-points OUT    (cuBLAS only, no build: the
        hand-built points of tests/edge_inputs.py RULE_POINTS; their bits go to tests/data/rule-points-h200.json)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from edge_inputs import CASES, bf16_bits, make_case  # noqa: E402

from fused_logp import linear_logp  # noqa: E402
from fused_logp.kernel.backends import get_backend  # noqa: E402


def _u32(x: torch.Tensor) -> np.ndarray:
    return x.detach().contiguous().cpu().view(torch.int32).numpy().view(np.uint32)


def _agree(a: np.ndarray, b: np.ndarray):
    fa, fb = a.view(np.float32), b.view(np.float32)
    nan = np.isnan(fa) & np.isnan(fb)
    return int((a == b).sum()), int(((a == b) | nan).sum()), int(a.size)


def _cublas_kernels(h, w):
    try:
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            torch.mm(h, w.t(), out_dtype=torch.float32)
            torch.cuda.synchronize()
        return sorted({e.name for e in prof.events() if e.device_type.name == "CUDA"})
    except Exception as exc:  # the names are informative only
        return [f"profiler failed: {type(exc).__name__}: {exc}"]


# The committed subset (tests/data, < 1 MiB): seed 1, the first EXTRACT_ROWS rows of every case with all columns
# (lse and logp need the whole row), inputs and the H200's logits, lse and logp at T = 1 and at the temperatures.
EXTRACT_SEED = 1
EXTRACT_ROWS = 16


def extract(src: str, dst: str) -> None:
    d = np.load(src)
    keep = {}
    for key in d.files:
        case, seed, field = key.split("__")
        if seed != f"s{EXTRACT_SEED}" or field == "logits_t":   # logits_t: the same bytes as kernel (the probe)
            continue
        a = d[key]
        if field == "w":
            keep[f"{case}__{field}"] = a
        else:
            keep[f"{case}__{field}"] = a[:EXTRACT_ROWS]
    for key in list(keep):
        if key.endswith("__cublas"):                     # equal to the kernel's bytes on every logit (the probe)
            case = key.split("__")[0]
            assert (keep[key] == keep[f"{case}__kernel"]).all(), case
            del keep[key]
    np.savez_compressed(dst, **keep)
    print(dst, os.path.getsize(dst), "bytes,", len({k.split('__')[0] for k in keep}), "cases")


def rule_points(out: str) -> None:
    """cuBLAS (no extension build) on the hand-built points (tests/edge_inputs.py RULE_POINTS, one per sentence
    of CONTRACT.md section 2): the H200's bits against the oracle and the exact transcription."""
    import gemm_reference as ref
    from fused_logp.kernel.oracle import hopper_logits

    from edge_inputs import RULE_POINTS as points
    from edge_inputs import point_operands

    rows = {}
    for name, (hv, wv) in points.items():
        hb, wb = point_operands(hv, wv)
        k = hb.shape[1]
        # 64 identical rows and columns: a shape cuBLAS serves with its usual tensor-core kernel
        hc, wc = hb.expand(64, k).contiguous().cuda(), wb.expand(64, k).contiguous().cuda()
        hw = int(torch.mm(hc, wc.t(), out_dtype=torch.float32).cpu().view(torch.int32)[0, 0]) & 0xFFFFFFFF
        orc = int(hopper_logits(hb, wb).view(torch.int32)[0, 0]) & 0xFFFFFFFF
        rf = ref.dot_bits(bf16_bits(hb)[0].tolist(), bf16_bits(wb)[0].tolist())
        rows[name] = {"h200_cublas": hex(hw), "oracle": hex(orc), "reference": hex(rf), "equal": hw == orc == rf}
        print(f"{name:28s} H200 {hw:#010x} oracle {orc:#010x} reference {rf:#010x} {'ok' if hw == orc == rf else 'DIFF'}")
    with open(os.path.join(out, "rule-points.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "points": rows}, f, indent=1)
    print("all equal:", all(r["equal"] for r in rows.values()))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--rule-points":
        rule_points(sys.argv[2] if len(sys.argv) > 2 else os.environ.get("OUT", "out"))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--extract":
        extract(sys.argv[2], sys.argv[4] if len(sys.argv) > 4 else "tests/data/edges-h200.npz")
        return
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--seeds", default="1,2")
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--cols", type=int, default=256)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    be = get_backend("sm90")
    ok, why = be.available()
    print("sm90:", ok, why, "|", torch.cuda.get_device_name(), "| torch", torch.__version__, flush=True)
    if not ok:
        raise SystemExit(1)
    dev = torch.device("cuda")
    store, per_class, per_case, kernels = {}, {}, {}, {}
    t0 = time.time()
    for seed in [int(s) for s in args.seeds.split(",")]:
        for name in CASES:
            cls, h, w = make_case(name, seed, args.rows, args.cols)
            rng = np.random.default_rng([seed, 7, sum(map(ord, name))])
            targets = torch.from_numpy(rng.integers(0, w.shape[0], size=h.shape[0]))
            temps = torch.from_numpy(rng.uniform(0.25, 4.0, size=h.shape[0]).astype(np.float32))
            hc, wc, tc = h.to(dev), w.to(dev), targets.to(dev)
            r1 = linear_logp(hc, wc, tc, backend="sm90", strict=True, return_logits=True)
            r2 = linear_logp(hc, wc, tc, backend="sm90", strict=True, temperature=temps.to(dev), return_logits=True)
            r3 = linear_logp(hc, wc, tc, backend="sm90", strict=True, return_logits=False)
            cub = torch.mm(hc, wc.t(), out_dtype=torch.float32)
            torch.cuda.synchronize()
            key = f"{name}__s{seed}"
            kz, cz = _u32(r1.logits), _u32(cub)
            store.update({f"{key}__h": bf16_bits(h), f"{key}__w": bf16_bits(w), f"{key}__targets": targets.numpy(),
                          f"{key}__temps": temps.numpy(), f"{key}__kernel": kz, f"{key}__cublas": cz,
                          f"{key}__lse": _u32(r1.lse), f"{key}__logp": _u32(r1.logp),
                          f"{key}__lse_t": _u32(r2.lse), f"{key}__logp_t": _u32(r2.logp),
                          f"{key}__logits_t": _u32(r2.logits)})
            dual = bool((_u32(r3.lse) == _u32(r1.lse)).all() and (_u32(r3.logp) == _u32(r1.logp)).all())
            same_logits_t = bool((_u32(r2.logits) == kz).all())
            bits, nan_eq, total = _agree(kz, cz)
            c = per_class.setdefault(cls, {"logits": 0, "bit_equal": 0, "equal_nan_any_payload": 0, "cases": 0,
                                           "dual_entry_equal": True, "nan_logits": 0, "inf_logits": 0,
                                           "subnormal_logits": 0, "zero_logits": 0, "neg_zero_logits": 0})
            kf = kz.view(np.float32)
            c["logits"] += total
            c["bit_equal"] += bits
            c["equal_nan_any_payload"] += nan_eq
            c["cases"] += 1
            c["dual_entry_equal"] &= dual and same_logits_t
            c["nan_logits"] += int(np.isnan(kf).sum())
            c["inf_logits"] += int(np.isinf(kf).sum())
            c["subnormal_logits"] += int(((kf != 0) & (np.abs(kf) < 2.0 ** -126)).sum())
            c["zero_logits"] += int((kf == 0).sum())
            c["neg_zero_logits"] += int((kz == 0x80000000).sum())
            per_case[key] = {"class": cls, "K": int(h.shape[1]), "bit_equal": bits, "equal_nan": nan_eq,
                             "total": total, "dual_entry_equal": dual,
                             "kernel_nan_payloads": sorted({hex(int(x)) for x in kz[np.isnan(kf)]})[:4],
                             "cublas_nan_payloads": sorted({hex(int(x)) for x in cz[np.isnan(cz.view(np.float32))]})[:4]}
            if int(h.shape[1]) not in kernels:
                kernels[int(h.shape[1])] = _cublas_kernels(hc, wc)
    np.savez_compressed(os.path.join(args.out, "edges.npz"), **store)
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "cuda": torch.version.cuda, "rows": args.rows, "cols": args.cols, "seeds": args.seeds,
               "per_class_kernel_vs_cublas": per_class, "per_case": per_case, "cublas_kernels_by_K": kernels,
               "seconds": round(time.time() - t0, 1)}
    with open(os.path.join(args.out, "edges-summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"{'class':22s} {'logits':>7s} {'bits=':>7s} {'nan-eq':>7s} {'nan':>6s} {'inf':>6s} {'sub':>6s} "
          f"{'zero':>6s} {'-0':>5s} dual")
    for cls, c in per_class.items():
        print(f"{cls:22s} {c['logits']:7d} {c['bit_equal']:7d} {c['equal_nan_any_payload']:7d} "
              f"{c['nan_logits']:6d} {c['inf_logits']:6d} {c['subnormal_logits']:6d} {c['zero_logits']:6d} "
              f"{c['neg_zero_logits']:5d} {c['dual_entry_equal']}")
    for key, c in per_case.items():
        if c["equal_nan"] != c["total"] or c["kernel_nan_payloads"]:
            print("  ", key, c)
    print("cuBLAS kernels by K:", json.dumps(kernels))


if __name__ == "__main__":
    main()
