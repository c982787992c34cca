"""Megatron-LM 0.19's pretrain_gpt.py with the fused_logp Megatron plugin, without editing pretrain_gpt.py.

Megatron-LM's own script is imported as a module (its forward_step, dataset provider and embedding ranks); this
file is its `__main__` with the plugin's lines, marked `# fused-logp`. The same lines put into pretrain_gpt.py
itself are examples/pretrain_gpt_logp.patch.

Run it where pretrain_gpt.py runs (a Megatron-LM checkout at core_r0.19.0, or its pretrain_gpt.py, gpt_builders.py
and model_provider.py next to the megatron-core 0.19 wheel, which ships megatron/training), with the checkout on
PYTHONPATH and pretrain_gpt.py's arguments:

    PYTHONPATH=/path/to/Megatron-LM torchrun --nproc-per-node 8 examples/pretrain_gpt_logp.py \\
        <pretrain_gpt.py's arguments> --logp-backend contract [--logp-vocab-size 151936]

Without --logp-backend it trains as pretrain_gpt.py does, to the bit (bench/megatron_h200_train.py checks the
lm loss and grad norm of every iteration against the unmodified script).
"""
from __future__ import annotations

import time

_PROGRAM_START_TIME = time.time()

import pretrain_gpt  # noqa: E402  Megatron-LM's script (core_r0.19.0), imported: its __main__ does not run
from megatron.core.enums import ModelType  # noqa: E402
from megatron.training import inprocess_restart, pretrain, set_startup_timestamps  # noqa: E402
from megatron.training.argument_utils import gpt_config_from_args, pretrain_cfg_container_from_args  # noqa: E402
from megatron.training.arguments import parse_and_validate_args  # noqa: E402

from fused_logp import megatron_plugin as mp  # noqa: E402                                     # fused-logp


def main():
    set_startup_timestamps(program_start=_PROGRAM_START_TIME, main_entry=time.time())
    provider = pretrain_gpt.train_valid_test_datasets_provider
    provider.is_distributed = True
    run, store = inprocess_restart.maybe_wrap_for_inprocess_restart(pretrain)

    modelopt = pretrain_gpt.has_nvidia_modelopt
    args = parse_and_validate_args(
        extra_args_provider=mp.chain_args_providers(pretrain_gpt.add_modelopt_args if modelopt else None,
                                                    mp.add_logp_args),                         # fused-logp
        args_defaults={"tokenizer_type": "GPT2BPETokenizer"})
    mp.setup_from_args(args)                                                                   # fused-logp
    if modelopt:
        pretrain_gpt.maybe_enable_modelopt(args)
    if modelopt and getattr(args, "modelopt_enabled", False):
        model_cfg = gpt_config_from_args(args, model_config_cls=pretrain_gpt.ModelOptModelConfig)
    else:
        model_cfg = gpt_config_from_args(args)
    model_cfg.post_wrap_hooks.append(mp.check_model)                                           # fused-logp
    run(pretrain_cfg_container_from_args(args, model_cfg), provider, ModelType.encoder_or_decoder,
        mp.logp_forward_step(pretrain_gpt.forward_step),                                      # fused-logp
        store=store, get_embedding_ranks=pretrain_gpt.get_embedding_ranks)


if __name__ == "__main__":
    main()
