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


# ---------------------------------------------------------------------------------------------------------
# The same functions on torch tensors (CPU or CUDA), for the device-side sampling-transform program.
#
# Each line is one torch elementwise op: one kernel, one correctly rounded binary32 add/sub/mul per element
# (a result is stored between ops, so nothing can be contracted into an FMA), or exact integer/bit work. An
# op with a Python-number operand rounds that number to binary32 (exact for every constant here). CPU and CUDA
# therefore give the numpy functions' bits; tests/test_transforms.py checks it on CPU, tests/test_transforms_gpu.py
# on the H200.
# ---------------------------------------------------------------------------------------------------------

def _f(b) -> float:
    return float(b)


_T_LOG2E, _T_SHIFTER, _T_LN2_HI, _T_LN2_LO = _f(LOG2E), _f(SHIFTER), _f(LN2_HI), _f(LN2_LO)
_T_EXP_POLY = tuple(_f(c) for c in EXP_POLY)
_T_EXP_X_MAX, _T_EXP_X_MIN = _f(EXP_X_MAX), _f(EXP_X_MIN)
_T_LOG_POLY = tuple(_f(c) for c in LOG_POLY)
_T_FLT_MIN = 2.0 ** -126                                  # np.float32(1.1754944e-38): the smallest normal


def _torch():
    import torch
    return torch


def _pow2_torch(n):
    """2^n as binary32 for an int32 tensor n in [-126, 127]; consumes n (exact bit construction)."""
    return n.add_(127).bitwise_left_shift_(23).view(_torch().float32)


def contract_exp_torch(x):
    """contract_exp on a float32 torch tensor (any device, any shape): the numpy function's bits."""
    torch = _torch()
    if x.dtype != torch.float32:
        raise TypeError(f"contract_exp_torch needs float32; got {x.dtype}")
    r = x.clamp(_T_EXP_X_MIN, _T_EXP_X_MAX)             # xc (NaN stays NaN); r's buffer from here on
    k = r * _T_LOG2E
    k.add_(_T_SHIFTER)
    k.sub_(_T_SHIFTER)                                  # round-to-nearest-even(xc*log2e), as binary32
    t = k * _T_LN2_HI
    r.sub_(t)                                           # xc - k*LN2_HI
    torch.mul(k, _T_LN2_LO, out=t)
    r.sub_(t)                                           # (xc - k*LN2_HI) - k*LN2_LO
    c2, c3, c4, c5, c6, c7 = _T_EXP_POLY
    p = torch.mul(r, c7, out=t)
    p.add_(c6)
    for c in (c5, c4, c3, c2, 1.0, 1.0):                # p = c + r*p: the product, then the sum
        p.mul_(r)
        p.add_(c)
    del r
    n1 = k.to(torch.int32)                              # k is an integer in [-150, 128] (garbage for NaN: fixed below)
    del k
    n2 = n1.clone()
    n1.bitwise_right_shift_(1)                          # floor(n/2)
    n2.sub_(n1)                                         # n - floor(n/2)
    p.mul_(_pow2_torch(n1))                             # exact
    p.mul_(_pow2_torch(n2))                             # rounds once
    p.masked_fill_(x > _T_EXP_X_MAX, float("inf"))
    p.masked_fill_(x < _T_EXP_X_MIN, 0.0)
    return torch.where(torch.isnan(x), x, p)


def contract_log_torch(x):
    """contract_log on a float32 torch tensor (any device, any shape): the numpy function's bits."""
    torch = _torch()
    if x.dtype != torch.float32:
        raise TypeError(f"contract_log_torch needs float32; got {x.dtype}")
    sub = (x > 0) & (x < _T_FLT_MIN)
    xs = torch.where(sub, x * 8388608.0, x)             # subnormals: exact scaling by 2^23
    bits = xs.view(torch.int32)
    e = bits.bitwise_right_shift(23)
    e.bitwise_and_(0xFF)
    e.sub_(127)
    e.sub_(sub.to(torch.int32) * 23)
    mbits = bits.bitwise_and(0x7FFFFF)
    mbits.bitwise_or_(0x3F800000)                       # m in [1, 2)
    big = mbits > 0x3FB504F3                            # m > sqrt(2): use m/2 and e+1
    mbits.sub_(big.to(torch.int32) * 0x00800000)
    e.add_(big.to(torch.int32))
    f = mbits.view(torch.float32).sub(1.0)              # exact (Sterbenz)
    q = torch.full_like(f, _T_LOG_POLY[-1])
    for c in _T_LOG_POLY[-2::-1]:                       # q = c + f*q
        q.mul_(f)
        q.add_(c)
    ef = e.to(torch.float32)
    t = f * f
    t.mul_(q)                                           # (f*f)*q
    y = ef * _T_LN2_LO
    y.add_(t)                                           # t + e*LN2_LO (commutative: one rounding)
    y.add_(f)                                           # f + (...)
    y.add_(ef.mul_(_T_LN2_HI))                          # e*LN2_HI + (...)
    y.masked_fill_(x == 0, float("-inf"))
    y.masked_fill_(torch.isposinf(x), float("inf"))
    y.masked_fill_((x < 0) | torch.isnan(x), float("nan"))
    return y
