"""The contract's exp2 and log as torch ops on any device (CPU or CUDA), for the device-side sampling-transform
program (kernel/transforms.py): the bits of shared_contract/numpy_contract.py's contract_ex2 and contract_log.

Each line is one torch elementwise op: one kernel, one correctly rounded binary32 add/sub/mul per element (a result
is stored between ops, so nothing can be contracted into an FMA), or exact integer/bit work. An op with a
Python-number operand rounds that number to binary32 (exact for every constant here). CPU and CUDA therefore give
the numpy functions' bits; tests/transforms/test_transforms.py checks it on CPU, tests/transforms/test_transforms_gpu.py
on the H200.
"""
from __future__ import annotations

import numpy as np

from ..shared_contract import constants as C
from ..shared_contract.ex2_table import table_f32
from ..shared_contract.numpy_contract import (EX2_K_CAP, EX2_POS_LIMIT, EX2_SCALE, LN2_HI, LN2_LO, LOG_POLY,
                                             Ex2DomainError)


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
    if bool((xd >= EX2_POS_LIMIT).any()):
        raise Ex2DomainError("contract_ex2_torch: an argument > 0 is outside the contract's exp2 domain (x <= 0)")
    fin = torch.isfinite(xd)
    a = torch.where(fin & (xd < 0), -xd, torch.zeros((), dtype=torch.float64, device=x.device))
    a = torch.where(a < 2.0 ** -126, torch.zeros((), dtype=torch.float64, device=x.device), a)
    k = torch.floor(a).clamp_(max=EX2_K_CAP)
    j = torch.floor((a - k) * EX2_SCALE).to(torch.int64)
    j.masked_fill_(a >= EX2_K_CAP, 0)
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
