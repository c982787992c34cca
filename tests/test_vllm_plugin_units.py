"""vLLM plugin pieces that need no engine: registration, settings, the column rescoring shared by both samplers,
and the Model Runner V2 wrappers (MRV2 needs Triton on a GPU, so only its wiring is checked here)."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

from fused_logp import linear_logp  # noqa: E402


def test_register_is_idempotent_and_replaces_logits_processor():
    from vllm.model_executor.custom_op import op_registry_oot

    from fused_logp.vllm_plugin import register
    from fused_logp.vllm_plugin.logits_processor import FusedLogpLogitsProcessor

    register()
    register()
    assert op_registry_oot["LogitsProcessor"] is FusedLogpLogitsProcessor
    from vllm.v1.worker.worker_base import WorkerBase
    assert callable(WorkerBase.fused_logp_status)


class _Cfg:
    def __init__(self, extra):
        self.additional_config = extra


def test_settings_and_kill_switch(monkeypatch, tmp_path):
    from fused_logp.vllm_plugin.settings import settings_from_vllm_config

    monkeypatch.delenv("FUSED_LOGP_VLLM", raising=False)
    monkeypatch.delenv("FUSED_LOGP_STRICT", raising=False)
    assert settings_from_vllm_config(_Cfg({})) is None
    assert settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": False}})) is None
    yaml = tmp_path / "strict.yaml"
    yaml.write_text("strict: true\nbackend: oracle\n")
    s = settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "config": str(yaml)}}))
    assert s.strict is True and s.backend == "oracle"
    s = settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True, "config": str(yaml), "strict": False}}))
    assert s.strict is False
    with pytest.raises(ValueError, match="unknown keys"):
        settings_from_vllm_config(_Cfg({"fused_logp": {"enable": True}}))
    monkeypatch.setenv("FUSED_LOGP_VLLM", "0")
    assert settings_from_vllm_config(_Cfg({"fused_logp": {"enabled": True}})) is None
    monkeypatch.setenv("FUSED_LOGP_VLLM", "1")
    assert settings_from_vllm_config(_Cfg({})) is not None


def test_rescore_every_column_at_row_temperature():
    """Both samplers end in rescore(): a top-k column repeating the sampled id and a padding column (-inf)."""
    from vllm.v1.outputs import LogprobsTensors

    from fused_logp.vllm_plugin.logits_processor import HeadState, Mark
    from fused_logp.vllm_plugin.patches import effective_temperature, rescore
    from fused_logp.vllm_plugin.settings import PluginSettings

    g = torch.Generator().manual_seed(0)
    n, d, v = 3, 64, 200
    h = torch.randn(n, d, generator=g).to(torch.bfloat16)
    w = torch.randn(v, d, generator=g).to(torch.bfloat16)
    z = linear_logp(h, w, torch.zeros(n, dtype=torch.int64), return_logits=True).logits
    ids = torch.tensor([[5, 5, 9], [7, 1, 7], [0, 199, 3]], dtype=torch.int32)
    old = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [-1.0, -2.0, float("-inf")]])
    lt = LogprobsTensors(ids, old, torch.zeros(n, dtype=torch.int64))
    temps = effective_temperature(torch.tensor([0.7, 0.0, 1.3]), n, z.device)     # greedy row scored at T=1
    assert temps.tolist() == [pytest.approx(0.7), 1.0, pytest.approx(1.3)]
    st = HeadState(PluginSettings(strict=True, backend="auto", capture=True, source="test"))
    out = rescore(lt, z, temps, Mark(st, h))
    want = linear_logp(h.repeat_interleave(3, 0), w, ids.flatten().long(),
                       temperature=temps.repeat_interleave(3)).logp.view(n, 3)
    assert torch.equal(out.logprobs[:, :2], want[:, :2]) and torch.equal(out.logprobs[:2, 2], want[:2, 2])
    assert out.logprobs[0, 0] == out.logprobs[0, 1] and out.logprobs[1, 0] == out.logprobs[1, 2]
    assert out.logprobs[2, 2] == float("-inf")
    assert len(st.captured) == n and st.captured[0]["ids"] == [5, 5, 9]


def test_model_runner_v2_wrappers_installed():
    from vllm.v1.sample.sampler import Sampler as V1Sampler
    from vllm.v1.worker.gpu.sample import prompt_logprob as pl
    from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from fused_logp.vllm_plugin import patches

    patches.install()
    patches.install()
    for fn in (V2Sampler.__call__, pl.PromptLogprobsWorker.compute_prompt_logprobs,
               pl.PromptLogprobsWorker.add_request, pl.compute_topk_scores, V1Sampler.forward,
               GPUModelRunner._sample, GPUModelRunner._get_prompt_logprobs_dict):
        assert fn.__code__.co_filename == patches.__file__, fn
        assert not hasattr(fn.__wrapped__, "__wrapped__"), "wrapped twice"

