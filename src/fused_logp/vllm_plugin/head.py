"""The lm_head surface: vLLM's LogitsProcessor whose projection is the contract op.

`_get_logits` calls the op on the real-vocab rows of the (local) lm_head and returns its unscaled FP32 logits;
vLLM samples from them. With one rank the call is logits_and_stats (the logits and every row's T = 1 tile
statistics in one launch, no targets), kept on the mark so that a batch whose rows are all scored at T = 1 reads
its logprob columns from them (logp_of_ids) without a second pass. Under tensor parallelism it is
linear_logp(return_logits=True) on each rank's real rows, padded back to the partition
width with zeros (vLLM's own padding value) before vLLM's gather; the statistics are taken later over the
gathered row with logp_from_logits, which works for any sharding (vLLM's shards need not be 64-aligned). The
returned tensor carries a `_fused_logp` mark that the sampler wrappers look for: logits without the mark (plugin
off, or a head outside the contract in non-strict mode) pass through vLLM unchanged.
"""
from __future__ import annotations

import logging
import os
import weakref

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.logits_processor import LogitsProcessor

from .. import linear_logp
from ..kernel.op import logits_and_stats
from ..shared_contract.constants import CONTRACT_VERSION
from . import capability, install, metrics
from .policy import engine_reasons, head_reasons, refuse_or_warn
from .settings import settings_from_vllm_config
from .state import PROMPT_CTX, HeadState, Mark
from .weight_sync import refresh_fingerprint

log = logging.getLogger("vllm.fused_logp")


class FusedLogpLogitsProcessor(LogitsProcessor):
    def __init__(self, vocab_size, org_vocab_size=None, scale=1.0, logits_as_input=False, soft_cap=None):
        super().__init__(vocab_size, org_vocab_size, scale, logits_as_input, soft_cap)
        self._fl_skip_gather = capability.detect().head_skip_gather
        vllm_config = get_current_vllm_config()
        settings = settings_from_vllm_config(vllm_config)
        self._fl_state = None if settings is None else HeadState(settings)
        if settings is None:
            return
        shapes = capability.require(settings.strict)
        reasons = engine_reasons(vllm_config, scale=scale, soft_cap=soft_cap, logits_as_input=logits_as_input)
        refuse_or_warn(reasons, strict=settings.strict, where="the engine")
        self._fl_state.note(reasons)
        install.install(shapes)
        self._fl_started = False

    def _vllm_logits(self, hidden_states, lm_head, embedding_bias, skip_gather, kwargs):
        if self._fl_skip_gather:
            return super()._get_logits(hidden_states, lm_head, embedding_bias, skip_gather, **kwargs)
        return super()._get_logits(hidden_states, lm_head, embedding_bias, **kwargs)

    # ---------------------------------------------------------------------------------------------------
    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, skip_gather=False, **kwargs):
        st = self._fl_state
        if st is None or st.fallback is not None:
            return self._vllm_logits(hidden_states, lm_head, embedding_bias, skip_gather, kwargs)
        weight = lm_head.weight
        key = (id(lm_head), id(weight), embedding_bias is None, bool(skip_gather))
        if st.head_checked != key:                       # checked once per lm_head (and bias / gather mode)
            reasons = head_reasons(lm_head, embedding_bias, skip_gather)
            if reasons:
                refuse_or_warn(reasons, strict=st.settings.strict, where="the lm_head")
                st.note(reasons)
                st.fallback = "; ".join(reasons)
                return self._vllm_logits(hidden_states, lm_head, embedding_bias, skip_gather, kwargs)
            st.head_checked = key

        if st.lm_head is None or st.lm_head() is not lm_head:
            st.lm_head = weakref.ref(lm_head)
            refresh_fingerprint(st)
        if not self._fl_started:
            self._fl_started = True
            log.info("fused_logp: active: lm_head served by the contract op (%s, backend %s, strict=%s, "
                     "fingerprint %s, vLLM %s, pid %d)", CONTRACT_VERSION, st.settings.backend, st.settings.strict,
                     st.fingerprint, capability.detect().vllm_version, os.getpid())
        si = lm_head.shard_indices
        n_real = si.num_org_elements
        h = hidden_states.reshape(-1, hidden_states.shape[-1])                  # [N, D] bf16
        w = weight if weight.shape[0] == n_real else weight[:n_real]           # [n_real, D] bf16
        bias = None if embedding_bias is None else embedding_bias[:n_real]
        stats = None
        if lm_head.tp_size == 1 and st.settings.backend != "torch":     # the torch backend has no tile statistics
            stats = res = logits_and_stats(h, w, vocab_size=n_real, bias=bias, backend=st.settings.backend,
                                           strict=st.settings.strict)
        else:
            targets = st.head_targets(h.shape[0], h.device)                    # id 0: no target is read
            res = linear_logp(h, w, targets, bias=bias, return_logits=True, vocab_size=n_real,
                              backend=st.settings.backend, strict=st.settings.strict)
        st.op_calls += 1
        if st.provenance is None:
            metrics.served(res.provenance.backend)                             # fused_logp_info's backend
        st.provenance = res.provenance                                         # to_dict() when read
        logits = res.logits                                                     # [N, n_real] fp32, unscaled
        if lm_head.tp_size > 1:
            width = lm_head.num_embeddings_per_partition
            if width > n_real:
                logits = torch.nn.functional.pad(logits, (0, width - n_real))
            logits = self._gather_logits(logits)
        if logits is None:
            return None
        if logits.shape[-1] != self.org_vocab_size:
            logits = logits[..., : self.org_vocab_size]
            stats = None
        if not logits.is_contiguous():
            logits = logits.contiguous()
            stats = None
        logits._fused_logp = Mark(st, h.detach().clone() if st.settings.capture else None, stats)
        ctx = PROMPT_CTX.get()
        if ctx is not None:
            ctx.last_logits = logits
        return logits
