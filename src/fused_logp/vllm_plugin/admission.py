"""The request-admission surface (vLLM's InputProcessor, in the frontend process): strict mode refuses sampling
parameters outside the contract before the request is queued (HTTP 400 on a server), and an engine configured
for the plugin in strict mode while the kill switch is set is refused at start.

The plugin's settings are read once per InputProcessor (at construction), not per request."""
from __future__ import annotations

import functools

from .policy import StrictRequestError, refuse_or_warn, request_reasons
from .settings import check_kill_switch, settings_from_vllm_config

_UNSET = object()


def _settings(processor):
    s = processor.__dict__.get("_fused_logp_settings", _UNSET)
    if s is _UNSET:
        s = settings_from_vllm_config(processor.vllm_config)
        processor.__dict__["_fused_logp_settings"] = s
    return s


def install() -> None:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    orig_init = InputProcessor.__init__
    orig = InputProcessor._validate_params

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        settings = _settings(self)           # reads the configuration once; refuses a kill-switch conflict
        if settings is not None:
            from . import metrics
            metrics.prepare_frontend()       # before vLLM starts the engine's processes
            metrics.publish(settings)

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        out = orig(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            settings = _settings(self)
            if settings is not None:
                refuse_or_warn(request_reasons(params), strict=settings.strict, where="the request",
                               error=StrictRequestError)
        return out

    InputProcessor.__init__ = __init__
    InputProcessor._validate_params = _validate_params


def install_kill_switch_check() -> None:
    """With the kill switch set, only this: refuse a strict engine configuration at start."""
    from vllm.v1.engine.input_processor import InputProcessor

    orig_init = InputProcessor.__init__

    @functools.wraps(orig_init)
    def __init__(self, *args, **kwargs):
        orig_init(self, *args, **kwargs)
        check_kill_switch(self.vllm_config)

    InputProcessor.__init__ = __init__
