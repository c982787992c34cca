"""The public op. Each entry prepares one immutable Request (kernel/request.py: the argument checks, the backend and
its provenance, the device's invalid rows) and runs it (kernel/execute.py; under kernel/autograd.py where a
gradient is wanted). No checks and no arithmetic live here.

    linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, return_logits=False, vocab_size=None)
        hidden  [N, D] bf16, D a multiple of 16
        weight  [V_rows, D] bf16; rows >= vocab_size are padding and never enter a statistic
        targets [N] int, each in [0, vocab_size)
        -> LogpResult(logp [N] fp32, lse [N] fp32, logits [N, vocab_size] fp32 unscaled or None, provenance)

    shard_tile_stats(...)   tile statistics of one vocabulary shard starting at global id vocab_start
    merge_shard_stats(...)  the rank-ordered merge of gathered shard statistics
    linear_logp_tp(...)     both, with the statistics all-gathered over a torch.distributed group
    logp_from_logits(...)   the same statistics and merge over an FP32 logits row (any sharding upstream)
    logits_and_stats(...)   a serving lm_head: unscaled logits and T = 1 tile statistics of every row, no targets
    logp_of_ids(...)        logp of ids [N] or [N, C] from the statistics and logits of one T = 1 call over the whole
                            vocabulary (logits_and_stats, shard_tile_stats): no second pass over the row
    linear_logp_program(...) logp under a sampling-transform program, from the op's logits in row chunks
    check_input_errors(...) synchronise with a device and raise for its invalid rows since the last check

A row whose logits contain a non-finite value (from a non-finite hidden or weight value, or an overflowing
z / T) gets NaN logp and lse; the other rows are unaffected. On a device, a row whose target or temperature lies
outside its range is invalid (CONTRACT.md section 0.1; kernel/invalid_rows.py); on the host it is refused.
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..shared_contract.errors import ContractInputError
from . import execute
from .autograd import differentiable
from .backends import resolve
from .invalid_rows import check_input_errors, nan_result, record_for
from .request import check_hidden_weight, check_target_form, constant_rows, prepare
from .results import LogpResult, ShardStats

__all__ = ["LogpResult", "ShardStats", "check_input_errors", "linear_logp", "linear_logp_program", "linear_logp_tp",
           "logits_and_stats", "logp_from_logits", "logp_of_ids", "merge_shard_stats", "shard_tile_stats"]

# linear_logp_program on CUDA: rows of FP32 logits per GEMM chunk (512 x 151936 x 4 B = 311 MB at Qwen3-8B).
PROGRAM_ROWS_PER_CHUNK_CUDA = 512


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)


def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, return_logits=False, vocab_size=None,
                backend=None, strict=None) -> LogpResult:
    """Selected-token logp and lse of softmax((hidden @ weight.T + bias) / T) under the contract."""
    req = prepare("linear_logp", hidden=hidden, weight=weight, targets=targets, bias=bias, temperature=temperature,
                  return_logits=return_logits, vocab_size=vocab_size, backend=backend, strict=strict)
    if _needs_grad(hidden, weight, bias):
        return nan_result(req.invalid_rows, differentiable(req, hidden, weight, bias))
    return nan_result(req.invalid_rows, execute.forward(req, hidden, weight))


def shard_tile_stats(hidden, weight_shard, targets, *, vocab_start, vocab_size, bias=None, temperature=1.0,
                     return_logits=False, backend=None, strict=None) -> ShardStats:
    """Tile statistics of the shard whose first weight row is global vocabulary id `vocab_start`."""
    req = prepare("shard_tile_stats", hidden=hidden, weight=weight_shard, targets=targets, bias=bias,
                  temperature=temperature, vocab_start=vocab_start, vocab_size=vocab_size,
                  return_logits=return_logits, backend=backend, strict=strict)
    return execute.shard_stats(req, hidden, weight_shard)


def merge_shard_stats(stats: Sequence[ShardStats], *, vocab_size, backend=None, strict=None) -> LogpResult:
    """Merge statistics of consecutive shards given in rank order (no arithmetic before the merge)."""
    req = prepare("merge_shard_stats", stats=stats, vocab_size=vocab_size, backend=backend, strict=strict)
    return execute.merge(req.stats, req.backend, req.provenance)


def linear_logp_tp(hidden, weight_shard, targets, *, vocab_start, vocab_size, group=None, bias=None,
                   temperature=1.0, backend=None, strict=None) -> LogpResult:
    """Tensor-parallel entry: this rank's tile statistics, all-gathered over `group` in rank order, merged.

    Every rank returns identical logp/lse bytes, equal to the single-device op on the unsharded weight.
    """
    req = prepare("linear_logp_tp", hidden=hidden, weight=weight_shard, targets=targets, bias=bias,
                  temperature=temperature, vocab_start=vocab_start, vocab_size=vocab_size, backend=backend,
                  strict=strict, group=group)
    if _needs_grad(hidden, weight_shard, bias):
        return differentiable(req, hidden, weight_shard, bias)
    return execute.forward(req, hidden, weight_shard)


def logp_from_logits(logits, targets, *, temperature=1.0, vocab_size=None, backend=None,
                     strict=None) -> LogpResult:
    """The contract's statistics and merge over FP32 unscaled logits rows [N, V] (e.g. a gathered vLLM row).
    targets [N], or [N, C] for several ids per row (logp [N, C]; the row statistics are computed once where the
    backend can, else once per column: the same bytes either way)."""
    req = prepare("logp_from_logits", logits=logits, targets=targets, temperature=temperature,
                  vocab_size=vocab_size, backend=backend, strict=strict)
    return nan_result(req.invalid_rows, execute.stats_from_logits(req, logits))


def logits_and_stats(hidden, weight, *, vocab_size=None, bias=None, backend=None, strict=None) -> ShardStats:
    """A serving lm_head: the unscaled FP32 logits z (section 2) and every row's T = 1 tile statistics over the whole
    real vocabulary (section 4), one launch, with no targets (no row can be invalid; the target slots read id 0).
    The same bytes as shard_tile_stats(hidden, weight, zeros, vocab_start=0, return_logits=True); logp_of_ids then
    gives any id's logp and the lse without a second pass over the row."""
    req = prepare("logits_and_stats", hidden=hidden, weight=weight, bias=bias, vocab_size=vocab_size,
                  backend=backend, strict=strict)
    return execute.head_stats(req, hidden, weight)


def logp_of_ids(stats: ShardStats, ids, *, vocab_size, backend=None, strict=None) -> LogpResult:
    """logp of ids [N] (or [N, C], logp [N, C]) from one T = 1 shard_tile_stats call over the whole real vocabulary
    (vocab_start 0, return_logits=True): the row merge (section 5) of that call's tile statistics, with
    z'_id = z[id] read from its logits (section 3: T = 1 is exact). No second pass over the row: the same bytes as
    logp_from_logits(stats.logits, ids, temperature=1.0) and linear_logp(..., ids) at T = 1. An id outside
    [0, vocab_size) makes its row invalid (section 0.1)."""
    req = prepare("logp_of_ids", stats=stats, targets=ids, vocab_size=vocab_size, backend=backend, strict=strict)
    return execute.ids_merge(req)


def linear_logp_program(hidden, weight, targets, program, *, vocab_size=None, rows_per_chunk=None, backend=None,
                        strict=None, transform_path=None) -> LogpResult:
    """Trainer side of the sampling-transform program: logp of each target under `program` (temperature,
    top-k, top-p, min-p), from the op's FP32 logits computed `rows_per_chunk` rows at a time (memory
    [rows_per_chunk, V] FP32, never [N, V]; default 64 rows on CPU, PROGRAM_ROWS_PER_CHUNK_CUDA on CUDA). The
    kept set is computed on the logits' device (transforms.program_logp_from_logits; `transform_path` forces
    'numpy' or 'torch', the same bytes). A target outside its row's kept set raises ContractInputError."""
    from .transforms import program_logp_from_logits

    req = prepare("linear_logp_program", hidden=hidden, weight=weight, targets=targets, vocab_size=vocab_size,
                  backend=backend, strict=strict)
    rows = _program_chunk(program, rows_per_chunk, req.device)
    logps, lses, targets = [], [], req.targets
    for r0 in range(0, hidden.shape[0], rows):
        res = linear_logp(hidden[r0:r0 + rows], weight, targets[r0:r0 + rows], return_logits=True,
                          vocab_size=req.window.size, backend=backend, strict=strict)
        lp, ls, _ = program_logp_from_logits(res.logits, targets[r0:r0 + rows], program, path=transform_path)
        logps.append(lp)
        lses.append(ls)
    empty = torch.zeros(0, dtype=torch.float32, device=req.device)
    return LogpResult(torch.cat(logps) if logps else empty, torch.cat(lses) if lses else empty, None, req.provenance)


def _program_chunk(program, rows_per_chunk, device) -> int:
    """linear_logp_program's rows per chunk, after checking `program` and `rows_per_chunk`."""
    from .transforms import TransformProgram

    if not isinstance(program, TransformProgram):
        raise ContractInputError(f"program must be a TransformProgram; got {type(program).__name__}")
    if rows_per_chunk is None:
        return PROGRAM_ROWS_PER_CHUNK_CUDA if device.type == "cuda" else 64
    if not isinstance(rows_per_chunk, int) or isinstance(rows_per_chunk, bool) or rows_per_chunk < 1:
        raise ContractInputError(f"rows_per_chunk must be None or a positive int; got {rows_per_chunk!r}")
    return rows_per_chunk


# Pieces that bench/serving_host_overhead.py times one by one, under the names it reads.
_check_hidden_weight = check_hidden_weight
_check_target_form = check_target_form
_constant_row_values = constant_rows
_resolve = resolve
_row_errors = record_for
