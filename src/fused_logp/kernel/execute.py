"""A prepared Request (kernel/request.py) run on its backend: the backend calls of every public entry, and the
rank-ordered merge of shard statistics. No argument checks (prepare made them) and no arithmetic (the backends'):
each function reads the request's fields and calls one entry of the backend interface (kernel/backends.py)."""
from __future__ import annotations

import torch

from . import invalid_rows
from .backends import require, serves
from .request import Request, check_shard_sequence, constant_rows
from .results import LogpResult, ShardStats


def forward(req: Request, hidden, weight) -> LogpResult:
    """linear_logp (single device) or linear_logp_tp (this rank's statistics, gathered, merged); hidden and weight
    may be detached copies (the autograd function passes them)."""
    if req.entry == "linear_logp_tp":
        return tp_forward(req, hidden, weight)
    out = req.backend.linear_logp(hidden.contiguous(), weight.contiguous(), req.targets, bias=req.bias,
                                  temperature=req.temperature, return_logits=req.return_logits,
                                  vocab_size=req.window.size)
    return LogpResult(out.logp, out.lse, out.logits, req.provenance)


def shard_stats(req: Request, hidden, weight_shard) -> ShardStats:
    require(req.backend, "shard_stats")
    st = req.backend.shard_stats(hidden.contiguous(), weight_shard.contiguous(), req.targets,
                                 vocab_start=req.window.start, vocab_size=req.window.size, bias=req.bias,
                                 temperature=req.temperature, return_logits=req.return_logits)
    tile_max, target_logit = invalid_rows.nan_rows(req.invalid_rows, st.tile_max, st.target_logit)
    return ShardStats(tile_max, st.tile_sum, target_logit, st.target_owned, st.tile_offset, st.logits,
                      req.provenance, req.unit_temperature)


def merge(stats, backend, provenance) -> LogpResult:
    """The row merge of consecutive shards' statistics (checked by request.check_shard_sequence)."""
    tile_max = torch.cat([s.tile_max for s in stats], dim=1)
    tile_sum = torch.cat([s.tile_sum for s in stats], dim=1)
    target = stats[0].target_logit
    for s in stats[1:]:
        target = torch.where(s.target_owned, s.target_logit, target)
    require(backend, "merge_stats")
    logp, lse = backend.merge_stats(tile_max.contiguous(), tile_sum.contiguous(), target.contiguous())
    return LogpResult(logp, lse, None, provenance)


def tp_forward(req: Request, hidden, weight_shard) -> LogpResult:
    """This rank's tile statistics, all-gathered over req.group in rank order, merged: every rank returns the
    same bytes, equal to the single-device op on the unsharded weight."""
    import torch.distributed as dist

    st = shard_stats(req, hidden, weight_shard)
    world = dist.get_world_size(req.group)
    dev = st.tile_max.device
    meta = torch.tensor([st.tile_offset, st.tile_max.shape[1]], dtype=torch.int64, device=dev)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=req.group)
    shapes = [tuple(int(x) for x in m.tolist()) for m in metas]
    nt_max = max(nt for _, nt in shapes)
    n = st.tile_max.shape[0]

    def gather(x, fill):
        padded = torch.full((n, nt_max), fill, dtype=x.dtype, device=dev)
        padded[:, : x.shape[1]] = x
        out = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(out, padded.contiguous(), group=req.group)
        return out

    maxes, sums = gather(st.tile_max, float("-inf")), gather(st.tile_sum, 0.0)
    tl = [torch.empty_like(st.target_logit) for _ in range(world)]
    dist.all_gather(tl, st.target_logit.contiguous(), group=req.group)
    owned_u8 = st.target_owned.to(torch.uint8)
    ow = [torch.empty_like(owned_u8) for _ in range(world)]
    dist.all_gather(ow, owned_u8, group=req.group)
    gathered = [ShardStats(maxes[r][:, : shapes[r][1]], sums[r][:, : shapes[r][1]], tl[r], ow[r].bool(),
                           shapes[r][0], None, st.provenance) for r in range(world)]
    return merge(check_shard_sequence(gathered, req.window.size), req.backend, req.provenance)


def stats_from_logits(req: Request, logits) -> LogpResult:
    """logp_from_logits: targets [N], or [N, C] in one call where the backend declares multi_target, else one
    call per column (the same bytes)."""
    size = req.window.size
    z = logits.contiguous() if size == logits.shape[1] else logits[:, :size].contiguous()
    be, targets = req.backend, req.targets
    if targets.dim() == 2 and not be.multi_target:
        cols = [be.stats_from_logits(z, targets[:, c].contiguous(), temperature=req.temperature, vocab_size=size)
                for c in range(targets.shape[1])]
        return LogpResult(torch.stack([c.logp for c in cols], dim=1), cols[0].lse, None, req.provenance)
    logp, lse = be.stats_from_logits(z, targets, temperature=req.temperature, vocab_size=size)
    return LogpResult(logp, lse, None, req.provenance)


def head_stats(req: Request, hidden, weight) -> ShardStats:
    """logits_and_stats: one launch where the backend declares the serving head, else its shard_stats at T = 1."""
    n, dev, size = hidden.shape[0], req.device, req.window.size
    if serves(req.backend, "logits_and_stats"):    # one launch and no per-call tensor work (a serving step)
        out = req.backend.logits_and_stats(hidden.contiguous(), weight.contiguous(), zeros=req.targets,
                                           ones=req.temperature, vocab_size=size, bias=req.bias)
        return ShardStats(out.tile_max, out.tile_sum, out.target_logit, constant_rows("owned", n, dev), 0,
                          out.logits, req.provenance, unit_temperature=True)
    require(req.backend, "shard_stats")
    st = req.backend.shard_stats(hidden.contiguous(), weight.contiguous(), req.targets, vocab_start=0,
                                 vocab_size=size, bias=req.bias, temperature=req.temperature, return_logits=True)
    return ShardStats(st.tile_max, st.tile_sum, st.target_logit, st.target_owned, st.tile_offset, st.logits,
                      req.provenance, unit_temperature=True)


def ids_merge(req: Request) -> LogpResult:
    """logp_of_ids: the row merge of one T = 1 call's statistics with z'_id = z[id] read from its logits."""
    stats, size, be = req.stats[0], req.window.size, req.backend
    if req.kernel_counts_rows:
        errs = invalid_rows.record_for(req.device, req.strict)
        logp, lse = be.merge_ids(stats.tile_max, stats.tile_sum, stats.logits, req.targets, vocab_size=size,
                                 bad_rows=errs.ids, mirror=errs.ids_mirror)
        return LogpResult(logp, lse, None, req.provenance)
    z, targets = stats.logits, req.targets
    n = z.shape[0]
    cols = 1 if targets.dim() == 1 else targets.shape[1]
    z_ids = z.gather(1, targets.view(n, cols)).view(-1)              # z'_id = z[id] at T = 1 (no arithmetic)
    tile_max, tile_sum = stats.tile_max, stats.tile_sum
    if cols > 1:
        tile_max, tile_sum = tile_max.repeat_interleave(cols, dim=0), tile_sum.repeat_interleave(cols, dim=0)
    require(be, "merge_stats")
    logp, lse = be.merge_stats(tile_max.contiguous(), tile_sum.contiguous(), z_ids.contiguous())
    if targets.dim() == 2:
        logp, lse = logp.view(n, cols), lse.view(n, cols)[:, 0]
    return invalid_rows.nan_result(req.invalid_rows, LogpResult(logp, lse, None, req.provenance))

