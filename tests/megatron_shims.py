"""Test-only shims that let megatron-core's GPTModel (0.16.1, 0.19.2) run forward and backward on CPU with gloo.

Each shim replaces one CUDA-only piece; nothing else of Megatron is replaced:
  * GlobalMemoryBuffer.get_tensor  - allocates its scratch buffer on torch.cuda.current_device(); the shim
    returns a fresh CPU tensor (used by DotProductAttention for the attention scores).
  * the CUDA RNG tracker           - model_parallel_cuda_manual_seed needs torch.cuda RNG states; the shim is
    Megatron's own inference tracker (its fork() is a no-op context), which is exact with dropout 0.
  * the default causal mask        - get_default_causal_mask builds it on "cuda"; tests pass an explicit CPU
    boolean mask [b, 1, s, s] (causal_mask below).
  * RoPE                           - RotaryEmbedding moves inv_freq to CUDA; tests use learned absolute
    position embeddings instead.
Apex/TE are absent, so Megatron's local spec uses torch norms (which do not allow sequence parallelism); the
sequence-parallel path of the plugin is therefore exercised at the output-processor level.
"""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

_orig_get_tensor = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def install_cpu_shims():
    global _orig_get_tensor
    import megatron.core.utils as mu
    from megatron.core import tensor_parallel

    if _orig_get_tensor is None:
        _orig_get_tensor = mu.GlobalMemoryBuffer.get_tensor

        def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
            return torch.empty(tuple(tensor_shape), dtype=dtype)

        mu.GlobalMemoryBuffer.get_tensor = _cpu_get_tensor
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def init_distributed(rank: int, world_size: int, port: int, *, tp: int = 1, cp: int = 1):
    """gloo process group and Megatron's model-parallel state. Returns True when it created the process group."""
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    if created:
        os.environ["MASTER_ADDR"] = "127.0.0.1"
        os.environ["MASTER_PORT"] = str(port)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=cp)
    install_cpu_shims()
    return created


def shutdown_distributed(destroy_process_group: bool = True):
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if destroy_process_group and dist.is_initialized():
        dist.destroy_process_group()
    remove_cpu_shims()


def remove_cpu_shims():
    global _orig_get_tensor
    import megatron.core.utils as mu

    if _orig_get_tensor is not None:
        mu.GlobalMemoryBuffer.get_tensor = _orig_get_tensor
        _orig_get_tensor = None


def causal_mask(b: int, s: int) -> torch.Tensor:
    """Replaces get_default_causal_mask (CUDA): True = masked."""
    return torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(b, 1, s, s)


def build_tiny_gpt(*, vocab_size=512, hidden=64, layers=1, heads=4, seq=16, tied=True, tp=1, seed=1234,
                   **config_overrides):
    """A bf16 GPTModel (local spec, learned absolute positions) wrapped in Megatron's Float16Module, the way
    Megatron runs bf16 training. Returns (wrapped, gpt_model)."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig

    torch.manual_seed(seed)
    cfg = TransformerConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                            use_cpu_initialization=True, params_dtype=torch.bfloat16, bf16=True,
                            tensor_model_parallel_size=tp, hidden_dropout=0.0, attention_dropout=0.0,
                            init_method_std=0.05, **config_overrides)
    gpt = GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=vocab_size, max_sequence_length=seq,
                   position_embedding_type="learned_absolute", share_embeddings_and_output_weights=tied)
    return Float16Module(cfg, gpt), gpt


def batch(b: int, s: int, real_vocab: int, seed: int = 7):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, real_vocab, (b, s), generator=g)
    labels = torch.randint(0, real_vocab, (b, s), generator=g)
    pos = torch.arange(s).expand(b, s).contiguous()
    return ids, pos, causal_mask(b, s), labels


class CaptureFinalHidden:
    """Records the decoder's output (the post-final-norm hidden states [s, b, h] that reach _postprocess)."""

    def __init__(self, gpt, retain_grad=False):
        self.value = None
        self._retain = retain_grad
        self._h = gpt.decoder.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        out = output[0] if isinstance(output, tuple) else output
        if self._retain and out.requires_grad:
            out.retain_grad()
        self.value = out

    def remove(self):
        self._h.remove()
