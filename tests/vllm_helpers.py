"""A tiny random Qwen3 saved to a directory (no hub access), and the op's recomputation of recorded logprobs."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fused_logp_jobs.tiny_model import HIDDEN, VOCAB, lm_head_weight, make_tiny_qwen3  # noqa: F401  (vLLM pads 1000 -> 1024)
from fused_logp_jobs.tiny_model import VLLM_ENGINE_KW as ENGINE_KW


def in_process_llm(model_dir, plugin_cfg):
    """One in-process vLLM engine with the plugin for a test module (yields it; shuts it down after)."""
    import copy

    import pytest
    from vllm import LLM

    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    mp.delenv("FUSED_LOGP_VLLM", raising=False)
    engine = LLM(model=str(model_dir), **ENGINE_KW, additional_config=copy.deepcopy(plugin_cfg))
    engine.collective_rpc("fused_logp_captured")
    yield engine
    engine.llm_engine.engine_core.shutdown()
    mp.undo()


def rewrite_lm_head(src: str | os.PathLike, dst: str | os.PathLike, *, seed: int) -> torch.Tensor:
    """Copy checkpoint src to dst with a new random lm_head; returns the new weight."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst, dirs_exist_ok=True)
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    new = (torch.randn(tensors["lm_head.weight"].shape, generator=g) * 0.5).to(torch.bfloat16)
    tensors["lm_head.weight"] = new
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return new


def op_logp_rows(hidden: list, ids: list, temps: list, weight: torch.Tensor) -> torch.Tensor:
    """linear_logp of each (hidden row as bf16 bit patterns, id, temperature), one call: the trainer's op."""
    from fused_logp import linear_logp

    h = torch.tensor(hidden, dtype=torch.int16).view(torch.bfloat16)
    res = linear_logp(h, weight, torch.tensor(ids, dtype=torch.int64),
                      temperature=torch.tensor(temps, dtype=torch.float32), vocab_size=weight.shape[0])
    return res.logp


def _offline(model_dir: str, cfg: str, sampling: str = "{}") -> None:
    """Run a fixed batch in-process and print its outputs as one JSON line (the plugin-off comparison)."""
    import json

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    extra = json.loads(cfg)
    llm = LLM(model=model_dir, **ENGINE_KW, **({"additional_config": extra} if extra else {}))
    prompts = [[11, 12, 13, 14], [3, 900, 41], [7, 8]]
    params = [SamplingParams(temperature=t, max_tokens=4, logprobs=2, prompt_logprobs=1, seed=7 + i,
                             **json.loads(sampling)) for i, t in enumerate([1.0, 0.7, 0.0])]
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)

    def lp(ds):
        return [None if d is None else sorted((k, v.logprob, v.rank) for k, v in d.items()) for d in ds]

    result = {"outputs": [{"tokens": list(o.outputs[0].token_ids), "logprobs": lp(o.outputs[0].logprobs),
                           "prompt_logprobs": lp(o.prompt_logprobs)} for o in outs]}
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    result["lp_class"] = type(model.logits_processor).__name__
    try:
        result["status"] = llm.collective_rpc("fused_logp_status")
    except NotImplementedError:            # the plugin is not installed at all
        result["status"] = None
    print(json.dumps(result))


def _tensor_parallel(model_dir: str, tp: str) -> None:
    """Generate with TP ranks in worker processes; print the status of every rank and the captured rows."""
    import json

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, tensor_parallel_size=int(tp), distributed_executor_backend="mp", **ENGINE_KW,
              additional_config={"fused_logp": {"enabled": True, "strict": True, "capture": True}})
    params = [SamplingParams(max_tokens=5, logprobs=3, temperature=t, seed=3 + i) for i, t in enumerate([0.8, 1.0, 1.3])]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ([5, 6, 7], [900, 2, 33, 4], [11])], params,
                 use_tqdm=False)
    status = [{"rank": s["rank"], "active": s["active"], "fingerprint": s["heads"][0]["fingerprint"]}
              for s in llm.collective_rpc("fused_logp_status")]
    captured = llm.collective_rpc("fused_logp_captured")
    print(json.dumps({"status": status, "captured": captured}))


if __name__ == "__main__":
    import sys

    if sys.argv[1] == "offline":
        _offline(*sys.argv[2:])
    elif sys.argv[1] == "tp":
        _tensor_parallel(*sys.argv[2:])
