"""lm_head weight fingerprint and weight-version counter on the trainer side.

The fingerprint (fused_logp.weight_fingerprint) is shard- and padding-invariant: the trainer's TP shards and the
rollout's give the same value for the same real-vocab bf16 bytes. It detects changed bytes; it is not a
cryptographic commitment.
"""
from __future__ import annotations

import logging

import torch

from ..shared_contract.config import get_config
from ..shared_contract.errors import FingerprintMismatchError
from ..kernel.fingerprint import weight_fingerprint
from .hook import settings_for, unwrap_gpt_model
from .parallel import group_rank, group_size
from .settings import LogpSettings, resolve_vocab_size

log = logging.getLogger("fused_logp")


class LmHeadFingerprint:
    """Fingerprint of a GPTModel's lm_head (the tied embedding on a first stage), recomputed after every optimizer
    step. `version` counts the steps that updated the weights (0 = as loaded)."""

    def __init__(self, model, *, vocab_size: int | None = None):
        self.model = unwrap_gpt_model(model)
        if not self.model.post_process:
            raise ValueError("the lm_head lives on the last pipeline stage; track it there")
        layer = self.model.output_layer
        self.tp_group = layer.tp_group if group_size(layer.tp_group) > 1 else None
        self._vocab_size = vocab_size
        self.version = 0
        self.fingerprint = None
        self._hooks: list = []
        self.refresh()

    def weight(self) -> torch.Tensor:
        m = self.model
        w = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight
        return w

    def refresh(self) -> str:
        w = self.weight().detach()
        tp = group_size(self.tp_group)
        vocab = resolve_vocab_size(LogpSettings(vocab_size=self._vocab_size or settings_for(self.model).vocab_size),
                                   w.shape[0] * tp, get_config().strict)
        self.fingerprint = weight_fingerprint(w, vocab_start=group_rank(self.tp_group) * w.shape[0],
                                              vocab_size=vocab, group=self.tp_group)
        return self.fingerprint

    def step_done(self, result=None) -> None:
        """Count an optimizer step and refingerprint. A Megatron step that reports `update_successful=False`
        (skipped for a loss-scale overflow) leaves the weights and the version as they were."""
        if isinstance(result, tuple) and result and result[0] is False:
            return
        self.version += 1
        self.refresh()

    def attach(self, optimizer):
        """Refingerprint after every `optimizer.step()`: a torch optimizer through its step post-hook, any other
        optimizer (Megatron's MegatronOptimizer / ChainedOptimizer) by wrapping its bound `step`."""
        if isinstance(optimizer, torch.optim.Optimizer):
            self._hooks.append(optimizer.register_step_post_hook(lambda *_: self.step_done()))
            return self
        orig = optimizer.step
        own = vars(optimizer).get("step")

        def step(*args, **kwargs):
            result = orig(*args, **kwargs)
            self.step_done(result)
            return result

        optimizer.step = step
        self._hooks.append(_Unwrap(optimizer, own))
        return self

    def detach(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def check_rollout(self, rollout_fingerprint: str, *, rollout_weight_version: int | None = None,
                      strict: bool | None = None) -> bool:
        """Compare with the fingerprint a rollout recorded. True when they agree. On a mismatch strict mode raises
        FingerprintMismatchError; otherwise it logs a warning and returns False."""
        strict = get_config().strict if strict is None else strict
        same = rollout_fingerprint == self.fingerprint
        if rollout_weight_version is not None and rollout_weight_version != self.version:
            same = False
        if same:
            return True
        msg = (f"lm_head fingerprint mismatch: trainer {self.fingerprint} (weight version {self.version}), rollout "
               f"{rollout_fingerprint}" + (f" (weight version {rollout_weight_version})"
                                           if rollout_weight_version is not None else "")
               + ": the rollout's logp were computed with other lm_head bytes")
        if strict:
            raise FingerprintMismatchError(msg)
        log.warning("fused_logp: %s", msg)
        return False


class _Unwrap:
    def __init__(self, obj, own):
        self.obj, self.own = obj, own

    def remove(self):
        if self.own is not None:
            self.obj.step = self.own
        elif "step" in vars(self.obj):
            del self.obj.step


def track_lm_head(model, optimizer=None, *, vocab_size: int | None = None) -> LmHeadFingerprint:
    """Fingerprint the lm_head now (at load) and, with an optimizer, after every step."""
    fp = LmHeadFingerprint(model, vocab_size=vocab_size)
    if optimizer is not None:
        fp.attach(optimizer)
    return fp
