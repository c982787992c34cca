"""A tiny random Qwen3 checkpoint made locally with transformers (nothing from a hub), shared by the vLLM rollout
and the Megatron trainer.

Defaults equal tests/vllm_helpers.py's builder, so a seed gives the same weight bytes on both sides: hidden 64,
2 layers, 2 query heads and 1 KV head (GQA) of head_dim 32, intermediate 128, vocab 1000 (vLLM pads its lm_head
to 1024 rows, Megatron to 128 * TP), 256 positions, RoPE theta 10000, RMSNorm eps 1e-6; lm_head drawn from
N(0, 0.5) so that logits are large enough for temperatures to matter.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch

VOCAB = 1000
HIDDEN = 64

DEFAULTS = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=256,
                bos_token_id=1, eos_token_id=2)
LM_HEAD_STD = 0.5
# A CPU vLLM engine for this model: token-id prompts, bf16, small KV cache, eager.
VLLM_ENGINE_KW = dict(skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True, max_model_len=128,
                      max_num_seqs=8, max_num_batched_tokens=256, kv_cache_memory_bytes=32 << 20, seed=0,
                      disable_log_stats=True, logprobs_mode="processed_logprobs")


def make_tiny_qwen3(path: str | os.PathLike, *, seed: int = 0, tie: bool = False, **overrides) -> Path:
    """Save a random bf16 Qwen3ForCausalLM (safetensors + config.json, no tokenizer) to `path`; returns it.

    Deterministic for (seed, tie, overrides, transformers version); the caller's RNG state is left untouched.
    `overrides` are Qwen3Config fields (e.g. num_hidden_layers=1, rope_theta=1e6)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    kw = {**DEFAULTS, **overrides}
    theta = kw.pop("rope_theta", None)
    if theta is not None:
        kw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(theta)}
    cfg = Qwen3Config(**kw, tie_word_embeddings=tie, torch_dtype="bfloat16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
        with torch.no_grad():
            model.lm_head.weight.normal_(0.0, LM_HEAD_STD)
    model = model.to(torch.bfloat16)
    path = Path(path)
    model.save_pretrained(path, safe_serialization=True)
    # transformers 5 writes "dtype"; older readers look for "torch_dtype".
    cfg_file = path / "config.json"
    data = json.loads(cfg_file.read_text())
    data.setdefault("torch_dtype", "bfloat16")
    cfg_file.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path


def read_config(path: str | os.PathLike) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def rope_theta(cfg: dict) -> float:
    """RoPE base from a Qwen3 config dict (transformers 5 `rope_parameters` or the older `rope_theta`)."""
    rp = cfg.get("rope_parameters") or {}
    if isinstance(rp, dict) and "rope_theta" in rp:
        if rp.get("rope_type", "default") != "default":
            raise ValueError(f"RoPE scaling {rp.get('rope_type')!r} is not supported")
        return float(rp["rope_theta"])
    if cfg.get("rope_scaling"):
        raise ValueError(f"RoPE scaling {cfg['rope_scaling']!r} is not supported")
    return float(cfg.get("rope_theta", 10000.0))


def load_state_dict(path: str | os.PathLike) -> dict:
    """All tensors of the checkpoint's safetensors files (one file or an index of shards)."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors file in {path}")
    out = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def lm_head_weight(path: str | os.PathLike) -> torch.Tensor:
    """The checkpoint's lm_head [vocab, hidden] bf16 (the embedding when tied)."""
    sd = load_state_dict(path)
    return sd.get("lm_head.weight", sd["model.embed_tokens.weight"]).to(torch.bfloat16)
