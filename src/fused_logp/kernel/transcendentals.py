"""The contract's exp2 and log on the CPU (numpy binary32), bit-identical to kernel/csrc/contract_math.cuh.

exp2 (CONTRACT.md section 6): SM90's `ex2.approx.ftz.f32`, reproduced exactly by its model for every binary32
x <= 0 (the only arguments the contract takes): k = floor(-x), j = floor(|x + k| * 2^23), ex2(x) = T[j] * 2^-k,
flushed to +0 below 2^-126, with T the table of shared_contract/ex2_table.py. Every step is exact integer or
float64 work, so any machine computes the same bits.

log: binary32 add, subtract and multiply (each rounded to nearest even, no fused multiply-add) and exact bit
manipulation only. numpy's float32 ufuncs are exactly that: one correctly rounded operation each, no contraction.
"""
from __future__ import annotations

import numpy as np

from ..shared_contract import constants as C
from ..shared_contract.ex2_table import table_f32

_f32 = np.float32


def _bits_to_f32(bits: int) -> np.float32:
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


LOG2E = _bits_to_f32(C.EXP_LOG2E)
LN2_HI = _bits_to_f32(C.LOG_LN2_HI)
LN2_LO = _bits_to_f32(C.LOG_LN2_LO)
LOG_POLY = tuple(_bits_to_f32(b) for b in C.LOG_POLY)
ONE = _f32(1.0)
_SCALE = float(1 << C.EX2_TABLE_FRAC_BITS)
# Positive arguments below 2^-23 truncate to T[0] = 1 (measured like the rest); larger ones are outside the domain.
_POS_LIMIT = 2.0 ** -C.EX2_TABLE_FRAC_BITS
# 2^-k for k beyond this is below the flush threshold for every table entry (T[j] <= 1).
_K_CAP = 160


class Ex2DomainError(ValueError):
    """An exp2 argument > 0 beyond the measured domain: the contract never forms one (an internal error)."""


def contract_ex2(x) -> np.ndarray:
    """exp2(x) of contract v2 for binary32 x <= 0 (any shape): SM90's ex2.approx.ftz.f32 bit for bit.
    ex2(+-0) = 1, ex2(-inf) = +0, ex2(NaN) = NaN, a subnormal x gives 1."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        xd = x.astype(np.float64)
        if bool((xd >= _POS_LIMIT).any()):
            raise Ex2DomainError(f"contract_ex2: argument {float(xd[xd >= _POS_LIMIT].flat[0])!r} > 0 is outside "
                                 "the contract's exp2 domain (x <= 0)")
        fin = np.isfinite(xd)
        a = np.where(fin & (xd < 0), -xd, 0.0)             # |x|; subnormals, +-0 and tiny positives give j = 0
        a = np.where(a < 2.0 ** -126, 0.0, a)               # ftz: a subnormal argument is 0
        k = np.minimum(np.floor(a), _K_CAP)
        j = np.floor((a - k) * _SCALE).astype(np.int64)     # exact: a - k in [0, 1), a multiple of ulp(a)
        j = np.where(a >= _K_CAP, 0, j)
        v = np.ldexp(table_f32()[j].astype(np.float64), -k.astype(np.int64))
        v = np.where(v < C.EX2_FLUSH_BELOW, 0.0, v)
        v = np.where(np.isneginf(xd), 0.0, v)
        y = v.astype(np.float32)
        y = np.where(np.isnan(xd), x, y)
    return y.astype(np.float32)


def contract_log(x) -> np.ndarray:
    """log(x) of the contract (unchanged since v1) for binary32 x (any shape). log(1) = 0 exactly; log(0) = -inf; log(x<0) = NaN."""
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


_T_LN2_HI, _T_LN2_LO = _f(LN2_HI), _f(LN2_LO)
_T_LOG_POLY = tuple(_f(c) for c in LOG_POLY)
_T_FLT_MIN = 2.0 ** -126                                  # np.float32(1.1754944e-38): the smallest normal
_device_tables: dict = {}


def _torch():
    import torch
    return torch


def _table_on(device):
    """The exp2 table as a float32 tensor on `device` (cached per device)."""
    torch = _torch()
    key = str(device)
    t = _device_tables.get(key)
    if t is None:
        t = torch.from_numpy(np.array(table_f32())).to(device)
        _device_tables[key] = t
    return t


def contract_ex2_torch(x):
    """contract_ex2 on a float32 torch tensor (any device, any shape): the numpy function's bits."""
    torch = _torch()
    if x.dtype != torch.float32:
        raise TypeError(f"contract_ex2_torch needs float32; got {x.dtype}")
    xd = x.to(torch.float64)
    if bool((xd >= _POS_LIMIT).any()):
        raise Ex2DomainError("contract_ex2_torch: an argument > 0 is outside the contract's exp2 domain (x <= 0)")
    fin = torch.isfinite(xd)
    a = torch.where(fin & (xd < 0), -xd, torch.zeros((), dtype=torch.float64, device=x.device))
    a = torch.where(a < 2.0 ** -126, torch.zeros((), dtype=torch.float64, device=x.device), a)
    k = torch.floor(a).clamp_(max=_K_CAP)
    j = torch.floor((a - k) * _SCALE).to(torch.int64)
    j.masked_fill_(a >= _K_CAP, 0)
    v = torch.ldexp(_table_on(x.device)[j].to(torch.float64), -k)
    v.masked_fill_(v < C.EX2_FLUSH_BELOW, 0.0)
    v.masked_fill_(torch.isneginf(xd), 0.0)
    y = v.to(torch.float32)
    return torch.where(torch.isnan(x), x, y)


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
