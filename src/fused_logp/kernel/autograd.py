"""Backward of linear_logp: gradients for hidden, the weight (shard) and the bias, at O(N) extra memory.

Forward bytes come from the contract op; the backward recomputes logits chunk by chunk from the saved lse
(never an [N, V] buffer) in FP32:

    p_v    = exp(z'_v - lse)                       z' = (h . W_v + b_v) / T
    dz'_v  = g_lse * p_v + g_logp * ([v == target] - p_v)
    dz_v   = dz'_v / T
    dh     = sum_v dz_v W_v      dW_v = sum_n dz_v h      db_v = sum_n dz_v

Gradient bytes are not part of the contract, but they are deterministic: chunks are visited in ascending
vocabulary order, no atomics. On the CPU the arithmetic is FP32 and each row's logits and hidden gradient are
its own matrix-vector products, so they are independent of the batch it is in.

On CUDA with bf16 inputs and the SM90 extension, each vocabulary chunk of C = 16896 columns is
  1. one launch of the contract GEMM with the logit gradient as its epilogue (kernel/csrc/sm90_backward.cu): the
     FP32 logits are the forward's own accumulators and are never written; dz is rounded once to bf16;
  2. dh += dz W_c in fixed slices of 1024 rows (cuBLAS, FP32 accumulation into the FP32 dh, beta = 1);
  3. dW_c = dz^T h (cuBLAS, bf16 out, written in place); db_c = column sums of dz in FP32.
The chunk width and the slice shape do not depend on N (the last slice is padded with zero rows), so every
cuBLAS call a row takes part in has the same shape alone and inside any batch, and dz depends on its own row
only: a row's hidden gradient is the same alone and in a batch. Extra memory: the [rows, C] bf16 dz buffer
(rows a multiple of 1024, at most _CUDA_CHUNK_BYTES: larger batches run in row groups, with the weight gradient
of a chunk accumulated over the groups in FP32) and the [N, D] FP32 hidden-gradient accumulator.
Without the extension the same loop computes z with cuBLAS (FP32 out) and dz with torch ops (logged once); the
batch invariance of a row then rests on cuBLAS and is not promised.

Under tensor parallelism a shard's call returns the *partial* hidden gradient of its rows of W; the caller
reduces it exactly once over the TP group (Megatron's `copy_to_tensor_model_parallel_region` on the output
layer's input does exactly that).
"""
from __future__ import annotations

import logging

import torch

from .backends import device_kernels, device_status
from .execute import forward as run_forward
from .results import LogpResult

_CHUNK = 8192
# CUDA bf16 path (see the module docstring): fixed chunk width and dh slice height, and the bound on the dz
# buffer (plus the FP32 logits buffer when the extension is missing). The chunk width does not depend on N (a
# row's hidden gradient must not depend on the batch).
# 16896 = 66 kernel tiles of 256 columns: on 132 SMs, any even number of 128-row tiles (N a multiple of 256) fills
# whole waves of the recompute kernel.
CUDA_CHUNK = 16896
_CUDA_SLICE = 1024
_CUDA_CHUNK_BYTES = 320 * 2 ** 20

_log = logging.getLogger("fused_logp.backward")
_warned = False


def cuda_group(n: int, bytes_per_element: int = 2) -> int:
    """Rows per group on the CUDA bf16 path: a multiple of the slice height whose [rows, chunk] buffers fit in
    _CUDA_CHUNK_BYTES (at least one slice), or all N rows rounded up to a slice when they fit."""
    s = _CUDA_SLICE
    fit = max(s, (_CUDA_CHUNK_BYTES // (bytes_per_element * CUDA_CHUNK)) // s * s)
    return min(fit, -(-max(n, 1) // s) * s)


def _dz_backend(device):
    """The device's auxiliary kernels (their backward_dz) where a device backend serves it, else None (logged
    once)."""
    global _warned
    be = device_kernels(device)
    if be is None and not _warned:
        why = device_status(device)[1]
        _log.warning("backward: the sm90 kernel is unavailable (%s); using cuBLAS logits and torch elementwise "
                     "ops (same formula, slower, a row's hidden gradient not promised batch-invariant; gradient "
                     "bytes are not contract-bearing)", why)
        _warned = True
    return be


def logp_grads(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, *, vocab_start: int, n_real: int,
               chunk: int | None = None):
    """hidden [N, D], weight [V_local, D], bias [V_local] or None, targets/temperature/lse/g_logp/g_lse [N].
    Returns (dh [N, D], dW [V_local, D], db [V_local] or None); dh and db in FP32 (FP64 for FP64 inputs)."""
    fast = hidden.is_cuda and hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
    dt = torch.float64 if hidden.dtype == torch.float64 else torch.float32
    n, d = hidden.shape
    dev = hidden.device
    if chunk is None:
        chunk = CUDA_CHUNK if fast else _CHUNK
    g_logp = torch.zeros(n, dtype=dt, device=dev) if g_logp is None else g_logp.to(dt)
    g_lse = torch.zeros(n, dtype=dt, device=dev) if g_lse is None else g_lse.to(dt)
    db = torch.zeros(weight.shape[0], dtype=dt, device=dev) if bias is not None else None
    if fast:
        dw = torch.empty(weight.shape, dtype=weight.dtype, device=dev)   # rows < n_real: written below
        dw[n_real:].zero_()
        dh = _grads_cuda_bf16(hidden, weight, bias, targets, temperature, lse, g_logp, g_lse, vocab_start, n_real,
                              chunk, dw, db)
        return dh, dw, db
    dh = torch.zeros(n, d, dtype=dt, device=dev)
    dw = torch.zeros(weight.shape, dtype=dt, device=dev)
    temp = temperature.to(dt)[:, None]
    lse = lse.to(dt)[:, None]
    coef = (g_lse - g_logp)[:, None]
    h = hidden.to(dt)
    local_t = targets - vocab_start
    rows = torch.arange(n, device=dev)
    for c0 in range(0, n_real, chunk):
        c1 = min(n_real, c0 + chunk)
        w = weight[c0:c1].to(dt)                                            # [C, D]
        # row by row: a batched GEMM picks its kernel (and summation order) by the row count
        z = torch.stack([torch.mv(w, h[i]) for i in range(n)]) if n else h @ w.T   # [N, C]
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
                     dw, db):
    """The CUDA bf16 path of the module docstring: fills dw (like weight, bf16) and db ([V_local] FP32) and
    returns dh [N, D] FP32 (a view of whole 1024-row slices)."""
    n, d = hidden.shape
    dev = hidden.device
    if n == 0:
        dw.zero_()
        return torch.zeros(0, d, dtype=torch.float32, device=dev)
    temp = temperature.to(torch.float32).contiguous()
    lse32 = lse.to(torch.float32).contiguous()
    coef = (g_lse - g_logp).to(torch.float32).contiguous()
    gl = g_logp.to(torch.float32).contiguous()
    tg = targets.to(torch.int64).contiguous()
    hidden, weight = hidden.contiguous(), weight.contiguous()
    be = _dz_backend(dev)
    sl = _CUDA_SLICE
    group = cuda_group(n, 2 if be is not None else 6)
    n_pad = -(-n // sl) * sl
    # dh in whole slices: the rows beyond N take zero dz and are dropped
    dh_pad = torch.zeros(n_pad, d, dtype=torch.float32, device=dev)
    ld = -(-chunk // 8) * 8         # 16-byte aligned rows; room for the kernel's column-pair stores
    dzbuf = torch.empty(group, ld, dtype=torch.bfloat16, device=dev)
    zbuf = torch.empty(group, chunk, dtype=torch.float32, device=dev) if be is None else None
    rows_idx = torch.arange(group, device=dev) if be is None else None
    grouped = group < n
    dwacc = torch.empty(chunk, d, dtype=torch.float32, device=dev) if grouped else None
    for c0 in range(0, n_real, chunk):
        c1 = min(n_real, c0 + chunk)
        cc = c1 - c0
        w = weight[c0:c1]
        b = None if bias is None else bias[c0:c1].to(torch.float32).contiguous()
        if grouped:
            dwacc[:cc].zero_()
        for g0 in range(0, n, group):
            g1 = min(n, g0 + group)
            rows = g1 - g0
            rows_pad = -(-rows // sl) * sl
            dz = dzbuf[:rows_pad, :cc]
            if be is not None:
                be.backward_dz(hidden[g0:g1], w, b, temp[g0:g1], lse32[g0:g1], coef[g0:g1], gl[g0:g1],
                                tg[g0:g1], int(vocab_start + c0), cc, dz[:rows])
            else:
                z = zbuf[:rows, :cc]
                torch.mm(hidden[g0:g1], w.T, out_dtype=torch.float32, out=z)
                if b is not None:
                    z += b
                dz[:rows].copy_(_dz_torch(z, temp[g0:g1, None], lse32[g0:g1, None], coef[g0:g1, None], gl[g0:g1],
                                          tg[g0:g1] - (vocab_start + c0), rows_idx[:rows]))
            if rows_pad > rows:
                dz[rows:].zero_()
            for s0 in range(0, rows_pad, sl):
                out = dh_pad[g0 + s0:g0 + s0 + sl]
                torch.addmm(out, dz[s0:s0 + sl], w, out_dtype=torch.float32, out=out)
            if db is not None:
                db[c0:c1] += dz[:rows].sum(dim=0, dtype=torch.float32)
            if grouped:
                torch.addmm(dwacc[:cc], dz[:rows].T, hidden[g0:g1], out_dtype=torch.float32, out=dwacc[:cc])
            else:
                torch.mm(dz[:rows].T, hidden[g0:g1], out=dw[c0:c1])
        if grouped:
            dw[c0:c1] = dwacc[:cc]
    return dh_pad[:n]


def differentiable(request, hidden, weight, bias) -> LogpResult:
    """The prepared request (kernel/request.py; linear_logp or linear_logp_tp) run under LinearLogpFunction:
    logp and lse differentiable in hidden, weight and bias; logits are not returned on the training path."""
    logp, lse = LinearLogpFunction.apply(hidden, weight, bias, request)
    return LogpResult(logp, lse, None, request.provenance)


class LinearLogpFunction(torch.autograd.Function):
    """Differentiable in hidden, weight and bias around the contract op of a prepared request (single device, or
    a TP shard with its gathered merge): the forward runs it (kernel/execute.py forward) on the detached inputs;
    the backward reads its targets, temperatures and vocabulary window. `bias` is the caller's tensor (the forward
    reads the request's FP32 copy)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, request):
        res = run_forward(request, hidden.detach(), weight.detach())
        ctx.save_for_backward(hidden, weight, bias, request.targets, request.temperature, res.lse)
        ctx.vocab_start, ctx.n_real = request.window.start, request.window.n_real
        ctx.has_bias = bias is not None
        return res.logp, res.lse

    @staticmethod
    def backward(ctx, g_logp, g_lse):
        hidden, weight, bias, targets, temperature, lse = ctx.saved_tensors
        dh, dw, db = logp_grads(hidden, weight, bias if ctx.has_bias else None, targets, temperature, lse,
                                g_logp, g_lse, vocab_start=ctx.vocab_start, n_real=ctx.n_real)
        return (dh.to(hidden.dtype) if ctx.needs_input_grad[0] else None,
                dw.to(weight.dtype) if ctx.needs_input_grad[1] else None,
                db.to(bias.dtype) if (ctx.has_bias and ctx.needs_input_grad[2]) else None,
                None)
