"""The checks: every value the plugin returns in vLLM against the trainer op on the captured rows.

check (run_check), per model runner and mode; logprobs-mode (run_logprobs_mode), one engine in one of vLLM's logprobs
modes; modes (run_modes), logprobs-mode for every mode and both runners, each engine a child process; mpstart
(run_mpstart), vLLM's default multiprocess engine with the plugin loaded through its entry point."""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .common import DEV, DRY, VOCAB, _child, _engine, _lm_head, _run_header, _wait, make_model


def _entry_point_dir() -> str:
    """A site directory whose only content is a distribution declaring the plugin's vllm.general_plugins entry point
    (what installing the wheel declares), so that every vLLM process, spawned ones included, loads the plugin."""
    d = Path("/tmp/fused_logp_entry_point")
    info = d / "fused_logp_gpu_run-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fused_logp_gpu_run\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nfused_logp = fused_logp.vllm_plugin:register\n")
    return str(d)


def run_mpstart(model_dir, plugin: bool) -> dict:
    """vLLM's default multiprocess engine (engine core in its own process), eager, on the small model: start, four
    requests, the plugin's status over the RPC. The plugin is loaded through its entry point, as installed."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":
        raise SystemExit("mpstart: unset VLLM_ENABLE_V1_MULTIPROCESSING (this part checks the multiprocess engine)")
    if plugin:
        ep = _entry_point_dir()
        sys.path.insert(0, ep)
        os.environ["PYTHONPATH"] = ep + os.pathsep + os.environ.get("PYTHONPATH", "")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256, max_num_seqs=8,
              kv_cache_memory_bytes=1 << 30, gpu_memory_utilization=0.1, seed=0, enforce_eager=True)
    if plugin:
        kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True}}
    print(f"mpstart: creating the engine (plugin {'on' if plugin else 'off'})", flush=True)
    llm = LLM(**kw)
    res = {"plugin": plugin, "start_s": round(time.time() - t0, 1)}
    print(f"mpstart: engine started in {res['start_s']} s", flush=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[1 + i, 2, 3]) for i in range(4)],
                        SamplingParams(max_tokens=4, logprobs=1, ignore_eos=True), use_tqdm=False)
    res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    if plugin:
        st = llm.collective_rpc("fused_logp_status")[0]
        res["status"] = {"active": st["active"], "pid": st["pid"], "main_pid": os.getpid(),
                         "backend": (st["heads"][0]["provenance"] or {}).get("backend"),
                         "non_contract": st["heads"][0]["non_contract"]}
    res["total_s"] = round(time.time() - t0, 1)
    print("MPSTART OK", json.dumps(res), flush=True)
    return res


def _recorded_and_expected(c, d, weight, logprobs_mode: str, kind: str):
    """FP32 on DEV: the values vLLM recorded for captured row c (d: its logprob dict, by id) and the trainer's call
    for them (vllm_plugin.expected_values in logprobs_mode, with the row's sampling record)."""
    import torch

    from fused_logp.vllm_plugin import expected_values

    h = torch.tensor([c["hidden"]], dtype=torch.int16).view(torch.bfloat16).to(DEV)
    ids = torch.tensor([c["ids"]], dtype=torch.int64, device=DEV)
    want = expected_values(h, weight, ids, logprobs_mode=logprobs_mode, kind=kind, sampling=c["sampling"],
                           vocab_size=VOCAB)[0]
    got = torch.tensor([d[i].logprob for i in c["ids"]], dtype=torch.float64).to(torch.float32).to(DEV)
    return got, want


def _compare(outs, captured, weight) -> dict:
    """Every recorded value of each output against the trainer's call (vllm_plugin.expected_values in
    processed_logprobs, the mode these engines run) on its captured rows (matched by request id) and their sampling
    record: sampled tokens at the request's scoring temperature and program, prompt tokens as vLLM scores them
    (T = 1, the full vocabulary)."""
    import torch

    with torch.inference_mode():        # the op's per-device state may have been made under vLLM's inference mode
        return _compare_rows(outs, captured, weight)


def _compare_rows(outs, captured, weight) -> dict:
    import torch

    from fused_logp.vllm_plugin.status_rpc import same_request

    n_vals = n_bad = n_neginf = 0
    first_bad = None
    for o in outs:
        rows = [c for c in captured if same_request(c["req_id"], o.request_id)]
        for kind, dicts in (("sample", o.outputs[0].logprobs), ("prompt", (o.prompt_logprobs or [None])[1:])):
            rs = [c for c in rows if c["kind"] == kind]
            if not dicts:
                continue
            assert len(rs) == len(dicts), (kind, len(rs), len(dicts))
            for c, d in zip(rs, dicts):
                got, want = _recorded_and_expected(c, d, weight, "processed_logprobs", kind)
                n_neginf += int(torch.isneginf(want).sum())
                bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
                n_vals += len(c["ids"])
                n_bad += bad
                if bad and first_bad is None:
                    first_bad = {"req": o.request_id, "kind": kind, "ids": c["ids"], "vllm": got.tolist(),
                                 "op": want.tolist(), "sampling": c["sampling"]}
    return {"values": n_vals, "mismatches": n_bad, "neg_inf_columns": n_neginf, "first_mismatch": first_bad}


# requests run together by `check` (and then each alone): above 64, so that the decode batches take the ping-pong
# kernel (sm90.auto_launch) as well as the 64-row one
CONCURRENT = 96


def run_check(model_dir, runner: str, mode: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp import weight_fingerprint

    t0 = time.time()
    # processed_logprobs, the RL recipe's mode (every mode is checked by `modes`); _compare scores each value as the
    # trainer does for that mode
    llm = _engine(model_dir, plugin=True, capture=True, eager=(mode == "eager"), max_num_seqs=128,
                  logprobs_mode="processed_logprobs")
    res = {"runner": runner, "mode": mode, "start_s": round(time.time() - t0, 1)}
    weight = _lm_head(model_dir)
    status = llm.collective_rpc("fused_logp_status")[0]
    head = status["heads"][0]
    res["status"] = {k: head[k] for k in ("strict", "backend", "fallback", "non_contract", "fingerprint")}
    res["status"]["provenance_backend"] = (head["provenance"] or {}).get("backend")
    res["vllm_hooks"] = status["vllm_hooks"]
    res["fingerprint_equal"] = head["fingerprint"] == weight_fingerprint(weight)
    llm.collective_rpc("fused_logp_captured")

    g = torch.Generator().manual_seed(1)
    # plain / temperature / greedy, then transform programs
    cases = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0), dict(temperature=1.3),
             dict(temperature=0.8, top_k=50), dict(temperature=1.0, top_p=0.9), dict(temperature=1.0, min_p=0.1),
             dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05)]
    prompts, params = [], []
    for i, kw in enumerate(cases):
        for j in range(2):
            p = torch.randint(0, VOCAB, (5 + 3 * j,), generator=g).tolist()
            sp = SamplingParams(max_tokens=8, logprobs=5, prompt_logprobs=2, seed=100 + 10 * i + j,
                                ignore_eos=True, **kw)
            prompts.append(TokensPrompt(prompt_token_ids=p))
            params.append(sp)
    outs = llm.generate(prompts, params, use_tqdm=False)
    res["modes"] = _compare(outs, llm.collective_rpc("fused_logp_captured")[0], weight)

    # CONCURRENT concurrent requests (decode batches above 64 rows: `auto` takes the ping-pong kernel), then each alone
    cprompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (4 + i % 9,), generator=g).tolist())
                for i in range(CONCURRENT)]
    cparams = [SamplingParams(max_tokens=16, logprobs=2, temperature=[1.0, 0.7, 0.0, 1.3][i % 4], seed=500 + i,
                              ignore_eos=True) for i in range(CONCURRENT)]
    conc = llm.generate(cprompts, cparams, use_tqdm=False)
    cap_conc = llm.collective_rpc("fused_logp_captured")[0]
    res[f"concurrent{CONCURRENT}"] = _compare(conc, cap_conc, weight)
    alone_cmp = {"values": 0, "mismatches": 0}
    same_tokens = same_logprobs = 0
    for i in range(CONCURRENT):
        o = llm.generate([cprompts[i]], [cparams[i]], use_tqdm=False)[0]
        c = _compare([o], llm.collective_rpc("fused_logp_captured")[0], weight)
        alone_cmp["values"] += c["values"]
        alone_cmp["mismatches"] += c["mismatches"]
        same_tokens += list(o.outputs[0].token_ids) == list(conc[i].outputs[0].token_ids)
        same_logprobs += [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            [d[t].logprob for d, t in zip(conc[i].outputs[0].logprobs, conc[i].outputs[0].token_ids)]
    res[f"alone{CONCURRENT}"] = dict(alone_cmp, requests_same_tokens_as_concurrent=same_tokens,
                          requests_same_logprobs_as_concurrent=same_logprobs)

    # reload_weights with a new lm_head moves the fingerprint; the new bytes score the next rollout
    from safetensors.torch import load_file
    state = load_file(str(Path(model_dir) / "model.safetensors"), device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(7)
    new_w = (torch.randn(weight.shape, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    state["lm_head.weight"] = new_w
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(state.items()),
                                                  "is_checkpoint_format": True})
    after = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    o = llm.generate(prompts[:2], params[:2], use_tqdm=False)
    res["reload"] = {"fingerprint_moved": after["fingerprint"] != head["fingerprint"],
                     "fingerprint_equal_trainer": after["fingerprint"] == weight_fingerprint(new_w),
                     "fingerprint_changes": after["fingerprint_changes"],
                     "after_reload": _compare(o, llm.collective_rpc("fused_logp_captured")[0], new_w)}
    res["total_s"] = round(time.time() - t0, 1)
    return res


MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


MODE_CASES = [dict(temperature=1.0), dict(temperature=0.7), dict(temperature=0.0), dict(temperature=1e-6),
              dict(temperature=5e-3), dict(temperature=0.8, top_k=50), dict(temperature=1.0, top_p=0.9),
              dict(temperature=1.0, min_p=0.1), dict(temperature=0.9, top_k=50, top_p=0.9, min_p=0.05),
              dict(temperature=5e-3, top_p=0.5), dict(temperature=0.9, top_k=20, n=2)]


def run_logprobs_mode(model_dir, runner: str, logprobs_mode: str) -> dict:
    import torch
    import vllm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp.shared_contract.sampling import effective_sampling
    from fused_logp.vllm_plugin import completion_index

    t0 = time.time()
    llm = _engine(model_dir, plugin=True, capture=True, eager=False, max_num_seqs=64, logprobs_mode=logprobs_mode)
    res = {"runner": runner, "logprobs_mode": logprobs_mode, "start_s": round(time.time() - t0, 1)}
    head = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    res["status"] = {k: head[k] for k in ("strict", "backend", "fallback", "non_contract")}
    res["status"]["provenance_backend"] = (head["provenance"] or {}).get("backend")
    weight = _lm_head(model_dir)
    llm.collective_rpc("fused_logp_captured")
    g = torch.Generator().manual_seed(3)
    prompts, params = [], []
    for i, kw in enumerate(MODE_CASES):
        for j in range(2):
            prompts.append(TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (5 + 3 * j,), generator=g).tolist()))
            params.append(SamplingParams(max_tokens=8, logprobs=1 + (i + j) % 5, prompt_logprobs=2,
                                         seed=300 + 10 * i + j, ignore_eos=True, **kw))
    outs = llm.generate(prompts, params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    vals = bad = neginf = wrong_ids = wrong_sampling = 0
    first_bad = None
    floor = []
    with torch.inference_mode():
        for p, kw, o in zip(prompts, [c for c in MODE_CASES for _ in range(2)], outs):
            want_s = effective_sampling("vllm", vllm.__version__, kw["temperature"], kw.get("top_k"),
                                        kw.get("top_p"), kw.get("min_p")).to_dict()
            mine = [c for c in captured if completion_index(c["req_id"], o.request_id) is not None]
            first = min(c.index for c in o.outputs)
            pairs = []
            for comp in o.outputs:
                rows = [c for c in mine if c["kind"] == "sample" and
                        completion_index(c["req_id"], o.request_id) == comp.index]
                pairs += [("sample", r, d) for r, d in zip(rows, comp.logprobs)]
                wrong_ids += abs(len(rows) - len(comp.logprobs))
            prows = [c for c in mine if c["kind"] == "prompt" and completion_index(c["req_id"], o.request_id) == first]
            pairs += [("prompt", r, d) for r, d in zip(prows, (o.prompt_logprobs or [None])[1:])]
            wrong_ids += abs(len(prows) - (len(p["prompt_token_ids"]) - 1))
            for kind, c, d in pairs:
                s = dict(c["sampling"])
                s.pop("program")
                wrong_sampling += s != want_s
                if kw["temperature"] in (1e-6, 5e-3):
                    floor.append(c["sampling"]["temperature"])
                wrong_ids += set(c["ids"]) != set(d)
                got, want = _recorded_and_expected(c, d, weight, logprobs_mode, kind)
                nb = int((got.view(torch.int32) != want.view(torch.int32)).sum())
                vals += len(c["ids"])
                bad += nb
                neginf += int(torch.isneginf(want).sum())
                if nb and first_bad is None:
                    first_bad = {"req": o.request_id, "kind": kind, "ids": c["ids"], "vllm": got.tolist(),
                                 "trainer": want.tolist(), "sampling": c["sampling"]}
    res.update(values=vals, mismatches=bad, neg_inf_values=neginf, rows_with_wrong_ids=wrong_ids,
               rows_with_wrong_sampling_record=wrong_sampling, floor_temperatures=sorted(set(floor)),
               first_mismatch=first_bad, total_s=round(time.time() - t0, 1))
    return res


def run_modes(out: Path, model_dir: Path, deadline_s: float) -> dict:
    t0 = time.time()
    result = _run_header(out)
    make_model(model_dir)
    runners = ("v1",) if DRY else ("v2", "v1")       # vLLM's V2 runner needs Triton: GPU only
    modes = [m for m in os.environ.get("FUSED_LOGP_VLLM_BENCH_MODES", ",".join(MODES)).split(",") if m]
    for runner in runners:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        procs = {}
        for mode in modes:
            name = f"mode-{runner}-{mode}"
            procs[name] = _child(["logprobs-mode", "--runner", runner, "--logprobs-mode", mode, "--model-dir",
                                  str(model_dir), "--json", str(out / f"{name}.json")], out / f"{name}.log", 0)[0]
        _wait(procs, t0 + deadline_s * (0.5 if runner == runners[0] and len(runners) > 1 else 1.0), result, out)
    parts = {k: v for k, v in result.items() if k.startswith("mode-")}
    result["summary"] = {
        "parts": len(parts), "parts_ok": sum(isinstance(v, dict) and "values" in v for v in parts.values()),
        "values": sum(v.get("values", 0) for v in parts.values() if isinstance(v, dict)),
        "mismatches": sum(v.get("mismatches", 0) for v in parts.values() if isinstance(v, dict)),
        "rows_with_wrong_ids": sum(v.get("rows_with_wrong_ids", 0) for v in parts.values() if isinstance(v, dict)),
        "rows_with_wrong_sampling_record": sum(v.get("rows_with_wrong_sampling_record", 0)
                                               for v in parts.values() if isinstance(v, dict))}
    result["wall_s"] = round(time.time() - t0, 1)
    (out / "vllm-gpu-modes.json").write_text(json.dumps(result, indent=1, default=str))
    return result
