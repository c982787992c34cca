"""CONTRACT.md section 6: the contract's exp and log, within 2 ulp of float64 over the domains the contract uses."""
import numpy as np
import pytest

from fused_logp.kernel.transcendentals import contract_exp, contract_log

MAX_ULP = 2.0


def _ulp_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - ref) / ulp


def _bits(lo: int, hi: int) -> np.ndarray:
    return np.arange(lo, hi, dtype=np.uint32).view(np.float32)


def test_exp_exact_points():
    assert contract_exp(np.float32(0.0)) == np.float32(1.0)
    assert contract_exp(np.float32(-0.0)) == np.float32(1.0)
    assert contract_exp(np.float32(-np.inf)) == 0.0
    assert contract_exp(np.float32(np.inf)) == np.inf
    assert np.isnan(contract_exp(np.float32(np.nan)))
    assert contract_exp(np.float32(-200.0)) == 0.0
    assert contract_exp(np.float32(100.0)) == np.inf


def test_log_exact_points():
    assert contract_log(np.float32(1.0)) == 0.0
    assert contract_log(np.float32(0.0)) == -np.inf
    assert contract_log(np.float32(np.inf)) == np.inf
    assert np.isnan(contract_log(np.float32(-1.0)))
    assert np.isnan(contract_log(np.float32(np.nan)))


@pytest.mark.parametrize("x", [-1e-45, -1e-30, -1e-8, -0.5, -0.34657359, -0.6931472, -1.0, -10.0, -87.33654,
                               -87.5, -100.0, -103.97, -103.972076, 1e-30, 0.5, 1.0, 10.0, 88.0, 88.72283])
def test_exp_edge_values(x):
    got = contract_exp(np.float32(x))
    ref = np.exp(np.float64(np.float32(x)))
    assert _ulp_error(np.asarray(got), np.asarray(ref)) <= MAX_ULP


@pytest.mark.parametrize("x", [1.4e-45, 1e-40, 1.1754944e-38, 1e-10, 0.01, 0.1, 0.70710677, 0.7071068, 0.99999994,
                               1.0000001, 1.4142135, 1.4142137, 2.0, 64.0, 151936.0, 2.0 ** 24, 3.4e38])
def test_log_edge_values(x):
    got = contract_log(np.float32(x))
    ref = np.log(np.float64(np.float32(x)))
    assert _ulp_error(np.asarray(got), np.asarray(ref)) <= MAX_ULP


def test_exp_random_1e7():
    rng = np.random.default_rng()
    x = np.concatenate([-rng.random(5_000_000) * 104.0, -np.exp(rng.uniform(-40, 4.6, 5_000_000))]).astype(np.float32)
    err = _ulp_error(contract_exp(x), np.exp(x.astype(np.float64)))
    assert err.max() <= MAX_ULP, x[err.argmax()]


def test_log_random_1e7():
    rng = np.random.default_rng()
    x = np.concatenate([1.0 + rng.random(5_000_000) * 2.0 ** 18, np.exp(rng.uniform(-87, 88, 5_000_000))]).astype(np.float32)
    err = _ulp_error(contract_log(x), np.log(x.astype(np.float64)))
    assert err.max() <= MAX_ULP, x[err.argmax()]


# Exhaustive: every binary32 in the contract's domains (run with `make test-slow`).
_CHUNK = 1 << 24


@pytest.mark.slow
def test_exp_exhaustive_nonpositive():
    """Every binary32 x in [EXP_X_MIN, -0]: the domain of exp(z' - m) and exp(m_t - m)."""
    hi = int(np.array(-103.972076, dtype=np.float32).view(np.uint32)) + 1
    worst = 0.0
    for lo in range(0x80000000, hi, _CHUNK):
        x = _bits(lo, min(hi, lo + _CHUNK))
        worst = max(worst, float(_ulp_error(contract_exp(x), np.exp(x.astype(np.float64))).max()))
    assert worst <= MAX_ULP, worst


@pytest.mark.slow
def test_log_exhaustive_positive_normals():
    """Every positive normal binary32: covers S in [1, V] of the merge and min-p thresholds in (0, 1]."""
    worst = 0.0
    for lo in range(0x00800000, 0x7F800000, _CHUNK):
        x = _bits(lo, min(0x7F800000, lo + _CHUNK))
        worst = max(worst, float(_ulp_error(contract_log(x), np.log(x.astype(np.float64))).max()))
    assert worst <= MAX_ULP, worst
