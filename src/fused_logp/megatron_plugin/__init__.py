"""Megatron plugin: per-token logp and lse from the contract op in place of the output layer + cross-entropy.

    from fused_logp import megatron_plugin as mp
    initialize_megatron(extra_args_provider=mp.add_logp_args)      # --logp-backend contract ...
    mp.setup_from_args(get_args())                                  # configures, refuses, installs the GPTModel hook
    forward_step = mp.logp_forward_step(forward_step)               # the script's loss_func sees per-token loss
    fp = mp.track_lm_head(model, optimizer)                          # content-addressed lm_head fingerprint
    sc = mp.score(model, tokens, temperature=0.7)                    # RL scoring: logp, lse, fingerprint

docs/megatron.md is the integration guide; examples/pretrain_gpt_logp.py a pretrain_gpt-shaped script.
"""
from .args import (add_logp_args, chain_args_providers, check_args, check_model, real_vocab_from_args,
                   settings_from_args, setup_from_args)
from .fingerprint import LmHeadFingerprint, track_lm_head
from .guards import UnsupportedMegatronConfigError
from .hook import (disable, enable, has_output_processor_hook, install, is_installed, megatron_core_version,
                   uninstall, unwrap_gpt_model)
from .parallel import gather_context_parallel
from .processor import LogpOutput, logp_output_processor
from .scoring import Scores, score, score_hidden_states
from .settings import (LogpSettings, PaddingRowsWarning, call_options, call_settings, configure, get_settings,
                       set_settings)
from .training import (LossChecks, logp_forward_step, logp_loss_adapter, logp_loss_func, per_token_loss,
                       set_loss_checks, validate_loss)

__all__ = [
    "LmHeadFingerprint", "LogpOutput", "LogpSettings", "LossChecks", "PaddingRowsWarning", "Scores",
    "UnsupportedMegatronConfigError", "add_logp_args", "call_options", "call_settings", "chain_args_providers",
    "check_args", "check_model", "configure", "disable", "enable", "gather_context_parallel", "get_settings",
    "has_output_processor_hook", "install", "is_installed", "logp_forward_step", "logp_loss_adapter",
    "logp_loss_func", "logp_output_processor", "megatron_core_version", "per_token_loss", "real_vocab_from_args",
    "score", "score_hidden_states", "set_loss_checks", "set_settings", "settings_from_args", "setup_from_args",
    "track_lm_head", "uninstall", "unwrap_gpt_model", "validate_loss",
]
