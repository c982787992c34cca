"""An on-policy RL loop on the embedded tiny Qwen3: vLLM (plugin) rolls out, Megatron (plugin) scores the same
tokens and takes a policy-gradient step (GRPO-style, group-normalised rewards), the new weights go into the
running vLLM engine through vLLM's own `reload_weights`, repeat.

Every step checks, over every generated token:
  - the logp half: the trainer's contract logp of the rollout's own hidden rows equals the recorded rollout
    logprob bit for bit (mismatches 0, max |dlogp| 0, K3 0);
  - the lm_head fingerprint of the trainer (recomputed at each check; content-addressed, so the weight versions
    are labels only) equals the one the rollout engine reports, and the scoring API attaches that fingerprint;
and reports beside them the end-to-end drift (the trainer's own body) and the ordinary paths (vLLM's own head
and raw logprobs vs Megatron's vocab_parallel_cross_entropy) on the same tokens. Strict mode stops the loop at
the first non-zero or fingerprint mismatch. The trainer updates the final norm and the lm_head (the tensors
whose Megatron and Hugging Face layouts coincide), so every step changes the hidden rows and the head.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from .report import compare

PROMPTS = [[11, 12, 13, 14], [3, 900, 41, 5], [250, 251, 252, 253]]
GROUP = 4
MAX_TOKENS = 8
TEMPERATURE = 1.0


def _reward(tokens: list[int]) -> float:
    """A synthetic reward: the share of generated ids below 500."""
    return float(np.mean([t < 500 for t in tokens]))


def run_loop(out_dir="out/rl", *, steps: int = 5, strict: bool = True, stale_at: int | None = None,
             seed: int = 0, lr: float = 4.0, quiet: bool = False) -> dict:
    """Run `steps` rollout -> train -> sync iterations. With `stale_at=k`, the weight push after step k-1 is
    skipped (a stale rollout at step k): strict mode raises FingerprintMismatchError there.
    Returns {"steps": [per-step dict], "stopped": reason or None}."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tqdm import tqdm
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.sample.sampler import Sampler

    from fused_logp import megatron_plugin as mp
    from .agreement import _engine
    from .megatron_cpu import install
    from .megatron_scoring import build_megatron_qwen3, ordinary_logp
    from fused_logp.shared_contract.config import Config, set_config
    from fused_logp.shared_contract.errors import FingerprintMismatchError
    from .tiny_model import load_state_dict, make_tiny_qwen3

    work = Path(out_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir = work / "model"
    if not (model_dir / "config.json").exists():
        make_tiny_qwen3(model_dir, seed=seed)
    set_config(Config(strict=strict, source="rl-loop"))
    llm = _engine(model_dir, {"fused_logp": {"enabled": True, "strict": strict, "capture": True}})
    llm.collective_rpc("fused_logp_captured")
    install()
    gpt, info = build_megatron_qwen3(model_dir)
    vocab = info["vocab_size"]
    trainable = [gpt.output_layer.weight, gpt.decoder.final_layernorm.weight]
    for prm in gpt.parameters():
        prm.requires_grad_(any(prm is t for t in trainable))
    opt = torch.optim.SGD(trainable, lr=lr)
    tracker = mp.track_lm_head(gpt, opt, vocab_size=vocab)
    hf_state = load_state_dict(model_dir)
    vhead = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model().lm_head

    history, stopped = [], None
    bar = tqdm(range(steps), desc="rl", unit="step", disable=quiet)
    for step in bar:
        head = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
        rollout_version = head["fingerprint_changes"]          # informational; the fingerprint is compared
        rec = {"step": step, "trainer_version": tracker.version, "rollout_version": rollout_version,
               "trainer_fingerprint": tracker.fingerprint, "rollout_fingerprint": head["fingerprint"]}
        rec["fingerprints_equal"] = tracker.fingerprint == head["fingerprint"]
        prompts = [p for p in PROMPTS for _ in range(GROUP)]
        params = [SamplingParams(temperature=TEMPERATURE, max_tokens=MAX_TOKENS, logprobs=0, ignore_eos=True,
                                 seed=1000 * step + i) for i in range(len(prompts))]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        captured = [c for c in llm.collective_rpc("fused_logp_captured")[0] if c["kind"] == "sample"]
        try:
            tracker.check_rollout(head["fingerprint"], rollout_weight_version=rollout_version, strict=strict)
        except FingerprintMismatchError as exc:
            stopped = f"step {step}: {exc}"
            history.append(rec)
            break
        from fused_logp.vllm_plugin.status_rpc import same_request
        toks, hid, lp_roll = [], [], []
        for o in outs:
            t = list(o.outputs[0].token_ids)
            rows = [c for c in captured if same_request(c["req_id"], o.request_id)]
            toks.append(t)
            hid.append(torch.tensor([c["hidden"] for c in rows], dtype=torch.int16).view(torch.bfloat16))
            lp_roll.append([o.outputs[0].logprobs[i][tok].logprob for i, tok in enumerate(t)])
        flat_t = torch.tensor([x for t in toks for x in t])
        flat_h = torch.cat(hid)
        roll = np.asarray(lp_roll, dtype=np.float32).ravel()
        # the logp half: the trainer scores the rollout's hidden rows (the plugin's public scoring API)
        half = mp.score_hidden_states(gpt, flat_h, flat_t, temperature=TEMPERATURE, vocab_size=vocab,
                                      tracker=tracker)
        rec["scored_fingerprint_equal"] = half.fingerprint == head["fingerprint"]
        half_ord = ordinary_logp(gpt, hidden_states=flat_h, targets=flat_t, temperature=TEMPERATURE,
                                 vocab_size=vocab)
        # the ordinary rollout path on the same rows: vLLM's own head GEMM and its sampler's raw logprobs
        with torch.no_grad():
            z = vhead.quant_method.apply(vhead, flat_h)[:, :vocab]
            ord_roll = Sampler.compute_logprobs(z).gather(1, flat_t[:, None]).squeeze(1).numpy()
        # the trainer's own body, with gradients (the scoring API's with_grad): GRPO-style policy gradient
        full = torch.tensor([p + t for p, t in zip(prompts, toks)])
        b, s = full.shape
        gen = torch.zeros(b, s)
        gen[:, len(prompts[0]) - 1:s - 1] = 1.0                      # positions that predict generated tokens
        opt.zero_grad()
        out = mp.score(gpt, full, loss_mask=gen, temperature=TEMPERATURE, vocab_size=vocab, with_grad=True)
        own = out.logp[gen.bool()].detach().numpy()
        own_ord = ordinary_logp(gpt, full, temperature=TEMPERATURE, vocab_size=vocab)[gen[:, :-1].bool()].numpy()
        rewards = torch.tensor([_reward(t) for t in toks]).view(len(PROMPTS), GROUP)
        adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1)
        loss = -(adv[:, None] * out.logp * gen).sum() / gen.sum()
        loss.backward()
        opt.step()
        rec.update({
            "reward": float(rewards.mean()), "loss": loss.item(),
            "contract_half": compare(roll, half.logp.numpy()),
            "contract_end_to_end": compare(roll, own),
            "ordinary_half": compare(ord_roll, half_ord.numpy()),
            "ordinary_end_to_end": compare(ord_roll, own_ord),
        })
        history.append(rec)
        bar.set_postfix_str(f"half mismatches {rec['contract_half']['mismatches']}, reward {rec['reward']:.2f}")
        if strict and rec["contract_half"]["mismatches"]:
            stopped = f"step {step}: {rec['contract_half']['mismatches']} logp mismatches"
            break
        if stale_at is not None and step + 1 == stale_at:
            continue                                                 # the push that a stale rollout misses
        hf_state["lm_head.weight"] = gpt.output_layer.weight.detach()[:vocab].clone()
        hf_state["model.norm.weight"] = gpt.decoder.final_layernorm.weight.detach().clone()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(hf_state.items()),
                                                      "is_checkpoint_format": True})
    llm.llm_engine.engine_core.shutdown()
    result = {"steps": history, "stopped": stopped, "strict": strict}
    _write(work, result)
    return result


def _write(work: Path, result: dict):
    import json

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    done = [r for r in result["steps"] if "contract_half" in r]
    from fused_logp.atomic_io import atomic_path, atomic_write_text
    atomic_write_text(work / "rl.json", json.dumps(result, indent=2, default=str) + "\n")
    if not done:
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    keys = [("contract_half", "contract, logp half"), ("ordinary_half", "ordinary, logp half"),
            ("contract_end_to_end", "contract, end to end"), ("ordinary_end_to_end", "ordinary, end to end")]
    x = [r["step"] for r in done]
    for key, label in keys:
        axes[0].plot(x, [r[key]["mismatches"] for r in done], marker="o", label=label)
        axes[1].plot(x, [r[key]["max_abs_delta"] for r in done], marker="o", label=label)
    axes[0].set_ylabel("mismatching tokens")
    axes[1].set_ylabel("max |dlogp|")
    axes[1].set_yscale("symlog", linthresh=1e-8)
    for ax in axes:
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.set_xlabel("RL step (weight version)")
        ax.legend(fontsize=7)
    fig.suptitle("Rollout vs trainer per step")
    fig.tight_layout()
    with atomic_path(work / "rl_steps.png") as tmp:
        fig.savefig(tmp, dpi=120, format="png")
    plt.close(fig)
