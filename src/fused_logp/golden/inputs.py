"""Platform-independent inputs for golden fingerprints: bf16 values from a splitmix64 stream (no RNG library
whose stream could change between versions), and sha256 of result bytes."""
from __future__ import annotations

import hashlib

import numpy as np
import torch

_MASK = (1 << 64) - 1

# name: (rows, hidden, vocab, padded rows, temperature, bias, value scale)
CASES = {
    "small-T1": (4, 64, 1000, 1024, 1.0, False, 1.0),
    "head-T0.7": (8, 256, 4000, 4096, 0.7, False, 0.25),
    "bias-T1.3": (3, 128, 200, 256, 1.3, True, 1.0),
    "wide-T1": (5, 96, 777, 832, 1.0, False, 40.0),
}


def _stream(seed: int, count: int) -> np.ndarray:
    idx = np.arange(1, count + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = np.uint64(seed) + idx * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return z


def _values(seed: int, shape, scale: float) -> torch.Tensor:
    """Uniform in [-scale*sqrt(3), scale*sqrt(3)) (unit variance at scale 1), rounded to bf16 by truncation."""
    u = (_stream(seed, int(np.prod(shape))) >> np.uint64(40)).astype(np.float64) / float(1 << 24)
    x = ((u * 2.0 - 1.0) * np.sqrt(3.0) * scale).astype(np.float32)
    bits = (x.view(np.uint32) >> np.uint32(16)).astype(np.uint16)
    return torch.from_numpy(bits.view(np.int16).reshape(shape).copy()).view(torch.bfloat16)


def case_inputs(name: str):
    n, d, v, vp, temp, with_bias, scale = CASES[name]
    seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    h = _values(seed, (n, d), scale)
    w = _values(seed + 1, (vp, d), 1.0 / np.sqrt(d))
    bias = _values(seed + 2, (vp,), 1.0).float() if with_bias else None
    t = torch.from_numpy((_stream(seed + 3, n) % np.uint64(v)).astype(np.int64))
    t[0] = v - 1
    return h, w, t, bias, temp, v


def digest(*tensors: torch.Tensor) -> str:
    hsh = hashlib.sha256()
    for x in tensors:
        hsh.update(x.detach().cpu().contiguous().numpy().tobytes())
    return hsh.hexdigest()
