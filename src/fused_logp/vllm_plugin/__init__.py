"""vLLM plugin: rollout logprobs from the contract op (docs/vllm.md).

Loaded by vLLM from the `vllm.general_plugins` entry point in every process; `register()` replaces vLLM's
LogitsProcessor class (PluggableLayer out-of-tree registration) and installs the admission check and the worker
RPCs. The replacement does nothing unless the engine's configuration turns it on:

    python -m vllm.entrypoints.openai.api_server --model M --dtype bfloat16 \\
        --additional-config '{"fused_logp": {"enabled": true, "strict": true}}'

FUSED_LOGP_VLLM=0 is the kill switch. `LLM.collective_rpc("fused_logp_status")` returns, per worker, whether the
op serves the lm_head, its provenance and the lm_head weight fingerprint.
"""
from __future__ import annotations

import logging

from .settings import CONFIG_KEY, ENV_SWITCH, PluginSettings, env_switch, settings_from_vllm_config

log = logging.getLogger("fused_logp.vllm")

_registered = False


def register() -> None:
    """vLLM general-plugin entry point (idempotent)."""
    global _registered
    if _registered or env_switch() is False:
        return
    from vllm.model_executor.custom_op import PluggableLayer, op_registry_oot

    from . import patches
    from .logits_processor import FusedLogpLogitsProcessor

    current = op_registry_oot.get("LogitsProcessor")
    if current is None:
        PluggableLayer.register_oot(FusedLogpLogitsProcessor, name="LogitsProcessor")
    elif current is not FusedLogpLogitsProcessor:
        raise RuntimeError(f"fused_logp: another plugin already replaces vLLM's LogitsProcessor "
                           f"({current.__module__}.{current.__qualname__}); the two cannot both serve the lm_head")
    patches.install_frontend()
    _registered = True


__all__ = ["CONFIG_KEY", "ENV_SWITCH", "PluginSettings", "register", "settings_from_vllm_config"]
