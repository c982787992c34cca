"""Backward of linear_logp: gradients for hidden, the weight (shard) and the bias, at O(N) extra memory.

Forward bytes come from the contract op; the backward recomputes logits chunk by chunk from the saved lse
(never an [N, V] buffer) in FP32:

    p_v    = exp(z'_v - lse)                       z' = (h . W_v + b_v) / T
    dz'_v  = g_lse * p_v + g_logp * ([v == target] - p_v)
    dz_v   = dz'_v / T
    dh     = sum_v dz_v W_v      dW_v = sum_n dz_v h      db_v = sum_n dz_v

Gradient bytes are not part of the contract, but they are deterministic: chunks are visited in ascending
vocabulary order, no atomics. On the CPU the arithmetic is FP32 and each row's hidden gradient is its own
vector-matrix product, so it is independent of the batch it is in. On CUDA with bf16 inputs each chunk is three
cuBLAS GEMMs with bf16 operands and FP32 accumulation around one elementwise kernel (kernel/csrc/sm90_backward.cu:
FP32 logits in, bf16 dz out, the forward's scaling and exp): dz is rounded to bf16 once, as the GEMM operand; the
hidden gradient accumulates across chunks in FP32 inside cuBLAS (beta = 1); the weight gradient is written in
bf16 straight into its rows. Extra memory on that path: an [N, C] FP32 and an [N, C] bf16 buffer (C chosen so
both fit in 320 MiB, see `cuda_chunk`) and the [N, D] FP32 hidden-gradient accumulator. cuBLAS picks its kernels
by shape, so on CUDA a row's hidden gradient is not promised to be identical alone and inside a batch (it is on
the CPU). Under tensor parallelism a shard's call returns the
*partial* hidden gradient of its rows of W; the caller reduces it exactly once over the TP group (Megatron's
`copy_to_tensor_model_parallel_region` on the output layer's input does exactly that).
"""
from __future__ import annotations

import logging

import torch

_CHUNK = 8192
# CUDA bf16 path: the two per-chunk buffers ([N, C] FP32 logits and [N, C] bf16 dz, 6 bytes per element) are
# sized to this many bytes at most, so the extra memory stays bounded for any N (the [N, D] FP32 hidden-gradient
# accumulator comes on top).
_CUDA_CHUNK_BYTES = 320 * 2 ** 20
_CUDA_CHUNK_MIN = 1024
_CUDA_CHUNK_MAX = 32768

_log = logging.getLogger("fused_logp.backward")
_warned = False


def cuda_chunk(n: int) -> int:
    """Vocabulary columns per chunk on the CUDA bf16 path for N rows: a multiple of 256 in [1024, 32768], the
    largest whose two buffers fit in _CUDA_CHUNK_BYTES (fewer chunks: fewer passes over the FP32 dh)."""
    c = (_CUDA_CHUNK_BYTES // (6 * max(n, 1))) // 256 * 256
    return max(_CUDA_CHUNK_MIN, min(_CUDA_CHUNK_MAX, c))


def _dz_kernel(device):
    """The SM90 extension's backward_dz where it is available on this device, else None (logged once)."""
    global _warned
    from . import sm90
    ext = sm90.extension(device)
    if ext is None and not _warned:
        with torch.cuda.device(device):
            why = sm90.SM90Backend().available()[1]
        _log.warning("backward: the sm90 elementwise kernel is unavailable (%s); using torch elementwise ops "
                     "(same formula, slower; gradient bytes are not contract-bearing)", why)
        _warned = True
    return ext


def logp_grads(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, *, vocab_start: int, n_real: int,
               chunk: int | None = None):
    """hidden [N, D], weight [V_local, D], bias [V_local] or None, targets/temperature/lse/g_logp/g_lse [N].
    Returns (dh [N, D], dW [V_local, D], db [V_local] or None); dh and db in FP32 (FP64 for FP64 inputs)."""
    fast = hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n, d = hidden.shape
    dev = hidden.device
    if chunk is None:
        chunk = cuda_chunk(n) if fast else _CHUNK
    g_logp = torch.zeros(n, dtype=dt, device=dev) if g_logp is None else g_logp.to(dt)
    g_lse = torch.zeros(n, dtype=dt, device=dev) if g_lse is None else g_lse.to(dt)
    dh = torch.zeros(n, d, dtype=dt, device=dev)
    dw = torch.zeros(weight.shape, dtype=weight.dtype if fast else dt, device=dev)
    db = torch.zeros(weight.shape[0], dtype=dt, device=dev) if bias is not None else None
    if fast:
        _grads_cuda_bf16(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, vocab_start, n_real,
                         chunk, dh, dw, db)
        return dh, dw, db
    temp = temperature.to(dt)[:, None]
    lse = lse.to(dt)[:, None]
    coef = (g_lse - g_logp)[:, None]
    h = hidden.to(dt)
    local_t = targets - vocab_start
    rows = torch.arange(n, device=dev)
    for c0 in range(0, n_real, chunk):
        c1 = min(n_real, c0 + chunk)
        w = weight[c0:c1].to(dt)                                            # [C, D]
        z = h @ w.T                                                         # [N, C]
        if bias is not None:
            z += bias[c0:c1].to(dt)
        dz = _dz_torch(z, temp, lse, coef, g_logp, local_t - c0, rows)
        if db is not None:
            db[c0:c1] = dz.sum(dim=0)
        for i in range(n):
            dh[i] += torch.mv(w.T, dz[i])
        dw[c0:c1] = dz.T @ h
    return dh, dw, db


def _dz_torch(z, temp, lse, coef, g_logp, tcol, rows):
    """dz = (coef * exp(z / T - lse) + g_logp [col == target]) / T, in place in z."""
    p = z.div_(temp).sub_(lse).exp_()
    dzs = p.mul_(coef)
    own = (tcol >= 0) & (tcol < z.shape[1])
    dzs[rows[own], tcol[own]] += g_logp[own]
    return dzs.div_(temp)


def _grads_cuda_bf16(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, vocab_start, n_real, chunk,
                     dh, dw, db):
    """Per chunk: z = h W_c^T (cuBLAS, bf16 operands, FP32 out); dz (one elementwise kernel, bf16 out);
    dh += dz W_c (cuBLAS accumulates into the FP32 dh, beta = 1); dW_c = dz^T h (cuBLAS, bf16 out, written in
    place); db_c = column sums of dz in FP32. Chunks in ascending vocabulary order, no atomics."""
    n = hidden.shape[0]
    dev = hidden.device
    f32 = dict(dtype=torch.float32, device=dev)
    temp = temperature.to(torch.float32).contiguous()
    lse32 = lse.to(torch.float32).contiguous()
    coef = (g_lse - g_logp).to(torch.float32).contiguous()
    gl = g_logp.to(torch.float32).contiguous()
    tg = targets.to(torch.int64).contiguous()
    ext = _dz_kernel(dev)
    zbuf = torch.empty(n * chunk, **f32)
    dbuf = torch.empty(n * chunk, dtype=torch.bfloat16, device=dev)
    rows = torch.arange(n, device=dev) if ext is None else None
    for c0 in range(0, n_real, chunk):
        c1 = min(n_real, c0 + chunk)
        cc = c1 - c0
        w = weight[c0:c1]
        z = zbuf[:n * cc].view(n, cc)
        torch.mm(hidden, w.T, out_dtype=torch.float32, out=z)
        dzb = dbuf[:n * cc].view(n, cc)
        b = None if bias is None else bias[c0:c1].to(torch.float32).contiguous()
        if ext is not None:
            ext.backward_dz(z, b, temp, lse32, coef, gl, tg, int(vocab_start + c0), dzb)
        else:
            if b is not None:
                z += b
            dzb.copy_(_dz_torch(z, temp[:, None], lse32[:, None], coef[:, None], gl, tg - (vocab_start + c0), rows))
        if db is not None:
            db[c0:c1] = dzb.sum(dim=0, dtype=torch.float32)
        torch.addmm(dh, dzb, w, out_dtype=torch.float32, out=dh)
        torch.mm(dzb.T, hidden, out=dw[c0:c1])


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
