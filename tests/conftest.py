import os
import secrets

import pytest
import torch

from fused_logp.shared_contract.config import Config, set_config

from cpu_backends import CPU_BACKENDS


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    """Each test starts from the default configuration and a clean environment."""
    for key in list(os.environ):
        if key.startswith("FUSED_LOGP_"):
            monkeypatch.delenv(key, raising=False)
    set_config(None)
    yield
    set_config(None)


@pytest.fixture(params=CPU_BACKENDS)
def cpu_backend(request, _fresh_config):
    """A contract test runs once per contract-bearing CPU backend (tests/cpu_backends.py): the backend becomes the
    configured default, so calls without `backend=` run on it. A module opts in with
    `pytestmark = pytest.mark.usefixtures("cpu_backend")`; a test that names the backend takes the argument."""
    set_config(Config(backend=request.param))
    yield request.param


@pytest.fixture
def gen(request):
    """A fresh random generator per test; the seed is shown on failure."""
    seed = secrets.randbits(31)
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator().manual_seed(seed)
    return g


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing test's report names the seed its `gen` drew (rerun: torch.Generator().manual_seed(seed))."""
    outcome = yield
    report = outcome.get_result()
    seeds = [v for k, v in item.user_properties if k == "seed"]
    if report.failed and seeds:
        report.sections.append(("seed", f"gen seed: {seeds[0]}"))


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not (torch.cuda.is_available()
                                           and torch.cuda.get_device_capability() == (9, 0)):
            item.add_marker(pytest.mark.skip(reason="needs an SM90 (H100/H200) GPU"))
