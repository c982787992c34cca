"""Installing the processor into GPTModel.

megatron-core >= 0.18: GPTModel.forward takes `output_processor=`; `install()` wraps forward so that a labelled
training/scoring call gets `logp_output_processor` when the caller passed none (callers may also pass it
themselves). The wrapper refuses uncovered configurations before the forward, because GPTModel._postprocess runs
the multi-token-prediction block and its loss before it calls output_processor. megatron-core 0.16/0.17:
`install()` wraps `GPTModel._postprocess`, which calls the processor with the >= 0.18 keywords. Both are
idempotent, reversible (`uninstall`) and pass through when the plugin is disabled, when labels are absent
(generation wants logits) or when an inference context is given. `install()` also guards the models the plugin
does not serve (versions.UNSERVED_MODELS: HybridModel, MambaModel): with the plugin on, their labelled training
forward raises UnsupportedMegatronConfigError instead of training on Megatron's own loss.
"""
from __future__ import annotations

import functools
import inspect
import logging
import threading

from .guards import UnsupportedMegatronConfigError, check_config
from .processor import logp_output_processor
from .settings import LogpSettings, active_call_settings, check_backend_allowed, get_settings
from .versions import megatron_core_version, unserved_model_classes, unserved_model_message  # noqa: F401

_ATTR = "_fused_logp_settings"
_lock = threading.Lock()
_warned_unlabelled = False
log = logging.getLogger("fused_logp")


def _note_unlabelled_call():
    """An unlabelled, non-inference forward with the plugin on gets Megatron's logits, not the contract's logp
    (an RL framework's log-prob step looks like this): said once per process."""
    global _warned_unlabelled
    if not _warned_unlabelled:
        _warned_unlabelled = True
        log.warning("fused_logp: a GPTModel forward without labels returns Megatron's own logits, not the contract "
                    "op's logp (the plugin needs the target ids); for RL log-probs call "
                    "fused_logp.megatron_plugin.score(model, tokens, targets, temperature=...)")
_installed: dict = {}          # (class, attribute name) -> original function


def _gpt_model_cls():
    from megatron.core.models.gpt.gpt_model import GPTModel
    return GPTModel


def has_output_processor_hook() -> bool:
    return "output_processor" in inspect.signature(_gpt_model_cls().forward).parameters


def unwrap_gpt_model(model):
    """The GPTModel inside DDP / Float16Module / other `.module` wrappers. A list (what `get_model` returns, one
    chunk per virtual pipeline stage) gives the chunk holding the output layer (post_process)."""
    GPTModel = _gpt_model_cls()
    if isinstance(model, (list, tuple)):
        if not model:
            raise TypeError("an empty model list")
        chunks = [unwrap_gpt_model(m) for m in model]
        last = [c for c in chunks if c.post_process]
        if not last:
            raise ValueError("no model chunk on this rank holds the output layer (post_process): the lm_head lives "
                             "on the last pipeline stage")
        return last[-1]
    seen = 0
    unserved = tuple(unserved_model_classes())
    while not isinstance(model, GPTModel):
        if unserved and isinstance(model, unserved):
            raise UnsupportedMegatronConfigError(unserved_model_message(model))
        if not hasattr(model, "module") or seen > 8:
            raise TypeError(f"no megatron.core GPTModel found inside {type(model).__name__}")
        model, seen = model.module, seen + 1
    return model


def settings_for(model) -> LogpSettings:
    """Per-call settings (`call_settings`, the scoring API) over per-model ones over the process-wide ones."""
    return active_call_settings() or getattr(model, _ATTR, None) or get_settings()


def enable(model, settings: LogpSettings | None = None):
    """Per-model settings (overriding the process-wide ones), e.g. to turn the plugin on for one model only."""
    settings = settings or LogpSettings(backend="contract")
    check_backend_allowed(settings.backend)
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        setattr(unwrap_gpt_model(chunk), _ATTR, settings)
    install()
    return model


def disable(model):
    """This model follows Megatron's own output layer and loss again (a disabled per-model setting)."""
    for chunk in (model if isinstance(model, (list, tuple)) else [model]):
        setattr(unwrap_gpt_model(chunk), _ATTR, LogpSettings(backend=None))
    return model


def _make_postprocess(orig):
    @functools.wraps(orig)
    def _postprocess(self, hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos,
                     rotary_pos_sin, mtp_in_postprocess=None, loss_mask=None, decoder_input=None,
                     attention_mask=None, inference_params=None, packed_seq_params=None, sequence_len_offset=None,
                     runtime_gather_output=None, extra_block_kwargs=None, inference_context=None, **kw):
        args = (hidden_states, input_ids, position_ids, labels, rotary_pos_emb, rotary_pos_cos, rotary_pos_sin)
        kwargs = dict(mtp_in_postprocess=mtp_in_postprocess, loss_mask=loss_mask, decoder_input=decoder_input,
                      attention_mask=attention_mask, inference_params=inference_params,
                      packed_seq_params=packed_seq_params, sequence_len_offset=sequence_len_offset,
                      runtime_gather_output=runtime_gather_output, extra_block_kwargs=extra_block_kwargs,
                      inference_context=inference_context, **kw)
        settings = settings_for(self)
        if settings.enabled and labels is None and inference_context is None and inference_params is None \
                and self.post_process:
            _note_unlabelled_call()
        if not settings.enabled or labels is None or inference_context is not None or not self.post_process:
            return orig(self, *args, **kwargs)
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights \
            else None
        if mtp_in_postprocess:
            from .guards import _refuse
            _refuse("multi-token prediction (mtp_block_spec)",
                    "its heads call output_layer and compute_language_model_loss directly, outside the contract op")
        return logp_output_processor(
            hidden_states=hidden_states, output_layer=self.output_layer, output_weight=output_weight,
            labels=labels, loss_mask=loss_mask, input_ids=input_ids, position_ids=position_ids,
            attention_mask=attention_mask, decoder_input=decoder_input, inference_context=inference_context,
            packed_seq_params=packed_seq_params, runtime_gather_output=runtime_gather_output, context=settings,
            compute_language_model_loss=self.compute_language_model_loss, config=self.config)

    _postprocess.__fused_logp_wrapper__ = True
    return _postprocess


def _make_forward(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        settings = settings_for(self)
        if settings.enabled and kwargs.get("output_processor") is None:
            bound = sig.bind_partial(self, *args, **kwargs).arguments
            if bound.get("inference_context") is None and bound.get("inference_params") is None:
                if bound.get("labels") is not None:
                    kwargs["output_processor"] = logp_output_processor
                    kwargs["output_processor_context"] = settings
                elif self.post_process:
                    _note_unlabelled_call()
        if kwargs.get("output_processor") is logp_output_processor:
            check_config(self.config)       # _postprocess runs the MTP block and loss before output_processor
        return orig(self, *args, **kwargs)

    forward.__fused_logp_wrapper__ = True
    return forward


def _make_unserved_forward(orig):
    sig = inspect.signature(orig)

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        if settings_for(self).enabled:
            bound = sig.bind_partial(self, *args, **kwargs).arguments
            if bound.get("labels") is not None and bound.get("inference_context") is None \
                    and bound.get("inference_params") is None:
                raise UnsupportedMegatronConfigError(unserved_model_message(self))
        return orig(self, *args, **kwargs)

    forward.__fused_logp_wrapper__ = True
    return forward


def _wrap(cls, name, make):
    key = (cls, name)
    if key in _installed:
        return
    orig = cls.__dict__[name]
    if getattr(orig, "__fused_logp_wrapper__", False):      # installed by another copy of this module
        return
    _installed[key] = orig
    setattr(cls, name, make(orig))


def install() -> str:
    """Install the hook on GPTModel (idempotent) and the refusal on the unserved models. Returns the GPTModel
    attribute wrapped: 'forward' or '_postprocess'."""
    GPTModel = _gpt_model_cls()
    name = "forward" if has_output_processor_hook() else "_postprocess"
    with _lock:
        _wrap(GPTModel, name, _make_forward if name == "forward" else _make_postprocess)
        for cls in unserved_model_classes():
            if "forward" in cls.__dict__:
                _wrap(cls, "forward", _make_unserved_forward)
    return name


def uninstall() -> None:
    """Restore the original methods (idempotent)."""
    with _lock:
        for (cls, name), orig in list(_installed.items()):
            setattr(cls, name, orig)
            del _installed[(cls, name)]


def is_installed() -> bool:
    GPTModel = _gpt_model_cls()
    return any(getattr(GPTModel.__dict__.get(n), "__fused_logp_wrapper__", False) for n in ("forward", "_postprocess"))
