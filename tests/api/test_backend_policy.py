"""The backend choice (kernel.backends.select_backend). For CUDA inputs without the SM90 kernel: 'auto' never
moves a CUDA call to the CPU oracle silently; the oracle runs there only when asked for by name. For CPU inputs:
'auto' is the compiled CPU oracle; where it cannot be built, strict mode refuses with the reason and outside
strict mode the numpy oracle runs, with a warning and the reason in provenance."""
from __future__ import annotations

import logging

import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel import backends, oracle_fast
from fused_logp.kernel.backends import device_status, select_backend
from fused_logp.shared_contract.errors import BackendUnavailableError, StrictModeError


def _cuda_without_sm90():
    if torch.cuda.is_available():
        ok, _ = device_status(torch.device("cuda"))
        if ok:
            pytest.skip("the SM90 kernel serves this machine's GPU")
    return torch.device("cuda")        # on a machine without CUDA the SM90 status of a CUDA device is "unavailable"


def test_auto_on_cuda_without_sm90_refused_in_strict_mode():
    dev = _cuda_without_sm90()
    with pytest.raises(StrictModeError) as err:
        select_backend("auto", dev, strict=True)
    msg = str(err.value)
    assert "SM90 kernel" in msg and "CPU oracle" in msg and "backend='oracle'" in msg and "backend: oracle" in msg
    assert "backend='torch'" not in msg


def test_auto_on_cuda_without_sm90_refused_outside_strict_mode():
    dev = _cuda_without_sm90()
    with pytest.raises(BackendUnavailableError) as err:
        select_backend("auto", dev, strict=False)
    msg = str(err.value)
    assert "CPU oracle" in msg and "FUSED_LOGP_BACKEND=oracle" in msg and "backend='torch'" in msg


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("name", ["oracle", "oracle-fast"])
def test_oracle_by_name_runs_for_cuda_inputs_and_says_where(strict, name, caplog):
    dev = _cuda_without_sm90()
    with caplog.at_level(logging.WARNING, logger="fused_logp"):
        be, fallback = select_backend(name, dev, strict=strict)
    assert be.name == name and be.contract_bearing and fallback is None
    assert "runs on the CPU" in caplog.text


@pytest.mark.parametrize("strict", [True, False])
def test_auto_on_cpu_inputs_is_the_compiled_oracle(strict):
    be, why = select_backend("auto", torch.device("cpu"), strict=strict)
    assert be.name == "oracle-fast" and be.contract_bearing and why is None


@pytest.fixture
def fast_unbuildable(monkeypatch):
    """The compiled CPU oracle's build state as on a machine where building it failed (its own reason text)."""
    why = "building the compiled CPU oracle failed: no C++ compiler on this machine (test)"
    monkeypatch.setattr(oracle_fast, "_ext", None)
    monkeypatch.setattr(oracle_fast, "_ext_error", why)
    monkeypatch.setattr(backends, "_warned", set())
    return why


def test_auto_on_cpu_without_the_compiled_oracle_refused_in_strict_mode(fast_unbuildable, gen):
    with pytest.raises(StrictModeError) as err:
        select_backend("auto", torch.device("cpu"), strict=True)
    msg = str(err.value)
    assert fast_unbuildable in msg and "oracle-fast" in msg and "backend='oracle'" in msg
    h, w = torch.randn(2, 16, generator=gen).bfloat16(), torch.randn(70, 16, generator=gen).bfloat16()
    with pytest.raises(StrictModeError, match="no C\\+\\+ compiler"):
        linear_logp(h, w, torch.tensor([1, 2]), strict=True)


def test_auto_on_cpu_without_the_compiled_oracle_falls_back_visibly(fast_unbuildable, gen, caplog):
    """Outside strict mode: the numpy oracle runs, one warning per process, the reason in every provenance."""
    h, w = torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(130, 32, generator=gen).bfloat16()
    t = torch.tensor([0, 64, 129])
    with caplog.at_level(logging.WARNING, logger="fused_logp"):
        first = linear_logp(h, w, t, temperature=0.7, strict=False)
        second = linear_logp(h, w, t, temperature=0.7, strict=False)
    assert caplog.text.count("oracle-fast") == 1 and fast_unbuildable in caplog.text
    for res in (first, second):
        assert res.provenance.backend == "oracle" and fast_unbuildable in res.provenance.fallback
    ref = linear_logp(h, w, t, temperature=0.7, backend="oracle", strict=True)
    assert torch.equal(first.logp.view(torch.int32), ref.logp.view(torch.int32))
    assert ref.provenance.fallback is None
