"""What megatron-core (0.16.1, 0.19.2) needs to run a GPTModel (local spec, RoPE) forward and backward on CPU.

Each shim replaces one CUDA-only piece and nothing else; the arithmetic stays Megatron's:
  * GlobalMemoryBuffer.get_tensor - allocates its scratch buffer on torch.cuda.current_device(); replaced by a
    fresh CPU tensor (DotProductAttention's attention-score buffer).
  * the CUDA RNG tracker          - model_parallel_cuda_manual_seed needs torch.cuda RNG states; replaced by
    Megatron's own inference tracker (fork() is a no-op context), exact with dropout 0.
  * get_default_causal_mask       - builds the mask with device="cuda" when attention_mask is None; replaced
    by the same triu mask on CPU (bound in megatron.core.fusions.fused_softmax, where it is called).
  * RotaryEmbedding.get_emb       - on the first call moves inv_freq to torch.cuda.current_device(); replaced by
    the same code without that move. The frequencies, the cos/sin and apply_rotary_pos_emb are Megatron's.
    (get_pos_emb_on_this_cp_rank also calls .cuda(), only for context parallelism > 1: not shimmed.)
  * `torch` as seen by megatron.core.pipeline_parallel.schedules - the schedules allocate their token counter
    with torch.zeros(..., device="cuda"); the module's `torch` name is bound to a view of torch that creates
    such tensors on the CPU and is torch itself otherwise. The schedules' logic is Megatron's.
  * `torch` as seen by megatron.core.rerun_state_machine - a rejected result (NaN / Inf / spiky loss) is
    reported with torch.cuda.current_device(); the same view answers "cpu" there. The checks are Megatron's.

`install()` is idempotent and does nothing when CUDA is available (unless forced); `uninstall()` restores every
original.
"""
from __future__ import annotations

import threading

import torch

_lock = threading.Lock()
_saved: dict = {}          # (module, attribute) -> original


def _cpu_get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
    """Replaces GlobalMemoryBuffer.get_tensor (CUDA scratch buffer): a fresh CPU tensor, not cached."""
    return torch.empty(tuple(tensor_shape), dtype=dtype)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Replaces megatron.core.transformer.utils.get_default_causal_mask (device="cuda"): same mask on CPU."""
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
    """Replaces RotaryEmbedding.get_emb, which moves inv_freq to CUDA on first use; otherwise the same code."""
    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if not self.rotary_interleaved:
        emb = torch.cat((freqs, freqs), dim=-1)
    else:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    return emb[:, None, None, :]


class _CpuCuda:
    """torch.cuda, except current_device() (CUDA-only) answers "cpu"."""

    def __getattr__(self, name):
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device():
        return "cpu"


class _TorchOnCpu:
    """torch, except that tensors requested on device="cuda" by zeros / tensor / empty / ones are made on the CPU
    and torch.cuda.current_device() answers "cpu"."""
    cuda = _CpuCuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def _dev(device):
        return "cpu" if (device == "cuda" or getattr(device, "type", None) == "cuda") else device

    def zeros(self, *a, device=None, **kw):
        return torch.zeros(*a, device=self._dev(device), **kw)

    def ones(self, *a, device=None, **kw):
        return torch.ones(*a, device=self._dev(device), **kw)

    def empty(self, *a, device=None, **kw):
        return torch.empty(*a, device=self._dev(device), **kw)

    def tensor(self, *a, device=None, **kw):
        return torch.tensor(*a, device=self._dev(device), **kw)


def _patch(obj, attr, new):
    key = (obj, attr)
    if key not in _saved:
        _saved[key] = obj.__dict__[attr]
    setattr(obj, attr, new)


def install(force: bool = False) -> bool:
    """Install the CPU shims (idempotent). Returns True when they are active, False on a CUDA machine unless
    `force` (a CPU run on a machine that also has a GPU)."""
    if torch.cuda.is_available() and not force:
        return False
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.pipeline_parallel.schedules as schedules
    import megatron.core.rerun_state_machine as rerun_state_machine
    import megatron.core.transformer.utils as tutils
    import megatron.core.utils as mu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.tensor_parallel import random as mrandom

    with _lock:
        if _saved:
            return True
        _patch(mu.GlobalMemoryBuffer, "get_tensor", _cpu_get_tensor)
        _patch(RotaryEmbedding, "get_emb", _cpu_get_emb)
        _patch(fused_softmax, "get_default_causal_mask", _cpu_default_causal_mask)
        _patch(tutils, "get_default_causal_mask", _cpu_default_causal_mask)
        _patch(schedules, "torch", _TorchOnCpu())
        _patch(rerun_state_machine, "torch", _TorchOnCpu())
        _saved[(mrandom, "_CUDA_RNG_STATE_TRACKER")] = mrandom._CUDA_RNG_STATE_TRACKER
        _saved[(mrandom, "_CUDA_RNG_STATE_TRACKER_INITIALIZED")] = mrandom._CUDA_RNG_STATE_TRACKER_INITIALIZED
        mrandom.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
    return True


def uninstall() -> None:
    """Restore everything install() replaced (idempotent)."""
    with _lock:
        for (obj, attr), orig in _saved.items():
            setattr(obj, attr, orig)
        _saved.clear()


def is_installed() -> bool:
    return bool(_saved)
