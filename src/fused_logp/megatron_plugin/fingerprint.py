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
    """Fingerprint of a GPTModel's lm_head (the tied embedding on a first stage).

    The compared weight version is the fingerprint itself (content-addressed): `check_rollout` and `current()`
    recompute it from the weight as it is now, so weights changed outside a tracked optimizer step (a checkpoint
    load, an in-place edit, a parameter copy) can never pass as the old ones, and a step that leaves the lm_head
    bytes unchanged never raises a mismatch. `version` (optimizer steps that reported success since tracking
    began) is an informational label only. The computation is a collective over the tensor-parallel group: call
    it on every TP rank of the last pipeline stage."""

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
        """Recompute the fingerprint from the weight as it is now (also the value of `current()`)."""
        w = self.weight().detach()
        tp = group_size(self.tp_group)
        vocab = resolve_vocab_size(LogpSettings(vocab_size=self._vocab_size or settings_for(self.model).vocab_size),
                                   w.shape[0] * tp, get_config().strict)
        self.fingerprint = weight_fingerprint(w, vocab_start=group_rank(self.tp_group) * w.shape[0],
                                              vocab_size=vocab, group=self.tp_group)
        return self.fingerprint

    current = refresh

    def step_done(self, result=None) -> None:
        """Count an optimizer step (the informational label) and refingerprint. A Megatron step that reports
        `update_successful=False` (skipped for a loss-scale overflow) is not counted."""
        if isinstance(result, tuple) and result and result[0] is False:
            return
        self.version += 1
        self.refresh()

    def attach(self, optimizer):
        """Count `optimizer.step()` calls: a torch optimizer through its step post-hook, any other optimizer
        (Megatron's MegatronOptimizer / ChainedOptimizer) by wrapping its bound `step`."""
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

    def check_rollout(self, rollout_fingerprint: str, *, rollout_weight_version=None,
                      strict: bool | None = None) -> bool:
        """Compare the fingerprint a rollout recorded with the trainer's lm_head as it is now (recomputed here).
        True when they agree. Weight versions are labels for the message only. On a mismatch strict mode raises
        FingerprintMismatchError; otherwise it logs a warning and returns False."""
        strict = get_config().strict if strict is None else strict
        before = self.fingerprint
        now = self.refresh()
        if rollout_fingerprint == now:
            return True
        rv = f" (rollout weight version {rollout_weight_version})" if rollout_weight_version is not None else ""
        changed = (f"; the trainer's lm_head changed since it was last fingerprinted ({before}) without a tracked "
                   f"optimizer step (checkpoint load or in-place edit)" if before != now else "")
        if rollout_fingerprint == before and before != now:
            side = "the trainer's weights moved after the rollout's weights were synced"
        else:
            side = "the rollout sampled with other lm_head bytes than the trainer holds (a stale or missed weight push)"
        msg = (f"lm_head fingerprint mismatch: rollout recorded {rollout_fingerprint}{rv}, trainer now {now} "
               f"(after {self.version} tracked optimizer steps){changed}: {side}")
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
    """Fingerprint the lm_head now (at load) and, with an optimizer, after every step. `model` may be wrapped
    (DDP, Float16Module) or the list `get_model` returns (the chunk with the output layer is used)."""
    fp = LmHeadFingerprint(model, vocab_size=vocab_size)
    if optimizer is not None:
        fp.attach(optimizer)
    return fp
