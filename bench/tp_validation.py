"""Tensor-parallel validation at the Qwen3-8B lm_head shape (D=4096, V=151936) on SM90 GPUs.

Single process (any GPU count): emulated shards for TP = 2, 4, 8 with Megatron's padding (151936 padded to a
multiple of 128*TP: 152064 at TP=2 and 4, 152576 at TP=8) and vLLM's unpadded shards through stats-from-logits; logp/lse bytes must
equal TP=1. Under torchrun with N processes: the op's TP entry over NCCL (`linear_logp_tp`), bytes equal the
single-device op on every rank, and the time and bytes of the tile-statistics all-gather against the forward.
Writes JSON to $OUT (or --out)."""
from __future__ import annotations

import argparse
import datetime
import json
import os

import torch
import torch.distributed as dist

from fused_logp import linear_logp, linear_logp_tp, logp_from_logits, merge_shard_stats, shard_tile_stats

D, V = 4096, 151936


def _same(a, b):
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def _padded(v, tp, divisible_by=128):
    m = divisible_by * tp
    return -(-v // m) * m


def emulated(n_rows, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n_rows, D, device="cuda", generator=g).bfloat16()
    w = (torch.randn(_padded(V, 8), D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    t = torch.randint(0, V, (n_rows,), device="cuda", generator=g)
    ref = linear_logp(h, w[:V], t, temperature=0.9, return_logits=True)
    out = {"rows": n_rows}
    for tp in (2, 4, 8):
        vp = _padded(V, tp)
        per = vp // tp
        stats = [shard_tile_stats(h, w[r * per:(r + 1) * per], t, vocab_start=r * per, vocab_size=V, temperature=0.9)
                 for r in range(tp)]
        m = merge_shard_stats(stats, vocab_size=V)
        out[f"megatron_tp{tp}_padded_{vp}"] = _same(m.logp, ref.logp) and _same(m.lse, ref.lse)
        cuts = [r * (V // tp) for r in range(tp)] + [V]          # vLLM: 151936 / TP wide (37984 at TP=4: not 64-aligned)
        parts = [ref.logits[:, a:b] for a, b in zip(cuts, cuts[1:])]
        fl = logp_from_logits(torch.cat(parts, dim=1), t, temperature=0.9)
        out[f"vllm_tp{tp}_unpadded_stats_from_logits"] = _same(fl.logp, ref.logp) and _same(fl.lse, ref.lse)
    return out


def distributed(n_rows, seed):
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n_rows, D, device="cuda", generator=g).bfloat16()
    vp = _padded(V, world)
    w = (torch.randn(vp, D, device="cuda", generator=g) * D ** -0.5).bfloat16()
    t = torch.randint(0, V, (n_rows,), device="cuda", generator=g)
    per = vp // world
    shard = w[rank * per:(rank + 1) * per].contiguous()
    res = linear_logp_tp(h, shard, t, vocab_start=rank * per, vocab_size=V, temperature=0.9)
    ref = linear_logp(h, w[:V], t, temperature=0.9)
    ok = _same(res.logp, ref.logp) and _same(res.lse, ref.lse)
    st = shard_tile_stats(h, shard, t, vocab_start=rank * per, vocab_size=V, temperature=0.9)
    buf = torch.cat([st.tile_max, st.tile_sum], dim=1).contiguous()
    outs = [torch.empty_like(buf) for _ in range(world)]
    for _ in range(3):
        dist.all_gather(outs, buf)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(20):
        dist.all_gather(outs, buf)
    b.record()
    torch.cuda.synchronize()
    gather_ms = a.elapsed_time(b) / 20
    a.record()
    for _ in range(5):
        shard_tile_stats(h, shard, t, vocab_start=rank * per, vocab_size=V, temperature=0.9)
    b.record()
    torch.cuda.synchronize()
    fwd_ms = a.elapsed_time(b) / 5
    return {"rank": rank, "world": world, "rows": n_rows, "bytes_equal_tp1": ok, "gather_ms": gather_ms,
            "gather_bytes_per_rank": buf.numel() * 4, "shard_forward_ms": fwd_ms}


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    args = p.parse_args()
    date = datetime.date.today().isoformat()
    if "RANK" in os.environ:
        dist.init_process_group("nccl")
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        r = distributed(args.rows, 7)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, r)
        if dist.get_rank() == 0:
            print(json.dumps(rows, indent=1))
            with open(os.path.join(args.out, f"tp-nccl-{dist.get_world_size()}gpu.json"), "w") as f:
                json.dump({"gpu": torch.cuda.get_device_name(), "date": date, "ranks": rows}, f, indent=2)
        dist.destroy_process_group()
        return
    r = emulated(args.rows, 5)
    print(json.dumps(r, indent=1))
    with open(os.path.join(args.out, "tp-emulated.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "date": date, **r}, f, indent=2)


if __name__ == "__main__":
    main()
