"""A tiny random Qwen3 saved to a directory (no hub access), and the op's recomputation of recorded logprobs."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from fused_logp_jobs.tiny_model import HIDDEN, VOCAB, lm_head_weight, make_tiny_qwen3  # noqa: F401  (vLLM pads 1000 -> 1024)
from fused_logp_jobs.tiny_model import VLLM_ENGINE_KW as ENGINE_KW


_SHARED: dict = {}


def shared_tiny_model() -> Path:
    """The default tiny Qwen3 (make_tiny_qwen3 defaults), made once per test process."""
    import atexit
    import shutil
    import tempfile

    if "model" not in _SHARED:
        d = tempfile.mkdtemp(prefix="fused_logp_qwen3_")
        atexit.register(shutil.rmtree, d, ignore_errors=True)
        _SHARED["model"] = make_tiny_qwen3(Path(d) / "model")
    return _SHARED["model"]


def shared_llm(model_dir, plugin_cfg, logprobs_mode: str | None = None):
    """One in-process vLLM engine per (model, plugin configuration) for the whole test process: the test modules
    that ask for the same one share its start-up. A request for another one shuts the previous one down first
    (one in-process engine at a time). Every caller leaves the engine's weights as it found them."""
    import atexit
    import copy
    import json

    from vllm import LLM

    key = (str(model_dir), json.dumps(plugin_cfg, sort_keys=True), logprobs_mode)
    if _SHARED.get("llm_key") == key:
        engine = _SHARED["llm"]
        engine.collective_rpc("fused_logp_captured")
        return engine
    _shutdown_shared()
    saved = {k: os.environ.get(k) for k in ("VLLM_ENABLE_V1_MULTIPROCESSING", "FUSED_LOGP_VLLM")}
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ.pop("FUSED_LOGP_VLLM", None)
    try:
        kw = dict(ENGINE_KW, **({"logprobs_mode": logprobs_mode} if logprobs_mode else {}))
        engine = LLM(model=str(model_dir), **kw, additional_config=copy.deepcopy(plugin_cfg))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    engine.collective_rpc("fused_logp_captured")
    if not _SHARED.get("atexit"):
        atexit.register(_shutdown_shared)
        _SHARED["atexit"] = True
    _SHARED["llm"], _SHARED["llm_key"] = engine, key
    return engine


def _shutdown_shared():
    engine = _SHARED.pop("llm", None)
    _SHARED.pop("llm_key", None)
    if engine is not None:
        engine.llm_engine.engine_core.shutdown()


def captured_floats(values: list) -> list[float]:
    """A captured row's logprobs as floats (the RPC sends -inf / inf / nan as strings)."""
    return [float(v) for v in values]


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


def _offline_batch(model_dir: str, extra: dict, kw: dict) -> dict:
    """A fixed batch through one in-process engine (plugin configuration `extra`, SamplingParams keywords `kw`):
    its outputs, the class of the model's logits processor and the plugin's status. The engine is shut down
    before returning."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, **ENGINE_KW, **({"additional_config": extra} if extra else {}))
    prompts = [[11, 12, 13, 14], [3, 900, 41], [7, 8]]
    kw = dict(kw)
    if "logit_bias" in kw:                 # JSON keys are strings; vLLM's are token ids
        kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
    params = [SamplingParams(temperature=t, max_tokens=4, logprobs=2, prompt_logprobs=1, seed=7 + i, **kw)
              for i, t in enumerate([1.0, 0.7, 0.0])]
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
    llm.llm_engine.engine_core.shutdown()
    return result


def _offline(model_dir: str, runs: str) -> None:
    """Run the fixed batch once per [plugin configuration, SamplingParams keywords] of the JSON list `runs`, one
    engine after another in this process (the first one in a fresh process), and print the results as one JSON
    line (a list, in the same order): the plugin-off comparison and the non-strict runs."""
    import json

    print(json.dumps([_offline_batch(model_dir, extra, kw) for extra, kw in json.loads(runs)]))


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
