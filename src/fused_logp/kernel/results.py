"""What the public entries return: LogpResult (logp, lse, optional logits, provenance) and ShardStats (one
vocabulary shard's tile statistics with their provenance)."""
from __future__ import annotations

import dataclasses

import torch

from ..shared_contract.provenance import Provenance


@dataclasses.dataclass
class LogpResult:
    logp: torch.Tensor                    # [N] fp32 ([N, C] for several ids per row)
    lse: torch.Tensor                     # [N] fp32
    logits: torch.Tensor | None           # [N, V] fp32, unscaled (before temperature), or None
    provenance: Provenance


@dataclasses.dataclass
class ShardStats:
    tile_max: torch.Tensor                # [N, nt] fp32, global tiles tile_offset .. tile_offset+nt-1
    tile_sum: torch.Tensor                # [N, nt] fp32
    target_logit: torch.Tensor            # [N] fp32: z'_target where this shard owns the target, else -inf
    target_owned: torch.Tensor            # [N] bool
    tile_offset: int
    logits: torch.Tensor | None           # [N, n_real_local] fp32 unscaled, or None
    provenance: Provenance
    unit_temperature: bool = False        # computed at T = 1 (a number that is 1 as binary32)
