"""The public op: argument checks, backend choice (registry), provenance. No arithmetic lives here.

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

A row whose logits contain a non-finite value (from a non-finite hidden or weight value, or an overflowing
z / T) gets NaN logp and lse; the other rows are unaffected.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

import torch

from ..shared_contract import constants as C
from ..shared_contract.config import get_config
from ..shared_contract.errors import ContractInputError
from ..shared_contract.provenance import Provenance, make_provenance
from .backends import select_backend
from .autograd import LinearLogpFunction

_FLOAT_BIAS = (torch.bfloat16, torch.float16, torch.float32)
# linear_logp_program on CUDA: rows of FP32 logits per GEMM chunk (512 x 151936 x 4 B = 311 MB at Qwen3-8B).
PROGRAM_ROWS_PER_CHUNK_CUDA = 512


@dataclasses.dataclass
class LogpResult:
    logp: torch.Tensor                    # [N] fp32
    lse: torch.Tensor                     # [N] fp32
    logits: torch.Tensor | None           # [N, V] fp32, unscaled (before temperature), or None
    provenance: Provenance


@dataclasses.dataclass
class ShardStats:
    tile_max: torch.Tensor                # [N, nt] fp32, global tiles tile_offset .. tile_offset+nt-1
    tile_sum: torch.Tensor                # [N, nt] fp32
    target_logit: torch.Tensor            # [N] fp32: z'_target where this shard owns the target, else -inf
    target_owned: torch.Tensor            # [N] bool
    tile_offset: int
    logits: torch.Tensor | None           # [N, n_real_local] fp32 unscaled, or None
    provenance: Provenance
    unit_temperature: bool = False        # computed at T = 1 (a number that is 1 as binary32)


# ---------------------------------------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------------------------------------

def _check_hidden_weight(hidden, weight, weight_name="weight"):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ContractInputError(f"hidden must be a 2-D tensor [N, D]; got "
                                 f"{getattr(hidden, 'shape', type(hidden).__name__)}")
    if hidden.dtype != torch.bfloat16:
        raise ContractInputError(f"hidden must be torch.bfloat16 (contract v1 covers bf16 inputs only); got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ContractInputError(f"{weight_name} must be a 2-D tensor [V, D]; got "
                                 f"{getattr(weight, 'shape', type(weight).__name__)}")
    if weight.dtype != torch.bfloat16:
        raise ContractInputError(f"{weight_name} must be torch.bfloat16 (contract v1 covers bf16 inputs only); "
                                 f"got {weight.dtype}")
    d = hidden.shape[1]
    if d < C.K_GROUP or d % C.K_GROUP:
        raise ContractInputError(f"hidden size D must be a positive multiple of {C.K_GROUP} (the k16 group); got D={d}")
    if weight.shape[1] != d:
        raise ContractInputError(f"{weight_name} must have D={d} columns to match hidden [N, D]; got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ContractInputError(f"hidden and {weight_name} must be on one device; got {hidden.device} and {weight.device}")


def _check_vocab(vocab_size, rows, sharded=False):
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ContractInputError(f"vocab_size must be a positive int; got {vocab_size!r}")
    if not sharded and vocab_size > rows:
        raise ContractInputError(f"vocab_size must be in [1, {rows}] (the weight's rows); got {vocab_size}")


def _check_target_form(targets, n, device, columns=False):
    """Refuse targets that are not an int32/int64 tensor [N] (or [N, C] with C >= 1 where columns) on `device`."""
    dims = (1, 2) if columns else (1,)
    if not isinstance(targets, torch.Tensor) or targets.dim() not in dims or targets.shape[0] != n:
        what = "a 1-D integer tensor [N] or a 2-D one [N, C]" if columns else "a 1-D integer tensor"
        raise ContractInputError(f"targets must be {what} of length N={n}; got "
                                 f"{getattr(targets, 'shape', type(targets).__name__)}")
    if targets.dim() == 2 and targets.shape[1] == 0:
        raise ContractInputError("targets [N, C] must have at least one column")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ContractInputError(f"targets must be torch.int64 or torch.int32; got {targets.dtype}")
    if targets.device != device:
        raise ContractInputError(f"targets must be on {device}; got {targets.device}")


def _check_targets(targets, n, vocab_size, device, columns=False, host_check=False):
    """-> (targets int64, invalid-row mask [N] bool on the device or None). On the CPU, or with host_check,
    an id outside [0, vocab_size) is refused here; on a device the row is invalid (section 0.1)."""
    _check_target_form(targets, n, device, columns)
    if n == 0:
        return targets.to(torch.int64), None
    if device.type == "cpu" or host_check:
        if targets.device.type == "cpu":              # one reduction, read on the host (a serving step calls this)
            lo, hi = torch.aminmax(targets)
            in_range = int(lo) >= 0 and int(hi) < vocab_size
        else:                                         # host_check of device targets: one synchronisation
            in_range = bool(((targets >= 0) & (targets < vocab_size)).all())
        if not in_range:
            ok = (targets >= 0) & (targets < vocab_size)
            bad = targets[~ok][0].item()
            raise ContractInputError(f"targets must lie in the real vocabulary [0, {vocab_size}); got {bad}")
        return (targets if targets.dtype == torch.int64 else targets.to(torch.int64)).contiguous(), None
    # On a device: no host synchronisation and no device-side assertion (it would end the process or poison the
    # CUDA context). An invalid row's target becomes the safe id 0 before any launch; the row is reported
    # (CONTRACT.md section 0.1, _row_guard) and its logp and lse become NaN.
    return _device_safe_targets(targets, vocab_size)


def _device_safe_targets(targets, vocab_size):
    """-> (targets int64 with every id outside [0, vocab_size) replaced by 0, invalid-row mask [N] bool): a few
    device operations, no host synchronisation (a serving engine calls this on every step)."""
    bad = (targets < 0) | (targets >= vocab_size)
    safe = targets.masked_fill(bad, 0)
    return safe.to(torch.int64).contiguous(), (bad if bad.dim() == 1 else bad.any(dim=1))


def _temperature_tensor(temperature, n, device):
    """-> (temperature as an FP32 tensor [N], invalid-row mask [N] bool on the device or None). A Python number
    is rounded to binary32 once. A value already on the host (a number, a CPU tensor) is checked and refused
    here; a tensor on a device is checked there: an invalid row's temperature becomes 1 before any launch and
    the row is reported (CONTRACT.md section 0.1, _row_guard)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(n)
        if temperature.dim() != 1 or temperature.shape[0] != n:
            raise ContractInputError(f"temperature must be a number or a tensor of shape [N]={n}; got "
                                     f"{tuple(temperature.shape)}")
        if not temperature.is_floating_point():
            raise ContractInputError(f"temperature must be a floating tensor; got {temperature.dtype}")
        if device.type == "cpu" and temperature.device.type != "cpu":    # a CPU call: the values come to the host
            temperature = temperature.cpu()
        on_host = temperature.device.type == "cpu"
        if on_host:
            t = temperature if temperature.dtype == torch.float32 else temperature.to(dtype=torch.float32)
        else:
            t = temperature.to(device=device, dtype=torch.float32)
        if on_host:
            if n:
                # one reduction: every value is finite and > 0 iff min > 0 and max < inf (a NaN makes both NaN)
                lo, hi = torch.aminmax(t)
                if not (float(lo) > 0 and float(hi) < math.inf):
                    ok = torch.isfinite(t) & (t > 0)
                    raise ContractInputError(f"temperature must be finite and > 0 (as binary32); got "
                                             f"{t[~ok][0].item()}")
            return (t if t.device == device else t.to(device=device)).contiguous(), None
        if not n:
            return t.contiguous(), None
        bad = ~(torch.isfinite(t) & (t > 0))
        return t.masked_fill(bad, 1.0).contiguous(), bad
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise ContractInputError(f"temperature must be a number or a tensor [N]; got {type(temperature).__name__}")
    t32 = torch.tensor(float(temperature), dtype=torch.float32)
    if not math.isfinite(float(temperature)) or not (float(t32) > 0) or not math.isfinite(float(t32)):
        raise ContractInputError(f"temperature must be finite and > 0 as binary32 (about [1.4e-45, 3.4e38]); "
                                 f"got {temperature!r}")
    # filled on the device: a host-to-device copy from pageable memory would synchronise the stream each call
    return torch.full((n,), float(t32), dtype=torch.float32, device=device), None


# Invalid per-row values on a device (CONTRACT.md section 0.1): counted on the device, never asserted there.
_ROW_ARGS = ("targets", "temperature")
_ROW_RANGE = {"targets": "must lie in the real vocabulary [0, vocab_size) of their call",
              "temperature": "must be finite and > 0 (as binary32)"}
_row_errors_by_device: dict = {}
_row_log = logging.getLogger("fused_logp")


class _RowErrors:
    """Invalid rows per argument on one device since the last check: a device counter, and its snapshot copied
    to pinned host memory after each call (no synchronisation) so that a later call can read it once done."""

    # The counter lives across calls made inside and outside torch.inference_mode (vLLM serves in it, a trainer
    # does not): it is an ordinary tensor, created and updated with inference mode off.
    # Kernels that count invalid target rows themselves (the serving merge of ids) use a second record: a running
    # device total with a block ticket (`ids`, never zeroed) that each launch also stores into pinned host memory
    # (`ids_mirror`), read here without a copy or an event; `ids_seen` is the total already reported.
    def __init__(self, device):
        with torch.inference_mode(False):
            self.count = torch.zeros(len(_ROW_ARGS), dtype=torch.int64, device=device)
            self.snapshot = torch.zeros(len(_ROW_ARGS), dtype=torch.int64, pin_memory=True)
            self.ids = torch.zeros(2, dtype=torch.int64, device=device)
            self.ids_mirror = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.ids_mirror_np = self.ids_mirror.numpy()       # the same host memory, read without a torch call
        self.ids_seen = 0
        self.event = None

    def record(self, masks):
        with torch.inference_mode(False), torch.no_grad():
            for i, m in enumerate(masks):
                if m is not None:
                    self.count[i].add_(m.sum())
            self.snapshot.copy_(self.count, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(self.count.device))

    def take(self, wait):
        """Counts recorded so far (all of them with wait=True, which synchronises; else what a finished
        snapshot and the mirror show, or nothing); the counter restarts from zero once a non-zero count is returned,
        and the running total of the ids record is reported once."""
        ids_total = int(self.ids[0]) if wait else int(self.ids_mirror_np[0])   # int(self.ids[0]) synchronises
        new_ids = max(0, ids_total - self.ids_seen)
        self.ids_seen = max(self.ids_seen, ids_total)
        if wait:
            counts = [int(c) for c in self.count.tolist()]
        elif self.event is not None and self.event.query():
            counts = [int(c) for c in self.snapshot.tolist()]
            self.event = None
        else:
            counts = [0] * len(_ROW_ARGS)
        if any(counts):
            with torch.inference_mode(False):
                self.count.zero_()
        counts[0] += new_ids
        return counts if any(counts) else None


def _row_error_message(counts, device):
    return "; ".join(f"{arg} {_ROW_RANGE[arg]}: {k} row(s) on {device} were not since the last check (their logp "
                     f"and lse are NaN)" for arg, k in zip(_ROW_ARGS, counts) if k)


def check_input_errors(device=None) -> None:
    """Synchronise with `device` (default: the current CUDA device) and raise ContractInputError naming the
    argument if any call since the last check had an invalid per-row value there (section 0.1)."""
    dev = torch.device(device if device is not None else f"cuda:{torch.cuda.current_device()}")
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device(f"cuda:{torch.cuda.current_device()}")
    errs = _row_errors_by_device.get(dev)
    counts = errs.take(wait=True) if errs is not None else None
    if counts:
        raise ContractInputError(_row_error_message(counts, dev))


def _row_errors(device, strict) -> _RowErrors:
    """The invalid-row record of `device` (a CUDA device), after reading earlier calls' finished records without
    waiting: strict mode raises ContractInputError naming the argument, otherwise a warning is logged."""
    if device.index is None:
        device = torch.device(f"cuda:{torch.cuda.current_device()}")
    errs = _row_errors_by_device.get(device)
    if errs is None:
        errs = _row_errors_by_device[device] = _RowErrors(device)
    counts = errs.take(wait=False)
    if counts:
        strict = get_config().strict if strict is None else bool(strict)
        if strict:
            raise ContractInputError(_row_error_message(counts, device))
        _row_log.warning("fused_logp: %s", _row_error_message(counts, device))
    return errs


def _row_guard(device, strict, bad_targets, bad_temperature):
    """Invalid-row bookkeeping of one call on a device: earlier calls' finished records are read without
    waiting (_row_errors), this call's masks are counted on the device. -> the combined invalid-row mask [N], or
    None (nothing to mask)."""
    present = [m for m in (bad_targets, bad_temperature) if m is not None]
    if device.type == "cpu" or not present:
        return None
    _row_errors(device, strict).record((bad_targets, bad_temperature))
    return present[0] if len(present) == 1 else present[0] | present[1]


def _nan_rows(bad, *tensors):
    """The tensors with the rows of `bad` set to NaN (None passes through)."""
    if bad is None:
        return tensors if len(tensors) > 1 else tensors[0]
    out = tuple(None if t is None else torch.where(bad.view(-1, *([1] * (t.dim() - 1))), float("nan"), t)
                for t in tensors)
    return out if len(out) > 1 else out[0]


def _nan_result(bad, res):
    """A LogpResult with the logp and lse of the rows of `bad` set to NaN."""
    if bad is None:
        return res
    logp, lse = _nan_rows(bad, res.logp, res.lse)
    return dataclasses.replace(res, logp=logp, lse=lse)


def _bias_tensor(bias, rows, device):
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != rows:
        raise ContractInputError(f"bias must be a 1-D tensor of {rows} entries (one per weight row); "
                                 f"got {getattr(bias, 'shape', type(bias).__name__)}")
    if bias.dtype not in _FLOAT_BIAS:
        raise ContractInputError(f"bias must be bf16, fp16 or fp32 (converted to fp32 exactly); got {bias.dtype}")
    if bias.device != device:
        raise ContractInputError(f"bias must be on {device}; got {bias.device}")
    return bias.detach().to(torch.float32).contiguous()


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _with_grad(forward, hidden, weight, bias, targets, temp, vocab_start, n_real) -> LogpResult:
    """Run `forward` (-> LogpResult) under LinearLogpFunction; logits are not returned on the training path."""
    box = []

    def run(h, w, b):
        box.append(forward(h, w, b))
        return box[0].logp, box[0].lse

    logp, lse = LinearLogpFunction.apply(hidden, weight, bias, targets, temp, run, vocab_start, n_real)
    return LogpResult(logp, lse, None, box[0].provenance)


_provenance: dict = {}


_resolved_cuda: dict = {}


def _resolve(backend, strict, device):
    cfg = get_config()
    if device.type == "cuda":         # the SM90 answer for a device is settled once (sm90.available): one lookup
        hit = _resolved_cuda.get((backend, strict, device))
        if hit is not None and hit[0] is cfg:
            return hit[1], hit[2]
        be, prov = _resolve_new(cfg, backend, strict, device)
        if be.name == "sm90":
            _resolved_cuda[(backend, strict, device)] = (cfg, be, prov)
        return be, prov
    return _resolve_new(cfg, backend, strict, device)


def _resolve_new(cfg, backend, strict, device):
    strict = cfg.strict if strict is None else bool(strict)
    name = cfg.backend if backend is None else backend
    be, fallback = select_backend(name, device, strict)
    # a backend's record is built once per (backend, what it depends on, strict, fallback), not on every call: the
    # device backend's depends on the device only; a host backend's is what it describes (its build can change, e.g.
    # a forced scalar path)
    depends = device if be.name == "sm90" else tuple(be.describe().items())
    key = (be.name, depends, strict, fallback)
    prov = _provenance.get(key)
    if prov is None:
        prov = _provenance[key] = make_provenance(be, strict=strict, fallback=fallback)
    return be, prov


def _is_unit_temperature(temperature) -> bool:
    """True for a number that is 1 as binary32 (section 3: z' = z exactly); tensors are not inspected."""
    if isinstance(temperature, torch.Tensor) or isinstance(temperature, bool) \
            or not isinstance(temperature, (int, float)):
        return False
    return float(torch.tensor(float(temperature), dtype=torch.float32)) == 1.0


def _require(be, method):
    if not hasattr(be, method):
        raise ContractInputError(f"backend {be.name!r} has no {method} entry")
    return getattr(be, method)


# ---------------------------------------------------------------------------------------------------------
# entries
# ---------------------------------------------------------------------------------------------------------

def linear_logp(hidden, weight, targets, *, bias=None, temperature=1.0, return_logits=False, vocab_size=None,
                backend=None, strict=None) -> LogpResult:
    """Selected-token logp and lse of softmax((hidden @ weight.T + bias) / T) under contract v1."""
    _check_hidden_weight(hidden, weight)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    _check_vocab(vocab_size, weight.shape[0])
    n, dev = hidden.shape[0], hidden.device
    targets, bad_targets = _check_targets(targets, n, vocab_size, dev)
    temp, bad_temp = _temperature_tensor(temperature, n, dev)
    b32 = _bias_tensor(bias, weight.shape[0], dev)          # fp32, detached: the forward's bias either way
    be, prov = _resolve(backend, strict, dev)
    bad = _row_guard(dev, strict, bad_targets, bad_temp)

    def forward(h, w, _bias):
        logp, lse, logits = be.linear_logp(h.contiguous(), w.contiguous(), targets, bias=b32, temperature=temp,
                                           return_logits=bool(return_logits), vocab_size=vocab_size)
        return LogpResult(logp, lse, logits, prov)

    if _needs_grad(hidden, weight, bias):
        return _nan_result(bad, _with_grad(forward, hidden, weight, bias, targets, temp, 0, vocab_size))
    return _nan_result(bad, forward(hidden, weight, bias))


def shard_tile_stats(hidden, weight_shard, targets, *, vocab_start, vocab_size, bias=None, temperature=1.0,
                     return_logits=False, backend=None, strict=None) -> ShardStats:
    """Tile statistics of the shard whose first weight row is global vocabulary id `vocab_start`."""
    _check_hidden_weight(hidden, weight_shard, "weight_shard")
    if not isinstance(vocab_start, int) or vocab_start < 0 or vocab_start % C.VOCAB_TILE:
        raise ContractInputError(f"vocab_start must be a non-negative multiple of VOCAB_TILE={C.VOCAB_TILE} "
                                 f"(a shard starts on a global tile boundary); got {vocab_start!r}. "
                                 f"Use logp_from_logits on the gathered row for other shardings.")
    _check_vocab(vocab_size, weight_shard.shape[0], sharded=True)
    end = vocab_start + weight_shard.shape[0]
    if end < vocab_size and end % C.VOCAB_TILE:
        raise ContractInputError(f"a shard must end on a tile boundary or at/after the real vocabulary end "
                                 f"({vocab_size}); weight_shard rows [{vocab_start}, {end}) end mid-tile")
    n, dev = hidden.shape[0], hidden.device
    targets, bad_targets = _check_targets(targets, n, vocab_size, dev)
    temp, bad_temp = _temperature_tensor(temperature, n, dev)
    b = _bias_tensor(bias, weight_shard.shape[0], dev)
    be, prov = _resolve(backend, strict, dev)
    bad = _row_guard(dev, strict, bad_targets, bad_temp)
    st = _require(be, "shard_stats")(hidden.contiguous(), weight_shard.contiguous(), targets,
                                      vocab_start=vocab_start, vocab_size=vocab_size, bias=b, temperature=temp,
                                      return_logits=bool(return_logits))
    st["tile_max"], st["target_logit"] = _nan_rows(bad, st["tile_max"], st["target_logit"])
    return ShardStats(provenance=prov, unit_temperature=_is_unit_temperature(temperature), **st)


def merge_shard_stats(stats: Sequence[ShardStats], *, vocab_size, backend=None, strict=None) -> LogpResult:
    """Merge statistics of consecutive shards given in rank order (no arithmetic before the merge)."""
    if not stats:
        raise ContractInputError("stats must hold at least one ShardStats")
    n_tiles = -(-vocab_size // C.VOCAB_TILE)
    expect = 0
    for r, st in enumerate(stats):
        if st.tile_offset != expect:
            raise ContractInputError(f"stats[{r}] starts at global tile {st.tile_offset}, expected {expect}: "
                                     f"shards must be consecutive and in rank order")
        expect += st.tile_max.shape[1]
    if expect != n_tiles:
        raise ContractInputError(f"the shards cover {expect} tiles; vocab_size={vocab_size} needs {n_tiles}")
    tile_max = torch.cat([s.tile_max for s in stats], dim=1)
    tile_sum = torch.cat([s.tile_sum for s in stats], dim=1)
    target = stats[0].target_logit
    for s in stats[1:]:
        target = torch.where(s.target_owned, s.target_logit, target)
    dev = tile_max.device
    be, prov = _resolve(backend, strict, dev)
    logp, lse = _require(be, "merge_stats")(tile_max.contiguous(), tile_sum.contiguous(), target.contiguous())
    return LogpResult(logp, lse, None, prov)


def linear_logp_tp(hidden, weight_shard, targets, *, vocab_start, vocab_size, group=None, bias=None,
                   temperature=1.0, backend=None, strict=None) -> LogpResult:
    """Tensor-parallel entry: this rank's tile statistics, all-gathered over `group` in rank order, merged.

    Every rank returns identical logp/lse bytes, equal to the single-device op on the unsharded weight.
    """
    import torch.distributed as dist

    def forward(h, w, bias_raw):
        return _tp_forward(dist, h, w, targets, vocab_start, vocab_size, group, bias_raw, temperature, backend, strict)

    if _needs_grad(hidden, weight_shard, bias):
        _check_hidden_weight(hidden, weight_shard, "weight_shard")
        n, dev = hidden.shape[0], hidden.device
        n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
        return _with_grad(forward, hidden, weight_shard, bias, _check_targets(targets, n, vocab_size, dev)[0],
                          _temperature_tensor(temperature, n, dev)[0], vocab_start, n_real)
    return forward(hidden, weight_shard, bias)


def _tp_forward(dist, hidden, weight_shard, targets, vocab_start, vocab_size, group, bias, temperature, backend,
                strict) -> LogpResult:
    st = shard_tile_stats(hidden, weight_shard, targets, vocab_start=vocab_start, vocab_size=vocab_size,
                          bias=bias, temperature=temperature, backend=backend, strict=strict)
    world = dist.get_world_size(group)
    dev = st.tile_max.device
    meta = torch.tensor([st.tile_offset, st.tile_max.shape[1]], dtype=torch.int64, device=dev)
    metas = [torch.empty_like(meta) for _ in range(world)]
    dist.all_gather(metas, meta, group=group)
    shapes = [tuple(int(x) for x in m.tolist()) for m in metas]
    nt_max = max(nt for _, nt in shapes)
    n = st.tile_max.shape[0]

    def gather(x, fill):
        padded = torch.full((n, nt_max), fill, dtype=x.dtype, device=dev)
        padded[:, : x.shape[1]] = x
        out = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(out, padded.contiguous(), group=group)
        return out

    maxes, sums = gather(st.tile_max, float("-inf")), gather(st.tile_sum, 0.0)
    tl = [torch.empty_like(st.target_logit) for _ in range(world)]
    dist.all_gather(tl, st.target_logit.contiguous(), group=group)
    owned_u8 = st.target_owned.to(torch.uint8)
    ow = [torch.empty_like(owned_u8) for _ in range(world)]
    dist.all_gather(ow, owned_u8, group=group)
    gathered = [ShardStats(maxes[r][:, : shapes[r][1]], sums[r][:, : shapes[r][1]], tl[r], ow[r].bool(),
                           shapes[r][0], None, st.provenance) for r in range(world)]
    return merge_shard_stats(gathered, vocab_size=vocab_size, backend=st.provenance.backend,
                             strict=st.provenance.strict)


def logp_from_logits(logits, targets, *, temperature=1.0, vocab_size=None, backend=None,
                     strict=None) -> LogpResult:
    """The contract's statistics and merge over FP32 unscaled logits rows [N, V] (e.g. a gathered vLLM row).
    targets [N], or [N, C] for several ids per row (logp [N, C]; the row statistics are computed once where the
    backend can, else once per column: the same bytes either way)."""
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ContractInputError(f"logits must be a 2-D tensor [N, V]; got "
                                 f"{getattr(logits, 'shape', type(logits).__name__)}")
    if logits.dtype != torch.float32:
        raise ContractInputError(f"logits must be torch.float32 (the contract's logits); got {logits.dtype}")
    vocab_size = logits.shape[1] if vocab_size is None else vocab_size
    _check_vocab(vocab_size, logits.shape[1])
    n, dev = logits.shape[0], logits.device
    targets, bad_targets = _check_targets(targets, n, vocab_size, dev, columns=True)
    temp, bad_temp = _temperature_tensor(temperature, n, dev)
    be, prov = _resolve(backend, strict, dev)
    bad = _row_guard(dev, strict, bad_targets, bad_temp)
    z = logits.contiguous() if vocab_size == logits.shape[1] else logits[:, :vocab_size].contiguous()
    if targets.dim() == 2 and not getattr(be, "multi_target", False):
        cols = [be.stats_from_logits(z, targets[:, c].contiguous(), temperature=temp, vocab_size=vocab_size)
                for c in range(targets.shape[1])]
        return _nan_result(bad, LogpResult(torch.stack([c[0] for c in cols], dim=1), cols[0][1], None, prov))
    logp, lse = be.stats_from_logits(z, targets, temperature=temp, vocab_size=vocab_size)
    return _nan_result(bad, LogpResult(logp, lse, None, prov))


_constant_rows: dict = {}
_constant_row_views: dict = {}


def _constant_row_values(kind, n, device):
    """[n] int64 zeros ('targets'), FP32 ones ('temperature') or True ('owned') on `device`: slices of one buffer
    per device, made outside inference mode and never written (a serving engine asks for them every step)."""
    rows = _constant_row_views.get((kind, device, n))
    if rows is not None:
        return rows
    key = (kind, device)
    buf = _constant_rows.get(key)
    with torch.inference_mode(False):
        if buf is None or buf.shape[0] < n:
            size = max(n, 256 if buf is None else 2 * buf.shape[0])
            buf = _constant_rows[key] = (torch.zeros(size, dtype=torch.int64, device=device) if kind == "targets"
                                         else torch.ones(size, dtype=torch.bool, device=device) if kind == "owned"
                                         else torch.ones(size, dtype=torch.float32, device=device))
        if len(_constant_row_views) >= 4096:
            _constant_row_views.clear()
        rows = _constant_row_views[(kind, device, n)] = buf[:n]       # one view per row count, not one per call
    return rows


def logits_and_stats(hidden, weight, *, vocab_size=None, bias=None, backend=None, strict=None) -> ShardStats:
    """A serving lm_head: the unscaled FP32 logits z (section 2) and every row's T = 1 tile statistics over the whole
    real vocabulary (section 4), one launch, with no targets (no row can be invalid; the target slots read id 0).
    The same bytes as shard_tile_stats(hidden, weight, zeros, vocab_start=0, return_logits=True); logp_of_ids then
    gives any id's logp and the lse without a second pass over the row."""
    _check_hidden_weight(hidden, weight)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    _check_vocab(vocab_size, weight.shape[0])
    n, dev = hidden.shape[0], hidden.device
    b = _bias_tensor(bias, weight.shape[0], dev)
    be, prov = _resolve(backend, strict, dev)
    if hasattr(be, "logits_and_stats"):        # one launch and no per-call tensor work (a serving step calls this)
        tile_max, tile_sum, logits, target_logit = be.logits_and_stats(
            hidden.contiguous(), weight.contiguous(), zeros=_constant_row_values("targets", n, dev),
            ones=_constant_row_values("temperature", n, dev), vocab_size=vocab_size, bias=b)
        return ShardStats(tile_max, tile_sum, target_logit, _constant_row_values("owned", n, dev), 0, logits, prov,
                          unit_temperature=True)
    st = _require(be, "shard_stats")(hidden.contiguous(), weight.contiguous(), _constant_row_values("targets", n, dev),
                                      vocab_start=0, vocab_size=vocab_size, bias=b,
                                      temperature=_constant_row_values("temperature", n, dev), return_logits=True)
    return ShardStats(provenance=prov, unit_temperature=True, **st)


def logp_of_ids(stats: ShardStats, ids, *, vocab_size, backend=None, strict=None) -> LogpResult:
    """logp of ids [N] (or [N, C], logp [N, C]) from one T = 1 shard_tile_stats call over the whole real vocabulary
    (vocab_start 0, return_logits=True): the row merge (section 5) of that call's tile statistics, with
    z'_id = z[id] read from its logits (section 3: T = 1 is exact). No second pass over the row: the same bytes as
    logp_from_logits(stats.logits, ids, temperature=1.0) and linear_logp(..., ids) at T = 1. An id outside
    [0, vocab_size) makes its row invalid (section 0.1)."""
    if not isinstance(stats, ShardStats) or stats.logits is None:
        raise ContractInputError("stats must be the ShardStats of a shard_tile_stats call with return_logits=True")
    if not stats.unit_temperature:
        raise ContractInputError("stats must come from a call at temperature 1 (a number); use logp_from_logits "
                                 "for other temperatures")
    n_tiles = -(-vocab_size // C.VOCAB_TILE)
    if stats.tile_offset != 0 or stats.tile_max.shape[1] != n_tiles or stats.logits.shape[1] != vocab_size:
        raise ContractInputError(f"stats must cover the whole real vocabulary ({vocab_size} ids, {n_tiles} tiles "
                                 f"from tile 0); got {stats.tile_max.shape[1]} tiles from tile {stats.tile_offset}")
    z = stats.logits
    n, dev = z.shape[0], z.device
    be, prov = _resolve(backend, strict, dev)
    if dev.type == "cuda" and hasattr(be, "merge_ids"):
        # one launch: the range check, the gather and the merge; invalid rows are counted by the kernel itself
        _check_target_form(ids, n, dev, columns=True)
        errs = _row_errors(dev, strict)
        logp, lse = be.merge_ids(stats.tile_max, stats.tile_sum, z, ids, vocab_size=vocab_size, bad_rows=errs.ids,
                                 mirror=errs.ids_mirror)
        return LogpResult(logp, lse, None, prov)
    targets, bad_targets = _check_targets(ids, n, vocab_size, dev, columns=True)
    bad = _row_guard(dev, strict, bad_targets, None)
    cols = 1 if targets.dim() == 1 else targets.shape[1]
    z_ids = z.gather(1, targets.view(n, cols)).view(-1)              # z'_id = z[id] at T = 1 (no arithmetic)
    tile_max, tile_sum = stats.tile_max, stats.tile_sum
    if cols > 1:
        tile_max, tile_sum = tile_max.repeat_interleave(cols, dim=0), tile_sum.repeat_interleave(cols, dim=0)
    logp, lse = _require(be, "merge_stats")(tile_max.contiguous(), tile_sum.contiguous(), z_ids.contiguous())
    if targets.dim() == 2:
        logp, lse = logp.view(n, cols), lse.view(n, cols)[:, 0]
    return _nan_result(bad, LogpResult(logp, lse, None, prov))


def linear_logp_program(hidden, weight, targets, program, *, vocab_size=None, rows_per_chunk=None, backend=None,
                        strict=None, transform_path=None) -> LogpResult:
    """Trainer side of the sampling-transform program: logp of each target under `program` (temperature,
    top-k, top-p, min-p), from the op's FP32 logits computed `rows_per_chunk` rows at a time (memory
    [rows_per_chunk, V] FP32, never [N, V]; default 64 rows on CPU, PROGRAM_ROWS_PER_CHUNK_CUDA on CUDA). The
    kept set is computed on the logits' device (transforms.program_logp_from_logits; `transform_path` forces
    'numpy' or 'torch', the same bytes). A target outside its row's kept set raises ContractInputError."""
    from .transforms import program_logp_from_logits

    _check_hidden_weight(hidden, weight)
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    _check_vocab(vocab_size, weight.shape[0])
    targets, _ = _check_targets(targets, hidden.shape[0], vocab_size, hidden.device, host_check=True)
    if rows_per_chunk is None:
        rows_per_chunk = PROGRAM_ROWS_PER_CHUNK_CUDA if hidden.device.type == "cuda" else 64
    logps, lses, prov = [], [], None
    for r0 in range(0, hidden.shape[0], rows_per_chunk):
        res = linear_logp(hidden[r0:r0 + rows_per_chunk], weight, targets[r0:r0 + rows_per_chunk],
                          return_logits=True, vocab_size=vocab_size, backend=backend, strict=strict)
        lp, ls, _ = program_logp_from_logits(res.logits, targets[r0:r0 + rows_per_chunk], program,
                                             path=transform_path)
        logps.append(lp)
        lses.append(ls)
        prov = res.provenance
    if prov is None:
        _, prov = _resolve(backend, strict, hidden.device)
    empty = torch.zeros(0, dtype=torch.float32, device=hidden.device)
    return LogpResult(torch.cat(logps) if logps else empty, torch.cat(lses) if lses else empty, None, prov)
