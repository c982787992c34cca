"""CONTRACT.md section 6: the contract's exp2 (SM90's ex2.approx.ftz.f32 by its exact model) and log.

The exp2 model is checked here against an independent transcription (tools/ex2_table.py's, the one verified on the
H200 over every binary32 x <= 0: bench/results/ex2-table-verify.json) and for its stated accuracy; the log within 2
ulp of float64 over the domains the contract uses, as before."""
import importlib.util
import os

import numpy as np
import pytest
import torch

from fused_logp.kernel.transcendentals import contract_ex2_torch
from fused_logp.shared_contract.numpy_contract import Ex2DomainError, contract_ex2, contract_log
from fused_logp.shared_contract import constants as C
from fused_logp.shared_contract import ex2_table

MAX_ULP = 2.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool():
    spec = importlib.util.spec_from_file_location("ex2_tool", os.path.join(ROOT, "tools", "ex2_table.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ulp_error(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    ulp = np.spacing(np.abs(ref).astype(np.float32)).astype(np.float64)
    return np.abs(got.astype(np.float64) - ref) / ulp


def _bits(lo: int, hi: int) -> np.ndarray:
    return np.arange(lo, hi, dtype=np.uint64).astype(np.uint32).view(np.float32)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    nan = np.isnan(a) & np.isnan(b)
    return bool(((a.view(np.uint32) == b.view(np.uint32)) | nan).all())


def _transcription(x: np.ndarray) -> np.ndarray:
    """tools/ex2_table.py's model (the one the H200 sweep verified) on the CPU."""
    tool = _tool()
    table = torch.from_numpy(np.array(ex2_table.table_bits()).view(np.int32))
    out, _ = tool.model_bits_torch(torch.from_numpy(np.ascontiguousarray(x, np.float32)).view(torch.int32), table)
    y = out.view(torch.float32).numpy().copy()
    y[np.isnan(x)] = np.nan
    return y


def test_ex2_table_is_the_named_one():
    bits = ex2_table.table_bits()
    assert bits.shape == (C.EX2_TABLE_ENTRIES,) and ex2_table.digest(bits) == C.EX2_TABLE_SHA256
    assert bits[0] == 0x3F800000 and bits[-1] == 0x3F000000            # ex2(0) = 1, ex2(-1) = 1/2
    assert (np.diff(bits.astype(np.int64)) <= 0).all()                  # non-increasing in j


def test_ex2_table_tool_round_trip_and_accuracy():
    """The committed tool's compression decodes to the same table; every entry is within 2 ulp of the correctly
    rounded 2^(-j 2^-23) (its measured spread: -2..+1 ulp)."""
    tool = _tool()
    blob = open(os.path.join(ROOT, "src", "fused_logp", "shared_contract", C.EX2_TABLE_FILE), "rb").read()
    assert np.array_equal(tool.decompress(blob), ex2_table.table_bits())
    acc = tool._accuracy(ex2_table.table_bits())["ulp_from_rounded_2^x"]
    assert set(int(k) for k in acc) <= {-2, -1, 0, 1}, acc


def test_ex2_table_damage_is_refused(monkeypatch):
    bits = np.array(ex2_table.table_bits())
    bits[12345] ^= 1
    assert ex2_table.digest(bits) != C.EX2_TABLE_SHA256


def test_ex2_exact_points():
    f = np.float32
    assert contract_ex2(f(0.0)) == f(1.0) and contract_ex2(f(-0.0)) == f(1.0)
    assert contract_ex2(f(-1e-45)) == f(1.0) and contract_ex2(f(-1e-39)) == f(1.0)     # subnormal: flushed to 0
    assert contract_ex2(f(-1.0)) == f(0.5) and contract_ex2(f(-2.0)) == f(0.25)
    assert contract_ex2(f(-126.0)) == f(2.0 ** -126)
    assert contract_ex2(f(-126.5)) == 0.0 and contract_ex2(f(-149.0)) == 0.0             # below 2^-126: +0
    assert contract_ex2(f(-np.inf)) == 0.0 and contract_ex2(f(-3e38)) == 0.0
    assert np.isnan(contract_ex2(f(np.nan)))
    assert contract_ex2(f(1e-30)) == f(1.0)                                              # [0, 2^-23): T[0]
    with pytest.raises(Ex2DomainError):
        contract_ex2(f(0.5))


def test_ex2_scale_rule():
    """ex2(x - k) = ex2(x) * 2^-k exactly wherever the result is normal (the model's scale; the H200 sweep's)."""
    rng = np.random.default_rng()
    x = -rng.random(1 << 18).astype(np.float32)
    for k in (1, 2, 3, 8, 100):
        xk = (x - np.float32(k)).astype(np.float32)
        exact = (xk + np.float32(k)).astype(np.float32) == x
        want = np.ldexp(contract_ex2(x).astype(np.float64), -k).astype(np.float32)
        assert _same(contract_ex2(xk)[exact], want[exact])


def test_ex2_equals_the_verified_transcription_sampled():
    rng = np.random.default_rng()
    bits = rng.integers(0x80000000, 0x100000000, 1 << 21, dtype=np.uint64).astype(np.uint32)
    j = np.arange(0, 1 << 23, 97, dtype=np.float64)
    x = np.concatenate([bits.view(np.float32), (-(j / 2.0 ** 23)).astype(np.float32),
                        (-(j / 2.0 ** 23) - 5.0).astype(np.float32), -rng.random(1 << 18).astype(np.float32) * 160,
                        np.array([0.0, -0.0, -np.inf, np.nan, -1e-45, 1e-30, -126.0, -125.99999, -126.00001],
                                 np.float32)])
    assert _same(contract_ex2(x), _transcription(x))
    assert _same(contract_ex2_torch(torch.from_numpy(x)).numpy(), contract_ex2(x))


def test_ex2_accuracy_random():
    """Within 2 ulp of the correctly rounded 2^x (results >= 2^-126; 2.5 ulp of the exact value)."""
    rng = np.random.default_rng()
    x = np.concatenate([-rng.random(2_000_000) * 125.0, -np.exp(rng.uniform(-40, 4.8, 2_000_000))]).astype(np.float32)
    x = x[x > -126]
    ref = np.exp2(x.astype(np.float64)).astype(np.float32).astype(np.float64)
    assert _ulp_error(contract_ex2(x), ref).max() <= MAX_ULP


def test_log_exact_points():
    assert contract_log(np.float32(1.0)) == 0.0
    assert contract_log(np.float32(0.0)) == -np.inf
    assert contract_log(np.float32(np.inf)) == np.inf
    assert np.isnan(contract_log(np.float32(-1.0)))
    assert np.isnan(contract_log(np.float32(np.nan)))


@pytest.mark.parametrize("x", [1.4e-45, 1e-40, 1.1754944e-38, 1e-10, 0.01, 0.1, 0.70710677, 0.7071068, 0.99999994,
                               1.0000001, 1.4142135, 1.4142137, 2.0, 64.0, 151936.0, 2.0 ** 24, 3.4e38])
def test_log_edge_values(x):
    got = contract_log(np.float32(x))
    ref = np.log(np.float64(np.float32(x)))
    assert _ulp_error(np.asarray(got), np.asarray(ref)) <= MAX_ULP


def test_log_random_1e7():
    rng = np.random.default_rng()
    x = np.concatenate([1.0 + rng.random(5_000_000) * 2.0 ** 18, np.exp(rng.uniform(-87, 88, 5_000_000))]).astype(np.float32)
    err = _ulp_error(contract_log(x), np.log(x.astype(np.float64)))
    assert err.max() <= MAX_ULP, x[err.argmax()]


# Exhaustive: every binary32 in the contract's domains (run with `make test-slow`).
_CHUNK = 1 << 24


@pytest.mark.slow
def test_ex2_exhaustive_nonpositive():
    """Every binary32 x <= 0 (all 2^31 patterns with the sign bit set): the numpy model equals the transcription the
    H200 verified."""
    for lo in range(0x80000000, 0x100000000, _CHUNK):
        x = _bits(lo, min(0x100000000, lo + _CHUNK))
        assert _same(contract_ex2(x), _transcription(x)), hex(lo)


@pytest.mark.slow
def test_log_exhaustive_positive_normals():
    """Every positive normal binary32: covers S in [1, V] of the merge and min-p thresholds in (0, 1]."""
    worst = 0.0
    for lo in range(0x00800000, 0x7F800000, _CHUNK):
        x = _bits(lo, min(0x7F800000, lo + _CHUNK))
        worst = max(worst, float(_ulp_error(contract_log(x), np.log(x.astype(np.float64))).max()))
    assert worst <= MAX_ULP, worst
