"""The contract's arithmetic in numpy binary32: the definition every other implementation reproduces bit for bit.

One function per rule of CONTRACT.md (the table in its appendix names each one's compiled, CUDA and torch
implementations):
  section 6    contract_ex2 (SM90's ex2.approx.ftz.f32 by its exact model) and contract_log;
  section 3    row_scale (c = div(LOG2E, T));
  section 4    tile_stats (M_t, the adjacent-pairwise tree s_t, m_t = div(M_t, T));
  section 5    row_lse (the max-then-ascending-chain merge), selected_logp, merge;
  section 13   scaled, lse_over, kept_set (top-k, top-p, min-p) and program_logp (logp under a program).
The GEMM's logits (section 2) are shared_contract/gemm_rule.py's. The numpy oracle backend (kernel/oracle.py) and
the numpy path of the sampling-transform program (kernel/transforms.py) run these functions.

exp2: for every binary32 x <= 0 (the only arguments the contract takes): k = floor(-x), j = floor(|x + k| * 2^23),
ex2(x) = T[j] * 2^-k, flushed to +0 below 2^-126, with T the table of shared_contract/ex2_table.py. Every step is
exact integer or float64 work, so any machine computes the same bits.

Everything else: binary32 add, subtract, multiply and divide (each rounded to nearest even, no fused
multiply-add) and exact bit manipulation only. numpy's float32 ufuncs are exactly that: one correctly rounded
operation each, no contraction.
"""
from __future__ import annotations

import numpy as np

from . import constants as C
from .ex2_table import table_f32

_f32 = np.float32
_TILE = C.VOCAB_TILE


def _bits_to_f32(bits: int) -> np.float32:
    return np.array(bits, dtype=np.uint32).view(np.float32)[()]


LOG2E = _bits_to_f32(C.EXP_LOG2E)
LN2_HI = _bits_to_f32(C.LOG_LN2_HI)
LN2_LO = _bits_to_f32(C.LOG_LN2_LO)
LOG_POLY = tuple(_bits_to_f32(b) for b in C.LOG_POLY)
ONE = _f32(1.0)
EX2_SCALE = float(1 << C.EX2_TABLE_FRAC_BITS)
# Positive arguments below 2^-23 truncate to T[0] = 1 (measured like the rest); larger ones are outside the domain.
EX2_POS_LIMIT = 2.0 ** -C.EX2_TABLE_FRAC_BITS
# 2^-k for k beyond this is below the flush threshold for every table entry (T[j] <= 1).
EX2_K_CAP = 160


class Ex2DomainError(ValueError):
    """An exp2 argument > 0 beyond the measured domain: the contract never forms one (an internal error)."""


def contract_ex2(x) -> np.ndarray:
    """exp2(x) of contract v2 for binary32 x <= 0 (any shape): SM90's ex2.approx.ftz.f32 bit for bit.
    ex2(+-0) = 1, ex2(-inf) = +0, ex2(NaN) = NaN, a subnormal x gives 1."""
    x = np.asarray(x, dtype=np.float32)
    with np.errstate(invalid="ignore"):
        xd = x.astype(np.float64)
        if bool((xd >= EX2_POS_LIMIT).any()):
            raise Ex2DomainError(f"contract_ex2: argument {float(xd[xd >= EX2_POS_LIMIT].flat[0])!r} > 0 is outside "
                                 "the contract's exp2 domain (x <= 0)")
        fin = np.isfinite(xd)
        a = np.where(fin & (xd < 0), -xd, 0.0)             # |x|; subnormals, +-0 and tiny positives give j = 0
        a = np.where(a < 2.0 ** -126, 0.0, a)               # ftz: a subnormal argument is 0
        k = np.minimum(np.floor(a), EX2_K_CAP)
        j = np.floor((a - k) * EX2_SCALE).astype(np.int64)  # exact: a - k in [0, 1), a multiple of ulp(a)
        j = np.where(a >= EX2_K_CAP, 0, j)
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
# Tile statistics and the row merge (numpy binary32)
# ---------------------------------------------------------------------------------------------------------

def row_scale(temperature: np.ndarray) -> np.ndarray:
    """c = div(LOG2E, T) per row (CONTRACT.md section 3): the exp2 argument's scale. [N] fp32 -> [N] fp32."""
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        return (LOG2E / np.asarray(temperature, dtype=np.float32)).astype(np.float32)


def tile_stats(z: np.ndarray, temperature: np.ndarray, n_real: int, keep: np.ndarray | None = None):
    """Statistics of consecutive global tiles (CONTRACT.md section 4). z [N, n_real] fp32 unscaled logits (+bias)
    starting on a tile boundary; temperature [N] fp32; keep [N, n_real] bool or None: lanes not kept are treated
    exactly like padding (the sampling-transform program's kept set). Returns (tile_max [N, nt] = div(M_t, T),
    tile_sum [N, nt], zs [N, n_real] = div(z, T), the scaled logits a target or a program reads)."""
    n = z.shape[0]
    nt = -(-n_real // _TILE)
    temp = np.asarray(temperature, dtype=np.float32)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        zr = np.ascontiguousarray(z[:, :n_real], dtype=np.float32)
        zs = (zr / temp[:, None]).astype(np.float32)
        c = row_scale(temp)
        real = np.zeros((n, nt * _TILE), dtype=bool)
        real[:, :n_real] = True if keep is None else keep
        tiles = np.where(real, np.pad(zr, ((0, 0), (0, nt * _TILE - n_real))), np.float32(-np.inf))
        tiles = tiles.astype(np.float32).reshape(n, nt, _TILE)
        real = real.reshape(n, nt, _TILE)
        raw_max = tiles.max(axis=-1)                                      # M_t over the raw logits
        nonfinite = (~np.isfinite(tiles) & real).any(axis=-1)
        raw_max = np.where(nonfinite, np.float32(np.nan), raw_max).astype(np.float32)
        arg = ((tiles - raw_max[..., None]).astype(np.float32) * c[:, None, None]).astype(np.float32)
        arg = np.where(real, arg, np.float32(-np.inf))                   # non-real lanes: exactly +0
        lanes = contract_ex2(arg)
        while lanes.shape[-1] > 1:                                        # adjacent-pairwise tree, 6 levels
            lanes = (lanes[..., 0::2] + lanes[..., 1::2]).astype(np.float32)
        tsum = np.where(nonfinite, np.float32(np.nan), lanes[..., 0]).astype(np.float32)
        tmax = (raw_max / temp[:, None]).astype(np.float32)
    return tmax, tsum, zs


def row_lse(tile_max: np.ndarray, tile_sum: np.ndarray) -> np.ndarray:
    """lse of each row from its global tiles in ascending order (CONTRACT.md section 5). [N, T], [N, T] fp32 ->
    [N] fp32."""
    with np.errstate(invalid="ignore", over="ignore"):
        m = tile_max.max(axis=1)                                          # NaN-propagating
        d = ((tile_max - m[:, None]).astype(np.float32) * LOG2E).astype(np.float32)
        w = contract_ex2(d)
        s = (tile_sum[:, 0] * w[:, 0]).astype(np.float32)
        for t in range(1, tile_max.shape[1]):
            s = (s + tile_sum[:, t] * w[:, t]).astype(np.float32)
        return (m + contract_log(s)).astype(np.float32)


def selected_logp(target_logit: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """min(z'_target - lse, 0); target_logit [N] or [N, C] (several targets per row), lse [N]."""
    lse_b = lse if target_logit.ndim == 1 else lse[:, None]
    with np.errstate(invalid="ignore"):
        return np.minimum(target_logit - lse_b, np.float32(0.0)).astype(np.float32)


def merge(tile_max: np.ndarray, tile_sum: np.ndarray, target_logit: np.ndarray):
    """Row merge over global tiles in ascending order. [N, T], [N, T], [N] fp32 -> (logp [N], lse [N])."""
    lse = row_lse(tile_max, tile_sum)
    return selected_logp(target_logit, lse), lse


# ---------------------------------------------------------------------------------------------------------
# The sampling-transform program (CONTRACT.md section 13). `program` is any object with the fields temperature,
# top_k, top_p and min_p (kernel/transforms.py's TransformProgram checks them).
# ---------------------------------------------------------------------------------------------------------

def lse_over(z: np.ndarray, t: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """lse [N] over the kept lanes of z [N, V] (sections 4-5, every other lane exactly like padding) at the
    temperatures t [N]."""
    tmax, tsum, _ = tile_stats(z, t, z.shape[1], keep=keep)
    return row_lse(tmax, tsum)


def scaled(z: np.ndarray, temperature) -> np.ndarray:
    """z' = div(z, T) (section 3) for one temperature."""
    with np.errstate(invalid="ignore", over="ignore"):
        return (z / np.float32(temperature)).astype(np.float32)


def kept_set(z: np.ndarray, program) -> np.ndarray:
    """z [N, V] fp32 unscaled logits -> keep [N, V] bool (sections 13.2-13.4; decisions on z' = div(z, T))."""
    zs = scaled(z, program.temperature)
    n, v = zs.shape
    keep = np.ones((n, v), dtype=bool)
    order = np.argsort(-zs, axis=1, kind="stable")                         # z' descending, id ascending
    rows = np.arange(n)[:, None]
    if program.top_k is not None and program.top_k < v:
        keep[rows, order[:, program.top_k:]] = False
    if program.top_p is not None and program.top_p < 1.0:
        lse_k = lse_over(z, np.full(n, np.float32(program.temperature), dtype=np.float32), keep)
        with np.errstate(invalid="ignore", over="ignore"):
            arg = ((zs - lse_k[:, None]).astype(np.float32) * LOG2E).astype(np.float32)
            q = contract_ex2(np.where(keep, arg, np.float32(-np.inf)))
        q = q[rows, order]                                                 # in (z' desc, id asc) order
        c = np.cumsum(q, axis=1, dtype=np.float32)                         # one binary32 add per step, in order
        reach = c >= np.float32(program.top_p)
        first = np.where(reach.any(axis=1), reach.argmax(axis=1), v - 1)
        drop = np.arange(v)[None, :] > first[:, None]
        keep[rows, order] &= ~drop
    if program.min_p is not None and program.min_p > 0.0:
        m = np.where(keep, zs, np.float32(-np.inf)).max(axis=1)
        thr = contract_log(np.float32(program.min_p))
        with np.errstate(invalid="ignore"):
            keep &= (zs - m[:, None]).astype(np.float32) >= thr
    return keep


def program_logp(z: np.ndarray, targets: np.ndarray, program):
    """Section 13.5 on one chunk of rows: z [R, V] fp32 unscaled logits, targets [R] or [R, C] int64 in [0, V) ->
    (logp like targets = min(z'_target - lse_kept, 0), lse_kept [R], in_set like targets, keep [R, V] bool)."""
    r, v = z.shape
    keep = kept_set(z, program)
    tmax, tsum, zs = tile_stats(z, np.full(r, np.float32(program.temperature), dtype=np.float32), v, keep=keep)
    rows = np.arange(r) if targets.ndim == 1 else np.arange(r)[:, None]
    lse = row_lse(tmax, tsum)
    return selected_logp(zs[rows, targets], lse), lse, keep[rows, targets], keep
