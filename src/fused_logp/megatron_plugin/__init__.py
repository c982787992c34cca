"""Megatron plugin: per-token logp and lse from the contract op in place of the output layer + cross-entropy.

Megatron-LM 0.19, the lines marked `# fused-logp` in its pretrain_gpt.py (examples/pretrain_gpt_logp.patch):

    from fused_logp import megatron_plugin as mp
    args = parse_and_validate_args(extra_args_provider=mp.chain_args_providers(<the script's>, mp.add_logp_args), ...)
    mp.setup_from_args(args)                                        # configures, refuses, installs the GPTModel hook
    model_cfg.post_wrap_hooks.append(mp.check_model)                # model-level refusals on the built model
    @mp.logp_forward_step                                           # on forward_step: loss_func sees per-token loss

RL scoring: `mp.score(model, tokens, temperature=0.7)` (logp, lse, lm_head fingerprint); `mp.track_lm_head(model)`.
docs/megatron.md is the integration guide (0.16 / 0.17 lines included); versions.py holds the per-release rules.

The names below are the public surface; the submodules (args, hook, settings, training, scoring, fingerprint,
parallel, processor, guards, versions) hold the rest for tests and advanced use.
"""
from .args import add_logp_args, chain_args_providers, check_model, real_vocab_from_args, setup_from_args
from .fingerprint import LmHeadFingerprint, track_lm_head
from .guards import UnsupportedMegatronConfigError
from .hook import disable, enable, install, uninstall, unwrap_gpt_model
from .processor import LogpOutput, logp_output_processor
from .scoring import Scores, score, score_hidden_states
from .settings import LogpSettings, PaddingRowsWarning, call_options, call_settings, configure, get_settings
from .training import logp_forward_step, logp_loss_func
from .versions import megatron_core_version, null_tokenizer_vocab_size

__all__ = [
    # a training script
    "add_logp_args", "chain_args_providers", "setup_from_args", "check_model", "logp_forward_step",
    "logp_loss_func", "LogpOutput",
    # RL scoring and the weight version
    "score", "score_hidden_states", "Scores", "track_lm_head", "LmHeadFingerprint",
    # settings: process-wide, per model, per call
    "configure", "get_settings", "LogpSettings", "enable", "disable", "call_settings",
    "call_options",
    # the hook, for code that calls the model itself
    "install", "uninstall", "logp_output_processor", "unwrap_gpt_model",
    # refusals and warnings
    "UnsupportedMegatronConfigError", "PaddingRowsWarning",
    # per-release rules
    "megatron_core_version", "null_tokenizer_vocab_size", "real_vocab_from_args",
]
