"""Contract v1 sentences (CONTRACT.md), each checked by byte equality on both CPU backends (the numpy oracle and
the compiled one)."""
import numpy as np
import pytest
import torch

from fused_logp import linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats

import contract_reference as ref
from cpu_backends import hopper_logits
from helpers import bits_equal


# every sentence here is checked on both contract-bearing CPU backends (tests/cpu_backends.py)
pytestmark = pytest.mark.usefixtures("cpu_backend")


V, D = 1000, 64       # 16 tiles, the last one ragged (1000 = 15*64 + 40)


def _data(gen, n=9, v=V, d=D, scale=1.0):
    h = (torch.randn(n, d, generator=gen) * scale).bfloat16()
    w = torch.randn(v, d, generator=gen).bfloat16()
    t = torch.randint(0, v, (n,), generator=gen)
    return h, w, t


def _eq(a, b):
    return bits_equal(a.logp, b.logp) and bits_equal(a.lse, b.lse)


# --- L1 ------------------------------------------------------------------------------------------------------

def test_l1_repeated_calls_identical(gen):
    h, w, t = _data(gen)
    first = linear_logp(h, w, t, temperature=0.8)
    for _ in range(5):
        assert _eq(linear_logp(h, w, t, temperature=0.8), first)


# --- L2 ------------------------------------------------------------------------------------------------------

def test_l2_row_alone_equals_row_in_any_batch(gen):
    """A row's bytes are the same alone, at any position, in batches of 1..N (primes included)."""
    h, w, t = _data(gen, n=13)
    full = linear_logp(h, w, t)
    for i in range(13):
        alone = linear_logp(h[i:i + 1], w, t[i:i + 1])
        assert bits_equal(alone.logp, full.logp[i:i + 1]) and bits_equal(alone.lse, full.lse[i:i + 1]), i
    for size in (2, 3, 5, 7, 11):
        idx = torch.randperm(13, generator=gen)[:size]
        part = linear_logp(h[idx], w, t[idx])
        assert bits_equal(part.logp, full.logp[idx]) and bits_equal(part.lse, full.lse[idx]), size


def test_l2_padding_rows_and_mixed_batches(gen):
    """Rows mixed with unrelated rows (large, tiny, repeated, padding-like zero rows) keep their bytes."""
    h, w, t = _data(gen, n=4)
    base = linear_logp(h, w, t)
    other = torch.cat([torch.zeros(2, D), torch.randn(3, D, generator=gen) * 300, torch.randn(2, D, generator=gen) * 1e-3])
    mixed_h = torch.cat([other[:3].bfloat16(), h[:2], other[3:].bfloat16(), h[2:], h[:1]])
    mixed_t = torch.cat([torch.tensor([0, 1, 2]), t[:2], torch.tensor([V - 1] * 4), t[2:], t[:1]])
    mixed = linear_logp(mixed_h, w, mixed_t)
    pos = [3, 4, 9, 10, 11]
    assert bits_equal(mixed.logp[pos], torch.cat([base.logp, base.logp[:1]]))
    assert bits_equal(mixed.lse[pos], torch.cat([base.lse, base.lse[:1]]))


# --- dual entry ------------------------------------------------------------------------------------------------

def test_dual_entry_same_bytes_and_unscaled_logits(gen):
    h, w, t = _data(gen)
    on = linear_logp(h, w, t, temperature=1.7, return_logits=True)
    off = linear_logp(h, w, t, temperature=1.7, return_logits=False)
    assert off.logits is None and _eq(on, off)
    assert on.logits.dtype == torch.float32 and on.logits.shape == (h.shape[0], V)
    assert bits_equal(on.logits, hopper_logits(h, w))          # unscaled: the accumulator itself


# --- TP and padding invariance ---------------------------------------------------------------------------------

@pytest.mark.parametrize("bounds", [
    [0, 1000],
    [0, 512, 1000],
    [0, 192, 640, 1000],                     # 3 uneven ranks
    [0, 256, 512, 768, 1000],
    [0, 128, 256, 320, 512, 640, 704, 960, 1000],  # 8 uneven ranks
])
def test_tp_shards_equal_one_unpadded_shard(gen, bounds):
    h, w, t = _data(gen)
    full = linear_logp(h, w, t, temperature=0.9)
    stats = [shard_tile_stats(h, w[a:b], t, vocab_start=a, vocab_size=V, temperature=0.9)
             for a, b in zip(bounds, bounds[1:])]
    assert _eq(merge_shard_stats(stats, vocab_size=V), full)


def test_padded_weight_and_padded_shards(gen):
    """Extra zero rows beyond the real vocabulary (Megatron pads 1000 -> 1024, TP=2 shards of 512)."""
    h, w, t = _data(gen)
    full = linear_logp(h, w, t)
    padded = torch.cat([w, torch.zeros(24, D, dtype=torch.bfloat16)])
    assert _eq(linear_logp(h, padded, t, vocab_size=V), full)
    stats = [shard_tile_stats(h, padded[r * 512:(r + 1) * 512], t, vocab_start=r * 512, vocab_size=V) for r in (0, 1)]
    assert _eq(merge_shard_stats(stats, vocab_size=V), full)
    # non-zero padding rows must not matter either
    junk = torch.cat([w, torch.randn(24, D, generator=gen).bfloat16() * 50])
    assert _eq(linear_logp(h, junk, t, vocab_size=V), full)


# --- stats from logits --------------------------------------------------------------------------------------

def test_stats_from_logits_equals_fused(gen):
    h, w, t = _data(gen)
    fused = linear_logp(h, w, t, temperature=1.3, return_logits=True)
    assert _eq(logp_from_logits(fused.logits, t, temperature=1.3), fused)
    # a vLLM-style TP=4 gather of 37984-wide shards is just a concatenated row: any split gives the same bytes
    parts = torch.split(fused.logits, [251, 250, 249, 250], dim=1)
    assert _eq(logp_from_logits(torch.cat(parts, dim=1), t, temperature=1.3), fused)


# --- temperature --------------------------------------------------------------------------------------------

def test_temperature_one_equals_no_temperature(gen):
    h, w, t = _data(gen)
    assert _eq(linear_logp(h, w, t, temperature=1.0), linear_logp(h, w, t))
    z = linear_logp(h, w, t, return_logits=True).logits
    assert _eq(logp_from_logits(z, t, temperature=torch.ones(h.shape[0])), linear_logp(h, w, t))


@pytest.mark.parametrize("temp", [0.3, 0.7, 1.0, 1.3, 2.5])
def test_result_equals_contract_definition(gen, temp):
    """logp/lse bytes equal a scalar transcription of sections 3-5 (z' = z / T, tile tree, chain, log, clamp)."""
    h, w, t = _data(gen, n=4)
    t[0], t[1] = 0, V - 1
    res = linear_logp(h, w, t, temperature=temp)
    z = ref.logits(h, w)
    for i in range(4):
        logp, lse = ref.row_logp(z[i], int(t[i]), temp, V)
        assert res.logp[i].numpy().view(np.int32) == np.float32(logp).view(np.int32), i
        assert res.lse[i].numpy().view(np.int32) == np.float32(lse).view(np.int32), i


def test_per_row_temperature(gen):
    h, w, t = _data(gen, n=5)
    temps = torch.tensor([0.5, 1.0, 1.5, 0.7, 2.0])
    both = linear_logp(h, w, t, temperature=temps)
    for i in range(5):
        one = linear_logp(h[i:i + 1], w, t[i:i + 1], temperature=float(temps[i]))
        assert bits_equal(one.logp, both.logp[i:i + 1]) and bits_equal(one.lse, both.lse[i:i + 1])


# --- edge cases (quack-style) -------------------------------------------------------------------------------

def test_large_logits_do_not_overflow(gen):
    """Logits near +-1300: a naive sum of exp would overflow; the contract's max-shift does not."""
    h, w, t = _data(gen, n=4, scale=200.0)
    res = linear_logp(h, w, t, return_logits=True)
    assert res.logits.abs().max() > 1000
    assert torch.isfinite(res.lse).all() and (res.logp <= 0).all()


def test_all_negative_logits_with_ragged_last_tile(gen):
    """All-negative logits: an unmasked zero lane in the ragged last tile would win the max."""
    h = torch.randn(3, D, generator=gen).abs().bfloat16()
    w = -torch.randn(V, D, generator=gen).abs().bfloat16()          # every logit strictly negative
    t = torch.tensor([0, V - 1, 961])
    res = linear_logp(h, w, t, return_logits=True)
    assert (res.logits < 0).all()
    z = ref.logits(h, w)
    for i in range(3):
        logp, lse = ref.row_logp(z[i], int(t[i]), 1.0, V)
        assert res.logp[i].item() == float(logp) and res.lse[i].item() == float(lse)
    tile_max = shard_tile_stats(h, w, t, vocab_start=0, vocab_size=V).tile_max
    assert (tile_max[:, -1] < 0).all()                              # the padding lanes did not enter the max


@pytest.mark.parametrize("col", [0, V - 1, 63, 64, 7, 8, 15, 16, 959, 960])
def test_target_columns(gen, col):
    h, w, _ = _data(gen, n=2)
    t = torch.tensor([col, col])
    res = linear_logp(h, w, t, return_logits=True)
    z = ref.logits(h, w)
    for i in range(2):
        logp, lse = ref.row_logp(z[i], col, 1.0, V)
        assert res.logp[i].item() == float(logp) and res.lse[i].item() == float(lse)


def test_all_equal_logits(gen):
    """Every logit equal: lse = z + log(V) in contract arithmetic, logp = -log(V) for every target."""
    h = torch.zeros(2, D).bfloat16()
    h[:, 0] = 1.0
    w = torch.zeros(V, D).bfloat16()
    w[:, 0] = 0.5
    t = torch.tensor([3, 999])
    res = linear_logp(h, w, t)
    assert res.logp[0].item() == res.logp[1].item()
    assert abs(res.logp[0].item() + np.log(V)) < 1e-5


def test_logp_is_clamped_to_zero(gen):
    """A target that takes all mass: z_t - lse may round above 0; the contract clamps it to exactly 0."""
    h = torch.ones(1, D).bfloat16()
    w = torch.zeros(70, D).bfloat16()
    w[5] = 4.0                                        # z_5 = 256, the rest 0
    res = linear_logp(h, w, torch.tensor([5]))
    assert res.logp.item() == 0.0 and not torch.signbit(res.logp).item()


def test_nonfinite_hidden_gives_nan_row_only(gen):
    h, w, t = _data(gen, n=4)
    clean = linear_logp(h, w, t)
    bad = h.clone()
    bad[1, 3] = float("inf")
    bad[2, 0] = float("nan")
    res = linear_logp(bad, w, t)
    assert torch.isnan(res.logp[1:3]).all() and torch.isnan(res.lse[1:3]).all()
    assert bits_equal(res.logp[[0, 3]], clean.logp[[0, 3]]) and bits_equal(res.lse[[0, 3]], clean.lse[[0, 3]])


# --- accuracy --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temp", [0.5, 1.0, 2.0])
def test_accuracy_against_float64(gen, temp):
    """Against log_softmax in float64 on the same bf16 inputs. Bound: each k16 group truncates the accumulator
    by < 2 ulp and each aligned term by < 2^-25 of 2^emax, so |dz| <= (D/16) * 2^-21 * sum|h_i w_i|; logp moves
    by at most 2 max|dz| / T, plus a few ulp of |lse| from exp, log and the merge."""
    h, w, t = _data(gen, n=16, d=256)
    res = linear_logp(h, w, t, temperature=temp)
    z64 = h.double() @ w.double().T
    ls = torch.log_softmax(z64 / float(np.float32(temp)), dim=1)
    want = ls.gather(1, t[:, None]).squeeze(1)
    lse64 = torch.logsumexp(z64 / float(np.float32(temp)), dim=1)
    dz = (256 / 16) * 2.0 ** -21 * (h.double().abs() @ w.double().abs().T).max(dim=1).values
    tol = 2 * dz / temp + 8 * 2.0 ** -23 * (1 + lse64.abs() + (z64 / temp).abs().max(dim=1).values)
    assert ((res.logp.double() - want).abs() <= tol).all()
    assert ((res.lse.double() - lse64).abs() <= tol).all()


def test_stats_from_logits_with_several_ids_per_row(gen):
    """targets [N, C]: each column has the bytes of its own single-id call, the lse is the row's."""
    h, w, t = _data(gen, n=6)
    z = linear_logp(h, w, t, temperature=0.8, return_logits=True).logits
    ids = torch.randint(0, V, (6, 5), generator=gen)
    ids[:, 2] = t
    many = logp_from_logits(z, ids, temperature=0.8)
    assert many.logp.shape == (6, 5)
    for c in range(5):
        one = logp_from_logits(z, ids[:, c].contiguous(), temperature=0.8)
        assert bits_equal(many.logp[:, c].contiguous(), one.logp) and bits_equal(many.lse, one.lse)
    torch_path = logp_from_logits(z, ids, temperature=0.8, backend="torch")          # the per-column loop
    assert torch_path.logp.shape == (6, 5)
