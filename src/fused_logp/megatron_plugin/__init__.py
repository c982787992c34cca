"""Megatron plugin: per-token logp and lse from the contract op in place of the output layer + cross-entropy.

    from fused_logp import megatron_plugin as mp
    initialize_megatron(extra_args_provider=mp.add_logp_args)      # --logp-backend contract ...
    mp.setup_from_args(get_args())                                  # configures and installs the GPTModel hook
    out = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)   # -> LogpOutput
    loss, num_tokens, report = mp.logp_loss_func(loss_mask, out)
    fp = mp.track_lm_head(model, optimizer)                          # fingerprint at load and after each step

On megatron-core >= 0.18 `mp.logp_output_processor` can also be passed directly as `output_processor=`.
"""
from .args import add_logp_args, chain_args_providers, settings_from_args, setup_from_args
from .fingerprint import LmHeadFingerprint, track_lm_head
from .guards import UnsupportedMegatronConfigError
from .hook import (disable, enable, has_output_processor_hook, install, is_installed, megatron_core_version,
                   uninstall, unwrap_gpt_model)
from .parallel import gather_context_parallel
from .processor import LogpOutput, logp_loss_func, logp_output_processor
from .settings import LogpSettings, call_options, configure, get_settings, set_settings

__all__ = [
    "LmHeadFingerprint", "LogpOutput", "LogpSettings", "UnsupportedMegatronConfigError", "add_logp_args",
    "call_options", "chain_args_providers", "configure", "disable", "enable", "gather_context_parallel",
    "get_settings", "has_output_processor_hook", "install", "is_installed", "logp_loss_func",
    "logp_output_processor", "megatron_core_version", "set_settings", "settings_from_args", "setup_from_args",
    "track_lm_head", "uninstall", "unwrap_gpt_model",
]
