"""The backend choice for CUDA inputs without the SM90 kernel (kernel.backends.select_backend): 'auto' never
moves a CUDA call to the CPU oracle silently; the oracle runs there only when asked for by name."""
from __future__ import annotations

import logging

import pytest
import torch

from fused_logp.kernel.backends import _sm90_status, select_backend
from fused_logp.shared_contract.errors import BackendUnavailableError, StrictModeError


def _cuda_without_sm90():
    if torch.cuda.is_available():
        ok, _ = _sm90_status(torch.device("cuda"))
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
def test_oracle_by_name_runs_for_cuda_inputs_and_says_where(strict, caplog):
    dev = _cuda_without_sm90()
    with caplog.at_level(logging.WARNING, logger="fused_logp"):
        be, fallback = select_backend("oracle", dev, strict=strict)
    assert be.name == "oracle" and be.contract_bearing and fallback is None
    assert "runs on the CPU" in caplog.text


def test_cpu_inputs_still_get_the_oracle():
    be, why = select_backend("auto", torch.device("cpu"), strict=True)
    assert be.name == "oracle" and why is None
