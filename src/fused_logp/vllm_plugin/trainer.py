"""The trainer-side call for each vLLM logprobs mode (docs/vllm.md, "Logprobs modes"): the values a rollout
recorded, recomputed from its final hidden rows and the lm_head with the op's public entries only. Imports no vLLM.

    values = expected_values(hidden, lm_head_weight, ids, logprobs_mode=mode, kind="sample", sampling=record)

`sampling` is the rollout's record of the request's effective sampling (captured rows carry it under
"sampling"; shared_contract.sampling.effective_sampling(...).to_dict() plus "program" gives the same), `ids`
[N, C] the ids whose values were returned per row.

| mode | sampled tokens | prompt tokens |
|---|---|---|
| raw_logprobs (vLLM's default) | linear_logp(h, W, ids) (T = 1, full vocabulary) | the same |
| processed_logprobs | linear_logp(h, W, ids, temperature=T) or, with a program, linear_logp_program / program_logp_from_logits (-inf outside the kept set) | linear_logp(h, W, ids) |
| raw_logits | linear_logp(h, W, ., return_logits=True).logits[ids] | the same |
| processed_logits | that logit / T (one binary32 division, CONTRACT.md section 3), -inf outside the kept set | the raw logit |

T is the effective temperature's scoring temperature (1 for greedy).
"""
from __future__ import annotations

import torch

from ..kernel.op import linear_logp
from ..kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


def _program(sampling: dict | None) -> TransformProgram | None:
    prog = None if sampling is None else sampling.get("program")
    if prog is None:
        return None
    return TransformProgram.from_dict(prog)


def expected_values(hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, *, logprobs_mode: str,
                    kind: str = "sample", sampling: dict | None = None, vocab_size: int | None = None,
                    backend=None) -> torch.Tensor:
    """[N, C] FP32: what a vLLM rollout with the plugin returns for the ids [N, C] of rows whose final hidden
    states are hidden [N, D] (bf16), in logprobs mode `logprobs_mode`, for sampled (kind="sample") or prompt
    (kind="prompt") tokens of one request whose effective sampling is `sampling` (greedy and the scoring
    temperature are read from it; None: T = 1, no program)."""
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES}; got {logprobs_mode!r}")
    if kind not in ("sample", "prompt"):
        raise ValueError(f"kind must be 'sample' or 'prompt'; got {kind!r}")
    ids = ids.to(device=hidden.device, dtype=torch.int64)
    if ids.dim() == 1:
        ids = ids[:, None]
    n, c = ids.shape
    v = vocab_size if vocab_size is not None else weight.shape[0]
    processed = kind == "sample" and logprobs_mode.startswith("processed")
    t = float(sampling["scoring_temperature"]) if processed and sampling is not None else 1.0
    prog = _program(sampling) if processed else None
    if prog is not None and prog.is_neutral(v):
        prog = None
    if logprobs_mode.endswith("logprobs") and prog is None:
        flat_h = hidden.repeat_interleave(c, dim=0)
        return linear_logp(flat_h, weight, ids.reshape(-1), temperature=t, vocab_size=v,
                           backend=backend).logp.reshape(n, c)
    z = linear_logp(hidden, weight, ids[:, 0], return_logits=True, vocab_size=v, backend=backend).logits
    if logprobs_mode.endswith("logprobs"):
        lp, _, kept = program_logp_from_logits(z, ids, prog, vocab_size=v, require_kept=False)
        return torch.where(kept, lp, torch.full_like(lp, float("-inf")))
    vals = z.gather(1, ids)
    if not processed:
        return vals
    vals = torch.div(vals, torch.full((n, 1), t, dtype=torch.float32, device=vals.device))
    if prog is not None:
        vals = torch.where(kept_mask(z, prog).gather(1, ids), vals, torch.full_like(vals, float("-inf")))
    return vals


__all__ = ["LOGPROBS_MODES", "expected_values"]
