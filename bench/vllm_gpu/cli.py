"""The entry point's command line (bench/vllm_gpu.py PART [options]) and `all` (run_all): the model, the trainer-side
scoring, the check parts and the speed parts, each part a child process, into OUTDIR/vllm-gpu.json."""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from .checks import CONCURRENT, run_check, run_logprobs_mode, run_modes, run_mpstart
from .common import DRY, HIDDEN, LAYERS, VOCAB, _child, _run_header, _wait, _write, make_model, make_small_model
from .speed import (_pool_kinds, _pool_speed, _speed_part, run_score, run_speed, run_speed_ab, run_speed_paired,
                    serve_speed)


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
                print(k, {x: r[k].get(x) for x in ("modes", f"concurrent{CONCURRENT}", f"alone{CONCURRENT}", "reload",
                                                   "fingerprint_equal", "error", "start_s")})
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
