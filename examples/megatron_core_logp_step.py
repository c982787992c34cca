"""One training step of a GPT with the fused_logp Megatron plugin on megatron-core alone (0.16 and later): the
model_provider / get_batch / loss_func / forward_step of a pretrain_gpt-shaped script, the shape Megatron-LM 0.16 and
0.17 train with `pretrain(train_valid_test_datasets_provider, model_provider, model_type, forward_step,
extra_args_provider=...)`. For Megatron-LM 0.19 see examples/pretrain_gpt_logp.py and examples/pretrain_gpt_logp.patch.

The integration is the lines marked `# fused-logp`:

    from fused_logp import megatron_plugin as mp                       # 1. import
    pretrain(..., extra_args_provider=mp.add_logp_args)                # 2. --logp-backend, ... (Megatron-LM <= 0.17)
    mp.setup_from_args(args); mp.check_model(model)                    # 3. in model_provider: configure + refuse
    @mp.logp_forward_step                                              # 4. on forward_step

Everything else is the usual script: `loss_func` keeps Megatron's own NaN / Inf / spiky-loss checks and its
`output_tensor.view(-1)`; `forward_step` returns `partial(loss_func, loss_mask, model=model)`. Without
`--logp-backend` the script trains exactly as Megatron does; with `--logp-backend contract --logp-vocab-size V`
the per-token loss `-logp` comes from the contract op (no [tokens, vocab] logits, padding rows excluded).

tests/megatron/test_megatron_example.py drives `forward_step` through megatron-core's own `get_forward_backward_func()` with
the flag on and off (megatron-core 0.16.1 on CPU).
"""
from __future__ import annotations

from functools import partial

import torch
from megatron.core import parallel_state
from megatron.core.rerun_state_machine import get_rerun_state_machine
from megatron.core.utils import get_batch_on_this_cp_rank

from fused_logp import megatron_plugin as mp                                                   # fused-logp

SPIKY_LOSS_FACTOR = 10


def get_args():
    """Megatron-LM's parsed arguments."""
    from megatron.training import get_args as megatron_args
    return megatron_args()


def model_provider(pre_process=True, post_process=True, vp_stage=None):
    """Builds the GPT model from Megatron-LM's arguments (local or Transformer Engine layer spec)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import (get_gpt_layer_local_spec,
                                                          get_gpt_layer_with_transformer_engine_spec)
    from megatron.training.arguments import core_transformer_config_from_args

    args = get_args()
    mp.setup_from_args(args)                                                                   # fused-logp
    config = core_transformer_config_from_args(args)
    if args.transformer_impl == "local":
        spec = get_gpt_layer_local_spec(args.num_experts, args.moe_grouped_gemm, args.qk_layernorm)
    else:
        spec = get_gpt_layer_with_transformer_engine_spec(args.num_experts, args.moe_grouped_gemm,
                                                          args.qk_layernorm)
    model = GPTModel(config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
                     max_sequence_length=args.max_position_embeddings, pre_process=pre_process,
                     post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
                     parallel_output=True, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
                     position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
                     rotary_base=args.rotary_base)
    if post_process and mp.get_settings().enabled:
        mp.check_model(model)                                                                  # fused-logp
    return model


def _batch_on_this_tp_rank(data_iterator):
    """Megatron-LM reads on TP rank 0 and broadcasts; with megatron-core alone every rank reads the same batch."""
    try:
        from megatron.training.utils import get_batch_on_this_tp_rank
    except ImportError:
        return next(data_iterator)
    return get_batch_on_this_tp_rank(data_iterator)


def get_batch(data_iterator):
    """tokens, labels, loss_mask, attention_mask, position_ids of this rank (TP broadcast, CP split)."""
    if not (parallel_state.is_pipeline_first_stage() or parallel_state.is_pipeline_last_stage()):
        return None, None, None, None, None
    batch = _batch_on_this_tp_rank(data_iterator)
    batch = get_batch_on_this_cp_rank(batch) if parallel_state.get_context_parallel_world_size() > 1 else batch
    return batch["tokens"], batch["labels"], batch["loss_mask"], batch["attention_mask"], batch["position_ids"]


def loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor, model=None):
    """Masked sum of the per-token loss, with Megatron's checks of the local loss before the DP reduction."""
    args = get_args()
    losses = output_tensor.view(-1).float()
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)

    rerun_state_machine = get_rerun_state_machine()
    if args.check_for_nan_in_loss_and_grad:
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isnan,
                                            message="found NaN in local forward loss calculation",
                                            tolerance=0.0, fatal=True)
        rerun_state_machine.validate_result(result=loss, rejection_func=torch.isinf,
                                            message="found Inf in local forward loss calculation",
                                            tolerance=0.0, fatal=True)
    if args.check_for_spiky_loss:
        rerun_state_machine.validate_result(
            result=loss,
            rejection_func=partial(rerun_state_machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR,
                                   context="loss"),
            message="Spiky loss", tolerance=0.0, fatal=False)

    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    reporting_loss = torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])
    return loss, num_tokens, {"lm loss": reporting_loss}


@mp.logp_forward_step                                                                          # fused-logp
def forward_step(data_iterator, model):
    """One micro-batch: the model's per-token loss and the loss function for the schedules."""
    tokens, labels, loss_mask, attention_mask, position_ids = get_batch(data_iterator)
    output_tensor = model(tokens, position_ids, attention_mask, labels=labels, loss_mask=loss_mask)
    return output_tensor, partial(loss_func, loss_mask, model=model)


def train_valid_test_datasets_provider(train_val_test_num_samples):
    """Megatron-LM's GPT datasets (blended / mock), as pretrain_gpt.py builds them."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
    from megatron.training import get_tokenizer
    from megatron.training.utils import get_blend_and_blend_per_split

    args = get_args()
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    split = args.split
    config = GPTDatasetConfig(random_seed=args.seed, sequence_length=args.seq_length, blend=blend,
                              blend_per_split=blend_per_split, split=split,
                              path_to_cache=args.data_cache_path, tokenizer=get_tokenizer(),
                              reset_position_ids=args.reset_position_ids,
                              reset_attention_mask=args.reset_attention_mask,
                              eod_mask_loss=args.eod_mask_loss, create_attention_mask=True)
    cls = MockGPTDataset if args.mock_data else GPTDataset
    return BlendedMegatronDatasetBuilder(cls, train_val_test_num_samples, lambda: True, config).build()


if __name__ == "__main__":
    from megatron.core.enums import ModelType
    from megatron.training import pretrain

    if mp.megatron_core_version() >= (0, 18):
        raise SystemExit("Megatron-LM >= 0.18 builds the model from its config and takes no extra_args_provider in "
                         "pretrain(): use examples/pretrain_gpt_logp.py (or examples/pretrain_gpt_logp.patch)")
    train_valid_test_datasets_provider.is_distributed = True
    pretrain(train_valid_test_datasets_provider, model_provider, ModelType.encoder_or_decoder, forward_step,
             args_defaults={"tokenizer_type": "GPT2BPETokenizer"},
             extra_args_provider=mp.add_logp_args)                                             # fused-logp
