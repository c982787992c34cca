"""The harness's commands (demo, agreement, rl, ladder), reached through `fused-logp`: `fused-logp demo` runs the op on an embedded configuration and prints what it proved."""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from fused_logp import (CONTRACT_VERSION, linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats,
                        weight_fingerprint)
from fused_logp.shared_contract.config import load_config, set_config

# The embedded default: a small lm_head shaped like a tiny Qwen3 head, random bf16 weights from a fixed seed.
DEFAULT = {"rows": 12, "hidden": 256, "vocab": 4000, "padded_vocab": 4096, "seed": 20261130, "temperature": 0.7}


def _inputs(cfg):
    g = torch.Generator().manual_seed(cfg["seed"])
    h = torch.randn(cfg["rows"], cfg["hidden"], generator=g).bfloat16()
    w = (torch.randn(cfg["padded_vocab"], cfg["hidden"], generator=g) * 0.05).bfloat16()
    w[cfg["vocab"]:] = 0                                  # padding rows, as engines pad the vocabulary
    t = torch.randint(0, cfg["vocab"], (cfg["rows"],), generator=g)
    t[0], t[1] = 0, cfg["vocab"] - 1                      # first and last real columns
    return h, w, t


def _same(a, b) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def demo(args) -> int:
    cfg = dict(DEFAULT)
    h, w, t = _inputs(cfg)
    v, temp = cfg["vocab"], cfg["temperature"]
    print(f"contract: {CONTRACT_VERSION}")
    print(f"embedded default: N={cfg['rows']} D={cfg['hidden']} V={v} (weight padded to {cfg['padded_vocab']} rows), T={temp}")
    t0 = time.perf_counter()
    ref = linear_logp(h, w, t, temperature=temp, vocab_size=v, return_logits=True)
    print(f"backend: {ref.provenance.backend} ({time.perf_counter() - t0:.2f} s)")
    checks = []

    def check(name, ok):
        checks.append((name, bool(ok)))
        print(f"  [{'PASS' if ok else 'FAIL'}] {name}")

    print("checks:")
    again = [linear_logp(h, w, t, temperature=temp, vocab_size=v) for _ in range(3)]
    check("L1 repeated calls: identical logp/lse bytes (3 calls)",
          all(_same(r.logp, ref.logp) and _same(r.lse, ref.lse) for r in again))
    ok = True
    for i in (0, 5, cfg["rows"] - 1):
        alone = linear_logp(h[i:i + 1], w, t[i:i + 1], temperature=temp, vocab_size=v)
        ok &= _same(alone.logp, ref.logp[i:i + 1]) and _same(alone.lse, ref.lse[i:i + 1])
    perm = torch.randperm(cfg["rows"], generator=torch.Generator().manual_seed(1))
    shuffled = linear_logp(h[perm], w, t[perm], temperature=temp, vocab_size=v)
    ok &= _same(shuffled.logp, ref.logp[perm]) and _same(shuffled.lse, ref.lse[perm])
    check("L2 batch invariance: rows alone and permuted give the same bytes", ok)
    off = linear_logp(h, w, t, temperature=temp, vocab_size=v, return_logits=False)
    check("dual entry: return_logits on/off give the same logp/lse bytes",
          _same(off.logp, ref.logp) and _same(off.lse, ref.lse))
    for ranks in (2, 4):
        per = cfg["padded_vocab"] // ranks
        stats = [shard_tile_stats(h, w[r * per:(r + 1) * per], t, vocab_start=r * per, vocab_size=v, temperature=temp)
                 for r in range(ranks)]
        m = merge_shard_stats(stats, vocab_size=v)
        check(f"TP={ranks} (emulated, padded shards): same bytes as TP=1", _same(m.logp, ref.logp) and _same(m.lse, ref.lse))
    unpadded = linear_logp(h, w[:v].clone(), t, temperature=temp)
    check("padding invariance: padded and unpadded weights give the same bytes",
          _same(unpadded.logp, ref.logp) and _same(unpadded.lse, ref.lse))
    fl = logp_from_logits(ref.logits, t, temperature=temp)
    check("stats-from-logits on the returned FP32 row: same bytes as the fused path",
          _same(fl.logp, ref.logp) and _same(fl.lse, ref.lse))
    fp_full = weight_fingerprint(w, vocab_size=v)
    fp_shards = weight_fingerprint(w[:v].clone())
    check("weight fingerprint: padded and unpadded heads agree", fp_full == fp_shards)
    print(f"weight fingerprint: {fp_full}")
    print("logp[:4]:", [f"{x:.6f}" for x in ref.logp[:4].tolist()])
    print("provenance:", json.dumps(ref.provenance.to_dict(), indent=2, sort_keys=True))
    failed = [n for n, ok in checks if not ok]
    print(f"op checks: {len(checks) - len(failed)} passed, {len(failed)} failed")
    if args.op_only:
        return 1 if failed else 0
    print()
    print("main job: vLLM rollout -> Megatron trainer on a tiny random Qwen3 (three processes)")
    code = agreement(args)
    return 1 if failed else code


def agreement(args) -> int:
    from .agreement import run
    res = run(args.out, strict=args.strict)
    if not res["ok"]:
        print("FAIL: the contract's logp half disagrees or the weight fingerprints differ")
        return 1 if args.strict else 0
    return 0


def rl(args) -> int:
    from .rl_loop import run_loop
    res = run_loop(args.out, steps=args.steps, strict=args.strict, stale_at=args.stale_at)
    print(f"{'step':>4} {'version':>7} {'fp equal':>8} {'reward':>7} {'contract half':>14} {'ordinary half':>14} "
          f"{'contract e2e max|d|':>20} {'ordinary e2e max|d|':>20}")
    for r in res["steps"]:
        if "contract_half" not in r:
            continue
        print(f"{r['step']:4d} {r['trainer_version']:7d} {str(r['fingerprints_equal']):>8} {r['reward']:7.3f} "
              f"{r['contract_half']['mismatches']:>6d} / {r['contract_half']['max_abs_delta']:<5.2g} "
              f"{r['ordinary_half']['mismatches']:>6d} / {r['ordinary_half']['max_abs_delta']:<5.2g} "
              f"{r['contract_end_to_end']['max_abs_delta']:20.3g} {r['ordinary_end_to_end']['max_abs_delta']:20.3g}")
    print(f"report: {args.out}/rl.json, {args.out}/rl_steps.png")
    if res["stopped"]:
        print(f"STOPPED: {res['stopped']}")
        return 1
    return 0


def ladder(args) -> int:
    from .ladder import run_ladder
    rep = run_ladder(args.out)
    for c in rep["checks"]:
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['backend']:11s} {c['level']:6s} {c['check']}")
    print(f"report: {args.out}/ladder.md, {args.out}/ladder.json")
    failed = sum(not c["passed"] for c in rep["checks"])
    print(f"{len(rep['checks']) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _positive(name):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
        if v < 1:
            raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
        return v
    parse.__name__ = name
    return parse


def _parser():
    from fused_logp.cli import Parser
    p = Parser(prog="fused-logp", description=__doc__)
    p.add_argument("--config", help="YAML configuration (strict: true|false, backend: ...)")
    sub = p.add_subparsers(dest="cmd", parser_class=Parser)
    d = sub.add_parser("demo", help="op checks on the embedded default, then the rollout -> trainer agreement job")
    d.add_argument("--op-only", action="store_true", help="only the op's own checks")
    ag = sub.add_parser("agreement", help="the rollout -> trainer agreement job alone")
    for sp in (d, ag):
        sp.add_argument("--out", default="out/agreement", help="folder for the report, plots and step logs")
        sp.add_argument("--no-strict", dest="strict", action="store_false",
                        help="do not fail on a mismatch (default: strict, non-zero exit on any mismatch)")
    rlp = sub.add_parser("rl", help="a short on-policy RL loop (vLLM rollout, Megatron step, weight sync), strict")
    rlp.add_argument("--steps", type=_positive("steps"), default=5, help="iterations, >= 1 (default 5)")
    rlp.add_argument("--out", default="out/rl")
    rlp.add_argument("--no-strict", dest="strict", action="store_false")
    rlp.add_argument("--stale-at", type=_positive("stale-at"), default=None,
                     help="skip the weight push before this step, 1 <= k < --steps (a test)")
    lad = sub.add_parser("ladder", help="run L1-L3 and the golden fingerprints on every backend here; write a report")
    lad.add_argument("--out", default="out/ladder", help="folder for ladder.md and ladder.json")
    return p


def _main(argv) -> int:
    from fused_logp.atomic_io import check_output_dir
    from fused_logp.cli import CliError
    argv = list(argv)
    p = _parser()
    args = p.parse_args(argv)
    if args.cmd is None:
        args = p.parse_args(["demo"] + argv)
    if args.config:
        set_config(load_config(args.config))
    check_output_dir(args.out, "--out")
    if args.cmd == "rl" and args.stale_at is not None and args.stale_at >= args.steps:
        raise CliError(f"argument --stale-at: expected 1 <= k < --steps ({args.steps}), got {args.stale_at}")
    return {"demo": demo, "agreement": agreement, "rl": rl, "ladder": ladder}[args.cmd](args)


def main(argv=None, _wrapped: bool = False) -> int:
    """The harness's commands; exit codes and messages as `fused-logp` (fused_logp/cli.py, docs/cli.md)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if _wrapped:                     # inside fused_logp.cli.main, which maps failures to exit codes
        return _main(argv)
    from fused_logp.cli import main as top
    return top(argv)


if __name__ == "__main__":
    sys.exit(main())
