"""The SM90 hardware exp2 (`ex2.approx.ftz.f32`) and its exact model (CONTRACT.md section 6).

On an SM90 GPU (Triton with one inline PTX instruction):

    python tools/ex2_table.py generate --out DIR     # the table T[j] = ex2(-j * 2^-23), j = 0 .. 2^23, compressed
    python tools/ex2_table.py verify --table FILE --out DIR
                                                      # every binary32 x <= 0 (and every x in [0, 2^-23)):
                                                      # hardware against the model, a JSON report

On any machine:

    python tools/ex2_table.py check --table FILE      # decompress, print the sha256 of the raw table and its
                                                      # distance (ulp) from the correctly rounded 2^x

The model (verified by `verify`): for x <= 0, with k = floor(-x) (so x + k is in (-1, 0] and exact) and
j = floor(|x + k| * 2^23): ex2(x) = T[j] * 2^-k, flushed to +0 below 2^-126; ex2(+-0) = 1, ex2(-inf) = +0, a NaN
stays a NaN; a subnormal x is flushed to 0 first (so 1).

The compressed file (`fused_logp/shared_contract/ex2_sm90.bin.xz`): the raw table is 2^23 + 1 little-endian
uint32 bit patterns; stored are the first pattern and then the differences T[j] - T[j+1] as signed bytes, xz
compressed. Decompression is exact integer arithmetic (`fused_logp.shared_contract.ex2_table`).
"""
from __future__ import annotations

import argparse
import json
import lzma
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from fused_logp.shared_contract.ex2_table import decode, digest  # noqa: E402

N_ENTRIES = (1 << 23) + 1


def compress(bits: np.ndarray) -> bytes:
    bits = np.asarray(bits, dtype=np.uint32)
    assert bits.shape == (N_ENTRIES,)
    d = bits[:-1].astype(np.int64) - bits[1:].astype(np.int64)
    if d.min() < -128 or d.max() > 127:
        raise SystemExit(f"ex2 table: a difference of {d.min()}..{d.max()} does not fit a signed byte")
    payload = np.uint32(bits[0]).tobytes() + d.astype(np.int8).tobytes()
    return lzma.compress(payload, preset=9 | lzma.PRESET_EXTREME)


decompress = decode        # the package's decoder (shared_contract/ex2_table.py): one reading of the file format
sha256_bits = digest


def _triton_ex2():
    import torch
    import triton
    import triton.language as tl

    @triton.jit
    def _k(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
        i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        msk = i < n
        x = tl.load(x_ptr + i, mask=msk, other=0)
        y = tl.inline_asm_elementwise(
            "{ .reg .f32 a, b; mov.b32 a, $1; ex2.approx.ftz.f32 b, a; mov.b32 $0, b; }",
            "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
        tl.store(y_ptr + i, y, mask=msk)

    def ex2_bits(xbits: "torch.Tensor") -> "torch.Tensor":
        y = torch.empty_like(xbits)
        n = xbits.numel()
        _k[(triton.cdiv(n, 1024),)](xbits, y, n, BLOCK=1024)
        return y

    return ex2_bits


def generate(out: str) -> None:
    import torch
    ex2_bits = _triton_ex2()
    j = torch.arange(N_ENTRIES, device="cuda", dtype=torch.int64)
    x = (-(j.to(torch.float64)) * 2.0 ** -23).to(torch.float32)       # exact: j < 2^24
    assert torch.equal((x.to(torch.float64) * -(2.0 ** 23)).to(torch.int64), j)
    t = ex2_bits(x.view(torch.int32).contiguous())
    bits = t.cpu().numpy().view(np.uint32).copy()
    blob = compress(bits)
    assert np.array_equal(decompress(blob), bits)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ex2_sm90.bin.xz"), "wb") as f:
        f.write(blob)
    info = {"entries": int(N_ENTRIES), "sha256_raw_le_u32": sha256_bits(bits), "compressed_bytes": len(blob),
            "device": torch.cuda.get_device_name(), "first_bits": int(bits[0]), "last_bits": int(bits[-1])}
    info.update(_accuracy(bits))
    with open(os.path.join(out, "ex2-table-generate.json"), "w") as f:
        json.dump(info, f, indent=1)
    print(json.dumps(info, indent=1))


def _accuracy(bits: np.ndarray) -> dict:
    """ulp distance of each entry from the correctly rounded 2^(-j 2^-23) (float64 reference, rounded once)."""
    j = np.arange(N_ENTRIES, dtype=np.float64)
    ref = np.exp2(-j * 2.0 ** -23).astype(np.float32).view(np.uint32).astype(np.int64)
    d = bits.astype(np.int64) - ref
    vals, counts = np.unique(d, return_counts=True)
    return {"ulp_from_rounded_2^x": {str(int(v)): int(c) for v, c in zip(vals, counts)},
            "exact_fraction": float(counts[vals == 0].sum() / N_ENTRIES) if (vals == 0).any() else 0.0}


def model_bits_torch(xbits, table):
    """The model over int32 bit patterns on the GPU (float64 arithmetic; every step exact)."""
    import torch
    x = xbits.view(torch.float32).to(torch.float64)
    nan = torch.isnan(x)
    sub = (x != 0) & (x.abs() < 2.0 ** -126)                    # ftz: subnormal input is 0
    x = torch.where(sub | nan, torch.zeros_like(x), x)
    neg_inf = torch.isneginf(x)
    xf = torch.where(neg_inf, torch.zeros_like(x), x)
    pos = xf > 0
    k = torch.floor(-xf).clamp(min=0)
    r = xf + k                                                  # in (-1, 0], exact
    jj = torch.floor(-r * 2.0 ** 23).to(torch.int64)
    jj = torch.where(pos, torch.zeros_like(jj), jj)             # [0, 2^-23): truncates to 0
    v = table[jj].view(torch.float32).to(torch.float64) * torch.exp2(-k)
    v = torch.where(v < 2.0 ** -126, torch.zeros_like(v), v)
    v = torch.where(neg_inf, torch.zeros_like(v), v)
    out = v.to(torch.float32).view(torch.int32)
    return out, nan


def verify(table_path: str, out: str) -> None:
    import torch
    ex2_bits = _triton_ex2()
    bits = decompress(open(table_path, "rb").read())
    table = torch.from_numpy(bits.view(np.int32).copy()).cuda()
    t0 = time.time()
    classes = {}
    # every x <= 0: sign bit set (0x80000000 .. 0xFFFFFFFF), plus +0 and every positive x below 2^-23
    ranges = [("nonpositive (sign bit set, all 2^31 patterns)", 0x80000000, 0x100000000),
              ("+0 and positive x < 2^-23", 0x00000000, 0x34000000)]
    chunk = 1 << 27
    for name, lo, hi in ranges:
        n_checked = n_diff = n_nan = 0
        first = []
        for a in range(lo, hi, chunk):
            b = min(a + chunk, hi)
            u = torch.arange(a, b, device="cuda", dtype=torch.int64)
            xb = (u - (1 << 32) * (u >= (1 << 31)).to(torch.int64)).to(torch.int32)
            hw = ex2_bits(xb)
            mo, nan = model_bits_torch(xb, table)
            hw_nan = torch.isnan(hw.view(torch.float32))
            ok = torch.where(nan, hw_nan, hw == mo)
            bad = (~ok).nonzero().flatten()
            n_checked += b - a
            n_diff += int(bad.numel())
            n_nan += int(nan.sum())
            for i in bad[:8].tolist():
                first.append({"x_bits": f"0x{(a + i) & 0xFFFFFFFF:08X}", "hw": f"0x{int(hw[i]) & 0xFFFFFFFF:08X}",
                              "model": f"0x{int(mo[i]) & 0xFFFFFFFF:08X}"})
        classes[name] = {"checked": n_checked, "differ": n_diff, "nan_inputs": n_nan, "first_differences": first[:8]}
        print(name, classes[name], flush=True)
    # the scale rule on its own: ex2(x - k) = ex2(x) * 2^-k for x in [-1, 0)
    res = {"table_sha256": sha256_bits(bits), "device": torch.cuda.get_device_name(),
           "seconds": round(time.time() - t0, 2), "classes": classes,
           "total_checked": sum(c["checked"] for c in classes.values()),
           "total_differ": sum(c["differ"] for c in classes.values())}
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "ex2-table-verify.json"), "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "classes"}, indent=1))


def check(table_path: str) -> None:
    bits = decompress(open(table_path, "rb").read())
    info = {"entries": int(bits.size), "sha256_raw_le_u32": sha256_bits(bits)}
    info.update(_accuracy(bits))
    print(json.dumps(info, indent=1))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sp = p.add_subparsers(dest="cmd", required=True)
    g = sp.add_parser("generate"); g.add_argument("--out", required=True)
    v = sp.add_parser("verify"); v.add_argument("--table", required=True); v.add_argument("--out", required=True)
    c = sp.add_parser("check"); c.add_argument("--table", required=True)
    a = p.parse_args(argv)
    if a.cmd == "generate":
        generate(a.out)
    elif a.cmd == "verify":
        verify(a.table, a.out)
    else:
        check(a.table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
