"""Forward timing of the SM90 linear_logp kernel against its peers at the Qwen3-8B lm_head shape.

    python bench/benchmark_linear_logp.py [--n 1,16,256,2048,8192,16384] [--vocab 151936,76032] [--temperature 1,0.7] [--out DIR]

Columns: cuBLAS bf16 GEMM alone (bf16 out, and FP32 out), cuBLAS FP32-out GEMM + FP32 log_softmax + gather,
ours with return_logits off and on (SM90Backend called directly, no op-layer checks). Median of
triton.testing.do_bench (CUDA events) after warm-up, two rotating hidden-state sets (the 1.24 GB weight is
far larger than the L2). Peak extra memory = max_memory_allocated during one call minus the inputs.
The H200 runs these at its power limit and its clock falls during a sustained load, so at small N a call timed right
after an idle moment runs faster than the same call timed after others: the GEMM, ours and ours with the logits are
also timed in the same interleaved rounds (7 rounds, the order reversed every other one, ~20 ms of calls each),
and the "interleaved" ratios come from those.
Liger and Apple CCE (forward only, under torch.no_grad, reduction="none": the per-token loss, i.e. -logp) are
measured the same way when their packages import (`make peer-wheels`, then `make bench-gpu`); when absent or when
they fail, the reason is recorded in the JSON as a string and nothing is substituted. QuACK (`make peer-parts`; forward
only, under torch.no_grad) is measured the same way; its fused linear cross-entropy offers reduction "sum" or "mean"
only, so its column is the sum over tokens of the per-token loss (bench/peers.py records the call and QuACK's path),
checked against the sum of ours.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/peers.py (scripts run with -P)
import peers as peer_lib  # noqa: E402
from interleave import interleaved_rounds  # noqa: E402
import energy  # noqa: E402


def _do_bench(fn, rep_ms):
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=max(25, rep_ms // 4), rep=rep_ms, return_mode="median"))


def _interleaved(fns, est_ms, rounds=7, block_ms=20.0):
    """Median ms a call of each of fns (name -> callable), all timed in the same rounds (bench/interleave.py), each
    block ~block_ms of calls (est_ms: a call's rough time)."""
    iters = max(3, int(block_ms / max(est_ms, 1e-3)))
    return {k: statistics.median(v) for k, v in interleaved_rounds(fns, rounds, iters).items()}


def _peak_extra(fn):
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


SMOKE_SHAPE = (70, 208, 1088, 1000)   # N, D, weight rows, V of --smoke


def smoke(launches=None, shape=SMOKE_SHAPE, bias=True):
    """Every entry and launch configuration (or those named) once on a small ragged shape (N, D, weight rows, V:
    by default N=70, D=208, V=1000 of 1088 rows); with or without a bias (without one, tiles whose rows and columns
    are all real store their logits on the unchecked path). A configuration that takes D and V in multiples of 64
    only runs on D and V rounded down to them, beside "auto" on the same inputs."""
    from fused_logp.kernel import sm90

    be = sm90.SM90Backend()
    be.allow_candidates = True
    ok, why = be.available()
    if not ok:
        sys.exit(f"sm90 backend unavailable: {why}")
    g = torch.Generator(device="cuda").manual_seed(7)
    n, d, rows, v = shape
    h = torch.randn(n, d, generator=g, device="cuda").to(torch.bfloat16)
    w = (torch.randn(rows, d, generator=g, device="cuda") * 0.1).to(torch.bfloat16)
    b = torch.randn(rows, generator=g, device="cuda") if bias else None
    tg = torch.randint(0, v, (n,), generator=g, device="cuda")
    t = torch.rand(n, generator=g, device="cuda") + 0.5
    ref = None
    names = list(sm90.LAUNCHES) if launches is None else launches
    for var in ("auto", *names):
        if var in sm90._MULTIPLE_OF_64 and (d % 64 or v % 64):
            d64, v64 = d - d % 64, v - v % 64
            h64, w64 = h[:, :d64].contiguous(), w[:, :d64].contiguous()
            tg64 = tg % v64
            be.launch = "auto"
            want = be.linear_logp(h64, w64, tg64, bias=b, temperature=t, return_logits=True, vocab_size=v64)
            be.launch = var
            out = be.linear_logp(h64, w64, tg64, bias=b, temperature=t, return_logits=True, vocab_size=v64)
            assert torch.equal(out[0].view(torch.int32), want[0].view(torch.int32)), (var, d64, v64)
            assert torch.equal(out[2].view(torch.int32), want[2].view(torch.int32)), (var, d64, v64)
            continue
        be.launch = var
        out = be.linear_logp(h, w, tg, bias=b, temperature=t, return_logits=True, vocab_size=v)
        if ref is None:
            ref = out
        assert torch.equal(out[0].view(torch.int32), ref[0].view(torch.int32)), var
    be.launch = "auto"
    st = be.shard_stats(h, w[512:].contiguous(), tg, vocab_start=512, vocab_size=v,
                        bias=None if b is None else b[512:].contiguous(), temperature=t, return_logits=True)
    be.stats_from_logits(ref[2], tg, temperature=t, vocab_size=v)
    torch.cuda.synchronize()
    print("smoke ok:", 1 + len(names), "launch configurations,", (n, d, rows, v), tuple(st["tile_max"].shape),
          "bias" if bias else "no bias")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", default="1,16,256,2048,8192,16384")
    ap.add_argument("--vocab", default="151936,76032")
    ap.add_argument("--d", type=int, default=4096)
    ap.add_argument("--rep", type=int, default=300, help="do_bench rep (ms)")
    ap.add_argument("--temperature", default="1,0.7",
                    help="the temperatures, each a pass over every shape with every column (one JSON a temperature): "
                         "every row's temperature for ours and cuBLAS + log_softmax (the peers run at 1: their APIs "
                         "take none)")
    ap.add_argument("--launch", default="auto", help="launch configuration of the 'ours' columns (sm90.LAUNCHES)")
    ap.add_argument("--sweep", default="",
                    help="extra launch configurations to time, also in the interleaved rounds, e.g. "
                         "cta-128x256,cta-128x256+mainloop (+mainloop: the timing hook, mainloop without statistics)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200")
    ap.add_argument("--energy", type=float, default=0.6,
                    help="seconds of back-to-back calls for the energy per call (NVML counter); 0: not measured")
    ap.add_argument("--smoke", action="store_true",
                    help="one small call per launch configuration and entry, then exit (for compute-sanitizer / ncu)")
    ap.add_argument("--smoke-launches", default="", help="with --smoke: only these configurations (and auto)")
    ap.add_argument("--smoke-shape", default=",".join(map(str, SMOKE_SHAPE)),
                    help="with --smoke: N,D,weight rows,V (e.g. 300,320,12160,12000: more 128x256 tiles than SMs, so "
                         "the CTAs run in more than one wave)")
    ap.add_argument("--smoke-no-bias", action="store_true", help="with --smoke: no bias")
    args = ap.parse_args()
    if args.smoke:
        return smoke([x for x in args.smoke_launches.split(",") if x] or None,
                     tuple(int(x) for x in args.smoke_shape.split(",")), bias=not args.smoke_no_bias)

    from fused_logp.kernel.sm90 import SM90Backend

    be = SM90Backend()
    ok, why = be.available()
    if not ok:
        sys.exit(f"sm90 backend unavailable: {why}")
    be.launch = args.launch
    dev = torch.device("cuda")
    peers = peer_lib.load("none", no_grad=True, names=[name for name, _ in peer_lib.PEERS])
    for temperature in [float(x) for x in args.temperature.split(",")]:
        _run(args, temperature, be, peers, dev)


def _run(args, temperature, be, peers, dev):
    """One pass over every shape at one temperature: the columns, the tables, the JSON."""
    g = torch.Generator(device=dev).manual_seed(1234)
    d = args.d
    rows = []
    for v in [int(x) for x in args.vocab.split(",")]:
        w = (torch.randn(v, d, generator=g, device=dev) * 0.02).to(torch.bfloat16)
        for n in [int(x) for x in args.n.split(",")]:
            hs = [(torch.randn(n, d, generator=g, device=dev)).to(torch.bfloat16) for _ in range(2)]
            tg = torch.randint(0, v, (n,), generator=g, device=dev)
            temp = torch.full((n,), temperature, device=dev)
            ones = torch.ones(n, device=dev)
            it = [0]

            def nxt():
                it[0] ^= 1
                return hs[it[0]]

            def gemm_bf16():
                return torch.mm(nxt(), w.t())

            def gemm_f32():
                return torch.mm(nxt(), w.t(), out_dtype=torch.float32)

            def ref_logsoftmax():
                z = torch.mm(nxt(), w.t(), out_dtype=torch.float32)
                return torch.log_softmax(z / temp[:, None], dim=-1).gather(1, tg[:, None])

            def ours():
                return be.linear_logp(nxt(), w, tg, bias=None, temperature=temp, return_logits=False, vocab_size=v)

            def ours_logits():
                return be.linear_logp(nxt(), w, tg, bias=None, temperature=temp, return_logits=True, vocab_size=v)

            extra = []
            for var in [x for x in args.sweep.split(",") if x]:
                def ours_var(var=var):
                    be.launch, be.mainloop_only = var.split("+")[0], var.endswith("+mainloop")
                    try:
                        return be.linear_logp(nxt(), w, tg, bias=None, temperature=temp, return_logits=False,
                                              vocab_size=v)
                    finally:
                        be.launch, be.mainloop_only = args.launch, False
                extra.append((f"ours_{var}", ours_var))
            rep = args.rep
            row = {"N": n, "D": d, "V": v}
            flops = 2.0 * n * d * v
            for name, fn in (("gemm_bf16", gemm_bf16), ("gemm_f32out", gemm_f32), ("cublas_logsoftmax", ref_logsoftmax),
                             ("ours", ours), ("ours_logits", ours_logits), *extra):
                try:
                    ms = _do_bench(fn, rep)
                    mem = _peak_extra(fn)
                except torch.OutOfMemoryError:
                    ms, mem = float("nan"), float("nan")
                row[name + "_ms"] = ms
                row[name + "_tflops"] = flops / ms / 1e9
                row[name + "_peak_extra_mib"] = mem / 2**20
                if args.energy and name in ("gemm_bf16", "cublas_logsoftmax", "ours", "ours_logits") and ms == ms:
                    row[name + "_joules"] = energy.joules_per_call(fn, args.energy)
                torch.cuda.empty_cache()
            for name, (pfn, pinfo) in peers.items():
                row[name + "_error"] = None if pfn is not None else pinfo["status"]
                row[name + "_ms"] = row[name + "_tflops"] = row[name + "_peak_extra_mib"] = None
                if pfn is None:
                    continue

                def peer(pfn=pfn):
                    return pfn(nxt(), w, tg)
                try:
                    h0 = nxt()
                    # the peers compute at temperature 1: their check is against ours at 1 too
                    ref = be.linear_logp(h0, w, tg, bias=None, temperature=ones, return_logits=False, vocab_size=v)[0]
                    got = pfn(h0, w, tg)
                    if pinfo.get("output") == "sum":  # their sum of -logp against the sum of our logp
                        s = ref.double().sum()
                        row[name + "_sum_abs_diff_vs_ours"] = float((got.double() + s).abs())
                        row[name + "_sum_rel_diff_vs_ours"] = float((got.double() + s).abs() / s.abs())
                        diff = None
                    else:
                        diff = got.float().reshape(-1) + ref.float().reshape(-1)  # their -logp against our logp
                        row[name + "_max_abs_diff_vs_ours"] = float(diff.abs().max())
                    del ref, got, diff
                    ms = _do_bench(peer, rep)
                    mem = _peak_extra(peer)
                    row[name + "_ms"] = ms
                    row[name + "_tflops"] = flops / ms / 1e9
                    row[name + "_peak_extra_mib"] = mem / 2**20
                    if args.energy:
                        row[name + "_joules"] = energy.joules_per_call(peer, args.energy)
                except Exception as e:  # noqa: BLE001 - the peer's failure is recorded, the run goes on
                    row[name + "_error"] = peer_lib.err(e)
                torch.cuda.empty_cache()
            if all(row[k] == row[k] for k in ("gemm_bf16_ms", "ours_ms", "ours_logits_ms")):   # no OOM (NaN)
                # the --sweep configurations join the same rounds (their ratio to the GEMM beside ours')
                il = _interleaved({"gemm_bf16": gemm_bf16, "ours": ours, "ours_logits": ours_logits, **dict(extra)},
                                  row["gemm_bf16_ms"])
                torch.cuda.empty_cache()
            else:
                il = {k: float("nan") for k in ("gemm_bf16", "ours", "ours_logits", *(name for name, _ in extra))}
            for k, ms in il.items():
                row[k + "_interleaved_ms"] = ms
            for name, _ in extra:
                row[f"ratio_{name}_vs_gemm_interleaved"] = il[name] / il["gemm_bf16"]
            row["ratio_ours_vs_gemm_interleaved"] = il["ours"] / il["gemm_bf16"]
            row["ratio_ours_logits_vs_ours_interleaved"] = il["ours_logits"] / il["ours"]
            row["ratio_ours_vs_gemm"] = row["ours_ms"] / row["gemm_bf16_ms"]
            row["ratio_ours_logits_vs_gemm"] = row["ours_logits_ms"] / row["gemm_bf16_ms"]
            row["ratio_ours_vs_logsoftmax"] = row["ours_ms"] / row["cublas_logsoftmax_ms"]
            row["ratio_ours_logits_vs_ours"] = row["ours_logits_ms"] / row["ours_ms"]
            rows.append(row)
            sweep = " ".join(f"{k[5:-3]}={row[k]:.3f}" for k in row
                             if k.startswith("ours_") and k.endswith("_ms") and "interleaved" not in k
                             and k not in ("ours_ms", "ours_logits_ms"))
            print(f"  V={v} N={n}: gemm {row['gemm_bf16_ms']:.3f} ms, ours {row['ours_ms']:.3f} ms "
                  f"({row['ratio_ours_vs_gemm']:.3f}x; interleaved {row['ratio_ours_vs_gemm_interleaved']:.3f}x) "
                  f"{sweep}" + "".join(f" {name[5:]} interleaved {row[f'ratio_{name}_vs_gemm_interleaved']:.3f}x"
                                       for name, _ in extra), flush=True)
            del hs, tg, temp, ones
        del w
        torch.cuda.empty_cache()

    info = {
        "gpu": torch.cuda.get_device_name(),
        "date": datetime.date.today().isoformat(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "backend": be.describe(),
        "timing": "triton.testing.do_bench median (CUDA events), 2 rotating hidden sets, no bias; *_interleaved: "
                  "GEMM, ours and ours with logits in the same 7 rounds (bench/benchmark_linear_logp.py _interleaved)",
        "temperature": temperature,
        "energy": "joules per call from NVML's total-energy counter over back-to-back calls (bench/energy.py)",
        "power_limit_w": energy.power_limit_w(),
        "peers_temperature": 1.0,
        "peers_not_installed": peer_lib.not_installed(peers),
        "peers": {name: pinfo for name, (_, pinfo) in peers.items()},
        "rows": rows,
    }
    hdr = (f"{'V':>7} {'N':>6} | {'GEMM bf16':>9} {'GEMM f32':>9} {'cuBLAS+LS':>9} | {'ours':>8} {'x GEMM':>6} "
           f"{'TFLOP/s':>7} {'+logits':>8} {'x GEMM':>6} {'x ours':>6} | {'mem ours':>9} {'mem LS':>9}")
    print()
    print(f"{info['gpu']}, torch {info['torch']}, CUDA {info['cuda']}, {info['date']}; median ms; temperature "
          f"{temperature:g} (the peers: 1)")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        print(f"{r['V']:>7} {r['N']:>6} | {r['gemm_bf16_ms']:>9.3f} {r['gemm_f32out_ms']:>9.3f} "
              f"{r['cublas_logsoftmax_ms']:>9.3f} | {r['ours_ms']:>8.3f} {r['ratio_ours_vs_gemm']:>6.3f} "
              f"{r['ours_tflops']:>7.1f} {r['ours_logits_ms']:>8.3f} {r['ratio_ours_logits_vs_gemm']:>6.3f} "
              f"{r['ratio_ours_logits_vs_ours']:>6.3f} | "
              f"{r['ours_peak_extra_mib']:>7.1f}Mi {r['cublas_logsoftmax_peak_extra_mib']:>7.1f}Mi")
    print()
    print("the same three timed in the same interleaved rounds (median ms a call; the ratios to trust at small N)")
    print(f"{'V':>7} {'N':>6} | {'GEMM bf16':>9} {'ours':>8} {'+logits':>8} | {'ours/GEMM':>9} {'+logits/ours':>12}")
    for r in rows:
        print(f"{r['V']:>7} {r['N']:>6} | {r['gemm_bf16_interleaved_ms']:>9.3f} {r['ours_interleaved_ms']:>8.3f} "
              f"{r['ours_logits_interleaved_ms']:>8.3f} | {r['ratio_ours_vs_gemm_interleaved']:>9.3f} "
              f"{r['ratio_ours_logits_vs_ours_interleaved']:>12.3f}")
    for k in info["peers_not_installed"]:
        print(f"{k}: {peers[k][1]['status']}")
    if any(pfn is not None for pfn, _ in peers.values()):
        def cell(x, width):
            return f"{x:>{width}.3f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"
        print()
        print("peers, forward only (no_grad; per-token loss, QuACK: its sum over tokens); median ms and peak extra MiB")
        def ratio(r, k):
            return r[k] / r["gemm_bf16_ms"] if isinstance(r[k], (int, float)) else None
        label = {"liger": "Liger", "cce": "CCE", "quack": "QuACK"}
        names = list(peers)
        print(f"{'V':>7} {'N':>6} | {'ours':>8} " + " ".join(f"{label.get(p, p):>8}" for p in names)
              + f" | {'ours/GEMM':>10} " + " ".join(f"{label.get(p, p) + '/GEMM':>10}" for p in names)
              + " | " + " ".join(f"{'mem ' + label.get(p, p):>10}" for p in names))
        for r in rows:
            print(f"{r['V']:>7} {r['N']:>6} | {r['ours_ms']:>8.3f} " + " ".join(cell(r[p + '_ms'], 8) for p in names)
                  + f" | {cell(ratio(r, 'ours_ms'), 10)} " + " ".join(cell(ratio(r, p + '_ms'), 10) for p in names)
                  + " | " + " ".join(cell(r[p + '_peak_extra_mib'], 10) for p in names))
        for name in peers:
            for r in rows:
                if r[name + "_error"] is not None:
                    print(f"{name} V={r['V']} N={r['N']}: {r[name + '_error']}")
                else:
                    checks = {k[len(name) + 1:]: r[k] for k in r if k.startswith(name + "_")
                              and ("diff_vs_ours" in k)}
                    print(f"{name} V={r['V']} N={r['N']}: {checks}")
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"bench-{args.tag}-T{temperature:.1f}-{info['date']}.json")
    with open(path, "w") as f:
        json.dump(info, f, indent=1)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
