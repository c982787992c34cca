"""The main job: roll out with vLLM + the plugin, score the same tokens with Megatron + the plugin at the same
weights, and compare, with the ordinary paths beside them and the body's drift attributed separately.

Each engine runs in its own process (as in a real RL system); they exchange only files in the work folder:
  rollout    vLLM with the plugin (strict as configured): sampled tokens, their recorded logprobs, the final
             hidden state of every sampled row (the plugin's capture), provenance and lm_head fingerprint
  native     vLLM without the plugin: its own prompt logprobs of the same full sequences (T = 1: vLLM's prompt
             logprobs do not apply temperature)
  trainer    Megatron (real megatron-core GPTModel from the same checkpoint) with the plugin: the contract logp
             of the rollout's hidden rows (the logp half), of its own hidden states (end to end), and Megatron's
             ordinary vocab_parallel_cross_entropy at T = 1
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

# The embedded default rollout: token-id prompts, sampling temperatures, tokens generated per prompt.
PROMPTS = [[11, 12, 13, 14], [3, 900, 41], [7, 8], [250, 251, 252, 253, 254], [99], [500, 17, 18]]
TEMPERATURES = [1.0, 0.7, 1.3, 1.0, 0.7, 1.3]
MAX_TOKENS = 12


def _engine(model_dir, plugin_cfg=None):
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    from .tiny_model import VLLM_ENGINE_KW
    return LLM(model=str(model_dir), **VLLM_ENGINE_KW, **({"additional_config": plugin_cfg} if plugin_cfg else {}))


def step_rollout(work: Path, strict: bool):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = _engine(work / "model", {"fused_logp": {"enabled": True, "strict": strict, "capture": True}})
    llm.collective_rpc("fused_logp_captured")
    params = [SamplingParams(temperature=t, max_tokens=MAX_TOKENS, logprobs=0, seed=100 + i, ignore_eos=True)
              for i, t in enumerate(TEMPERATURES)]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    captured = llm.collective_rpc("fused_logp_captured")[0]
    status = llm.collective_rpc("fused_logp_status")[0]
    from fused_logp.vllm_plugin.status_rpc import same_request

    seqs = []
    for prompt, t, o in zip(PROMPTS, TEMPERATURES, outs):
        toks = list(o.outputs[0].token_ids)
        rows = [c for c in captured if c["kind"] == "sample" and same_request(c["req_id"], o.request_id)]
        seqs.append({
            "prompt": prompt, "tokens": toks, "temperature": t,
            "logprobs": [o.outputs[0].logprobs[i][tok].logprob for i, tok in enumerate(toks)],
            "hidden": torch.tensor([c["hidden"] for c in rows], dtype=torch.int16).view(torch.bfloat16),
        })
    # vLLM's own head on the same hidden rows (its lm_head GEMM, then its sampler's raw logprobs, T = 1):
    # the ordinary rollout path's logp half, for comparison with Megatron's on the same rows.
    from vllm.v1.sample.sampler import Sampler
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    head = model.lm_head
    vocab = model.config.vocab_size
    with torch.no_grad():
        for s in seqs:
            z = head.quant_method.apply(head, s["hidden"])[:, :vocab]
            lp = Sampler.compute_logprobs(z)
            s["native_half_t1"] = lp.gather(1, torch.tensor(s["tokens"])[:, None]).squeeze(1).tolist()
    torch.save({"seqs": seqs, "status": status}, work / "rollout.pt")


def step_native(work: Path):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seqs = torch.load(work / "rollout.pt", weights_only=False)["seqs"]
    llm = _engine(work / "model")
    full = [s["prompt"] + s["tokens"] for s in seqs]
    outs = llm.generate([TokensPrompt(prompt_token_ids=f) for f in full],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0), use_tqdm=False)
    native = []
    for s, f, o in zip(seqs, full, outs):
        pl = o.prompt_logprobs                       # entry i scores token f[i] given f[:i]
        start = len(s["prompt"])
        native.append([pl[i][f[i]].logprob for i in range(start, len(f))])
    torch.save({"native_logprobs": native}, work / "native.pt")


def step_trainer(work: Path, strict: bool):
    from fused_logp import weight_fingerprint
    from .megatron_cpu import install
    from .megatron_scoring import build_megatron_qwen3, lm_head_weight, score_tokens
    from fused_logp.shared_contract.config import Config, set_config

    set_config(Config(strict=strict, source="agreement"))
    install()
    seqs = torch.load(work / "rollout.pt", weights_only=False)["seqs"]
    model, info = build_megatron_qwen3(work / "model")
    vocab = info["vocab_size"] if "vocab_size" in info else 1000
    out = []
    for s in seqs:
        full = torch.tensor([s["prompt"] + s["tokens"]], dtype=torch.int64)
        n_prompt, t = len(s["prompt"]), s["temperature"]
        own = score_tokens(model, full, temperature=t)
        own_t1 = score_tokens(model, full, temperature=1.0)
        half = score_tokens(model, torch.tensor(s["tokens"]), temperature=t, hidden_states=s["hidden"])
        half_t1 = score_tokens(model, torch.tensor(s["tokens"]), temperature=1.0, hidden_states=s["hidden"])
        sl = slice(n_prompt - 1, full.shape[1] - 1)           # positions predicting the generated tokens
        out.append({"logp_half": half["logp_contract"], "logp_own": own["logp_contract"][0, sl],
                    "ordinary_own_t1": own_t1["logp_ordinary"][0, sl],
                    "ordinary_half_t1": half_t1["logp_ordinary"], "provenance": half["provenance"]})
    fp = weight_fingerprint(lm_head_weight(model), vocab_size=vocab)
    torch.save({"scores": out, "fingerprint": fp, "info": {k: str(v) for k, v in info.items()}}, work / "trainer.pt")


def _run_step(work: Path, step: str, strict: bool, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    cmd = [sys.executable, "-m", "fused_logp_jobs.agreement", step, "--work", str(work)] + (["--strict"] if strict else [])
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    (work / f"{step}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode:
        raise RuntimeError(f"step {step!r} failed (exit {proc.returncode}); log: {work / f'{step}.log'}\n"
                           + "\n".join((proc.stdout + proc.stderr).splitlines()[-25:]))
    return time.perf_counter() - t0


def run(out_dir="out/agreement", strict=True, seed=0) -> dict:
    from tqdm import tqdm

    from .report import agreement_table, compare, plot_drift, write_report
    from .tiny_model import make_tiny_qwen3

    work = Path(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_tiny_qwen3(work / "model", seed=seed)
    timings = {}
    steps = [("rollout", {}), ("native", {"FUSED_LOGP_VLLM": "0"}), ("trainer", {})]
    for step, env in tqdm(steps, desc="agreement", unit="step"):
        timings[step] = round(_run_step(work, step, strict, env), 1)
    ro = torch.load(work / "rollout.pt", weights_only=False)
    na = torch.load(work / "native.pt", weights_only=False)
    tr = torch.load(work / "trainer.pt", weights_only=False)
    cat = lambda xs: np.concatenate([np.asarray(x, dtype=np.float32).ravel() for x in xs])  # noqa: E731
    rollout = cat([s["logprobs"] for s in ro["seqs"]])
    half = cat([x["logp_half"].numpy() for x in tr["scores"]])
    own = cat([x["logp_own"].numpy() for x in tr["scores"]])
    ord_train = cat([x["ordinary_own_t1"].numpy() for x in tr["scores"]])
    ord_roll = cat(na["native_logprobs"])
    ord_half_roll = cat([s["native_half_t1"] for s in ro["seqs"]])
    ord_half_train = cat([x["ordinary_half_t1"].numpy() for x in tr["scores"]])
    pos = np.concatenate([np.arange(len(s["tokens"])) for s in ro["seqs"]])
    rows = {
        "contract, logp half (trainer scores the rollout's hidden states)": compare(rollout, half),
        "contract, end to end (trainer's own hidden states)": compare(rollout, own),
        "ordinary, logp half (vLLM head vs Megatron CE, same rows, T=1)": compare(ord_half_roll, ord_half_train),
        "ordinary, end to end (vLLM native vs Megatron CE, T=1)": compare(ord_roll, ord_train),
    }
    head = ro["status"]["heads"][0]
    fp_roll = head["fingerprint"].split(":")[-1]
    fp_train = tr["fingerprint"].split(":")[-1]
    series = {"contract (logp half)": (rollout, half), "ordinary (logp half, T=1)": (ord_half_roll, ord_half_train),
              "contract (end to end)": (rollout, own), "ordinary (end to end, T=1)": (ord_roll, ord_train)}
    plots = plot_drift(work, series, pos)
    extra = {
        "weight fingerprints": {"rollout (vLLM plugin)": head["fingerprint"], "trainer (Megatron)": tr["fingerprint"],
                                "equal": fp_roll == fp_train},
        "provenance": {"rollout": head["provenance"], "trainer": tr["scores"][0]["provenance"].to_dict()},
        "rollout": {"prompts": len(PROMPTS), "tokens per prompt": MAX_TOKENS, "temperatures": TEMPERATURES,
                    "strict": strict},
        "step seconds": timings,
    }
    md, js = write_report(work, "Rollout -> trainer agreement", rows, extra, plots)
    print(agreement_table(rows))
    print(f"weight fingerprint: rollout {fp_roll} / trainer {fp_train}: {'equal' if fp_roll == fp_train else 'DIFFERENT'}")
    print(f"report: {md}  plots: {', '.join(Path(p).name for p in plots)}")
    half_row = rows["contract, logp half (trainer scores the rollout's hidden states)"]
    ok = half_row["mismatches"] == 0 and fp_roll == fp_train
    return {"ok": ok, "rows": rows, "report": md}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m fused_logp_jobs.agreement")
    p.add_argument("step", choices=["rollout", "native", "trainer"])
    p.add_argument("--work", required=True, type=Path)
    p.add_argument("--strict", action="store_true")
    a = p.parse_args(argv)
    {"rollout": lambda: step_rollout(a.work, a.strict), "native": lambda: step_native(a.work),
     "trainer": lambda: step_trainer(a.work, a.strict)}[a.step]()


if __name__ == "__main__":
    main()
