"""The numpy oracle backend (`oracle`): the contract on the CPU, bit for bit the SM90 kernel's bytes, GEMM included.

The arithmetic is the contract layer's: the logits by the GEMM rule (shared_contract/gemm_rule.py, CONTRACT.md
section 2), the statistics, the merge and logp in numpy binary32 (shared_contract/numpy_contract.py, sections 3-6).
This module is the backend around them: tensors in and out, the shard window, the targets' owning tile.
"""
from __future__ import annotations

import numpy as np
import torch

from ..shared_contract import constants as C
from ..shared_contract.gemm_rule import hopper_logits
from ..shared_contract.numpy_contract import merge, row_lse, selected_logp, tile_stats
from .backends import CORE_ENTRIES, Forward, Merged, TileStats

_TILE = C.VOCAB_TILE


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
