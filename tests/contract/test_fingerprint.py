"""CONTRACT.md section 11, on the CPU: the lm_head weight fingerprint is invariant to sharding and padding (shard
lanes added modulo 2^64, as an integer all-reduce would), detects one changed bit and swapped rows, and reads the
bytes, not a version counter. The SM90 row-hash kernel's twin: test_fingerprint_gpu.py."""

import pytest
import torch

from fused_logp import weight_fingerprint
from fused_logp.shared_contract import constants as C


@pytest.fixture
def head(gen):
    return torch.randn(1000, 64, generator=gen).bfloat16()


def _fp_of_shards(w, bounds, vocab_size):
    """Fingerprint from shard lanes added modulo 2^64, as an integer all-reduce would."""
    from fused_logp.shared_contract.fingerprint import reference_lanes, row_words
    tot = [0, 0]
    for a, b in zip(bounds, bounds[1:]):
        n_real = max(0, min(b, vocab_size) - a)
        for k, x in enumerate(reference_lanes(row_words(w[a:a + n_real]), a) if n_real else [0, 0]):
            tot[k] = (tot[k] + int(x)) & ((1 << 64) - 1)
    return f"{C.FINGERPRINT_ID}:{tot[0]:016x}{tot[1]:016x}"


@pytest.mark.parametrize("bounds", [[0, 500, 1000], [0, 250, 500, 750, 1000], [0, 37, 401, 999, 1000],
                                    [0, 128, 256, 384, 512, 640, 768, 896, 1024]])
def test_fingerprint_invariant_to_sharding_and_padding(head, bounds):
    padded = torch.cat([head, torch.randn(24, 64).bfloat16()])
    assert _fp_of_shards(padded, bounds, 1000) == weight_fingerprint(head)
    assert weight_fingerprint(padded, vocab_size=1000) == weight_fingerprint(head)


def test_fingerprint_detects_one_changed_bit_and_row_swaps(head):
    base = weight_fingerprint(head)
    changed = head.clone()
    changed.view(torch.int16)[613, 17] ^= 1
    assert weight_fingerprint(changed) != base
    swapped = head.clone()
    swapped[[3, 4]] = head[[4, 3]]
    assert weight_fingerprint(swapped) != base
    moved = head.clone()
    moved[10, [0, 1]] = head[10, [1, 0]]
    assert weight_fingerprint(moved) != base or torch.equal(head[10, 0], head[10, 1])


def test_fingerprint_reads_bytes_not_versions(head):
    """An in-place update keeps the tensor object and its identity; the fingerprint follows the bytes."""
    base = weight_fingerprint(head)
    with torch.no_grad():
        head.data.copy_(head * 1.5)
    assert weight_fingerprint(head) != base
