"""shared_contract: constants cannot be overridden, provenance carries every field, config and registry rules (the
weight fingerprint's invariances: test_fingerprint.py)."""

import pytest
import torch

from fused_logp import CONTRACT_VERSION, linear_logp
from fused_logp.shared_contract import constants as C
from fused_logp.shared_contract.config import get_config, load_config, set_config
from fused_logp.shared_contract.constants import ContractOverrideError
from fused_logp.shared_contract.errors import StrictModeError
from fused_logp.kernel.backends import select_backend

REPO = __import__("pathlib").Path(__file__).resolve().parents[2]


def test_contract_version_string():
    assert CONTRACT_VERSION == "cuda-fused-linear-logp-sm90-contract-v2"
    assert "cuda-fused-linear-logp-sm90-contract-v1" in C.RETIRED_CONTRACT_VERSIONS
    assert C.VOCAB_TILE == 64 and C.K_GROUP == 16


def test_env_override_of_a_constant_raises(monkeypatch):
    monkeypatch.setenv("FUSED_LOGP_VOCAB_TILE", "128")
    with pytest.raises(ContractOverrideError, match=r"VOCAB_TILE.*cuda-fused-linear-logp-sm90-contract-v2"):
        load_config()


def test_yaml_override_of_a_constant_raises(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("strict: true\nk_group: 32\n")
    with pytest.raises(ContractOverrideError, match=r"K_GROUP is a bit-relevant constant of cuda-fused-linear-logp"):
        load_config(p)


def test_yaml_unknown_key_raises(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("strictt: true\n")
    with pytest.raises(ValueError, match=r"unknown keys \['strictt'\]"):
        load_config(p)


def test_shipped_configs():
    assert load_config(REPO / "configs" / "default.yaml").strict is False
    assert load_config(REPO / "configs" / "strict.yaml").strict is True


def test_strict_from_environment(monkeypatch, gen):
    monkeypatch.setenv("FUSED_LOGP_STRICT", "1")
    set_config(None)
    assert get_config().strict is True
    h = torch.randn(2, 16, generator=gen).bfloat16()
    w = torch.randn(70, 16, generator=gen).bfloat16()
    with pytest.raises(StrictModeError):
        linear_logp(h, w, torch.tensor([1, 2]), backend="torch")
    assert linear_logp(h, w, torch.tensor([1, 2])).provenance.strict is True


def test_strict_config_file_refuses_torch_backend(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("strict: true\nbackend: torch\n")
    set_config(load_config(p))
    with pytest.raises(StrictModeError):
        linear_logp(torch.ones(1, 16).bfloat16(), torch.ones(3, 16).bfloat16(), torch.tensor([0]))


def test_provenance_carries_every_field(gen):
    h = torch.randn(2, 16, generator=gen).bfloat16()
    w = torch.randn(70, 16, generator=gen).bfloat16()
    p = linear_logp(h, w, torch.tensor([1, 2])).provenance.to_dict()
    for field in ("backend", "contract_version", "arch", "compute_capability", "vocab_tile", "k_group", "k_slab",
                  "n_split_policy", "tree_id", "transcendental_id", "toolkit", "build", "strict", "fallback"):
        assert field in p, field
    assert p["contract_version"] == CONTRACT_VERSION and p["backend"] == "oracle-fast"
    assert p["vocab_tile"] == 64 and p["k_group"] == 16 and p["k_slab"] == 32


def test_cpu_auto_selects_the_compiled_oracle():
    be, why = select_backend("auto", torch.device("cpu"), strict=True)
    assert be.name == "oracle-fast" and be.contract_bearing and why is None
