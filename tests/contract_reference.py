"""An independent, scalar, deliberately plain transcription of CONTRACT.md, for tests only.

It shares nothing with the oracle except the contract's exp2/log (tested on their own, the exp2 against the model
the H200 verified and the log against float64):
the GEMM rule is exact Python integer arithmetic on the bf16 bit fields, and the tile tree and the row merge
are explicit loops over numpy binary32 scalars.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from fused_logp.shared_contract.numpy_contract import LOG2E, contract_ex2, contract_log

F32 = np.float32


def _bf16_fields(bits: int):
    sign = -1 if bits & 0x8000 else 1
    field = (bits >> 7) & 0xFF
    frac = bits & 0x7F
    sig = (frac | 0x80) if field else frac          # 8-bit significand, s = sig / 2^7
    return sign, sig, max(field, 1) - 127


def _f32_fields(x: float):
    bits = int(np.array(x, dtype=np.float32).view(np.uint32))
    sign = -1 if bits >> 31 else 1
    field = (bits >> 23) & 0xFF
    frac = bits & 0x7FFFFF
    sig = (frac | 0x800000) if field else frac      # 24-bit significand, s = sig / 2^23
    return sign, sig, max(field, 1) - 127


def _shift(mag: int, sh: int) -> int:
    return mag << sh if sh >= 0 else mag >> (-sh)     # right shift of a magnitude = truncation toward zero


def hopper_dot(hbits, wbits) -> float:
    """One logit under the k16 rule from lists of bf16 bit patterns (finite inputs)."""
    acc = 0.0
    for g in range(0, len(hbits), 16):
        terms = []                                  # (sign, magnitude, significand fraction bits, exponent)
        for a, b in zip(hbits[g:g + 16], wbits[g:g + 16]):
            sa, ma, ea = _bf16_fields(a)
            sb, mb, eb = _bf16_fields(b)
            terms.append((sa * sb, ma * mb, 14, ea + eb))
        sc, mc, ec = _f32_fields(acc)
        terms.append((sc, mc, 23, ec))
        emax = max(e for _, _, _, e in terms)
        total = sum(s * _shift(m, 25 - fb + e - emax) for s, m, fb, e in terms)
        if total == 0:
            acc = 0.0
            continue
        sign, mag, exp = (1 if total > 0 else -1), abs(total), emax - 25
        extra = mag.bit_length() - 24
        if extra > 0:
            mag, exp = mag >> extra, exp + extra
        if exp < -149:                              # binary32 subnormal grid
            mag, exp = mag >> (-149 - exp), -149
        acc = sign * math.ldexp(mag, exp)
        if abs(acc) >= 2.0 ** 128:
            acc = sign * math.inf
    return float(np.float32(acc))


def logits(hidden: torch.Tensor, weight: torch.Tensor) -> np.ndarray:
    hb = hidden.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    wb = weight.view(torch.int16).numpy().astype(np.int64) & 0xFFFF
    out = np.empty((hb.shape[0], wb.shape[0]), dtype=np.float32)
    for i in range(hb.shape[0]):
        for j in range(wb.shape[0]):
            out[i, j] = hopper_dot(hb[i].tolist(), wb[j].tolist())
    return out


def row_logp(z_row: np.ndarray, target: int, temperature: float, vocab_size: int):
    """(logp, lse) of one row of unscaled FP32 logits by the contract's definition, scalar loops."""
    T = F32(temperature)
    c = F32(LOG2E / T)
    z = [F32(z_row[v]) for v in range(vocab_size)]
    n_tiles = -(-vocab_size // 64)
    tmax, tsum = [], []
    for t in range(n_tiles):
        real = [z[v] for v in range(64 * t, min(64 * t + 64, vocab_size))]
        big = F32(max(real))
        lanes = [F32(contract_ex2(F32(F32(x - big) * c))) for x in real] + [F32(0.0)] * (64 - len(real))
        while len(lanes) > 1:
            lanes = [F32(lanes[i] + lanes[i + 1]) for i in range(0, len(lanes), 2)]
        tmax.append(F32(big / T))
        tsum.append(lanes[0])
    m = F32(max(tmax))
    s = F32(tsum[0] * F32(contract_ex2(F32(F32(tmax[0] - m) * LOG2E))))
    for t in range(1, n_tiles):
        s = F32(s + F32(tsum[t] * F32(contract_ex2(F32(F32(tmax[t] - m) * LOG2E)))))
    lse = F32(m + F32(contract_log(s)))
    logp = min(F32(F32(z[target] / T) - lse), F32(0.0))
    return F32(logp), lse
