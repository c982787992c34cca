"""One request through the op: the argument checks of every public entry, and `prepare`, the one door from an
entry's arguments to the immutable Request that kernel/execute.py runs.

A Request holds what a call needs, each computed once: the targets (int64; on a device, an invalid row's id
replaced by 0), the temperatures (FP32 [N]; on a device, an invalid row's replaced by 1), the bias (FP32,
detached), the vocabulary window (the weight's rows as global ids, the real rows among them, the first tile), the
backend and its provenance, and the invalid-row mask of a device call (CONTRACT.md section 0.1, kernel/
invalid_rows.py). Every refusal is a ContractInputError naming the argument and what is accepted.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import Sequence

import torch

from ..shared_contract import constants as C
from ..shared_contract.errors import ContractInputError
from ..shared_contract.provenance import Provenance
from . import invalid_rows
from .backends import resolve, serves
from .invalid_rows import TEMPERATURE_MAX, TEMPERATURE_MIN, TEMPERATURE_RANGE
from .results import ShardStats

_FLOAT_BIAS = (torch.bfloat16, torch.float16, torch.float32)
_DEVICE_TYPES = ("cpu", "cuda")
ENTRIES = ("linear_logp", "shard_tile_stats", "linear_logp_tp", "logp_from_logits", "logits_and_stats",
           "logp_of_ids", "merge_shard_stats", "linear_logp_program")


@dataclasses.dataclass(frozen=True)
class VocabWindow:
    """The weight (shard)'s rows as global vocabulary ids [start, start + rows), of a real vocabulary [0, size)."""
    start: int
    size: int
    rows: int
    n_real: int            # rows that are real vocabulary ids: max(0, min(rows, size - start))
    tile_offset: int       # the first global tile, start // VOCAB_TILE

    @classmethod
    def of(cls, start: int, size: int, rows: int) -> "VocabWindow":
        return cls(start, size, rows, max(0, min(rows, size - start)), start // C.VOCAB_TILE)


@dataclasses.dataclass(frozen=True, eq=False)
class Request:
    entry: str                              # the public entry that prepared it (ENTRIES)
    device: torch.device
    window: VocabWindow
    targets: torch.Tensor | None            # int64 [N] or [N, C] (None: the entry takes none)
    temperature: torch.Tensor | None        # FP32 [N]
    unit_temperature: bool                  # a number that is 1 as binary32 (section 3: z' = z exactly)
    bias: torch.Tensor | None               # FP32 [rows], detached
    backend: object                         # a backends.Backend
    provenance: Provenance
    invalid_rows: torch.Tensor | None       # bool [N] on the device: rows whose logp and lse become NaN
    return_logits: bool = False
    kernel_counts_rows: bool = False        # logp_of_ids: the backend's merge_ids checks and counts the ids itself
    group: object = None                    # linear_logp_tp: the torch.distributed group
    stats: tuple = ()                       # merge_shard_stats, logp_of_ids: the ShardStats they merge

    @property
    def strict(self) -> bool:
        return self.provenance.strict


# ---------------------------------------------------------------------------------------------------------
# checks
# ---------------------------------------------------------------------------------------------------------

def _shape(x):
    return tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__


def check_tensor_place(name: str, t: torch.Tensor) -> None:
    """A dense tensor with values on a CPU or CUDA device (a meta tensor has no values)."""
    if t.device.type not in _DEVICE_TYPES:
        raise ContractInputError(f"{name} must be on a CPU or CUDA device; got {t.device}"
                                 + (" (a meta tensor has no values)" if t.device.type == "meta" else ""))
    if t.layout != torch.strided:
        raise ContractInputError(f"{name} must be a dense (strided) tensor; got layout {t.layout}")


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise ContractInputError(f"{name} must be True or False; got {type(value).__name__} {value!r}")
    return value


def check_hidden_weight(hidden, weight, weight_name="weight"):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 2:
        raise ContractInputError(f"hidden must be a 2-D tensor [N, D]; got {_shape(hidden)}")
    check_tensor_place("hidden", hidden)
    if hidden.dtype != torch.bfloat16:
        raise ContractInputError(f"hidden must be torch.bfloat16 (the contract covers bf16 inputs only); got "
                                 f"{hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ContractInputError(f"{weight_name} must be a 2-D tensor [V, D]; got {_shape(weight)}")
    check_tensor_place(weight_name, weight)
    if weight.dtype != torch.bfloat16:
        raise ContractInputError(f"{weight_name} must be torch.bfloat16 (the contract covers bf16 inputs only); "
                                 f"got {weight.dtype}")
    d = hidden.shape[1]
    if d < C.K_GROUP or d % C.K_GROUP:
        raise ContractInputError(f"hidden size D must be a positive multiple of {C.K_GROUP} (the k16 group); got D={d}")
    if weight.shape[1] != d:
        raise ContractInputError(f"{weight_name} must have D={d} columns to match hidden [N, D]; got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ContractInputError(f"hidden and {weight_name} must be on one device; got {hidden.device} and {weight.device}")


def check_vocab(vocab_size, rows, sharded=False, what="the weight's rows"):
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < 1:
        raise ContractInputError(f"vocab_size must be a positive int; got {vocab_size!r}")
    if not sharded and vocab_size > rows:
        raise ContractInputError(f"vocab_size must be in [1, {rows}] ({what}); got {vocab_size}")


def check_vocab_start(vocab_start, vocab_size, rows):
    if not isinstance(vocab_start, int) or isinstance(vocab_start, bool) or vocab_start < 0 \
            or vocab_start % C.VOCAB_TILE:
        raise ContractInputError(f"vocab_start must be a non-negative multiple of VOCAB_TILE={C.VOCAB_TILE} "
                                 f"(a shard starts on a global tile boundary); got {vocab_start!r}. "
                                 f"Use logp_from_logits on the gathered row for other shardings.")
    check_vocab(vocab_size, rows, sharded=True)
    end = vocab_start + rows
    if end < vocab_size and end % C.VOCAB_TILE:
        raise ContractInputError(f"a shard must end on a tile boundary or at/after the real vocabulary end "
                                 f"({vocab_size}); weight_shard rows [{vocab_start}, {end}) end mid-tile")


def check_target_form(targets, n, device, columns=False, name="targets"):
    """Refuse targets that are not an int32/int64 tensor [N] (or [N, C] with C >= 1 where columns) on `device`;
    `name` is the argument's name in the entry (targets, ids)."""
    dims = (1, 2) if columns else (1,)
    if not isinstance(targets, torch.Tensor) or targets.dim() not in dims or targets.shape[0] != n:
        what = "a 1-D integer tensor [N] or a 2-D one [N, C]" if columns else "a 1-D integer tensor"
        raise ContractInputError(f"{name} must be {what} of length N={n}; got {_shape(targets)}")
    if targets.dim() == 2 and targets.shape[1] == 0:
        raise ContractInputError(f"{name} [N, C] must have at least one column")
    if targets.dtype not in (torch.int32, torch.int64):
        raise ContractInputError(f"{name} must be torch.int64 or torch.int32; got {targets.dtype}")
    if targets.device != device:
        raise ContractInputError(f"{name} must be on {device}; got {targets.device}")
    check_tensor_place(name, targets)


def check_targets(targets, n, vocab_size, device, columns=False, host_check=False, name="targets"):
    """-> (targets int64, invalid-row mask [N] bool on the device or None). On the CPU, or with host_check,
    an id outside [0, vocab_size) is refused here; on a device the row is invalid (section 0.1)."""
    check_target_form(targets, n, device, columns, name)
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
            raise ContractInputError(f"{name} must lie in the real vocabulary [0, {vocab_size}); got {bad}")
        return (targets if targets.dtype == torch.int64 else targets.to(torch.int64)).contiguous(), None
    # On a device: no host synchronisation and no device-side assertion (it would end the process or poison the
    # CUDA context). An invalid row's target becomes the safe id 0 before any launch; the row is reported
    # (CONTRACT.md section 0.1, invalid_rows.guard) and its logp and lse become NaN.
    bad = (targets < 0) | (targets >= vocab_size)
    safe = targets.masked_fill(bad, 0)
    return safe.to(torch.int64).contiguous(), (bad if bad.dim() == 1 else bad.any(dim=1))


def _temperature_refusal(got) -> ContractInputError:
    return ContractInputError(f"temperature must be finite and > 0, within {TEMPERATURE_RANGE}, as binary32; "
                              f"got {got}")


def check_temperature(temperature, n, device):
    """-> (temperature as an FP32 tensor [N], invalid-row mask [N] bool on the device or None). A Python number
    is rounded to binary32 once. A value already on the host (a number, a CPU tensor) outside
    [TEMPERATURE_MIN, TEMPERATURE_MAX] is refused here; a tensor on a device is checked there: an invalid row's
    temperature becomes 1 before any launch and the row is reported (CONTRACT.md section 0.1)."""
    if isinstance(temperature, torch.Tensor):
        if temperature.dim() == 0:
            temperature = temperature.reshape(1).expand(n)
        if temperature.dim() != 1 or temperature.shape[0] != n:
            raise ContractInputError(f"temperature must be a number or a tensor of shape [N]={n}; got "
                                     f"{tuple(temperature.shape)}")
        check_tensor_place("temperature", temperature)
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
                # one reduction: every value lies in the range iff min and max do (a NaN makes both NaN)
                lo, hi = torch.aminmax(t)
                if not (float(lo) >= TEMPERATURE_MIN and float(hi) <= TEMPERATURE_MAX):
                    ok = (t >= TEMPERATURE_MIN) & (t <= TEMPERATURE_MAX)
                    raise _temperature_refusal(t[~ok][0].item())
            return (t if t.device == device else t.to(device=device)).contiguous(), None
        if not n:
            return t.contiguous(), None
        bad = ~((t >= TEMPERATURE_MIN) & (t <= TEMPERATURE_MAX))
        return t.masked_fill(bad, 1.0).contiguous(), bad
    t32 = _binary32(temperature)
    if not (TEMPERATURE_MIN <= t32 <= TEMPERATURE_MAX):
        raise _temperature_refusal(f"{temperature!r}" + ("" if t32 == temperature or math.isnan(t32)
                                                        else f" ({t32!r} as binary32)"))
    # filled on the device: a host-to-device copy from pageable memory would synchronise the stream each call
    return torch.full((n,), t32, dtype=torch.float32, device=device), None


def _binary32(temperature) -> float:
    """A real number rounded to binary32 (a value beyond its range becomes +-inf)."""
    if isinstance(temperature, bool) or not isinstance(temperature, numbers.Real):
        raise ContractInputError(f"temperature must be a number or a tensor [N]; got {type(temperature).__name__}")
    try:
        x = float(temperature)
    except OverflowError:
        x = math.inf if temperature > 0 else -math.inf
    return float(torch.tensor(x, dtype=torch.float32))


def is_unit_temperature(temperature) -> bool:
    """True for a number that is 1 as binary32 (section 3: z' = z exactly); tensors are not inspected."""
    if isinstance(temperature, (torch.Tensor, bool)) or not isinstance(temperature, numbers.Real):
        return False
    return _binary32(temperature) == 1.0


def check_bias(bias, rows, device):
    if bias is None:
        return None
    if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != rows:
        raise ContractInputError(f"bias must be a 1-D tensor of {rows} entries (one per weight row); "
                                 f"got {_shape(bias)}")
    if bias.dtype not in _FLOAT_BIAS:
        raise ContractInputError(f"bias must be bf16, fp16 or fp32 (converted to fp32 exactly); got {bias.dtype}")
    if bias.device != device:
        raise ContractInputError(f"bias must be on {device}; got {bias.device}")
    return bias.detach().to(torch.float32).contiguous()


def check_logits(logits):
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
        raise ContractInputError(f"logits must be a 2-D tensor [N, V]; got {_shape(logits)}")
    check_tensor_place("logits", logits)
    if logits.dtype != torch.float32:
        raise ContractInputError(f"logits must be torch.float32 (the contract's logits); got {logits.dtype}")


def check_shard_sequence(stats, vocab_size) -> tuple:
    """The ShardStats of consecutive shards in rank order covering the real vocabulary's tiles."""
    if isinstance(stats, (ShardStats, torch.Tensor, str, bytes)) or not isinstance(stats, Sequence) or not stats:
        raise ContractInputError(f"stats must be a non-empty sequence of ShardStats (one per rank, in rank order); "
                                 f"got {type(stats).__name__}")
    for r, st in enumerate(stats):
        if not isinstance(st, ShardStats):
            raise ContractInputError(f"stats[{r}] must be a ShardStats; got {type(st).__name__}")
    check_vocab(vocab_size, 0, sharded=True)
    n, dev = stats[0].tile_max.shape[0], stats[0].tile_max.device
    for r, st in enumerate(stats):
        if st.tile_max.shape[0] != n or st.tile_max.device != dev:
            raise ContractInputError(f"stats[{r}] holds {st.tile_max.shape[0]} rows on {st.tile_max.device}; "
                                     f"stats[0] holds {n} rows on {dev}: the shards must be of one call")
    n_tiles = -(-vocab_size // C.VOCAB_TILE)
    expect = 0
    for r, st in enumerate(stats):
        if st.tile_offset != expect:
            raise ContractInputError(f"stats[{r}] starts at global tile {st.tile_offset}, expected {expect}: "
                                     f"shards must be consecutive and in rank order")
        expect += st.tile_max.shape[1]
    if expect != n_tiles:
        raise ContractInputError(f"stats cover {expect} tiles; vocab_size={vocab_size} needs {n_tiles}")
    check_tensor_place("stats[0].tile_max", stats[0].tile_max)
    return tuple(stats)


def check_head_stats(stats, vocab_size):
    """The ShardStats of one T = 1 call with logits over the whole real vocabulary (logp_of_ids)."""
    if not isinstance(stats, ShardStats) or stats.logits is None:
        raise ContractInputError("stats must be the ShardStats of a shard_tile_stats call with return_logits=True")
    if not stats.unit_temperature:
        raise ContractInputError("stats must come from a call at temperature 1 (a number); use logp_from_logits "
                                 "for other temperatures")
    check_vocab(vocab_size, 0, sharded=True)
    n_tiles = -(-vocab_size // C.VOCAB_TILE)
    if stats.tile_offset != 0 or stats.tile_max.shape[1] != n_tiles or stats.logits.shape[1] != vocab_size:
        raise ContractInputError(f"stats must cover the whole real vocabulary ({vocab_size} ids, {n_tiles} tiles "
                                 f"from tile 0); got {stats.tile_max.shape[1]} tiles from tile {stats.tile_offset}")
    check_tensor_place("stats.logits", stats.logits)


# ---------------------------------------------------------------------------------------------------------
# constant rows of the serving head
# ---------------------------------------------------------------------------------------------------------

_constant_rows: dict = {}
_constant_row_views: dict = {}


def constant_rows(kind, n, device):
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


# ---------------------------------------------------------------------------------------------------------
# the door
# ---------------------------------------------------------------------------------------------------------

def prepare(entry: str, *, hidden=None, weight=None, logits=None, stats=None, targets=None, temperature=1.0,
            bias=None, vocab_start=0, vocab_size=None, return_logits=False, backend=None, strict=None,
            group=None) -> Request:
    """Check the arguments of public entry `entry` (ENTRIES) and return its Request. Raises ContractInputError
    naming the argument; backend and strict are resolved once (backends.resolve)."""
    check_flag("return_logits", return_logits)
    if entry in ("merge_shard_stats", "logp_of_ids"):
        return _prepare_from_stats(entry, stats, targets, vocab_size, backend, strict)
    if entry == "logp_from_logits":
        check_logits(logits)
        n, dev, rows, what = logits.shape[0], logits.device, logits.shape[1], "the logits' columns"
    else:
        shard = entry in ("shard_tile_stats", "linear_logp_tp")
        check_hidden_weight(hidden, weight, "weight_shard" if shard else "weight")
        n, dev, rows, what = hidden.shape[0], hidden.device, weight.shape[0], "the weight's rows"
        if shard:
            check_vocab_start(vocab_start, vocab_size, rows)
    if entry not in ("shard_tile_stats", "linear_logp_tp"):
        vocab_start, vocab_size = 0, rows if vocab_size is None else vocab_size
        check_vocab(vocab_size, rows, what=what)
    window = VocabWindow.of(vocab_start, vocab_size, rows)
    if entry == "logits_and_stats":                    # no targets: every row's T = 1 statistics, no row invalid
        b = check_bias(bias, rows, dev)
        be, prov = resolve(backend, strict, dev)
        return Request(entry, dev, window, constant_rows("targets", n, dev), constant_rows("temperature", n, dev),
                       True, b, be, prov, None, True)
    tg, bad_targets = check_targets(targets, n, vocab_size, dev, columns=entry == "logp_from_logits",
                                    host_check=entry == "linear_logp_program")
    if entry == "linear_logp_program":                 # its temperature is the program's (kernel/transforms.py)
        be, prov = resolve(backend, strict, dev)
        return Request(entry, dev, window, tg, None, True, None, be, prov, None, True)
    temp, bad_temperature = check_temperature(temperature, n, dev)
    b = check_bias(bias, rows, dev) if entry != "logp_from_logits" else None
    be, prov = resolve(backend, strict, dev)
    bad = invalid_rows.guard(dev, prov.strict, bad_targets, bad_temperature)
    return Request(entry, dev, window, tg, temp, is_unit_temperature(temperature), b, be, prov, bad,
                   return_logits, group=group)


def _prepare_from_stats(entry, stats, ids, vocab_size, backend, strict) -> Request:
    if entry == "merge_shard_stats":
        stats = check_shard_sequence(stats, vocab_size)
        dev = stats[0].tile_max.device
        be, prov = resolve(backend, strict, dev)
        return Request(entry, dev, VocabWindow.of(0, vocab_size, vocab_size), None, None, False, None, be, prov,
                       None, stats=stats)
    check_head_stats(stats, vocab_size)
    n, dev = stats.logits.shape[0], stats.logits.device
    window = VocabWindow.of(0, vocab_size, vocab_size)
    be, prov = resolve(backend, strict, dev)
    if dev.type == "cuda" and serves(be, "merge_ids"):
        # one launch: the range check, the gather and the merge; invalid rows are counted by the kernel itself
        check_target_form(ids, n, dev, columns=True, name="ids (the targets)")
        return Request(entry, dev, window, ids, None, True, None, be, prov, None, kernel_counts_rows=True,
                       stats=(stats,))
    tg, bad_targets = check_targets(ids, n, vocab_size, dev, columns=True, name="ids (the targets)")
    bad = invalid_rows.guard(dev, prov.strict, bad_targets, None)
    return Request(entry, dev, window, tg, None, True, None, be, prov, bad, stats=(stats,))
