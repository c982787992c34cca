"""shared_contract.sampling: the two rules that decide which temperature a rollout row is scored at, one test
each, plus the layer rule (the module imports nothing above the contract layer)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from fused_logp import linear_logp
from fused_logp.shared_contract import sampling
from fused_logp.shared_contract.sampling import (GREEDY_SCORING_TEMPERATURE, SAMPLING_EPS, is_greedy,
                                                 scoring_temperature, scoring_temperatures)


def test_sampling_epsilon_is_vllms_greedy_threshold():
    """Rule 1: T < 1e-5 is greedy; 1e-5 itself is not (vLLM's `temperature < _SAMPLING_EPS`)."""
    assert SAMPLING_EPS == 1e-5
    assert is_greedy(0.0) and is_greedy(None) and is_greedy(0.99e-5)
    assert not is_greedy(1e-5) and not is_greedy(0.7)
    t = torch.tensor([0.0, 0.99e-5, 1e-5, 0.7], dtype=torch.float32)
    assert scoring_temperatures(t, 4).tolist() == [1.0, 1.0, pytest.approx(1e-5), pytest.approx(0.7)]
    vllm_sp = pytest.importorskip("vllm.sampling_params")
    assert vllm_sp._SAMPLING_EPS == SAMPLING_EPS
    from vllm.v1.sample import sampler as v1
    assert v1._SAMPLING_EPS == SAMPLING_EPS
    with pytest.raises(ValueError, match="temperature"):
        is_greedy(float("nan"))


@pytest.mark.usefixtures("cpu_backend")
def test_greedy_rows_are_scored_at_t1():
    """Rule 2: a greedy row's logp is the op's at T = 1, byte for byte; no temperature at all means all greedy."""
    assert GREEDY_SCORING_TEMPERATURE == 1.0
    assert scoring_temperature(0.0) == 1.0 and scoring_temperature(None) == 1.0 and scoring_temperature(0.5) == 0.5
    assert torch.equal(scoring_temperatures(None, 3), torch.ones(3))
    g = torch.Generator().manual_seed(3)
    h = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 300, (4,), generator=g)
    t = scoring_temperatures(torch.tensor([0.0, 0.0, 0.8, 0.0]), 4)
    got = linear_logp(h, w, ids, temperature=t).logp
    at1 = linear_logp(h, w, ids).logp
    assert torch.equal(got[[0, 1, 3]].view(torch.int32), at1[[0, 1, 3]].view(torch.int32))
    with pytest.raises(ValueError, match="shape"):
        scoring_temperatures(torch.ones(3), 4)


def test_sampling_module_imports_nothing_above_the_contract():
    tree = ast.parse(Path(sampling.__file__).read_text())
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    levels = [n.level for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    assert all(lv <= 1 for lv in levels), "relative import above shared_contract"
    assert not [m for m in mods if m.startswith(("fused_logp", "vllm", "megatron"))], mods
