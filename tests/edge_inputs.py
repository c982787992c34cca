"""Inputs at the edges of the tensor-core rule (CONTRACT.md section 2), one generator per edge class.

Each case draws hidden [N, K] and weight [V, K] bf16 from a seeded numpy generator, built from bit fields so that
the exponents land where the class needs them: subnormal operands, subnormal sums, exact cancellation, products
that truncate to zero (the sign of zero), overflow inside one k16 group and across groups, an infinite
accumulator fed into the next group, non-finite inputs, and bit patterns spread over the whole exponent range.
Used by bench/probe_edges.py (bytes captured on the H200), tests/contract/test_contract_edges.py and
tests/contract/test_contract_edges_gpu.py.
"""
from __future__ import annotations

import numpy as np
import torch
from helpers import same_bytes

INF_BITS, NAN_BITS = 0x7F80, 0x7FC0


def bits_to_bf16(bits: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int16).numpy().view(np.uint16).copy()


def from_exponents(rng, e: np.ndarray, sign=None) -> np.ndarray:
    """bf16 bits of values near 2^e (random 7-bit fraction); e < -126 gives subnormals (e >= -133)."""
    e = np.asarray(e, dtype=np.int64)
    frac = rng.integers(0, 128, size=e.shape)
    field = np.clip(e + 127, 0, 254)
    sub = e < -126
    # subnormal: value = m * 2^-133, the leading bit of m at position e + 133
    lead = np.clip(e + 133, 0, 6)
    m_sub = (1 << lead) | (frac & ((1 << lead) - 1))
    mant = np.where(sub, m_sub, frac)
    field = np.where(sub, 0, field)
    if sign is None:
        sign = rng.integers(0, 2, size=e.shape)
    return ((np.asarray(sign, dtype=np.int64) << 15) | (field << 7) | mant).astype(np.uint16)


def uniform_exp(rng, shape, lo, hi, sign=None):
    return from_exponents(rng, rng.integers(lo, hi + 1, size=shape), sign)


def randn_bits(rng, shape, scale_exp=0):
    x = torch.from_numpy(rng.standard_normal(shape).astype(np.float32) * np.float32(2.0 ** scale_exp))
    return bf16_bits(x.bfloat16())


def neg(bits):
    return (bits ^ 0x8000).astype(np.uint16)


# ---------------------------------------------------------------------------------------------------------
# the cases: name -> (edge class, K, generator(rng, n, v) -> (h bits [n, K], w bits [v, K]))
# ---------------------------------------------------------------------------------------------------------

def _ordinary(rng, n, v, k=64):
    return randn_bits(rng, (n, k)), randn_bits(rng, (v, k))


def _sub_ops_big_w(rng, n, v, k=16):
    return uniform_exp(rng, (n, k), -133, -120), uniform_exp(rng, (v, k), 100, 127)


def _sub_ops_small_w(rng, n, v, k=32):
    return uniform_exp(rng, (n, k), -133, -127), uniform_exp(rng, (v, k), -10, 10)


def _sub_ops_both(rng, n, v, k=16):
    """Subnormal x subnormal and subnormal x normal products, all far below the accumulator's floor."""
    h = uniform_exp(rng, (n, k), -133, -120)
    w = uniform_exp(rng, (v, k), -133, 20)
    return h, w


def _sub_sums(lo_h, hi_h, lo_w, hi_w, k):
    def gen(rng, n, v):
        return uniform_exp(rng, (n, k), lo_h, hi_h), uniform_exp(rng, (v, k), lo_w, hi_w)
    return gen


def _sub_chain_down(rng, n, v, k=32):
    """Group 0 small normal/subnormal sums, group 1 far smaller: c dominates emax in group 1."""
    h = np.concatenate([uniform_exp(rng, (n, 16), -66, -58), uniform_exp(rng, (n, 16), -80, -66)], axis=1)
    w = np.concatenate([uniform_exp(rng, (v, 16), -66, -60), uniform_exp(rng, (v, 16), -80, -66)], axis=1)
    return h, w


def _sub_chain_up(rng, n, v, k=32):
    """Group 0 subnormal c, group 1 products near 2^-120: a subnormal c aligned into a larger emax."""
    h = np.concatenate([uniform_exp(rng, (n, 16), -75, -66), uniform_exp(rng, (n, 16), -62, -58)], axis=1)
    w = np.concatenate([uniform_exp(rng, (v, 16), -75, -66), uniform_exp(rng, (v, 16), -66, -58)], axis=1)
    return h, w


def _cancel_groups(rng, n, v, k=32):
    """Group 1 is the exact negation of group 0; rows scaled from 2^-70 to 2^20."""
    s = rng.integers(-70, 21, size=(n, 1))
    h0 = from_exponents(rng, s + rng.integers(-3, 4, size=(n, 16)))
    w0 = uniform_exp(rng, (v, 16), -5, 5)
    return np.concatenate([h0, neg(h0)], axis=1), np.concatenate([w0, w0], axis=1)


def _cancel_pairs(rng, n, v, k=16):
    """Adjacent products cancel inside one group; in odd rows one pair is left one ulp apart."""
    s = rng.integers(-75, 21, size=(n, 1))
    h = from_exponents(rng, s + rng.integers(-3, 4, size=(n, k)))
    h[:, 1::2] = neg(h[:, 0::2])
    h[1::2, 5] = (h[1::2, 4] ^ 0x8000) + 1                      # one pair off by one ulp of h
    w = uniform_exp(rng, (v, k), -5, 5)
    w[:, 1::2] = w[:, 0::2]
    return h, w


def _cancel_near(rng, n, v, k=32):
    """Group 1 = -(group 0) except one element one ulp off: a remainder far below the group's sums."""
    s = rng.integers(-70, 21, size=(n, 1))
    h0 = from_exponents(rng, s + rng.integers(-3, 4, size=(n, 16)))
    h1 = neg(h0)
    idx = rng.integers(0, 16, size=n)
    h1[np.arange(n), idx] = (h1[np.arange(n), idx] + rng.choice([-1, 1], size=n)).astype(np.uint16)
    w0 = uniform_exp(rng, (v, 16), -5, 5)
    return np.concatenate([h0, h1], axis=1), np.concatenate([w0, w0], axis=1)


def _signed_zero(rng, n, v, k=16):
    """Rows of four kinds: all +-0; products below the truncation grid, all negative for positive w; one nonzero
    tiny product among zeros; tiny products of both signs."""
    h = np.zeros((n, k), dtype=np.uint16)
    w = uniform_exp(rng, (v, k), -80, -70)
    w[: v // 2] &= 0x7FFF                                          # half the columns positive
    for r in range(n):
        kind = r % 4
        if kind == 0:
            h[r] = rng.integers(0, 2, size=k).astype(np.uint16) << 15
        elif kind == 1:
            h[r] = uniform_exp(rng, (k,), -84, -76, sign=np.ones(k, dtype=np.int64))
        elif kind == 2:
            j = rng.integers(0, k)
            h[r] = (rng.integers(0, 2, size=k) << 15).astype(np.uint16)
            h[r, j] = from_exponents(rng, np.array([rng.integers(-80, -68)]))[0]
        else:
            h[r] = uniform_exp(rng, (k,), -84, -70)
    return h, w


def _overflow_single(rng, n, v, k=16):
    sign_rows = np.where(np.arange(n)[:, None] % 2 == 0, 0, rng.integers(0, 2, size=(n, k)))
    return (uniform_exp(rng, (n, k), 58, 66, sign=sign_rows),
            uniform_exp(rng, (v, k), 58, 66, sign=np.zeros((v, k), dtype=np.int64)))


def _overflow_near_max(rng, n, v, k=16):
    """Same-sign products near 2^123 whose sums land around the binary32 maximum (2^128 - 2^104)."""
    h = uniform_exp(rng, (n, k), 61, 64, sign=np.zeros((n, k), dtype=np.int64))
    h[n // 2:] = neg(h[n // 2:])
    w = uniform_exp(rng, (v, k), 58, 60, sign=np.zeros((v, k), dtype=np.int64))
    return h, w


def _transient_overflow(rng, n, v, k=32):
    """Group 0 overflows the binary32 range, group 1 cancels it (exactly or partly)."""
    h0 = uniform_exp(rng, (n, 16), 60, 64, sign=np.zeros((n, 16), dtype=np.int64))
    h0[n // 2:] = neg(h0[n // 2:])
    h1 = neg(h0)
    h1[1::2] = uniform_exp(rng, (n // 2, 16), 55, 64)[: h1[1::2].shape[0]]
    w0 = uniform_exp(rng, (v, 16), 60, 64, sign=np.zeros((v, 16), dtype=np.int64))
    return np.concatenate([h0, h1], axis=1), np.concatenate([w0, w0], axis=1)


def _transient_overflow3(rng, n, v, k=48):
    """Group 0 overflows, group 1 overflows the other way, group 2 is ordinary."""
    h0 = uniform_exp(rng, (n, 16), 60, 64, sign=np.zeros((n, 16), dtype=np.int64))
    h1 = uniform_exp(rng, (n, 16), 60, 64, sign=np.ones((n, 16), dtype=np.int64))
    w0 = uniform_exp(rng, (v, 16), 60, 64, sign=np.zeros((v, 16), dtype=np.int64))
    w1 = uniform_exp(rng, (v, 16), 60, 64, sign=np.zeros((v, 16), dtype=np.int64))
    return (np.concatenate([h0, h1, randn_bits(rng, (n, 16))], axis=1),
            np.concatenate([w0, w1, randn_bits(rng, (v, 16))], axis=1))


def _inf_c(rng, n, v, k=32):
    """An infinite c after group 0 (an inf input), then group 1: finite, -inf, NaN, an overflow of the other
    sign, or zeros."""
    h = randn_bits(rng, (n, k))
    w = randn_bits(rng, (v, k))
    w[:8, 3] = 0                                                  # inf * 0 in these columns
    h[:, 3] = np.where(np.arange(n) % 2 == 0, INF_BITS, INF_BITS | 0x8000)
    kind = np.arange(n) // 2 % 5
    h[kind == 1, 20] = INF_BITS | 0x8000
    h[kind == 2, 25] = NAN_BITS
    big = uniform_exp(rng, (n, 16), 60, 64, sign=np.ones((n, 16), dtype=np.int64))
    h[kind == 3, 16:] = big[kind == 3]
    w[:, 16:] = np.where(np.arange(v)[:, None] % 2 == 0, uniform_exp(rng, (v, 16), 60, 64,
                                                                     sign=np.zeros((v, 16), dtype=np.int64)),
                         w[:, 16:])
    h[kind == 4, 16:] = 0
    return h, w


def _overflow_then_inf(rng, n, v, k=32):
    """A group-0 sum beyond binary32 (c becomes +-inf or saturates) followed by ordinary and opposite groups."""
    h0 = uniform_exp(rng, (n, 16), 62, 64, sign=np.zeros((n, 16), dtype=np.int64))
    w0 = uniform_exp(rng, (v, 16), 62, 64, sign=np.zeros((v, 16), dtype=np.int64))
    h1 = np.where(np.arange(n)[:, None] % 3 == 0, randn_bits(rng, (n, 16)),
                  uniform_exp(rng, (n, 16), 50, 62, sign=np.ones((n, 16), dtype=np.int64)))
    w1 = uniform_exp(rng, (v, 16), 50, 62, sign=np.zeros((v, 16), dtype=np.int64))
    return np.concatenate([h0, h1], axis=1), np.concatenate([w0, w1], axis=1)


def _nonfinite(rng, n, v, k=16):
    def draw(shape):
        x = randn_bits(rng, shape)
        u = rng.random(shape)
        x[u < 0.02] = INF_BITS
        x[(u >= 0.02) & (u < 0.04)] = INF_BITS | 0x8000
        x[(u >= 0.04) & (u < 0.06)] = NAN_BITS
        x[(u >= 0.06) & (u < 0.16)] = 0
        return x
    return draw((n, k)), draw((v, k))


def wide_bits(rng, shape, p_zero=0.04, p_sub=0.04, p_inf=0.005, p_nan=0.005):
    """bf16 bits over the whole exponent range: uniform exponent fields, with zeros, subnormals, +-inf, NaN."""
    x = uniform_exp(rng, shape, -126, 127)
    u = rng.random(shape)
    a = p_zero
    x[u < a] = (rng.integers(0, 2, size=int((u < a).sum())) << 15).astype(np.uint16)
    sel = (u >= a) & (u < a + p_sub)
    x[sel] = uniform_exp(rng, (int(sel.sum()),), -133, -127)
    a += p_sub
    sel = (u >= a) & (u < a + p_inf)
    x[sel] = INF_BITS | (rng.integers(0, 2, size=int(sel.sum())) << 15).astype(np.uint16)
    a += p_inf
    sel = (u >= a) & (u < a + p_nan)
    x[sel] = NAN_BITS
    return x


def _wide_random(k):
    def gen(rng, n, v):
        return wide_bits(rng, (n, k)), wide_bits(rng, (v, k))
    return gen


def _wide_window(rng, n, v, k=32):
    """Each row and column near its own random scale across the whole range: every product magnitude occurs."""
    hc = rng.integers(-126, 127, size=(n, 1))
    wc = rng.integers(-126, 127, size=(v, 1))
    h = from_exponents(rng, np.clip(hc + rng.integers(-8, 9, size=(n, k)), -133, 127))
    w = from_exponents(rng, np.clip(wc + rng.integers(-8, 9, size=(v, k)), -133, 127))
    return h, w


CASES = {
    "ordinary": ("ordinary", 64, _ordinary),
    "sub_ops_big_w": ("subnormal_operands", 16, _sub_ops_big_w),
    "sub_ops_small_w": ("subnormal_operands", 32, _sub_ops_small_w),
    "sub_ops_both": ("subnormal_operands", 16, _sub_ops_both),
    "sub_sums_k16": ("subnormal_sums", 16, _sub_sums(-75, -55, -75, -60, 16)),
    "sub_sums_k64": ("subnormal_sums", 64, _sub_sums(-70, -60, -70, -60, 64)),
    "sub_sums_near": ("subnormal_sums", 16, _sub_sums(-70, -64, -70, -63, 16)),
    "sub_sums_k256": ("subnormal_sums", 256, _sub_sums(-72, -60, -72, -62, 256)),
    "sub_chain_down": ("subnormal_sums", 32, _sub_chain_down),
    "sub_chain_up": ("subnormal_sums", 32, _sub_chain_up),
    "cancel_groups": ("cancellation", 32, _cancel_groups),
    "cancel_pairs": ("cancellation", 16, _cancel_pairs),
    "cancel_near": ("cancellation", 32, _cancel_near),
    "signed_zero": ("signed_zero", 16, _signed_zero),
    "overflow_single": ("overflow", 16, _overflow_single),
    "overflow_near_max": ("overflow", 16, _overflow_near_max),
    "transient_overflow": ("transient_overflow", 32, _transient_overflow),
    "transient_overflow3": ("transient_overflow", 48, _transient_overflow3),
    "overflow_then_more": ("transient_overflow", 32, _overflow_then_inf),
    "inf_c": ("infinite_c", 32, _inf_c),
    "nonfinite": ("nonfinite_inputs", 16, _nonfinite),
    "wide_random_k16": ("whole_range", 16, _wide_random(16)),
    "wide_random_k64": ("whole_range", 64, _wide_random(64)),
    "wide_window": ("whole_range", 32, _wide_window),
}


def make_case(name: str, seed: int, n: int = 64, v: int = 256):
    """(edge class, hidden [n, K] bf16, weight [v, K] bf16) of one case, from a seeded generator."""
    cls, k, gen = CASES[name]
    rng = np.random.default_rng([seed, sum(map(ord, name))])
    h, w = gen(rng, n, v)
    assert h.shape == (n, k) and w.shape == (v, k), (name, h.shape, w.shape)
    return cls, bits_to_bf16(h), bits_to_bf16(w)


# ---------------------------------------------------------------------------------------------------------
# hand-built single dot products, one per sentence of CONTRACT.md section 2 (floats exact in bf16; K padded
# with zeros to a multiple of 16). Their H200 bits: tests/data/rule-points-h200.json.
# ---------------------------------------------------------------------------------------------------------

def point_operands(h_vals, w_vals, k: int | None = None):
    """One dot product given as float lists (each value exact in bf16, e.g. a RULE_POINTS entry) as (hidden [1, k],
    weight [1, k]) bf16, zero-padded to k columns (default: len(h_vals) rounded up to whole k16 groups)."""
    k = -(-len(h_vals) // 16) * 16 if k is None else k
    h, w = torch.zeros(1, k), torch.zeros(1, k)
    h[0, :len(h_vals)] = torch.tensor(h_vals, dtype=torch.float64).float()
    w[0, :len(w_vals)] = torch.tensor(w_vals, dtype=torch.float64).float()
    hb, wb = h.bfloat16(), w.bfloat16()
    assert same_bytes(hb.float(), h) and same_bytes(wb.float(), w), "inputs must be exact in bf16"
    return hb, wb


_BIG = (2 - 2.0 ** -7) * 2.0 ** 127
_INF, _NAN = float("inf"), float("nan")
RULE_POINTS = {
    "zero_c_no_part": ([1.5 * 2.0 ** -76] * 16, [2.0 ** -76] * 16),
    "floor_-133": ([-(2.0 ** -75)] + [1.5 * 2.0 ** -80] * 15, [2.0 ** -74] + [2.0 ** -79] * 15),
    "subnormal_c_-126": ([1.5 * 2.0 ** -76] * 32, [2.0 ** -76] * 32),
    "plus_zero_a": ([-(2.0 ** -76)], [2.0 ** -76]), "plus_zero_b": ([-(2.0 ** -75)], [2.0 ** -75]),
    "plus_zero_c": ([-0.0] * 16, [1.0] * 16), "minus_2^-149": ([-(2.0 ** -75)], [2.0 ** -74]),
    "max_bf16": ([_BIG], [1.0]), "below_2^128_a": ([_BIG, 2.0 ** 119], [1.0, 1.0]),
    "trunc_not_round": ([_BIG, 2.0 ** 119, 1.5 * 2.0 ** 103], [1.0] * 3),
    "above_max_below_2^128": ([_BIG, (2 - 2.0 ** -7) * 2.0 ** 119, (2 - 2.0 ** -7) * 2.0 ** 111,
                               1.5 * 2.0 ** 103], [1.0] * 4),
    "exactly_2^128": ([_BIG, 2.0 ** 120], [1.0, 1.0]), "neg_overflow": ([-_BIG, -(2.0 ** 121)], [1.0, 1.0]),
    "c_binary32_between_groups": ([2.0 ** 64] * 16 + [-(2.0 ** 64)] * 16, [2.0 ** 64] * 32),
    "inf_c_vs_finite_overflow": ([_INF] + [0.0] * 15 + [-(2.0 ** 64)] * 16, [1.0] * 16 + [2.0 ** 64] * 16),
    "inf_times_0": ([_INF], [0.0]), "inf_minus_inf": ([_INF, _INF], [1.0, -1.0]), "nan_in": ([_NAN], [1.0]),
    "inf_c_then_-inf": ([_INF] + [0.0] * 15 + [-_INF], [1.0] * 17),
    "overflowed_c_then_-inf": ([2.0 ** 64] * 16 + [-_INF], [2.0 ** 64] * 17),
    "inf_beats_finite_overflow": ([_INF, 2.0 ** 127], [1.0, -4.0]),
    "zero_prod_large": ([0.0] + [1.5 * 2.0 ** -53] * 15, [2.0 ** 100] + [1.0] * 15),
    "zero_prod_large_neg0": ([-0.0] + [1.5 * 2.0 ** -53] * 15, [-(2.0 ** 100)] + [1.0] * 15),
    "zero_prod_subnormal": ([0.0] + [1.5 * 2.0 ** -76] * 15, [1.0] + [2.0 ** -76] * 15),
    "zero_prod_none": ([0.0] + [1.5 * 2.0 ** -76] * 15, [2.0 ** -100] + [2.0 ** -76] * 15),
}
