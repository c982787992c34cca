"""vLLM plugin: rollout logprobs from the contract op (docs/vllm.md).

Loaded by vLLM from the `vllm.general_plugins` entry point in every process; `register()` replaces vLLM's
LogitsProcessor class (PluggableLayer out-of-tree registration) and installs the admission check, the worker
RPCs and the status metric. The replacement does nothing unless the engine's configuration turns it on:

    python -m vllm.entrypoints.openai.api_server --model M --dtype bfloat16 \\
        --additional-config '{"fused_logp": {"enabled": true, "strict": true}}'

FUSED_LOGP_VLLM=0 is the kill switch (an engine configured for strict mode is then refused at start).

Public surface (what other code may import from `fused_logp.vllm_plugin`; everything else is internal):
register, the settings (CONFIG_KEY, ENV_SWITCH, PluginSettings, settings_from_vllm_config), matching captured rows
to requests (same_request, completion_index), the logprobs modes and their trainer-side call (LOGPROBS_MODES,
expected_values), the engine's sampling normalisation (request_sampling: the record a rollout stores; the
trainer's side of it is fused_logp.shared_contract.sampling.effective_sampling) and the hook shapes (detect_hooks).

Modules, one per vLLM surface: head (LogitsProcessor._get_logits), v1_sampler, mrv2_sampler, prompt_logprobs,
weight_sync, status_rpc, admission, metrics; state (shared state), scoring (the rescoring both samplers end in),
settings, policy (what strict mode refuses), capability (hook shapes), install (the engine-side installer),
trainer (the trainer-side call per logprobs mode; no vLLM import).
"""
from __future__ import annotations

from .settings import CONFIG_KEY, ENV_SWITCH, PluginSettings, env_switch, settings_from_vllm_config

_registered = False


def register() -> None:
    """vLLM general-plugin entry point (idempotent)."""
    global _registered
    if _registered:
        return
    from . import admission

    if env_switch() is False:
        admission.install_kill_switch_check()
        _registered = True
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    from . import metrics, status_rpc
    from .head import FusedLogpLogitsProcessor

    current = op_registry_oot.get("LogitsProcessor")
    if current is None:
        PluggableLayer.register_oot(FusedLogpLogitsProcessor, name="LogitsProcessor")
    elif current is not FusedLogpLogitsProcessor:
        raise RuntimeError(f"fused_logp: another plugin already replaces vLLM's LogitsProcessor "
                           f"({current.__module__}.{current.__qualname__}); the two cannot both serve the lm_head")
    admission.install()
    status_rpc.install()
    metrics.install()
    _registered = True


_LAZY = {"same_request": "status_rpc", "completion_index": "status_rpc", "LOGPROBS_MODES": "trainer",
         "expected_values": "trainer", "request_sampling": "policy"}


def __getattr__(name):
    """The public names that live in heavier modules, imported on first use."""
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(f"{__name__}.{mod}"), name)


def detect_hooks():
    """The installed vLLM's hook shapes (capability.detect())."""
    from .capability import detect
    return detect()


__all__ = ["CONFIG_KEY", "ENV_SWITCH", "LOGPROBS_MODES", "PluginSettings", "completion_index", "detect_hooks",
           "expected_values", "register", "request_sampling", "same_request", "settings_from_vllm_config"]
