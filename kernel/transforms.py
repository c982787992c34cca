"""The sampling-transform program (TRANSFORM_PROGRAM_VERSION): temperature -> top-k -> top-p -> min-p, each
optional, replayed identically by the rollout and the trainer (CONTRACT.md section 13).

Every decision is made in contract arithmetic on the scaled logits z' = z / T of the real vocabulary:
  top-k   keep the k largest z', ties broken by the lower token id;
  top-p   order the kept tokens by (z' descending, id ascending); q_v = exp(z'_v - lse_K) with lse_K the
          contract lse over the kept set K; accumulate c = add(c, q_v) in that order; keep the shortest prefix
          whose c >= p (all of K if rounding never reaches p);
  min-p   keep z'_v - m >= log(min_p), m the largest kept z', with the contract's log.
The program's logp is z'_target - lse_kept: the contract's tile tree and row merge with every non-kept lane
treated exactly like padding. A target outside the kept set cannot have been sampled: the trainer refuses it.

The trainer side works in bounded chunks of rows ([rows_per_chunk, V] FP32 logits at a time), never [N, V].
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from ..shared_contract.constants import TRANSFORM_PROGRAM_VERSION
from ..shared_contract.errors import ContractInputError
from .oracle import row_lse, selected_logp, tile_stats
from .transcendentals import contract_exp, contract_log


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


def _lse_over(zs: np.ndarray, keep: np.ndarray) -> np.ndarray:
    ones = np.ones(zs.shape[0], dtype=np.float32)
    tmax, tsum, _ = tile_stats(zs, ones, zs.shape[1], keep=keep)
    return row_lse(tmax, tsum)


def kept_set(zs: np.ndarray, program: TransformProgram) -> np.ndarray:
    """zs [N, V] fp32 scaled logits -> keep [N, V] bool (sections 13.2-13.4)."""
    n, v = zs.shape
    keep = np.ones((n, v), dtype=bool)
    order = np.argsort(-zs, axis=1, kind="stable")                         # z' descending, id ascending
    rows = np.arange(n)[:, None]
    if program.top_k is not None and program.top_k < v:
        keep[rows, order[:, program.top_k:]] = False
    if program.top_p is not None and program.top_p < 1.0:
        lse_k = _lse_over(zs, keep)
        with np.errstate(invalid="ignore", over="ignore"):
            q = contract_exp((zs - lse_k[:, None]).astype(np.float32))
        q = np.where(keep, q, np.float32(0.0))[rows, order]                # in (z' desc, id asc) order
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


def program_logp_from_logits(logits: torch.Tensor, targets: torch.Tensor, program: TransformProgram, *,
                             vocab_size: int | None = None, rows_per_chunk: int = 64, require_kept: bool = True):
    """logp/lse_kept under `program` from FP32 unscaled logits [N, V]. targets [N], or [N, C] for several ids per
    row (the kept set and lse_kept are computed once per row). Returns (logp shaped like targets, lse_kept [N],
    kept shaped like targets: whether each id is in its row's kept set). With require_kept, an id outside it
    raises."""
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise ContractInputError(f"logits must be a 2-D torch.float32 tensor; got {logits.dtype} {tuple(logits.shape)}")
    v = logits.shape[1] if vocab_size is None else vocab_size
    n = logits.shape[0]
    t32 = np.float32(program.temperature)
    tg = targets.detach().cpu().numpy().astype(np.int64)
    logp = np.empty(tg.shape, dtype=np.float32)
    lse = np.empty(n, dtype=np.float32)
    in_set = np.empty(tg.shape, dtype=bool)
    for r0 in range(0, n, rows_per_chunk):
        r1 = min(n, r0 + rows_per_chunk)
        z = logits[r0:r1, :v].detach().cpu().numpy().astype(np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            zs = (z / t32).astype(np.float32)
        keep = kept_set(zs, program)
        tmax, tsum, _ = tile_stats(zs, np.ones(r1 - r0, dtype=np.float32), v, keep=keep)
        rows = np.arange(r1 - r0) if tg.ndim == 1 else np.arange(r1 - r0)[:, None]
        lse[r0:r1] = row_lse(tmax, tsum)
        logp[r0:r1] = selected_logp(zs[rows, tg[r0:r1]], lse[r0:r1])
        in_set[r0:r1] = keep[rows, tg[r0:r1]]
    if require_kept and not in_set.all():
        bad = np.argwhere(~in_set)[0]
        raise ContractInputError(f"targets[{', '.join(map(str, bad))}]={int(tg[tuple(bad)])} is outside its row's kept "
                                 f"set under {program}: it cannot have been sampled by this program")
    dev = logits.device
    return torch.from_numpy(logp).to(dev), torch.from_numpy(lse).to(dev), torch.from_numpy(in_set).to(dev)


def kept_mask(logits: torch.Tensor, program: TransformProgram, *, vocab_size: int | None = None) -> torch.Tensor:
    """The kept set [N, V] bool for FP32 unscaled logits (the rollout samples from exactly this set)."""
    v = logits.shape[1] if vocab_size is None else vocab_size
    z = logits[:, :v].detach().cpu().numpy().astype(np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        zs = (z / np.float32(program.temperature)).astype(np.float32)
    return torch.from_numpy(kept_set(zs, program)).to(logits.device)
