"""The lm_head weight fingerprint: identical for the same real-vocab bytes whatever the sharding and padding.

Construction (FINGERPRINT_ID): view each bf16 row as D/4 unsigned 64-bit words u_j (4 bf16 each, little
endian); per lane L in {0, 1}: rowsum_L = sum_j u_j * P_L[j] mod 2^64 with fixed odd multipliers P_L[j]; the row
hash is mix64(rowsum_L + (global_row + 1) * G_L) with the splitmix64 finaliser; the fingerprint lane is the sum
over real-vocab rows of the row hashes mod 2^64. Integer addition modulo 2^64 is exact, associative and
commutative, so each rank sums its own rows and one integer all-reduce (sum) finishes it; padding rows (global
id >= vocab_size) are skipped. It detects changed bytes; it is not a cryptographic commitment.
"""
from __future__ import annotations

import torch

from .constants import FINGERPRINT_ID

_MASK64 = (1 << 64) - 1
_GOLDEN = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F)
_ROW_CHUNK_ELEMS = 1 << 24


def _to_signed(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _splitmix_sequence(seed: int, count: int) -> list[int]:
    out, state = [], seed
    for _ in range(count):
        state = (state + 0x9E3779B97F4A7C15) & _MASK64
        z = state
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        out.append((z ^ (z >> 31)) | 1)
    return out


_mult_cache: dict = {}


def _multipliers(words: int, lane: int, device) -> torch.Tensor:
    key = (words, lane, str(device))
    if key not in _mult_cache:
        vals = [_to_signed(v) for v in _splitmix_sequence(0xF1A9E5 + lane, words)]
        _mult_cache[key] = torch.tensor(vals, dtype=torch.int64, device=device)
    return _mult_cache[key]


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(z: torch.Tensor) -> torch.Tensor:
    z = (z ^ _srl(z, 30)) * _to_signed(0xBF58476D1CE4E5B9)
    z = (z ^ _srl(z, 27)) * _to_signed(0x94D049BB133111EB)
    return z ^ _srl(z, 31)


def _device_rows_kernel(words: torch.Tensor):
    """The SM90 extension's fingerprint_rows (the same integer arithmetic, one pass over the weight) for a
    CUDA tensor on an SM90 GPU; None elsewhere (the torch construction below then gives the same bytes)."""
    if not words.is_cuda:
        return None
    from ..kernel import sm90
    return sm90.extension(words.device)


def _lanes(weight_rows: torch.Tensor, first_row: int, use_kernel: bool = True) -> list[int]:
    v, d = weight_rows.shape
    if v == 0:
        return [0, 0]
    if d % 4:
        raise ValueError(f"fingerprint needs the hidden size to be a multiple of 4; got {d}")
    words = weight_rows.contiguous().view(torch.int64)            # [v, d/4]
    ext = _device_rows_kernel(words) if use_kernel else None
    if ext is not None:
        mult = torch.stack([_multipliers(words.shape[1], lane, words.device) for lane in (0, 1)])
        hashes = ext.fingerprint_rows(words, mult, first_row, _to_signed(_GOLDEN[0]), _to_signed(_GOLDEN[1]))
        total = hashes.sum(dim=0)                                   # int64 sums wrap modulo 2^64
        return [total[0], total[1]]
    lanes = []
    for lane in (0, 1):
        mult = _multipliers(words.shape[1], lane, words.device)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        step = max(1, _ROW_CHUNK_ELEMS // words.shape[1])
        for r0 in range(0, v, step):
            w = words[r0:r0 + step]
            rowsum = (w * mult).sum(dim=1)
            idx = torch.arange(first_row + r0 + 1, first_row + r0 + 1 + w.shape[0], dtype=torch.int64,
                               device=w.device)
            total = total + _mix64(rowsum + idx * _to_signed(_GOLDEN[lane])).sum()
        lanes.append(total)
    return lanes


def weight_fingerprint(weight_shard: torch.Tensor, *, vocab_start: int = 0, vocab_size: int | None = None,
                       group=None, _use_kernel: bool = True) -> str:
    """Fingerprint of the real-vocab rows of an lm_head (shard). weight_shard [V_local, D] bf16, its first row
    global id `vocab_start`. With a torch.distributed `group`, the shards' sums are all-reduced. Returns
    '<FINGERPRINT_ID>:<32 hex digits>'."""
    if weight_shard.dtype != torch.bfloat16 or weight_shard.dim() != 2:
        raise ValueError(f"weight_shard must be a 2-D bf16 tensor; got {weight_shard.dtype} {tuple(weight_shard.shape)}")
    vocab_size = vocab_start + weight_shard.shape[0] if vocab_size is None else vocab_size
    n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
    lanes = _lanes(weight_shard[:n_real], vocab_start, _use_kernel)
    lanes_t = torch.stack([torch.as_tensor(x, device=weight_shard.device) for x in lanes])
    if group is not None:
        import torch.distributed as dist
        dist.all_reduce(lanes_t, op=dist.ReduceOp.SUM, group=group)
    hi, lo = (int(x) & _MASK64 for x in lanes_t.tolist())
    return f"{FINGERPRINT_ID}:{hi:016x}{lo:016x}"
