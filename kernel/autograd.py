"""Backward of linear_logp: gradients for hidden, the weight (shard) and the bias, at O(N) extra memory.

Forward bytes come from the contract op; the backward recomputes logits chunk by chunk from the saved lse
(never an [N, V] buffer) in FP32:

    p_v    = exp(z'_v - lse)                       z' = (h . W_v + b_v) / T
    dz'_v  = g_lse * p_v + g_logp * ([v == target] - p_v)
    dz_v   = dz'_v / T
    dh     = sum_v dz_v W_v      dW_v = sum_n dz_v h      db_v = sum_n dz_v

Gradient bytes are not part of the contract, but they are deterministic: chunks are visited in ascending
vocabulary order, no atomics. On the CPU the arithmetic is FP32 and each row's hidden gradient is its own
vector-matrix product, so it is independent of the batch it is in. On CUDA with bf16 inputs the three GEMMs per
chunk take bf16 operands with FP32 accumulation (dz is rounded to bf16 once, as the GEMM operand), which is what
makes the backward run at GEMM speed; the hidden gradient accumulates across chunks in FP32, and the weight
gradient is written in bf16. Extra memory: two [N, chunk] FP32 buffers and the [N, D] FP32 accumulator. Under tensor parallelism a shard's call returns the
*partial* hidden gradient of its rows of W; the caller reduces it exactly once over the TP group (Megatron's
`copy_to_tensor_model_parallel_region` on the output layer's input does exactly that).
"""
from __future__ import annotations

import torch

_CHUNK = 8192


def logp_grads(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, *, vocab_start: int, n_real: int,
               chunk: int = _CHUNK):
    """hidden [N, D], weight [V_local, D], bias [V_local] or None, targets/temperature/lse/g_logp/g_lse [N].
    Returns (dh [N, D], dW [V_local, D], db [V_local] or None); dh and db in FP32 (FP64 for FP64 inputs)."""
    fast = hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n, d = hidden.shape
    dev = hidden.device
    temp = temperature.to(dt)[:, None]
    lse = lse.to(dt)[:, None]
    g_logp = torch.zeros(n, dtype=dt, device=dev) if g_logp is None else g_logp.to(dt)
    g_lse = torch.zeros(n, dtype=dt, device=dev) if g_lse is None else g_lse.to(dt)
    coef = (g_lse - g_logp)[:, None]
    h = hidden if fast else hidden.to(dt)
    dh = torch.zeros(n, d, dtype=dt, device=dev)
    dw = torch.zeros(weight.shape, dtype=weight.dtype if fast else dt, device=dev)
    db = torch.zeros(weight.shape[0], dtype=dt, device=dev) if bias is not None else None
    local_t = targets - vocab_start
    rows = torch.arange(n, device=dev)
    for c0 in range(0, n_real, chunk):
        c1 = min(n_real, c0 + chunk)
        w = weight[c0:c1] if fast else weight[c0:c1].to(dt)              # [C, D]
        z = torch.mm(h, w.T, out_dtype=torch.float32) if fast else h @ w.T   # [N, C]
        if bias is not None:
            z += bias[c0:c1].to(dt)
        p = z.div_(temp).sub_(lse).exp_()                                   # in place: one [N, C] buffer
        dzs = p.mul_(coef)
        own = (local_t >= c0) & (local_t < c1)
        dzs[rows[own], (local_t[own] - c0)] += g_logp[own]
        dz = dzs.div_(temp)                                                # [N, C]
        if db is not None:
            db[c0:c1] = dz.sum(dim=0)
        if fast:
            dzb = dz.to(torch.bfloat16)
            dh += torch.mm(dzb, w, out_dtype=torch.float32)
            dw[c0:c1] = torch.mm(dzb.T, h)
        else:
            for i in range(n):
                dh[i] += torch.mv(w.T, dz[i])
            dw[c0:c1] = dz.T @ h
    return dh, dw, db


class LinearLogpFunction(torch.autograd.Function):
    """Differentiable in hidden, weight and bias around `forward_fn(hidden, weight, bias) -> (logp, lse)`, which
    runs the contract op (single device, or a TP shard with its gathered merge)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, forward_fn, vocab_start, n_real):
        logp, lse = forward_fn(hidden.detach(), weight.detach(), None if bias is None else bias.detach())
        ctx.save_for_backward(hidden, weight, bias, targets, temperature, lse)
        ctx.vocab_start, ctx.n_real, ctx.has_bias = vocab_start, n_real, bias is not None
        return logp, lse

    @staticmethod
    def backward(ctx, g_logp, g_lse):
        hidden, weight, bias, targets, temperature, lse = ctx.saved_tensors
        dh, dw, db = logp_grads(hidden, weight, bias if ctx.has_bias else None, targets, temperature, lse,
                                g_logp, g_lse, vocab_start=ctx.vocab_start, n_real=ctx.n_real)
        return (dh.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                db.to(bias.dtype) if (ctx.has_bias and ctx.needs_input_grad[2]) else None,
                None, None, None, None, None)
