"""Host time per call of the serving entries against the torch operations they stand in for (one CUDA device).

A decode step of vLLM is bound by host work, so what the plugin adds per step is its host time, not its kernels'.
Each entry is called K times back to back without synchronising; the time to issue the K calls, divided by K, is
its host time (the device queue holds them: K is far below its depth). Median of R rounds, microseconds.

    python bench/serving_host_overhead.py --out OUT [--rows 1,64,256] [--k 200] [--rounds 7]

Rows: torch's F.linear (vLLM's bf16 head), the op's logits_and_stats and its layers down to the bare extension
call (the fused kernel with preallocated outputs); torch's log_softmax + gather and the op's logp_of_ids and its layers; the plugin's
contract_columns (what vLLM's compute_token_logprobs call becomes); and the pieces of the op's checks.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


def host_us(fn, k: int, rounds: int, sync) -> dict:
    for _ in range(10):
        fn()
    sync()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(k):
            fn()
        t1 = time.perf_counter()
        sync()
        per.append((t1 - t0) / k * 1e6)
    return {"median_us": round(statistics.median(per), 2), "min_us": round(min(per), 2)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,64,256")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--k", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    from fused_logp.kernel import op
    from fused_logp.kernel.sm90 import SM90Backend
    from fused_logp.vllm_plugin.scoring import contract_columns
    from fused_logp.vllm_plugin.settings import PluginSettings
    from fused_logp.vllm_plugin.state import HeadState, Mark

    dev = torch.device("cuda", torch.cuda.current_device())
    sync = torch.cuda.synchronize
    v, d = args.vocab, args.hidden
    g = torch.Generator(device=dev).manual_seed(1)
    w = (torch.randn(v, d, device=dev, generator=g) * 0.02).to(torch.bfloat16)
    be = SM90Backend()
    ok, why = be.available(dev)
    if not ok:
        raise SystemExit(f"sm90 backend unavailable: {why}")
    ext = be._module()
    state = HeadState(PluginSettings(strict=True, backend="auto", capture=False, source="bench"))
    results = {}
    with torch.inference_mode():                                   # as vLLM serves
        for n in [int(x) for x in args.rows.split(",")]:
            h = torch.randn(n, d, device=dev, generator=g).to(torch.bfloat16)
            ids = torch.randint(0, v, (n, 1), device=dev, generator=g, dtype=torch.int64)
            stats = op.logits_and_stats(h, w, vocab_size=v)
            z = stats.logits
            zeros = op._constant_row_values("targets", n, dev)
            ones = op._constant_row_values("temperature", n, dev)
            nt = -(-v // 64)
            tm, ts = torch.empty(n, nt, device=dev), torch.empty(n, nt, device=dev)
            lg, sc = torch.empty(n, v, device=dev), torch.empty(n, device=dev)
            errs = op._row_errors(dev, True)
            mark = Mark(state, None, stats)
            lid = be._launch_name(n, d, v)
            r = {
                "head: F.linear bf16 (vLLM)": lambda: torch.nn.functional.linear(h, w),
                "head: F.linear + .float()": lambda: torch.nn.functional.linear(h, w).float(),
                "head: op.logits_and_stats": lambda: op.logits_and_stats(h, w, vocab_size=v),
                "head: SM90Backend.logits_and_stats": lambda: be.logits_and_stats(
                    h, w, zeros=zeros, ones=ones, vocab_size=v, bias=None),
                "head: ext.fused_stats, outputs preallocated": lambda: ext.fused_stats(
                    h, w, zeros, ones, None, 0, v, tm, ts, sc, lg, lid, 0),
                "head: ext.logits_and_stats (outputs by the extension)": lambda: ext.logits_and_stats(
                    h, w, zeros, ones, None, v, lid, None),
                "columns: log_softmax + gather (torch)": lambda: z.log_softmax(-1).gather(1, ids),
                "columns: plugin contract_columns": lambda: contract_columns(z, ids, None, mark,
                                                                             unit_temperature=True),
                "columns: op.logp_of_ids": lambda: op.logp_of_ids(stats, ids, vocab_size=v),
                "columns: SM90Backend.merge_ids": lambda: be.merge_ids(
                    stats.tile_max, stats.tile_sum, z, ids, vocab_size=v, bad_rows=errs.ids, mirror=errs.ids_mirror),
                "columns: ext.merge_ids (outputs by the extension)": lambda: ext.merge_ids(
                    stats.tile_max, stats.tile_sum, z, ids, v, errs.ids, errs.ids_mirror, None),
                "piece: torch.empty [n] fp32": lambda: torch.empty(n, dtype=torch.float32, device=dev),
                "piece: _check_hidden_weight": lambda: op._check_hidden_weight(h, w),
                "piece: _resolve": lambda: op._resolve(None, None, dev),
                "piece: _row_errors": lambda: op._row_errors(dev, None),
                "piece: _check_target_form": lambda: op._check_target_form(ids, n, dev, columns=True),
                "piece: _constant_row_values": lambda: op._constant_row_values("targets", n, dev),
                "piece: ShardStats(...)": lambda: op.ShardStats(tm, ts, sc, zeros, 0, lg, stats.provenance, True),
                "piece: Mark(...) + setattr": lambda: setattr(z, "_fused_logp", Mark(state, None, stats)),
            }
            results[n] = {name: host_us(fn, args.k, args.rounds, sync) for name, fn in r.items()}
            for name, x in results[n].items():
                print(f"N={n:4d}  {name:48s} {x['median_us']:8.2f} us  (min {x['min_us']:.2f})", flush=True)
    doc = {"what": "host time per call (us), median of rounds of K back-to-back calls without synchronising",
           "k": args.k, "rounds": args.rounds, "vocab": v, "hidden": d, "device": torch.cuda.get_device_name(dev),
           "torch": torch.__version__, "python": platform.python_version(), "results": results}
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "serving-host-overhead.json"), "w") as f:
            json.dump(doc, f, indent=1)


if __name__ == "__main__":
    main()
