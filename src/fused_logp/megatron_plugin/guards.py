"""Configurations the contract does not cover, refused before any arithmetic."""
from __future__ import annotations

import torch

from ..shared_contract.errors import ContractInputError

_SOFTCAP_FIELDS = ("final_logit_softcapping", "logit_softcapping", "output_logit_softcapping", "logits_soft_cap")


class UnsupportedMegatronConfigError(ContractInputError):
    """The Megatron model uses a feature on its output layer that the contract does not cover."""


def _refuse(what: str, why: str):
    raise UnsupportedMegatronConfigError(f"fused_logp Megatron plugin: {what} is not supported: {why}. "
                                         f"Turn it off or run without --logp-backend.")


def check_config(config) -> None:
    """Refuse model-level features that change the output layer's arithmetic or bypass it."""
    if getattr(config, "mtp_num_layers", None):
        _refuse("multi-token prediction (mtp_num_layers)",
                "its heads call output_layer and compute_language_model_loss directly, outside the contract op")
    if getattr(config, "use_mup", False) and getattr(config, "mup_output_mult", 1.0) != 1.0:
        _refuse("MuP logit scaling (use_mup with mup_output_mult != 1)",
                "the contract's logits are h.W / T with no extra multiplier")
    for name in _SOFTCAP_FIELDS:
        if getattr(config, name, None):
            _refuse(f"logit soft-capping ({name})", "the contract has no tanh cap on the logits")
    if getattr(config, "fp8_output_proj", False):
        _refuse("a quantized output projection (fp8_output_proj)", "the contract covers bf16 x bf16 -> fp32 only")
    if getattr(config, "defer_embedding_wgrad_compute", False):
        _refuse("deferred embedding wgrad (defer_embedding_wgrad_compute)",
                "the plugin bypasses output_layer, so its deferred-wgrad buffers would stay empty")


def check_output_layer(output_layer, weight) -> None:
    """Refuse output layers whose GEMM is not the plain bf16 ColumnParallelLinear."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    if output_layer is None or type(output_layer) is not ColumnParallelLinear:
        name = type(output_layer).__name__
        _refuse(f"the output layer class {name}",
                "only megatron.core.tensor_parallel.ColumnParallelLinear is covered (TE / MXFP8 / quantized "
                "output layers compute other bits)")
    if getattr(output_layer, "bias", None) is not None:
        _refuse("an output-layer bias", "GPTModel builds its output layer without bias; the plugin does too")
    if weight is None:
        _refuse("an output layer without a weight", "no lm_head weight was found")
    base = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    if type(base) is not torch.Tensor:
        _refuse(f"a quantized or wrapped lm_head weight ({type(base).__name__})",
                "the contract covers plain bf16 weights")
    if weight.dtype != torch.bfloat16:
        _refuse(f"an lm_head weight of dtype {weight.dtype}",
                "the contract covers bf16 hidden states and weights (wrap the model in Float16Module with bf16)")
