"""The CPU oracle of the contract: the same arithmetic as the SM90 kernel, bit for bit, GEMM included.

GEMM: `hopper_logits` (its docstring is the rule, step by step; CONTRACT.md section 2). Every aligned term is an
integer below 2^28 and the 17-term sum is below 2^33, so float64 holds every intermediate exactly: the emulation
uses float64 tensors with trunc(), which is integer arithmetic in disguise and vectorises over [rows, cols, 16].

Statistics (CONTRACT.md sections 3-5) run in numpy binary32, one rounded operation per step.
"""
from __future__ import annotations


import numpy as np
import torch

from ..shared_contract import constants as C
from .backends import CORE_ENTRIES, Forward, Merged, TileStats
from .transcendentals import LOG2E, contract_ex2, contract_log

_TILE = C.VOCAB_TILE
_KG = C.K_GROUP
_FRAC = C.ALIGN_FRAC_BITS
_ACC_BITS = C.ACC_SIGNIFICAND_BITS
_EXP_FLOOR = C.ALIGN_EXP_FLOOR
_NAN_BITS = C.GEMM_NAN_BITS - (1 << 32) if C.GEMM_NAN_BITS >= 1 << 31 else C.GEMM_NAN_BITS   # as int32
# Elements of one [rows, cols, 16] float64 work block (512 KiB): keeps the emulation in cache.
_BLOCK_ELEMS = 1 << 16
# Clears the 29 low mantissa bits of a float64: truncation toward zero to a 24-bit significand.
_F64_TO_F32_GRID = ~((1 << 29) - 1)
_F32_OVERFLOW = 2.0 ** 128


# The exponent given to a zero input: its products (zero) take no part in emax (any product's sum with it stays
# below ALIGN_EXP_FLOOR, as bf16 exponents are at most 127).
_ZERO_INPUT_EXP = -1000


def _nominal_exponent_bf16(x: torch.Tensor) -> torch.Tensor:
    """Exponent e of x = s * 2^e with s in [1, 2); subnormals take e = -126; zero takes _ZERO_INPUT_EXP (a zero
    product is no term of emax). int16, same shape."""
    bits = x.view(torch.int16).to(torch.int32)
    field = (bits >> 7) & 0xFF
    e = torch.clamp(field, min=1) - 127
    return torch.where((bits & 0x7FFF) == 0, _ZERO_INPUT_EXP, e).to(torch.int16)


def _acc_exponent(acc: torch.Tensor) -> torch.Tensor:
    """The exponent c brings to emax: its binary32 nominal exponent (a subnormal c: -126), and for c = 0 (or a
    non-finite c, whose group is decided by step 1) the floor ALIGN_EXP_FLOOR. acc: finite float64 on the
    binary32 grid. int16."""
    e = (((acc.view(torch.int64) >> 52) & 0x7FF) - 1023).clamp_(min=-126)
    return torch.where(acc == 0, torch.full_like(e, _EXP_FLOOR), e).to(torch.int16)


def _trunc_to_f32_grid(v: torch.Tensor) -> torch.Tensor:
    """Truncate float64 values toward zero onto the binary32 grid (24-bit significand, subnormal floor);
    a result that truncates to zero is +0."""
    tiny = (v.abs() < 2.0 ** -126) & (v != 0)
    if not bool(tiny.any()):
        return (v.view(torch.int64) & _F64_TO_F32_GRID).view(torch.float64).add_(0.0)
    mant, exp = torch.frexp(v)                         # v = mant * 2^exp, |mant| in [0.5, 1)
    keep = torch.clamp(exp + 149, max=_ACC_BITS)       # significant bits available at this exponent
    return torch.ldexp(torch.trunc(torch.ldexp(mant, keep)), exp - keep).add_(0.0)


def hopper_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """z = hidden @ weight.T under the Hopper k16 rule. hidden [N, D] bf16, weight [V, D] bf16 -> [N, V] fp32.

    The rule (CONTRACT.md section 2, as measured on the H200: wgmma and cuBLAS alike). Per (row, column), one
    binary32 accumulator c = +0; for each group of 16 consecutive k in ascending order (k = 16g .. 16g+15):

    1. Special values first. The 16 products p_k = a_k * b_k are formed as in IEEE (NaN if a_k or b_k is NaN
       or for inf * 0; +-inf if one factor is infinite and the other nonzero). If c is NaN or any p_k is NaN:
       c = NaN. Otherwise, among the infinite p_k and c (when c is infinite): +inf and -inf both present ->
       c = NaN; else one sign present -> c = that infinity (the finite products of the group are ignored, even
       if their sum would overflow the other way). The group is then done. NaN is written as GEMM_NAN_BITS
       (0x7FFFFFFF).
    2. Otherwise every value is finite. Write each bf16 input as s * 2^e, s in [1, 2), e its unbiased exponent;
       a subnormal input has e = -126 (s < 1). A nonzero product k: significand s_a * s_b (exact, in (0, 4)),
       nominal exponent e_a + e_b (not the exponent of its value). A product with a zero factor is no term.
       c: when c != 0, a term with its binary32 significand and nominal exponent (a subnormal c: e = -126);
       when c = +0, no term.
    3. emax = the largest of: the nonzero products' nominal exponents, c's (when c != 0), and
       ALIGN_EXP_FLOOR = -133. (Zeros, products or c, never set emax.)
    4. Each term's value is multiplied by 2^(ALIGN_FRAC_BITS - emax) (ALIGN_FRAC_BITS = 25) and truncated
       toward zero to an integer. The (up to 17) integers are added exactly: the sum S.
    5. c = S * 2^(emax - 25), truncated toward zero to a 24-bit significand (ACC_SIGNIFICAND_BITS) when its
       magnitude is >= 2^-126, else to a multiple of 2^-149 (the binary32 subnormal grid). A result that is
       zero (S = 0, or truncated to zero) is +0, never -0. A magnitude >= 2^128 after truncation becomes
       +-inf (sign of S); below that, truncation keeps it finite (at most 0x7F7FFFFF).

    After the last group, z = c (a binary32; c is a binary32 between groups, so an overflow in one group is an
    infinity for every later group, by step 1).
    """
    n, d = hidden.shape
    v = weight.shape[0]
    g = d // _KG
    h = hidden.detach().cpu().contiguous()
    w = weight.detach().cpu().contiguous()
    special = not (bool(torch.isfinite(h).all()) and bool(torch.isfinite(w).all()))
    h_clean = torch.where(torch.isfinite(h), h, torch.zeros((), dtype=h.dtype)) if special else h
    w_clean = torch.where(torch.isfinite(w), w, torch.zeros((), dtype=w.dtype)) if special else w
    ha = h_clean.to(torch.float64).view(n, g, _KG)                                   # [N, G, 16]
    he = _nominal_exponent_bf16(h_clean).view(n, g, _KG)
    wa = w_clean.to(torch.float64).view(v, g, _KG).transpose(0, 1).contiguous()      # [G, V, 16]
    we = _nominal_exponent_bf16(w_clean).view(v, g, _KG).transpose(0, 1).contiguous()
    if special:                                                   # raw values for step 1 (inf, NaN kept)
        hr = h.to(torch.float64).view(n, g, _KG)
        wr = w.to(torch.float64).view(v, g, _KG).transpose(0, 1).contiguous()
    out = torch.empty(n, v, dtype=torch.float32)
    cols = max(1, min(v, _BLOCK_ELEMS // (_KG * max(1, min(n, 16)))))
    rows = max(1, min(n, _BLOCK_ELEMS // (_KG * cols)))
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        for c0 in range(0, v, cols):
            c1 = min(v, c0 + cols)
            raw = (hr[r0:r1], wr[:, c0:c1]) if special else None
            out[r0:r1, c0:c1] = _hopper_block(ha[r0:r1], he[r0:r1], wa[:, c0:c1], we[:, c0:c1], raw)
    if special:
        out.view(torch.int32)[torch.isnan(out)] = _NAN_BITS
    return out


def _hopper_block(ha, he, wa, we, raw=None) -> torch.Tensor:
    """One [rows, cols] block. ha [R, G, 16] f64 (finite), he [R, G, 16] i16, wa [G, Cc, 16] f64 (finite),
    we [G, Cc, 16] i16; raw = (h [R, G, 16], w [G, Cc, 16]) float64 with their inf/NaN, or None if all finite."""
    r, groups, _ = ha.shape
    cc = wa.shape[1]
    acc = torch.zeros(r, cc, dtype=torch.float64)                          # c, a binary32 value (inf, NaN)
    for g in range(groups):
        finite_c = torch.isfinite(acc)
        c_val = torch.where(finite_c, acc, torch.zeros((), dtype=torch.float64))
        e = he[:, None, g, :] + we[None, g]                                  # [R, Cc, 16] nominal exponents
        emax = torch.maximum(e.amax(dim=-1), _acc_exponent(c_val)).to(torch.int32)   # >= ALIGN_EXP_FLOOR
        scale = torch.ldexp(torch.ones(emax.shape, dtype=torch.float64), _FRAC - emax)
        terms = ha[:, None, g, :] * wa[None, g]                              # exact products
        terms.mul_(scale[..., None]).trunc_()                                # aligned, truncated toward zero
        total = terms.sum(dim=-1).add_(torch.trunc(c_val * scale))           # exact integer sum
        new = _trunc_to_f32_grid(torch.ldexp(total, emax - _FRAC))
        new = torch.where(new.abs() >= _F32_OVERFLOW, torch.copysign(torch.full_like(new, float("inf")), new), new)
        if raw is None:                     # finite inputs: only an infinite c (an earlier overflow) persists
            acc = torch.where(finite_c, new, acc)
            continue
        p = raw[0][:, None, g, :] * raw[1][None, g]                          # IEEE products, inf/NaN included
        pos = (p == float("inf")).any(dim=-1) | (acc == float("inf"))
        neg = (p == float("-inf")).any(dim=-1) | (acc == float("-inf"))
        nan = torch.isnan(p).any(dim=-1) | torch.isnan(acc) | (pos & neg)
        new = torch.where(pos, float("inf"), new)
        new = torch.where(neg, float("-inf"), new)
        acc = torch.where(nan, float("nan"), new)
    return acc.to(torch.float32)


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


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


class OracleBackend:
    """The contract on the CPU. Accepts tensors on any device; computes on the CPU; returns on the input device."""

    name = "oracle"
    contract_bearing = True
    entries = CORE_ENTRIES

    def available(self, device=None):
        return True, "always available"

    def describe(self) -> dict:
        return {"arch": "cpu", "compute_capability": "none", "toolkit": f"torch {torch.__version__} cpu",
                "build": "python"}

    def _logits(self, hidden, weight, bias, n_real):
        z = hopper_logits(hidden, weight[:n_real])
        if bias is not None:
            z = (z + bias[:n_real].detach().cpu().to(torch.float32)[None, :]).to(torch.float32)
        return z

    def shard_stats(self, hidden, weight_shard, targets, *, vocab_start, vocab_size, bias, temperature,
                    return_logits):
        dev = hidden.device
        n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
        z = self._logits(hidden, weight_shard, bias, n_real)
        temp = _np(temperature).astype(np.float32)
        tmax, tsum, zs = tile_stats(_np(z), temp, n_real)
        tgt = _np(targets).astype(np.int64) - vocab_start
        owned = (tgt >= 0) & (tgt < n_real)
        rows = np.arange(zs.shape[0])
        tlogit = np.where(owned, zs[rows, np.clip(tgt, 0, max(n_real - 1, 0))] if n_real else -np.inf,
                          np.float32(-np.inf)).astype(np.float32)
        return TileStats(torch.from_numpy(tmax).to(dev), torch.from_numpy(tsum).to(dev),
                         torch.from_numpy(tlogit).to(dev), torch.from_numpy(owned).to(dev), vocab_start // _TILE,
                         z.to(dev) if return_logits else None)

    def merge_stats(self, tile_max, tile_sum, target_logit):
        dev = tile_max.device
        logp, lse = merge(_np(tile_max), _np(tile_sum), _np(target_logit))
        return Merged(torch.from_numpy(logp).to(dev), torch.from_numpy(lse).to(dev))

    def linear_logp(self, hidden, weight, targets, *, bias, temperature, return_logits, vocab_size):
        st = self.shard_stats(hidden, weight, targets, vocab_start=0, vocab_size=vocab_size, bias=bias,
                              temperature=temperature, return_logits=return_logits)
        logp, lse = self.merge_stats(st.tile_max, st.tile_sum, st.target_logit)
        return Forward(logp, lse, st.logits)

    multi_target = True          # stats_from_logits takes targets [N] or [N, C]

    def stats_from_logits(self, logits, targets, *, temperature, vocab_size):
        dev = logits.device
        z = _np(logits).astype(np.float32)
        tmax, tsum, zs = tile_stats(z, _np(temperature).astype(np.float32), vocab_size)
        tg = _np(targets).astype(np.int64)
        rows = np.arange(zs.shape[0]) if tg.ndim == 1 else np.arange(zs.shape[0])[:, None]
        lse = row_lse(tmax, tsum)
        logp = selected_logp(zs[rows, tg], lse)
        return Merged(torch.from_numpy(logp).to(dev), torch.from_numpy(lse).to(dev))
