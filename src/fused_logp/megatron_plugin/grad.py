"""The plugin's single call into the op when gradients are needed.

The op's own backward (fused_logp.kernel.autograd) returns this rank's *partial* hidden-state gradient under
tensor parallelism. It is all-reduced over the TP group here when `reduce_hidden_grad` is true (the role of
Megatron's copy_to_tensor_model_parallel_region on the output layer's input), and left partial otherwise
(the caller's sequence-parallel gather reduce-scatters it instead). Never both.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernel.op import linear_logp, linear_logp_tp


def _group_size(group):
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


class _ReduceGradOverGroup(torch.autograd.Function):
    """Identity forward; all-reduce of the gradient in backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _op_with_grad(hidden, weight, targets, *, temperature, vocab_start=0, vocab_size, tp_group=None,
                  reduce_hidden_grad=True, backend=None, strict=None):
    """(logp [N] fp32, lse [N] fp32, provenance) of `hidden [N, D]` against `weight` (this rank's vocabulary
    shard, first row global id `vocab_start`), differentiable in hidden and weight.

    temperature: fp32 tensor [N]. With a TP group of size > 1 the statistics are all-gathered in rank order
    (linear_logp_tp) and every rank gets the unsharded op's bytes."""
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone(), None
    if _group_size(tp_group) > 1:
        if reduce_hidden_grad and hidden.requires_grad:
            hidden = _ReduceGradOverGroup.apply(hidden, tp_group)
        res = linear_logp_tp(hidden, weight, targets, vocab_start=vocab_start, vocab_size=vocab_size,
                             group=tp_group, temperature=temperature, backend=backend, strict=strict)
    else:
        res = linear_logp(hidden, weight, targets, temperature=temperature, vocab_size=vocab_size,
                          backend=backend, strict=strict)
    return res.logp, res.lse, res.provenance
