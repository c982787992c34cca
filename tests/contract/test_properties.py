"""Property-based checks (hypothesis) over shapes, shards, temperatures and targets."""
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fused_logp import linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats

from helpers import bits_equal


# every sentence here is checked on both contract-bearing CPU backends (tests/cpu_backends.py)
pytestmark = pytest.mark.usefixtures("cpu_backend")


SETTINGS = settings(max_examples=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@st.composite
def problems(draw):
    n = draw(st.integers(1, 5))
    d = 16 * draw(st.integers(1, 4))
    v = draw(st.integers(1, 330))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    scale = draw(st.sampled_from([1.0, 1e-3, 30.0, 400.0]))       # 400: logits near +-1000
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(n, d, generator=g) * scale).bfloat16()
    w = torch.randn(v, d, generator=g).bfloat16()
    special = [0, v - 1, min(63, v - 1), min(64, v - 1), (v - 1) // 64 * 64]   # first/last, tile edges, ragged tile
    targets = draw(st.lists(st.one_of(st.sampled_from(special), st.integers(0, v - 1)), min_size=n, max_size=n))
    temp = draw(st.sampled_from([1.0, 0.25, 0.7, 1.3, 3.0]))
    return h, w, torch.tensor(targets), temp


@st.composite
def shard_bounds(draw, v):
    n_tiles = -(-v // 64)
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, n_tiles - 1)), max_size=7)))) if n_tiles > 1 else []
    pad = draw(st.integers(0, 70))
    return [0] + [64 * c for c in cuts] + [v + pad]


@SETTINGS
@given(problems(), st.data())
def test_shards_padding_and_logits_entry_give_fused_bytes(prob, data):
    h, w, t, temp = prob
    v = w.shape[0]
    fused = linear_logp(h, w, t, temperature=temp, return_logits=True)
    assert torch.isfinite(fused.lse).all() and (fused.logp <= 0).all()
    bounds = data.draw(shard_bounds(v))
    padded = torch.cat([w, torch.randn(bounds[-1] - v, w.shape[1]).bfloat16()])
    stats = [shard_tile_stats(h, padded[a:b], t, vocab_start=a, vocab_size=v, temperature=temp)
             for a, b in zip(bounds, bounds[1:])]
    merged = merge_shard_stats(stats, vocab_size=v)
    assert bits_equal(merged.logp, fused.logp) and bits_equal(merged.lse, fused.lse)
    fl = logp_from_logits(fused.logits, t, temperature=temp)
    assert bits_equal(fl.logp, fused.logp) and bits_equal(fl.lse, fused.lse)


@SETTINGS
@given(problems())
def test_rows_are_batch_invariant(prob):
    h, w, t, temp = prob
    fused = linear_logp(h, w, t, temperature=temp)
    for i in range(h.shape[0]):
        one = linear_logp(h[i:i + 1], w, t[i:i + 1], temperature=temp)
        assert bits_equal(one.logp, fused.logp[i:i + 1]) and bits_equal(one.lse, fused.lse[i:i + 1])


@SETTINGS
@given(problems())
def test_close_to_float64(prob):
    h, w, t, temp = prob
    res = linear_logp(h, w, t, temperature=temp)
    t32 = float(np.float32(temp))
    z = (h.double() @ w.double().T) / t32
    want = torch.log_softmax(z, dim=1).gather(1, t[:, None]).squeeze(1)
    d = h.shape[1]
    dz = (d / 16) * 2.0 ** -21 * (h.double().abs() @ w.double().abs().T).max(dim=1).values / t32
    tol = 2 * dz + 8 * 2.0 ** -23 * (1 + z.abs().max(dim=1).values + torch.logsumexp(z, 1).abs())
    assert ((res.logp.double() - want).abs() <= tol).all()
