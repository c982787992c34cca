"""The lm_head replacement: vLLM's LogitsProcessor whose projection is the contract op.

`_get_logits` calls linear_logp(return_logits=True) on the real-vocab rows of the (local) lm_head and returns the
op's unscaled FP32 logits; vLLM samples from them. Under tensor parallelism each rank's real rows are padded back
to the partition width with zeros (vLLM's own padding value) before vLLM's gather, and the statistics are taken
later over the gathered row with logp_from_logits, which works for any sharding (vLLM's shards need not be
64-aligned). The returned tensor carries a `_fused_logp` mark that the sampler wrappers look for: logits without
the mark (plugin off, or a head outside the contract in non-strict mode) pass through vLLM unchanged.
"""
from __future__ import annotations

import contextvars
import dataclasses
import logging
import os
import weakref

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from .. import linear_logp, weight_fingerprint
from ..shared_contract.constants import CONTRACT_VERSION
from .policy import engine_reasons, head_reasons, refuse_or_warn
from .settings import PluginSettings, settings_from_vllm_config

log = logging.getLogger("fused_logp.vllm")

# Set by the prompt-logprob wrappers; the processor leaves its last logits there.
PROMPT_CTX: contextvars.ContextVar = contextvars.ContextVar("fused_logp_prompt", default=None)


@dataclasses.dataclass
class HeadState:
    """Per-processor record, read through the workers' fused_logp_status RPC."""
    settings: PluginSettings
    notes: set = dataclasses.field(default_factory=set)        # non-contract features seen
    provenance: dict | None = None
    fingerprint: str | None = None
    weight_version: int = 0
    op_calls: int = 0
    rows_rescored: int = 0
    rows_program: int = 0                                      # sampled rows drawn from a program's kept set
    programs: dict = dataclasses.field(default_factory=dict)   # req_id -> program dict (bounded, newest last)
    fallback: str | None = None                                # why vLLM's own head ran, if it did
    captured: list = dataclasses.field(default_factory=list)
    lm_head: object = None                                    # weakref to the lm_head module

    def note(self, reasons):
        self.notes.update(reasons)

    def record_programs(self, req_ids, programs, limit: int = 65536):
        for rid, prog in zip(req_ids, programs):
            if rid is not None and prog is not None and rid not in self.programs:
                self.programs[rid] = prog.to_dict()
        while len(self.programs) > limit:
            self.programs.pop(next(iter(self.programs)))


@dataclasses.dataclass
class Mark:
    state: HeadState
    hidden: torch.Tensor | None        # [N, D] bf16, kept only when capturing


class FusedLogpLogitsProcessor(LogitsProcessor):
    def __init__(self, vocab_size, org_vocab_size=None, scale=1.0, logits_as_input=False, soft_cap=None):
        super().__init__(vocab_size, org_vocab_size, scale, logits_as_input, soft_cap)
        vllm_config = get_current_vllm_config()
        settings = settings_from_vllm_config(vllm_config)
        self._fl_state = None if settings is None else HeadState(settings)
        if settings is None:
            return
        reasons = engine_reasons(vllm_config, scale=scale, soft_cap=soft_cap, logits_as_input=logits_as_input)
        refuse_or_warn(reasons, strict=settings.strict, where="the engine")
        self._fl_state.note(reasons)
        from . import patches
        patches.install()
        log.info("fused_logp: lm_head served by the contract op (%s, strict=%s, pid %d)",
                 CONTRACT_VERSION, settings.strict, os.getpid())

    # ---------------------------------------------------------------------------------------------------
    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, skip_gather=False, **kwargs):
        st = self._fl_state
        if st is None or st.fallback is not None:
            return super()._get_logits(hidden_states, lm_head, embedding_bias, skip_gather, **kwargs)
        reasons = head_reasons(lm_head, embedding_bias, skip_gather)
        if reasons:
            refuse_or_warn(reasons, strict=st.settings.strict, where="the lm_head")
            st.note(reasons)
            st.fallback = "; ".join(reasons)
            return super()._get_logits(hidden_states, lm_head, embedding_bias, skip_gather, **kwargs)

        if st.lm_head is None or st.lm_head() is not lm_head:
            st.lm_head = weakref.ref(lm_head)
            refresh_fingerprint(st)
        si = lm_head.shard_indices
        n_real = si.num_org_elements
        h = hidden_states.reshape(-1, hidden_states.shape[-1])                  # [N, D] bf16
        w = lm_head.weight[:n_real]                                             # [n_real, D] bf16
        bias = None if embedding_bias is None else embedding_bias[:n_real]
        targets = torch.zeros(h.shape[0], dtype=torch.int64, device=h.device)
        res = linear_logp(h, w, targets, bias=bias, return_logits=True, vocab_size=n_real,
                          backend=st.settings.backend, strict=st.settings.strict)
        st.op_calls += 1
        st.provenance = res.provenance.to_dict()
        logits = res.logits                                                     # [N, n_real] fp32, unscaled
        if lm_head.tp_size > 1:
            width = lm_head.num_embeddings_per_partition
            if width > n_real:
                logits = torch.nn.functional.pad(logits, (0, width - n_real))
            logits = self._gather_logits(logits)
        if logits is None:
            return None
        logits = logits[..., : self.org_vocab_size]
        if not logits.is_contiguous():
            logits = logits.contiguous()
        logits._fused_logp = Mark(st, h.detach().clone() if st.settings.capture else None)
        ctx = PROMPT_CTX.get()
        if ctx is not None:
            ctx.last_logits = logits
        return logits


def lm_head_fingerprint(lm_head) -> str:
    """weight_fingerprint of the real-vocab rows the op reads, summed over the tensor-parallel group."""
    si = lm_head.shard_indices
    group = None
    if lm_head.tp_size > 1:
        from vllm.distributed.parallel_state import get_tp_group
        group = get_tp_group().device_group
    return weight_fingerprint(lm_head.weight.data[: si.num_org_elements], vocab_start=si.org_vocab_start_index,
                              vocab_size=lm_head.org_vocab_size, group=group)


def refresh_fingerprint(st: HeadState) -> str | None:
    """Fingerprint the lm_head bytes now; a changed value starts a new weight version."""
    head = st.lm_head() if st.lm_head is not None else None
    if head is None:
        return st.fingerprint
    fp = lm_head_fingerprint(head)
    if st.fingerprint is not None and fp != st.fingerprint:
        st.weight_version += 1
    st.fingerprint = fp
    return fp
