"""The lm_head weight fingerprint: identical for the same real-vocab bytes whatever the sharding and padding.

Construction (FINGERPRINT_ID): view each bf16 row as D/4 unsigned 64-bit words u_j (4 bf16 each, little
endian); per lane L in {0, 1}: rowsum_L = sum_j u_j * P_L[j] mod 2^64 with fixed odd multipliers P_L[j]; the row
hash is mix64(rowsum_L + (global_row + 1) * G_L) with the splitmix64 finaliser; the fingerprint lane is the sum
over real-vocab rows of the row hashes mod 2^64. Integer addition modulo 2^64 is exact, associative and
commutative, so each rank sums its own rows and one integer all-reduce (sum) finishes it; padding rows (global
id >= vocab_size) are skipped. It detects changed bytes; it is not a cryptographic commitment.

This module is the definition (reference_lanes, in torch integer ops); `fused_logp.weight_fingerprint`
(kernel/fingerprint.py) computes it, on an SM90 GPU with the device backend's row-hash entry.
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


def row_words(weight_rows: torch.Tensor) -> torch.Tensor:
    """The bf16 rows [v, D] as D/4 unsigned 64-bit words per row (held in int64), little endian."""
    if weight_rows.shape[1] % 4:
        raise ValueError(f"fingerprint needs the hidden size to be a multiple of 4; got {weight_rows.shape[1]}")
    return weight_rows.contiguous().view(torch.int64)


def multipliers(words: int, device) -> torch.Tensor:
    """[2, words] int64: the odd multipliers P_0[j], P_1[j]."""
    return torch.stack([_multipliers(words, lane, device) for lane in (0, 1)])


def golden_signed() -> tuple[int, int]:
    """G_0, G_1 as signed 64-bit integers (as a device entry takes them)."""
    return _to_signed(_GOLDEN[0]), _to_signed(_GOLDEN[1])


def reference_lanes(words: torch.Tensor, first_row: int) -> list:
    """The two lane sums (int64 tensors, wrapping modulo 2^64) of rows [v, D/4] whose first global id is first_row:
    the definition above in torch integer ops, on any device."""
    lanes = []
    for lane in (0, 1):
        mult = _multipliers(words.shape[1], lane, words.device)
        total = torch.zeros((), dtype=torch.int64, device=words.device)
        step = max(1, _ROW_CHUNK_ELEMS // max(1, words.shape[1]))
        for r0 in range(0, words.shape[0], step):
            w = words[r0:r0 + step]
            rowsum = (w * mult).sum(dim=1)
            idx = torch.arange(first_row + r0 + 1, first_row + r0 + 1 + w.shape[0], dtype=torch.int64,
                               device=w.device)
            total = total + _mix64(rowsum + idx * _to_signed(_GOLDEN[lane])).sum()
        lanes.append(total)
    return lanes


def format_fingerprint(hi: int, lo: int) -> str:
    return f"{FINGERPRINT_ID}:{hi & _MASK64:016x}{lo & _MASK64:016x}"
