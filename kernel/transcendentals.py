"""The contract's exp and log on the CPU (numpy binary32), bit-identical to kernel/csrc/contract_math.cuh.

Only binary32 add, subtract and multiply (each rounded to nearest even, no fused multiply-add) and exact bit
manipulation are used, so any IEEE-754 machine computes the same bits. numpy's float32 ufuncs are exactly
that: one correctly rounded operation each, no contraction. CUDA's expf/logf are not correctly rounded and
may change between toolkits; glibc's differ from CUDA's: neither can be the contract's.
"""
from __future__ import annotations

import numpy as np

from ..shared_contract import constants as C

_f32 = np.float32


def _bits_to_f32(bits: int) -> np.float32:
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


LOG2E = _bits_to_f32(C.EXP_LOG2E)
SHIFTER = _bits_to_f32(C.EXP_SHIFTER)
LN2_HI = _bits_to_f32(C.EXP_LN2_HI)
LN2_LO = _bits_to_f32(C.EXP_LN2_LO)
EXP_POLY = tuple(_bits_to_f32(b) for b in C.EXP_POLY)
EXP_X_MAX = _bits_to_f32(C.EXP_X_MAX)
EXP_X_MIN = _bits_to_f32(C.EXP_X_MIN)
LOG_POLY = tuple(_bits_to_f32(b) for b in C.LOG_POLY)
ONE = _f32(1.0)


def _pow2(n: np.ndarray) -> np.ndarray:
    """2^n as binary32 for integer n in [-126, 127] (exact bit construction)."""
    return ((n.astype(np.int32) + 127) << 23).astype(np.uint32).view(np.float32)


def contract_exp(x) -> np.ndarray:
    """exp(x) of contract v1 for binary32 x (any shape). exp(0) = 1 exactly; exp(-inf) = 0."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore"):
        xc = np.clip(x, EXP_X_MIN, EXP_X_MAX)            # keep n in range; the ends are fixed below
        k = (xc * LOG2E + SHIFTER) - SHIFTER               # round-to-nearest-even(x*log2e), as binary32
        r = (xc - k * LN2_HI) - k * LN2_LO
        c2, c3, c4, c5, c6, c7 = EXP_POLY
        p = c6 + r * c7
        p = c5 + r * p
        p = c4 + r * p
        p = c3 + r * p
        p = c2 + r * p
        p = ONE + r * p
        p = ONE + r * p
        n = k.astype(np.int32)
        n1 = n >> 1                                         # floor(n/2): both halves are normal powers of two
        n2 = n - n1
        y = (p * _pow2(n1)) * _pow2(n2)                     # the first product is exact, the second rounds once
        y = np.where(x > EXP_X_MAX, np.float32(np.inf), y)
        y = np.where(x < EXP_X_MIN, np.float32(0.0), y)
        y = np.where(np.isnan(x), x, y)
    return y.astype(np.float32)


def contract_log(x) -> np.ndarray:
    """log(x) of contract v1 for binary32 x (any shape). log(1) = 0 exactly; log(0) = -inf; log(x<0) = NaN."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        sub = (x > 0) & (x < np.float32(1.1754944e-38))
        xs = np.where(sub, x * _f32(8388608.0), x)          # subnormals: exact scaling by 2^23
        bits = xs.view(np.uint32).astype(np.int64)
        e = ((bits >> 23) & 0xFF) - 127 - np.where(sub, 23, 0)
        mbits = (bits & 0x7FFFFF) | 0x3F800000              # m in [1, 2)
        big = mbits > 0x3FB504F3                             # m > sqrt(2): use m/2 and e+1
        mbits = np.where(big, mbits - 0x00800000, mbits)
        e = e + big
        m = mbits.astype(np.uint32).view(np.float32)
        f = m - ONE                                          # exact (Sterbenz)
        q = LOG_POLY[-1] * np.ones_like(f)
        for c in LOG_POLY[-2::-1]:
            q = c + f * q
        ef = e.astype(np.float32)
        t = (f * f) * q
        y = ef * LN2_HI + (f + (t + ef * LN2_LO))
        y = np.where(x == 0, np.float32(-np.inf), y)
        y = np.where(np.isposinf(x), np.float32(np.inf), y)
        y = np.where((x < 0) | np.isnan(x), np.float32(np.nan), y)
    return y.astype(np.float32)
