"""The SM90 extension's entries outside the backend interface, over the backend's extension and output buffers.

SM90Aux       the auxiliary kernels, whose bytes do not depend on where they run (their callers have a torch/host
              formulation of the same arithmetic): the backward's dz epilogue (kernel/autograd.py), the transform
              program's tile statistics over FP32 logits and top-p crossing (kernel/transforms.py), the
              fingerprint's row hashes (kernel/fingerprint.py). backends.device_kernels(device) returns them.
SM90TestHooks the device functions of contract_math.cuh and stats_epilogue.cuh, elementwise, for the tests.

Both take the SM90Backend they belong to: its `_module()` (the built extension) and `_empty` (output buffers,
poisoned when the tests ask for it).
"""
from __future__ import annotations

import torch

from ..shared_contract import constants as C

_TILE = C.VOCAB_TILE


class SM90Aux:
    """The auxiliary kernels of one SM90 backend."""

    def __init__(self, backend):
        self._backend = backend

    def tile_stats_from_logits(self, logits, targets, temperature, vocab_size):
        """(tile_max [N, nt], tile_sum [N, nt], target_logit [N]) of FP32 logits rows, without the merge."""
        be = self._backend
        ext = be._module()
        n = logits.shape[0]
        nt = -(-int(vocab_size) // _TILE)
        tile_max = be._empty(n, nt, device=logits.device)
        tile_sum = be._empty(n, nt, device=logits.device)
        target_logit = be._empty(n, device=logits.device)
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()   # rows may be strided
        ext.logits_stats(logits, targets.contiguous(), temperature.contiguous(), int(vocab_size),
                         tile_max, tile_sum, target_logit)
        return tile_max, tile_sum, target_logit

    def topp_crossing(self, q, p: float) -> torch.Tensor:
        """Per row of q [R, V] (FP32, sorted descending), the first index where the sequential binary32 sum of
        q reaches p (CONTRACT.md section 13.3)."""
        return self._backend._module().topp_crossing(q.contiguous(), float(p))

    def backward_dz(self, hidden, weight, bias, temperature, lse, coef, g_logp, targets, vocab_start, n_cols, out):
        """The contract GEMM of a vocabulary chunk with the logit gradient as its epilogue: out [rows, n_cols]
        bf16 = (coef * exp(z/T - lse) + g_logp [target]) / T (kernel/autograd.py), with the backend's dz_launch."""
        be = self._backend
        launch = be._dz_launch_name(hidden.shape[1])
        be._module().backward_dz(hidden, weight, bias, temperature, lse, coef, g_logp, targets, int(vocab_start),
                                 int(n_cols), out, launch)

    def fingerprint_rows(self, words, multipliers, first_row, golden0, golden1) -> torch.Tensor:
        """Per-row fingerprint hashes [rows, 2] int64 of words [rows, D/4] int64 (shared_contract/fingerprint.py)."""
        return self._backend._module().fingerprint_rows(words, multipliers, first_row, golden0, golden1)


class SM90TestHooks:
    """Device functions of the kernels, elementwise, for the tests."""

    def __init__(self, backend):
        self._backend = backend

    def device_ex2log(self, x):
        """(contract_ex2(x), contract_log(x)) from the device functions of contract_math.cuh; the exp2 is meaningful
        for x <= 0 (its domain) only."""
        return tuple(self._backend._module().ex2log(x.contiguous()))
