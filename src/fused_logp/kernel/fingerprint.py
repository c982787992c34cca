"""`weight_fingerprint`: the lm_head fingerprint of shared_contract/fingerprint.py, computed by the device backend's
row-hash entry on an SM90 GPU (one pass over the weight) and by the definition's torch integer ops elsewhere; the
two give the same bytes (tests/contract/test_fingerprint_gpu.py)."""
from __future__ import annotations

import torch

from ..shared_contract import fingerprint as definition
from ..shared_contract.errors import ContractInputError
from .backends import device_kernels


def _lanes(weight_rows: torch.Tensor, first_row: int, use_kernel: bool = True) -> list:
    v = weight_rows.shape[0]
    if v == 0:
        return [0, 0]
    words = definition.row_words(weight_rows)
    be = device_kernels(words.device) if (use_kernel and words.is_cuda) else None
    if be is None:
        return definition.reference_lanes(words, first_row)
    mult = definition.multipliers(words.shape[1], words.device)
    hashes = be.fingerprint_rows(words, mult, first_row, *definition.golden_signed())
    total = hashes.sum(dim=0)                                       # int64 sums wrap modulo 2^64
    return [total[0], total[1]]


def weight_fingerprint(weight_shard: torch.Tensor, *, vocab_start: int = 0, vocab_size: int | None = None,
                       group=None, _use_kernel: bool = True) -> str:
    """Fingerprint of the real-vocab rows of an lm_head (shard). weight_shard [V_local, D] bf16, its first row
    global id `vocab_start`. With a torch.distributed `group`, the shards' sums are all-reduced. Returns
    '<FINGERPRINT_ID>:<32 hex digits>'."""
    _check(weight_shard, vocab_start, vocab_size)
    vocab_size = vocab_start + weight_shard.shape[0] if vocab_size is None else vocab_size
    n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
    lanes = _lanes(weight_shard[:n_real], vocab_start, _use_kernel)
    lanes_t = torch.stack([torch.as_tensor(x, device=weight_shard.device) for x in lanes])
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(lanes_t, op=dist.ReduceOp.SUM, group=group)
    hi, lo = (int(x) for x in lanes_t.tolist())
    return definition.format_fingerprint(hi, lo)


def _check(weight_shard, vocab_start, vocab_size) -> None:
    """ContractInputError (a ValueError) naming the argument."""
    if not isinstance(weight_shard, torch.Tensor) or weight_shard.dtype != torch.bfloat16 or weight_shard.dim() != 2:
        raise ContractInputError(f"weight_shard must be a 2-D bf16 tensor; got "
                                 f"{getattr(weight_shard, 'dtype', type(weight_shard).__name__)} "
                                 f"{tuple(getattr(weight_shard, 'shape', ()))}")
    if weight_shard.device.type not in ("cpu", "cuda") or weight_shard.layout != torch.strided:
        raise ContractInputError(f"weight_shard must be a dense tensor on a CPU or CUDA device; got "
                                 f"{weight_shard.layout} on {weight_shard.device}")
    if weight_shard.shape[1] % 4:
        raise ContractInputError(f"weight_shard's hidden size D must be a multiple of 4 (the fingerprint reads "
                                 f"64-bit words); got D={weight_shard.shape[1]}")
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0:
        raise ContractInputError(f"vocab_start must be a non-negative int (the global id of weight_shard's first "
                                 f"row); got {vocab_start!r}")
    if vocab_size is not None and (not isinstance(vocab_size, int) or isinstance(vocab_size, bool)
                                   or vocab_size < 1):
        raise ContractInputError(f"vocab_size must be None or a positive int; got {vocab_size!r}")
