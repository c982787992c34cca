"""The sampling-transform program (TRANSFORM_PROGRAM_VERSION): temperature -> top-k -> top-p -> min-p, each
optional, replayed identically by the rollout and the trainer (CONTRACT.md section 13).

Every decision is made in contract arithmetic on the scaled logits z' = z / T of the real vocabulary:
  top-k   keep the k largest z', ties broken by the lower token id;
  top-p   order the kept tokens by (z' descending, id ascending); q_v = ex2((z'_v - lse_K) * LOG2E) with lse_K
          the contract lse over the kept set K (sections 4-5 on the unscaled z and T); accumulate c = add(c, q_v)
          in that order; keep the shortest prefix whose c >= p (all of K if rounding never reaches p);
  min-p   keep z'_v - m >= log(min_p), m the largest kept z', with the contract's log.
The program's logp is z'_target - lse_kept: the contract's tile tree and row merge with every non-kept lane
treated exactly like padding. A target outside the kept set cannot have been sampled: the trainer refuses it.

The trainer side works in bounded chunks of rows ([rows_per_chunk, V] FP32 logits at a time), never [N, V].
Two implementations give the same bytes (NaN payloads aside, which the contract does not fix):
  numpy   the reference (shared_contract/numpy_contract.py: kept_set, program_logp), on the host: the default
          for CPU logits;
  torch   the same operations as torch ops on the logits' device: the default for CUDA logits (see the comment
          at the torch path below for how each step stays exact). On an SM90 GPU the two sequential steps (the row
          merge, the top-p sum) run in the SM90 extension's kernels; elsewhere on the host.
`path='numpy'|'torch'` forces either one (tests/transforms/test_transforms.py compares them byte for byte on CPU,
tests/transforms/test_transforms_gpu.py on the H200).

Rows with a non-finite logit follow the rules literally: a non-finite z' inside a set whose statistics are taken
makes them NaN, one outside it is padding. top-k orders NaN last and -inf below every finite value (so k below
the finite count drops them; +inf is first and kept); top-p over a K holding a non-finite value has a NaN lse_K,
never reaches p and keeps K; min-p with a kept NaN or +inf has m = NaN or +inf and keeps nothing (lse NaN, every
target outside the set); a kept set holding a non-finite z' has lse_kept = logp = NaN.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..shared_contract.constants import TRANSFORM_PROGRAM_VERSION, VOCAB_TILE
from ..shared_contract.errors import ContractInputError
from ..shared_contract.numpy_contract import LOG2E, contract_log, kept_set, program_logp, row_lse
from .transcendentals import contract_ex2_torch


@dataclasses.dataclass(frozen=True)
class TransformProgram:
    temperature: float = 1.0
    top_k: int | None = None          # None or >= V: neutral
    top_p: float | None = None        # None or 1.0: neutral
    min_p: float | None = None        # None or 0.0: neutral
    version: str = TRANSFORM_PROGRAM_VERSION

    def __post_init__(self):
        if self.version != TRANSFORM_PROGRAM_VERSION:
            raise ContractInputError(f"transform program version must be {TRANSFORM_PROGRAM_VERSION}; got {self.version!r}")
        t = float(np.float32(self.temperature)) if isinstance(self.temperature, (int, float)) else float("nan")
        if not (math.isfinite(t) and t > 0):
            raise ContractInputError(f"temperature must be finite and > 0 as binary32; got {self.temperature!r}")
        if self.top_k is not None and (isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 1):
            raise ContractInputError(f"top_k must be None or an int >= 1; got {self.top_k!r}")
        if self.top_p is not None and not (0.0 < float(self.top_p) <= 1.0):
            raise ContractInputError(f"top_p must be None or in (0, 1]; got {self.top_p!r}")
        if self.min_p is not None and not (0.0 <= float(self.min_p) <= 1.0):
            raise ContractInputError(f"min_p must be None or in [0, 1]; got {self.min_p!r}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransformProgram":
        return cls(**d)

    def is_neutral(self, vocab_size: int) -> bool:
        return ((self.top_k is None or self.top_k >= vocab_size) and (self.top_p is None or self.top_p >= 1.0)
                and (self.min_p is None or self.min_p <= 0.0))


def _program_numpy(logits, tg, program, v, rows_per_chunk, keep_out=None):
    """The numpy path (the reference): logp [tg.shape], lse [N], in_set [tg.shape] as numpy arrays (and the kept
    set into keep_out [N, V] bool when given)."""
    n = logits.shape[0]
    logp = np.empty(tg.shape, dtype=np.float32)
    lse = np.empty(n, dtype=np.float32)
    in_set = np.empty(tg.shape, dtype=bool)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        z = logits[r0:r1, :v].detach().cpu().numpy().astype(np.float32)
        logp[r0:r1], lse[r0:r1], in_set[r0:r1], keep = program_logp(z, tg[r0:r1], program)
        if keep_out is not None:
            keep_out[r0:r1] = keep
    return logp, lse, in_set


def _kept_mask_numpy(logits, program, v):
    z = logits[:, :v].detach().cpu().numpy().astype(np.float32)
    return kept_set(z, program)


# ---------------------------------------------------------------------------------------------------------
# The torch path: the same decisions and bytes as the numpy path above, on the logits' device.
#
# Every elementwise step is one torch op (one correctly rounded binary32 operation per element, or exact
# integer/bit/select work), so CPU and CUDA give the numpy path's bits (the contract's exp/log: the torch
# versions in kernel/transcendentals.py). The two sequential steps run where they are exact:
#   the row merge (section 5)       CUDA: the SM90 extension's merge kernel; elsewhere numpy_contract.row_lse on
#                                   the host;
#   the top-p sum (section 13.3)    CUDA: the SM90 extension's topp_crossing kernel (one warp per row, one
#                                   binary32 add per step, in order, stopping at the crossing); elsewhere
#                                   numpy's sequential float32 cumsum on the host.
# Order: an int32 key per token whose ascending order is (z' descending, id ascending): the binary32 bits
# mapped to a monotone signed integer with -0.0 taken as +0.0 and NaN last, exactly numpy's stable argsort
# of -z'. Sorts are stable; top-k takes the k-th smallest key (a value, unique whatever the ties) and breaks
# ties at it by the lower id with an integer cumsum, so no step depends on how a device sort or top-k orders
# equal keys.
# ---------------------------------------------------------------------------------------------------------

PATHS = ("numpy", "torch")
NUMPY_ROWS_PER_CHUNK = 64
# Rows per chunk of the torch path on CUDA. Peak working memory is about 40-60 bytes per logit of the chunk
# (Qwen3-8B, V = 151936: about 1.6-2.4 GB at 256 rows) on top of the caller's logits.
DEVICE_ROWS_PER_CHUNK = 256
# top-p without top-k first orders only the first _TOPP_PREFIX tokens of each row (an exact selection); rows
# whose sum does not reach p there are ordered in full. Speed only: both give the same bits.
_TOPP_PREFIX = 4096
# Tile statistics over a kept set touch only the tiles holding a kept lane when the busiest row has at most
# 1/_SPARSE_TILE_DIV of the tiles busy (a tile without kept lanes is m_t = -inf, s_t = 0 either way).
_SPARSE_TILE_DIV = 4
_TILE = VOCAB_TILE
_INT32_MAX = 2**31 - 1


def _device_backend(device: torch.device):
    """The device backend for `device` (backends.device_backend: the sm90 backend on an SM90 GPU), else None: the
    host then runs the sequential steps (the same bytes)."""
    from .backends import device_backend
    return device_backend(device)


def resolve_path(path: str | None, device) -> str:
    """'numpy' or 'torch' for logits on `device`: `path` when given, else 'torch' on CUDA and 'numpy' on CPU."""
    if path is None:
        return "torch" if torch.device(device).type == "cuda" else "numpy"
    if path not in PATHS:
        raise ContractInputError(f"path must be None or one of {PATHS}; got {path!r}")
    return path


def describe_path(path: str | None, device) -> str:
    """Which implementation runs for logits on `device` (benchmarks record it)."""
    device = torch.device(device)
    p = resolve_path(path, device)
    if p == "numpy":
        return "numpy (host, chunks of 64 rows)"
    seq = "SM90 merge + topp_crossing kernels" if _device_backend(device) is not None else "host row merge + host top-p sum"
    return f"torch on {device.type} ({seq})"


def _order_key(zs: torch.Tensor) -> torch.Tensor:
    """int32 [R, V] whose ascending order is (z' descending, id ascending) under a stable sort."""
    b = zs.view(torch.int32)
    b = torch.where(b == -(2**31), 0, b)                          # -0.0 orders with +0.0 (numpy compares them equal)
    key = torch.where(b < 0, torch.bitwise_xor(b, 0x7FFFFFFF), b)  # monotone in z' over non-NaN binary32
    d = torch.bitwise_not(key)                                    # ascending d = descending z'
    d = torch.where(torch.isnan(zs), _INT32_MAX, d)              # NaN last (numpy sorts NaN to the end)
    assert d.dtype == torch.int32
    return d


def _first_mask(d: torch.Tensor, count: int) -> torch.Tensor:
    """bool [R, V]: the first `count` tokens of each row in key order (ties at the cut by the lower id)."""
    r, v = d.shape
    if count >= v:
        return torch.ones(r, v, dtype=torch.bool, device=d.device)
    thr = torch.topk(d, count, dim=1, largest=False, sorted=False).values.amax(dim=1, keepdim=True)
    below = d < thr                                               # fewer than `count`
    tie = d == thr
    need = count - below.sum(dim=1, keepdim=True)                 # >= 1, and <= the number of ties
    return below | (tie & (torch.cumsum(tie, dim=1, dtype=torch.int32) <= need))


def _ordered_ids(d: torch.Tensor, count: int, sel: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [R, count]: the ids of the first `count` tokens of each row, in key order. `sel` is their mask
    when the caller has it."""
    r, v = d.shape
    if count >= v:
        return torch.sort(d, dim=1, stable=True).indices
    if sel is None:
        sel = _first_mask(d, count)
    ids = sel.nonzero()[:, 1].view(r, count)                      # row-major: each row's ids, together
    ids = torch.sort(ids, dim=1).values                           # ascending id (nonzero gives it; made sure)
    return ids.gather(1, torch.sort(d.gather(1, ids), dim=1, stable=True).indices)


def _tile_stats_dense(z3: torch.Tensor, k3: torch.Tensor, t_vec: torch.Tensor):
    """Section 4 over tiles [R, T, 64] of unscaled logits with kept mask k3 (non-kept lanes exactly like padding)
    and the rows' temperatures t_vec [R]: (div(M_t, T), s_t)."""
    tiles = torch.where(k3, z3, float("-inf"))
    raw_max = tiles.amax(dim=-1)
    bad = (k3 & ~torch.isfinite(z3)).any(dim=-1)
    raw_max = torch.where(bad, float("nan"), raw_max)
    c = torch.full_like(t_vec, float(LOG2E)).div_(t_vec)         # div(LOG2E, T), one rounding
    x = tiles.sub_(raw_max[..., None]).mul_(c[:, None, None])     # mul(sub(z, M_t), c)
    x.masked_fill_(~k3, float("-inf"))
    lanes = contract_ex2_torch(x)
    del x, tiles
    while lanes.shape[-1] > 1:                                    # adjacent-pairwise tree, 6 levels
        lanes = lanes[..., 0::2] + lanes[..., 1::2]
    tsum = torch.where(bad, float("nan"), lanes[..., 0])
    return raw_max.div_(t_vec[:, None]), tsum


def _tile_stats_torch(z: torch.Tensor, keep: torch.Tensor | None, t_vec: torch.Tensor):
    """(tile_max, tile_sum) [R, nt] of the global tiles of unscaled logits z over the kept set (None: every real
    lane), at the rows' temperatures t_vec [R]."""
    r, v = z.shape
    nt = -(-v // _TILE)
    pad = nt * _TILE - v
    kp = keep if keep is not None else torch.ones(r, v, dtype=torch.bool, device=z.device)
    zp = z
    if pad:
        zp = torch.cat([z, z.new_zeros(r, pad)], dim=1)
        kp = torch.cat([kp, kp.new_zeros(r, pad)], dim=1)
    z3, k3 = zp.view(r, nt, _TILE), kp.view(r, nt, _TILE)
    if keep is not None and r > 0:
        busy = k3.any(dim=-1)
        cnt = int(busy.sum(dim=1).max())
        if cnt * _SPARSE_TILE_DIV <= nt:
            tmax = torch.full((r, nt), float("-inf"), dtype=torch.float32, device=z.device)
            tsum = torch.zeros((r, nt), dtype=torch.float32, device=z.device)
            if cnt == 0:
                return tmax, tsum
            idx = torch.topk(busy.to(torch.int32), cnt, dim=1).indices    # all busy tiles (+ idle ones)
            g = idx[..., None].expand(r, cnt, _TILE)
            tm, ts = _tile_stats_dense(z3.gather(1, g), k3.gather(1, g), t_vec)
            return tmax.scatter_(1, idx, tm), tsum.scatter_(1, idx, ts)
    return _tile_stats_dense(z3, k3, t_vec)


def _row_lse_torch(tmax: torch.Tensor, tsum: torch.Tensor, be) -> torch.Tensor:
    """Section 5's lse [R] from [R, nt] statistics: the device backend's merge on CUDA, numpy_contract.row_lse
    elsewhere."""
    if be is not None:
        return be.merge_stats(tmax, tsum, torch.zeros(tmax.shape[0], dtype=torch.float32, device=tmax.device))[1]
    return torch.from_numpy(row_lse(tmax.cpu().numpy(), tsum.cpu().numpy())).to(tmax.device)


def _lse_torch(keep, be, z, t_vec) -> torch.Tensor:
    """lse [R] over the kept set (None: the whole row; with a device backend, its stats-from-logits entry), from
    the unscaled z and the temperatures t_vec."""
    if keep is None and be is not None:
        r, v = z.shape
        tmax, tsum, _ = be.tile_stats_from_logits(z, torch.zeros(r, dtype=torch.int64, device=z.device), t_vec, v)
    else:
        tmax, tsum = _tile_stats_torch(z, keep, t_vec)
    return _row_lse_torch(tmax, tsum, be)


def _crossing(q: torch.Tensor, p32: np.float32, be) -> torch.Tensor:
    """int64 [R]: the first j with the sequential binary32 sum q_0 + ... + q_j >= p, or -1."""
    if be is not None:
        return be.topp_crossing(q, float(p32))
    c = np.cumsum(q.cpu().numpy(), axis=1, dtype=np.float32)        # one binary32 add per step, in order
    reach = c >= p32
    first = np.where(reach.any(axis=1), reach.argmax(axis=1), -1).astype(np.int64)
    return torch.from_numpy(first).to(q.device)


def _top_p_torch(zs, z, t_vec, d, keep, n_kept, p32, be):
    """Section 13.3 on the kept set `keep` (None: every token; else the top-k set, the first n_kept tokens in
    key order). Returns the new kept set [R, V] bool."""
    r, v = zs.shape
    lse_k = _lse_torch(keep, be, z, t_vec)
    out = keep.clone() if keep is not None else torch.ones(r, v, dtype=torch.bool, device=zs.device)
    pending = (~torch.isnan(lse_k)).nonzero()[:, 0]              # a NaN lse_K never reaches p: K stays
    lengths = [min(n_kept, _TOPP_PREFIX)] + ([n_kept] if n_kept > _TOPP_PREFIX else [])
    for length in lengths:
        if pending.numel() == 0:
            break
        every = pending.numel() == r

        def pick(t):
            return t if every else t.index_select(0, pending)
        dk = pick(d)
        kp = pick(keep) if keep is not None else None
        ids = _ordered_ids(dk, length, kp if (kp is not None and length == n_kept) else None)
        x = pick(zs).gather(1, ids)
        x.sub_(pick(lse_k)[:, None]).mul_(float(LOG2E))           # mul(sub(z'_v, lse_K), LOG2E)
        if kp is not None:
            x.masked_fill_(~kp.gather(1, ids), float("-inf"))
        q = contract_ex2_torch(x)
        if kp is not None:
            q = torch.where(kp.gather(1, ids), q, 0.0)            # non-kept contribute +0
        first = _crossing(q, p32, be)
        hit = first >= 0
        rows = pending[hit]
        if rows.numel():
            upto = torch.arange(length, device=zs.device)[None, :] <= first[hit][:, None]
            m = torch.zeros(rows.numel(), v, dtype=torch.bool, device=zs.device).scatter_(1, ids[hit], upto)
            out[rows] = m if keep is None else m & keep.index_select(0, rows)
        pending = pending[~hit]
    return out


def _program_chunk_torch(z: torch.Tensor, program: TransformProgram, be, want_lse: bool):
    """z [R, V] fp32 unscaled, contiguous, on its device -> (zs [R, V], keep [R, V] bool, lse_kept [R] or None)."""
    r, v = z.shape
    t_vec = torch.full((r,), float(np.float32(program.temperature)), dtype=torch.float32, device=z.device)
    zs = torch.div(z, t_vec[:, None])                # a device tensor divisor: IEEE division (never x * (1/T))
    keep = None                                                   # None: every token kept
    top_k = program.top_k is not None and program.top_k < v
    top_p = program.top_p is not None and program.top_p < 1.0
    d = _order_key(zs) if (top_k or top_p) else None
    if top_k:
        keep = _first_mask(d, program.top_k)
    if top_p:
        keep = _top_p_torch(zs, z, t_vec, d, keep, program.top_k if top_k else v, np.float32(program.top_p), be)
    del d
    if program.min_p is not None and program.min_p > 0.0:
        base = zs if keep is None else torch.where(keep, zs, float("-inf"))
        m = base.amax(dim=1, keepdim=True)                        # NaN-propagating, like numpy's max
        del base
        thr = float(contract_log(np.float32(program.min_p)))
        ok = (zs - m) >= thr
        keep = ok if keep is None else keep & ok
    lse = _lse_torch(keep, be, z, t_vec) if want_lse else None
    if keep is None:
        keep = torch.ones(r, v, dtype=torch.bool, device=z.device)
    return zs, keep, lse


def _program_torch(logits, tg, program, v, rows_per_chunk):
    """The torch path on the logits' device: (logp like tg, lse [N], in_set like tg) as tensors there."""
    dev = logits.device
    n = logits.shape[0]
    be = _device_backend(dev)
    tg2 = tg.reshape(n, 1) if tg.dim() == 1 else tg
    logp = torch.empty(tg2.shape, dtype=torch.float32, device=dev)
    lse = torch.empty(n, dtype=torch.float32, device=dev)
    in_set = torch.empty(tg2.shape, dtype=torch.bool, device=dev)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        z = logits[r0:r1, :v].detach().contiguous()
        zs, keep, ls = _program_chunk_torch(z, program, be, True)
        t = tg2[r0:r1]
        dlt = zs.gather(1, t).sub_(ls[:, None])                  # z'_target - lse_kept
        logp[r0:r1] = torch.where((dlt < 0) | torch.isnan(dlt), dlt, 0.0)   # numpy's minimum(d, 0): +0 at d = -0
        lse[r0:r1] = ls
        in_set[r0:r1] = keep.gather(1, t)
        del zs, keep
    return logp.view(tg.shape), lse, in_set.view(tg.shape)


def _kept_mask_torch(logits, program, v, rows_per_chunk):
    n = logits.shape[0]
    be = _device_backend(logits.device)
    out = torch.empty(n, v, dtype=torch.bool, device=logits.device)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        z = logits[r0:r1, :v].detach().to(torch.float32).contiguous()
        out[r0:r1] = _program_chunk_torch(z, program, be, False)[1]
    return out


# ---------------------------------------------------------------------------------------------------------
# public entries
# ---------------------------------------------------------------------------------------------------------

def _default_rows(path: str, device) -> int:
    return DEVICE_ROWS_PER_CHUNK if (path == "torch" and torch.device(device).type == "cuda") else NUMPY_ROWS_PER_CHUNK


def _check_logits(logits, vocab_size, float32_only=True):
    if (not isinstance(logits, torch.Tensor) or logits.dim() != 2
            or (logits.dtype != torch.float32 if float32_only else not logits.is_floating_point())):
        raise ContractInputError(f"logits must be a 2-D torch.float32 tensor; got "
                                 f"{getattr(logits, 'dtype', type(logits).__name__)} {tuple(getattr(logits, 'shape', ()))}")
    v = logits.shape[1] if vocab_size is None else vocab_size
    if not isinstance(v, int) or isinstance(v, bool) or not (1 <= v <= logits.shape[1]):
        raise ContractInputError(f"vocab_size must be an int in [1, {logits.shape[1]}]; got {vocab_size!r}")
    return v


def program_logp_from_logits(logits: torch.Tensor, targets: torch.Tensor, program: TransformProgram, *,
                             vocab_size: int | None = None, rows_per_chunk: int | None = None,
                             require_kept: bool = True, path: str | None = None):
    """logp/lse_kept under `program` from FP32 unscaled logits [N, V]. targets [N], or [N, C] for several ids per
    row (the kept set and lse_kept are computed once per row). Returns (logp shaped like targets, lse_kept [N],
    kept shaped like targets: whether each id is in its row's kept set), on the logits' device. With
    require_kept, an id outside it raises.

    path: None (the torch path for CUDA logits, the numpy path for CPU logits), 'numpy' or 'torch'; both give
    the same bytes (NaN payloads aside). rows_per_chunk: rows per [rows, V] working chunk (default 64 for the
    numpy path and for torch on CPU, DEVICE_ROWS_PER_CHUNK for torch on CUDA)."""
    v = _check_logits(logits, vocab_size)
    n = logits.shape[0]
    if not isinstance(targets, torch.Tensor) or targets.dim() not in (1, 2) or targets.shape[0] != n:
        raise ContractInputError(f"targets must be [N] or [N, C] with N={n}; got {getattr(targets, 'shape', None)}")
    which = resolve_path(path, logits.device)
    rows = rows_per_chunk or _default_rows(which, logits.device)
    if n and bool(((targets < 0) | (targets >= v)).any()):
        raise ContractInputError(f"targets must lie in the real vocabulary [0, {v})")
    dev = logits.device
    if which == "numpy":
        tg = targets.detach().cpu().numpy().astype(np.int64)
        logp, lse, in_set = _program_numpy(logits, tg, program, v, rows)
        logp, lse, in_set = (torch.from_numpy(logp).to(dev), torch.from_numpy(lse).to(dev),
                             torch.from_numpy(in_set).to(dev))
    else:
        tg = targets.detach().to(device=dev, dtype=torch.int64)
        logp, lse, in_set = _program_torch(logits, tg, program, v, rows)
    if require_kept and n and not bool(in_set.all()):
        bad = tuple(int(i) for i in torch.nonzero(~in_set.cpu())[0])
        raise ContractInputError(f"targets[{', '.join(map(str, bad))}]={int(targets.cpu()[bad])} is outside its row's "
                                 f"kept set under {program}: it cannot have been sampled by this program")
    return logp, lse, in_set


def kept_mask(logits: torch.Tensor, program: TransformProgram, *, vocab_size: int | None = None,
              path: str | None = None, rows_per_chunk: int | None = None) -> torch.Tensor:
    """The kept set [N, V] bool for FP32 unscaled logits (the rollout samples from exactly this set), on the
    logits' device. path / rows_per_chunk as in program_logp_from_logits (the numpy path works on all rows
    at once unless rows_per_chunk is given)."""
    v = _check_logits(logits, vocab_size, float32_only=False)       # other float dtypes: rounded to FP32 first
    which = resolve_path(path, logits.device)
    if which == "numpy":
        if rows_per_chunk is None:
            return torch.from_numpy(_kept_mask_numpy(logits, program, v)).to(logits.device)
        parts = [_kept_mask_numpy(logits[r0:r0 + rows_per_chunk], program, v)
                 for r0 in range(0, logits.shape[0], rows_per_chunk)]
        out = np.concatenate(parts) if parts else np.zeros((0, v), dtype=bool)
        return torch.from_numpy(out).to(logits.device)
    return _kept_mask_torch(logits, program, v, rows_per_chunk or _default_rows(which, logits.device))
