"""The lm_head fingerprint on the H200: the SM90 row-hash kernel gives the torch construction's bytes (full
weights, shards with offsets, padding, odd row counts), and the Qwen3-8B lm_head is fingerprinted without
copying it. Skipped without an SM90 GPU."""
import pytest
import torch

from fused_logp import weight_fingerprint
from fused_logp.kernel import fingerprint as fp
from fused_logp.kernel.backends import device_backend

pytestmark = pytest.mark.gpu


def _weight(v, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(v, d, device="cuda", generator=g) * 0.05).bfloat16()


@pytest.mark.parametrize("v,d", [(1, 4), (37, 64), (1000, 256), (151936, 4096), (152064, 4096)])
def test_kernel_equals_torch_construction(v, d):
    w = _weight(v, d, v + d)
    assert device_backend(w.device) is not None, "the SM90 row-hash kernel is not available"
    for kw in ({}, {"vocab_size": max(1, v - 128)}, {"vocab_start": 64, "vocab_size": 64 + v}):
        assert weight_fingerprint(w, **kw) == weight_fingerprint(w, **kw, _use_kernel=False), kw


def test_shards_sum_to_unsharded():
    w = _weight(152064, 4096, 7)
    full = weight_fingerprint(w, vocab_size=151936)
    lanes = [0, 0]
    for a in range(0, 152064, 38016):
        n_real = max(0, min(38016, 151936 - a))
        part = fp._lanes(w[a:a + n_real], a)
        lanes = [(x + int(y)) % 2 ** 64 for x, y in zip(lanes, part)]
    assert full.endswith(f"{lanes[0]:016x}{lanes[1]:016x}")


def test_changed_byte_changes_fingerprint():
    w = _weight(4096, 512, 9)
    a = weight_fingerprint(w)
    w.view(torch.int16)[4000, 100] ^= 1
    assert weight_fingerprint(w) != a
