"""CONTRACT.md section 6.1: the accuracy of lse and logp against float64 over the same binary32 logits.

|lse - lse64| <= u (4|m| + 8 ln V + n_tiles + 32), |logp - logp64| <= |lse - lse64| + u (|z'_target| + |logp|),
u = 2^-24, m the row's largest z' = z / T. Checked on random and adversarial rows on the numpy oracle (the CPU
oracles and the SM90 kernel give its bytes: the other tests)."""
import math

import numpy as np
import pytest

from fused_logp.shared_contract.numpy_contract import row_lse, selected_logp, tile_stats

U = 2.0 ** -24


def _rows(kind, n, v, rng):
    if kind == "normal":
        return rng.standard_normal((n, v)) * rng.choice([0.5, 3.0, 12.0], size=(n, 1))
    if kind == "flat":
        return np.full((n, v), 1.25) + np.zeros((n, 1))
    if kind == "dominant":
        z = rng.standard_normal((n, v)) - 30.0
        z[np.arange(n), rng.integers(0, v, n)] = 25.0
        return z
    if kind == "wide":
        return rng.uniform(-300.0, 60.0, (n, v))
    if kind == "offset":                       # large common offset: the u|m| terms
        return rng.standard_normal((n, v)) * 2.0 + 1000.0
    raise AssertionError(kind)


def _check(z, temps, rng):
    n, v = z.shape
    z = z.astype(np.float32)
    t32 = np.asarray(temps, np.float32)
    tg = rng.integers(0, v, n)
    tmax, tsum, zs = tile_stats(z, t32, v)
    lse = row_lse(tmax, tsum)
    logp = selected_logp(zs[np.arange(n), tg], lse)
    zd = z.astype(np.float64) / t32.astype(np.float64)[:, None]
    mx = zd.max(axis=1)
    lse64 = mx + np.log(np.exp(zd - mx[:, None]).sum(axis=1))
    logp64 = np.minimum(zd[np.arange(n), tg] - lse64, 0.0)
    m = zs.max(axis=1).astype(np.float64)
    bound = U * (4 * np.abs(m) + 8 * math.log(v) + math.ceil(v / 64) + 32)
    err = np.abs(lse.astype(np.float64) - lse64)
    assert (err <= bound).all(), (err / bound).max()
    lb = err + U * (np.abs(zs[np.arange(n), tg]) + np.abs(logp64))
    assert (np.abs(logp.astype(np.float64) - logp64) <= lb + 1e-300).all()
    return err


@pytest.mark.parametrize("kind", ["normal", "flat", "dominant", "wide", "offset"])
@pytest.mark.parametrize("v", [1, 63, 1000, 4099])
def test_lse_and_logp_within_the_stated_bound(kind, v):
    rng = np.random.default_rng()
    n = 16
    temps = rng.choice([2.0 ** -20, 0.01, 0.3, 0.7, 1.0, 1.7, 100.0, 2.0 ** 20], size=n)
    _check(_rows(kind, n, v, rng), temps, rng)


def test_qwen3_sized_rows_typical_error():
    """V = 151936 (n_tiles = 2374): the bound holds and the typical error is far inside it."""
    rng = np.random.default_rng()
    z = rng.standard_normal((4, 151936)) * 3.0
    err = _check(z, [1.0, 0.7, 1.0, 0.7], rng)
    assert err.max() < 2e-5
