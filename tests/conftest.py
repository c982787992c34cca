import os
import secrets

import pytest
import torch

from fused_logp.shared_contract.config import set_config


@pytest.fixture(autouse=True)
def _fresh_config(monkeypatch):
    """Each test starts from the default configuration and a clean environment."""
    for key in list(os.environ):
        if key.startswith("FUSED_LOGP_"):
            monkeypatch.delenv(key, raising=False)
    set_config(None)
    yield
    set_config(None)


@pytest.fixture
def gen(request):
    """A fresh random generator per test; the seed is shown on failure."""
    seed = secrets.randbits(31)
    request.node.user_properties.append(("seed", seed))
    g = torch.Generator().manual_seed(seed)
    return g


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not (torch.cuda.is_available()
                                           and torch.cuda.get_device_capability() == (9, 0)):
            item.add_marker(pytest.mark.skip(reason="needs an SM90 (H100/H200) GPU"))
