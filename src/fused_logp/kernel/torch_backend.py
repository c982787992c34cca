"""The ordinary path: fp32 matmul + log_softmax. Not contract-bearing; for comparison, refused in strict mode."""
from __future__ import annotations

import torch

from .backends import Forward, Merged


class TorchBackend:
    name = "torch"
    contract_bearing = False
    entries = frozenset({"linear_logp", "stats_from_logits"})
    multi_target = False

    def available(self, device=None):
        return True, "always available"

    def describe(self) -> dict:
        cuda = torch.version.cuda or "none"
        return {"arch": "any", "compute_capability": "any", "toolkit": f"torch {torch.__version__} cuda {cuda}",
                "build": "torch"}

    def _scaled(self, hidden, weight, bias, temperature, vocab_size):
        z = torch.matmul(hidden.float(), weight[:vocab_size].float().T)
        if bias is not None:
            z = z + bias[:vocab_size].float()
        return z, z / temperature[:, None]

    def linear_logp(self, hidden, weight, targets, *, bias, temperature, return_logits, vocab_size):
        z, zs = self._scaled(hidden, weight, bias, temperature, vocab_size)
        lse = torch.logsumexp(zs, dim=-1)
        logp = zs.gather(1, targets[:, None]).squeeze(1) - lse
        return Forward(logp, lse, z if return_logits else None)

    def stats_from_logits(self, logits, targets, *, temperature, vocab_size):
        zs = logits[:, :vocab_size].float() / temperature[:, None]
        lse = torch.logsumexp(zs, dim=-1)
        return Merged(zs.gather(1, targets[:, None]).squeeze(1) - lse, lse)
