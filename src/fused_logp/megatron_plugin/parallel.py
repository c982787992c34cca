"""Tensor, sequence and context parallel plumbing around the op (no arithmetic on logits here)."""
from __future__ import annotations

import torch
import torch.distributed as dist


def group_size(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group) -> int:
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 0
    return dist.get_rank(group)


class _GatherSequenceParallel(torch.autograd.Function):
    """[s/TP, b, h] -> [s, b, h] in rank order; backward reduce-scatters the (partial) gradient, which is the
    one reduction of the hidden-state gradient over the TP group in sequence-parallel mode."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        world, rank = dist.get_world_size(group), dist.get_rank(group)
        grad = grad.contiguous()
        chunk = grad.shape[0] // world
        if dist.get_backend(group) == "gloo":       # gloo has no reduce-scatter
            total = grad.clone()
            dist.all_reduce(total, group=group)
            return total[rank * chunk:(rank + 1) * chunk].contiguous(), None
        out = torch.empty((chunk,) + tuple(grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad, group=group)
        return out, None


def gather_sequence_parallel(hidden_states, group):
    if group_size(group) == 1:
        return hidden_states
    return _GatherSequenceParallel.apply(hidden_states, group)


@torch.no_grad()
def gather_context_parallel(x, cp_group=None):
    """Reassemble a CP-local [b, s/CP] tensor (Megatron's load-balanced split: rank r holds chunks r and
    2*CP-1-r of 2*CP) into sequence order [b, s]. For logging and comparison with the rollout; no gradient.
    The logp/lse themselves never enter a CP reduction: each CP rank owns its rows."""
    if cp_group is None:
        from megatron.core import parallel_state
        cp_group = parallel_state.get_context_parallel_group()
    cp = group_size(cp_group)
    if cp == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(cp)]
    dist.all_gather(parts, x, group=cp_group)
    s_local = x.shape[1]
    half = s_local // 2
    chunks = [None] * (2 * cp)
    for r, p in enumerate(parts):
        chunks[r] = p[:, :half]
        chunks[2 * cp - 1 - r] = p[:, half:]
    return torch.cat(chunks, dim=1)
