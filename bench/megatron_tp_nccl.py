"""Megatron plugin at TP=2 over NCCL (two GPUs, megatron-core 0.19.x, the SM90 backend): the TP=2 model's logp
and lse equal the TP=1 bytes at the Qwen3-8B lm_head shape (hidden 4096, vocabulary 151936 padded to 152064).

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 bench/megatron_tp_nccl.py [--out DIR]   (make test-megatron-gpu)

Each rank builds the same GPTModel as tests/megatron/test_megatron_model.py (one Qwen3-style layer, Megatron's local spec,
bf16) with tensor_model_parallel_size=2, the plugin on (`--logp-backend contract`, T=0.7, real vocabulary
151936), and checks, tied and untied:
  * the TP=2 plugin's logp/lse [b, s] (each rank's 76032-row lm_head shard, tile statistics all-gathered) equal
    the TP=1 op (`linear_logp`, backend sm90) on the captured final hidden states and the gathered real rows, and
    the TP=1 plugin (the same processor with an unsharded output layer), byte for byte; both ranks agree;
  * the final hidden states are identical on both ranks (the input both ranks feed the op);
  * the shard-invariant fingerprint equals the unsharded weight's on both ranks;
  * untied: the hidden-state gradient (reduced exactly once over TP) and each rank's lm_head shard gradient
    against FP32 torch (tests/megatron_shims.grad_close, tolerance 2^-6); padding rows get no gradient;
  * sequence parallelism at the output-processor level ([s/2, b, h] per rank): TP=1 bytes, gradient close.
Writes megatron-tp2-nccl.json to --out (default $OUT or .) and exits 1 when any check fails.

`--cpu` runs the same on CPU (gloo, the CPU oracle, small shapes): a dry run of this script's logic.
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

T = 0.7
GPU_SHAPES = dict(padded=152064, real=151936, hidden=4096, heads=32, groups=8, ffn=1024, b=2, s=64)
CPU_SHAPES = dict(padded=1024, real=1000, hidden=64, heads=4, groups=2, ffn=128, b=2, s=8)


def _beq(a, b) -> bool:
    a, b = a.detach().contiguous(), b.detach().contiguous()
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def _model_checks(name, tied, sh, dev, backend, res):
    import megatron_shims as ms
    from megatron.core import parallel_state

    import fused_logp
    from fused_logp import megatron_plugin as mp

    tp_group = parallel_state.get_tensor_model_parallel_group()
    padded, real, d, b, s = sh["padded"], sh["real"], sh["hidden"], sh["b"], sh["s"]
    wrapped, gpt = ms.build_qwen3_style_gpt(vocab_size=padded, hidden=d, heads=sh["heads"],
                                            query_groups=sh["groups"], ffn=sh["ffn"], seq=s, tied=tied,
                                            tp=dist.get_world_size(tp_group), seed=1234 if tied else 99, device=dev)
    ids, pos, labels = ms.token_batch(b, s, real, seed=3, device=dev)
    mask = torch.ones(b, s, device=dev)
    mask[0, :2] = 0
    mask[1, -1] = 0
    cap = ms.CaptureFinalHidden(gpt, retain_grad=not tied)
    t0 = time.perf_counter()
    with torch.set_grad_enabled(not tied):
        out = wrapped(ids, pos, None, labels=labels, loss_mask=mask)
    if dev == "cuda":
        torch.cuda.synchronize()
    res[f"{name}_forward_s"] = time.perf_counter() - t0
    cap.remove()
    prov = out.provenance
    res[f"{name}_provenance"] = {"backend": prov.backend, "contract_bearing": prov.contract_bearing,
                                 "fallback": prov.fallback, "contract_version": prov.contract_version}
    res[f"{name}_provenance_ok"] = (prov.backend == backend and prov.contract_bearing and prov.fallback is None)

    h = cap.value.detach()                                          # [s, b, d]
    res[f"{name}_hidden_same_on_ranks"] = all(_beq(x, h) for x in _all(h, tp_group))
    shard = ms.lm_head_weight(gpt)
    res[f"{name}_shard_rows"] = int(shard.shape[0])
    w_full = ms.gather_rows(shard.detach(), tp_group)               # [padded, d], rank order
    keep = mask.t().reshape(-1) != 0
    h2, targets = h.reshape(-1, d), labels.t().reshape(-1)
    ref = fused_logp.linear_logp(h2[keep], w_full[:real], targets[keep], temperature=T, backend=backend)
    res[f"{name}_logp_equal_tp1_op"] = _beq(out.logp.t().reshape(-1)[keep], ref.logp)
    res[f"{name}_lse_equal_tp1_op"] = _beq(out.lse.t().reshape(-1)[keep], ref.lse)
    head1 = copy.copy(gpt.output_layer)                             # the same output layer, unsharded (TP=1)
    head1.tp_group = None
    with torch.no_grad():
        one = mp.logp_output_processor(hidden_states=h, output_layer=head1, output_weight=w_full, labels=labels,
                                       loss_mask=mask, config=gpt.config)
    res[f"{name}_logp_lse_equal_tp1_plugin"] = _beq(out.logp, one.logp) and _beq(out.lse, one.lse)
    res[f"{name}_ranks_agree"] = all(_beq(x, out.logp) for x in _all(out.logp.detach(), tp_group)) and \
        all(_beq(x, out.lse) for x in _all(out.lse.detach(), tp_group))
    fp2 = mp.track_lm_head(wrapped).fingerprint
    res[f"{name}_fingerprint_tp2"] = fp2
    res[f"{name}_fingerprint_equal_unsharded"] = fp2 == fused_logp.weight_fingerprint(w_full, vocab_size=real)

    if not tied:
        (-(out.logp * mask).sum() + 0.3 * (out.lse * mask).sum()).backward()
        gh, gw = ms.fp32_reference_grads(h2, w_full, targets, keep, T, real, 0.3)
        ok, worst, rel = ms.grad_close(cap.value.grad.reshape(-1, d), gh)
        res[f"{name}_hidden_grad_close"], res[f"{name}_hidden_grad_err"] = ok, [worst, rel]
        rank, rows = dist.get_rank(tp_group), shard.shape[0]
        v0, v1 = rank * rows, min(real, (rank + 1) * rows)
        ok, worst, rel = ms.grad_close(shard.grad[:v1 - v0], gw[v0:v1])
        res[f"{name}_weight_grad_close"], res[f"{name}_weight_grad_err"] = ok, [worst, rel]
        res[f"{name}_padding_grad_zero"] = bool((shard.grad[v1 - v0:] == 0).all())
    del wrapped, gpt, cap, out


def _sp_checks(sh, dev, backend, res):
    """Sequence parallelism at the output-processor level ([s/TP, b, h] in, all-gather, reduce-scatter of dh)."""
    import megatron_shims as ms
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    import fused_logp
    from fused_logp import megatron_plugin as mp

    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    padded, real, d, b, s = sh["padded"], sh["real"], sh["hidden"], sh["b"], sh["s"]
    _, gpt = ms.build_qwen3_style_gpt(vocab_size=padded, hidden=d, heads=sh["heads"], query_groups=sh["groups"],
                                      ffn=sh["ffn"], seq=s, tied=False, tp=tp, seed=5, device=dev)
    cfg = copy.copy(gpt.config)
    cfg.sequence_parallel = True
    head = ColumnParallelLinear(d, padded, config=cfg, init_method=cfg.init_method, bias=False, gather_output=False,
                                tp_group=tp_group)
    if dev == "cuda":
        head.cuda()
    g = torch.Generator().manual_seed(17)
    h_full = torch.randn(s, b, d, generator=g).bfloat16().to(dev)
    lab = torch.randint(0, real, (b, s), generator=g).to(dev)
    part = s // tp
    h_local = h_full[rank * part:(rank + 1) * part].clone().requires_grad_()
    out = mp.logp_output_processor(hidden_states=h_local, output_layer=head, labels=lab, config=cfg)
    (-(out.logp).sum() + 0.3 * out.lse.sum()).backward()
    w_full = ms.gather_rows(head.weight.detach(), tp_group)
    ref = fused_logp.linear_logp(h_full.reshape(-1, d), w_full[:real], lab.t().reshape(-1), temperature=T,
                                 backend=backend)
    res["sp_logp_equal_tp1_op"] = _beq(out.logp.t().reshape(-1), ref.logp)
    res["sp_lse_equal_tp1_op"] = _beq(out.lse.t().reshape(-1), ref.lse)
    gh, _ = ms.fp32_reference_grads(h_full.reshape(-1, d), w_full, lab.t().reshape(-1),
                                    torch.ones(s * b, device=dev), T, real, 0.3)
    ok, worst, rel = ms.grad_close(h_local.grad, gh.reshape(s, b, d)[rank * part:(rank + 1) * part])
    res["sp_hidden_grad_close"], res["sp_hidden_grad_err"] = ok, [worst, rel]


def _all(x, group):
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return parts


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cpu", action="store_true", help="gloo + CPU oracle at small shapes (dry run)")
    args = p.parse_args()
    warnings.filterwarnings("ignore")
    dev = "cpu" if args.cpu else "cuda"
    backend = "oracle" if args.cpu else "sm90"
    sh = CPU_SHAPES if args.cpu else GPU_SHAPES
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if dev == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.backends.cuda.matmul.allow_tf32 = False
    # a rank that fails alone leaves the other in a collective: give up after 3 minutes, not after 10
    dist.init_process_group("nccl" if dev == "cuda" else "gloo", timeout=datetime.timedelta(minutes=3))

    import megatron_shims as ms
    from megatron.core import package_info

    from fused_logp import megatron_plugin as mp

    res = {"rank": rank}
    try:
        ms.start_model_parallel(rank, world, tp=world, device=dev)
        mp.configure("contract", temperature=T, vocab_size=sh["real"])
        mp.install()
        _model_checks("tied", True, sh, dev, backend, res)
        _model_checks("untied", False, sh, dev, backend, res)
        _sp_checks(sh, dev, backend, res)
    except Exception as exc:                            # noqa: BLE001 - reported in the JSON
        res["error"] = "".join(traceback.format_exception(exc))
    rows = [None] * world
    dist.all_gather_object(rows, res)
    failed = sorted({k for r in rows for k, v in r.items() if v is False} | {"error" for r in rows if "error" in r})
    if rank == 0:
        doc = {"what": "Megatron plugin, TP=%d over %s: logp/lse equal the TP=1 bytes" % (world, dist.get_backend()),
               "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name() if dev == "cuda"
               else "cpu", "torch": torch.__version__, "megatron_core": package_info.__version__,
               "backend": backend, "temperature": T, "shapes": sh, "failed": failed, "ranks": rows}
        print(json.dumps(doc, indent=1, default=str))
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "megatron-tp2-nccl.json" if dev == "cuda" else "megatron-tp2-gloo.json"),
                  "w") as f:
            json.dump(doc, f, indent=2, default=str)
        print("megatron TP=%d: %s" % (world, "all checks passed" if not failed else "FAILED: " + ", ".join(failed)))
    mp.uninstall()
    ms.stop_model_parallel()
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
