"""The backends, their written interface, and the one door to them. Strict mode selects contract-bearing backends
only; everything else raises.

  sm90         the fused wgmma kernel (contract-bearing; CUDA, compute capability 9.0)
  oracle       the CPU oracle, numpy (contract-bearing; any device, computes on the CPU): the readable reference
  oracle-fast  the same bytes compiled (kernel/cpu, C++/AVX-512, threads); needs a C++ compiler and ninja.
               What 'auto' selects for CPU inputs (every contract test runs on both CPU backends)
  torch        fp32 matmul + log_softmax (NOT contract-bearing; refused in strict mode)

The interface (`Backend`, `TileStatsBackend`, `ServingBackend` below) is typed: every entry returns one of the
result types `Forward`, `TileStats`, `Merged`, `HeadStats`, never a dict. A backend declares which entries it has
in `entries` (ENTRIES, SERVING_ENTRIES) and whether `stats_from_logits` takes targets [N, C] in `multi_target`;
the op reads the declaration (`require`, `serves`), never probes for a method.

A device backend (sm90) also carries the auxiliary kernels whose bytes do not depend on where they run (the
backward's dz epilogue, stats from logits, the top-p crossing, the fingerprint's row hashes; kernel/sm90_aux.py):
`device_kernels(device)` returns them for tensors on an SM90 GPU, and the backward, the transform program and
the fingerprint use them there (elsewhere their torch/host formulation of the same arithmetic).
`device_status(device)` says whether one serves a device and why not. Nothing outside this package reaches a
compiled extension directly.
"""
from __future__ import annotations

import dataclasses
import importlib
import logging
from typing import NamedTuple, Protocol, runtime_checkable

import torch

from ..shared_contract.config import get_config
from ..shared_contract.errors import BackendUnavailableError, ContractInputError, StrictModeError
from ..shared_contract.provenance import Provenance, make_provenance

log = logging.getLogger("fused_logp")


# ---------------------------------------------------------------------------------------------------------
# the interface: result types and protocols
# ---------------------------------------------------------------------------------------------------------

class Forward(NamedTuple):
    """`linear_logp`'s result: logp [N] and lse [N] FP32, logits [N, vocab_size] FP32 unscaled or None."""
    logp: torch.Tensor
    lse: torch.Tensor
    logits: torch.Tensor | None


class Merged(NamedTuple):
    """The row merge's result (section 5): logp [N] (or [N, C]) and lse [N] FP32."""
    logp: torch.Tensor
    lse: torch.Tensor


class HeadStats(NamedTuple):
    """`logits_and_stats`'s result: T = 1 tile statistics [N, nt] of the whole real vocabulary, the logits
    [N, vocab_size] FP32 and the target slots [N] (a scratch row: no target is asked for)."""
    tile_max: torch.Tensor
    tile_sum: torch.Tensor
    logits: torch.Tensor
    target_logit: torch.Tensor


@dataclasses.dataclass(frozen=True, eq=False)
class TileStats:
    """`shard_stats`'s result: the tile statistics (section 4) of one vocabulary shard."""
    tile_max: torch.Tensor                # [N, nt] FP32, global tiles tile_offset .. tile_offset + nt - 1
    tile_sum: torch.Tensor                # [N, nt] FP32
    target_logit: torch.Tensor            # [N] FP32: z'_target where this shard owns the target, else -inf
    target_owned: torch.Tensor            # [N] bool
    tile_offset: int
    logits: torch.Tensor | None           # [N, n_real] FP32 unscaled, or None

    def __getitem__(self, field: str):
        """Read access by field name (`stats["tile_max"]`), for callers written against the mapping form."""
        if field not in _TILE_STATS_FIELDS:
            raise KeyError(field)
        return getattr(self, field)


_TILE_STATS_FIELDS = frozenset(f.name for f in dataclasses.fields(TileStats))

# The contract entries, and the serving head's (one launch per step: logits with every row's T = 1 statistics, and
# the merge of ids from them).
ENTRIES = ("linear_logp", "stats_from_logits", "shard_stats", "merge_stats")
SERVING_ENTRIES = ("logits_and_stats", "merge_ids")
CORE_ENTRIES = frozenset(ENTRIES)


@runtime_checkable
class Backend(Protocol):
    """What every backend has. `entries` names the entries of ENTRIES + SERVING_ENTRIES it implements (at least
    linear_logp and stats_from_logits); `multi_target`: stats_from_logits takes targets [N] or [N, C]."""
    name: str
    contract_bearing: bool
    entries: frozenset
    multi_target: bool

    def available(self, device=None) -> tuple[bool, str]: ...

    def describe(self) -> dict: ...

    def linear_logp(self, hidden, weight, targets, *, bias, temperature, return_logits, vocab_size) -> Forward: ...

    def stats_from_logits(self, logits, targets, *, temperature, vocab_size) -> Merged: ...


@runtime_checkable
class TileStatsBackend(Backend, Protocol):
    """A backend with the sharded entries (declares "shard_stats" and "merge_stats")."""

    def shard_stats(self, hidden, weight_shard, targets, *, vocab_start, vocab_size, bias, temperature,
                    return_logits) -> TileStats: ...

    def merge_stats(self, tile_max, tile_sum, target_logit) -> Merged: ...


@runtime_checkable
class ServingBackend(TileStatsBackend, Protocol):
    """A backend with the serving head (declares SERVING_ENTRIES): zeros [N] int64 and ones [N] FP32 are the
    target slots and temperatures of a T = 1 call; merge_ids counts its invalid rows into bad_rows (device int64
    [2]) and stores the running count into mirror (pinned host int64 [1])."""

    def logits_and_stats(self, hidden, weight, *, zeros, ones, vocab_size, bias) -> HeadStats: ...

    def merge_ids(self, tile_max, tile_sum, logits, ids, *, vocab_size, bad_rows, mirror) -> Merged: ...


def serves(backend, entry: str) -> bool:
    """Whether `backend` declares `entry`."""
    return entry in backend.entries


def require(backend, entry: str) -> None:
    """Refuse a call of an entry that `backend` does not declare (naming both)."""
    if entry not in backend.entries:
        raise ContractInputError(f"backend {backend.name!r} has no {entry} entry (it has {sorted(backend.entries)}); "
                                 f"choose another with backend=")

_BACKENDS = {
    "sm90": "fused_logp.kernel.sm90:SM90Backend",
    "oracle": "fused_logp.kernel.oracle:OracleBackend",
    "oracle-fast": "fused_logp.kernel.oracle_fast:OracleFastBackend",
    "torch": "fused_logp.kernel.torch_backend:TorchBackend",
}
_instances: dict = {}
_warned: set = set()


def backend_names():
    return tuple(_BACKENDS)


def get_backend(name: str):
    if name not in _BACKENDS:
        raise ValueError(f"backend must be one of {tuple(_BACKENDS)} or 'auto', got {name!r}")
    if name not in _instances:
        module, cls = _BACKENDS[name].split(":")
        try:
            _instances[name] = getattr(importlib.import_module(module), cls)()
        except ImportError as exc:       # the module is absent from this build
            raise BackendUnavailableError(f"backend {name!r} cannot be imported: {exc}") from exc
    return _instances[name]


def device_status(device) -> tuple[bool, str]:
    """(whether the device backend serves tensors on `device`, why or why not)."""
    device = torch.device(device)
    if device.type != "cuda":
        return False, f"inputs are on {device.type}, not CUDA"
    try:
        backend = get_backend("sm90")
    except BackendUnavailableError as exc:
        return False, str(exc)
    return backend.available(device)


def device_backend(device):
    """The device backend serving tensors on `device` (the sm90 backend on an SM90 GPU with the extension built),
    else None."""
    return get_backend("sm90") if device_status(device)[0] else None


def device_kernels(device):
    """The device backend's auxiliary kernels (kernel/sm90_aux.py SM90Aux: backward_dz, tile_stats_from_logits,
    topp_crossing, fingerprint_rows) for tensors on `device`, else None."""
    be = device_backend(device)
    return None if be is None else be.aux


def _cpu_default(strict: bool):
    """'auto' on CPU inputs: the compiled CPU oracle. Where it cannot be built (no C++ compiler, a failed build, a
    build with other contract constants) strict mode raises with the reason; outside strict mode the numpy oracle
    (the same bytes, slower) runs, with a warning logged once per process and the reason in provenance."""
    try:
        fast = get_backend("oracle-fast")
        ok, why = fast.available()
    except BackendUnavailableError as exc:
        fast, ok, why = None, False, str(exc)
    if ok:
        return fast, None
    msg = f"backend 'auto' on CPU inputs selects the compiled CPU oracle (oracle-fast), which is unavailable: {why}"
    if strict:
        raise StrictModeError(f"{msg}. The numpy oracle computes the same bytes far more slowly; it is not chosen "
                              f"silently: ask for it by name (backend='oracle', YAML `backend: oracle`, "
                              f"FUSED_LOGP_BACKEND=oracle), or make the build work (a C++ compiler and ninja)")
    reason = f"{msg}; the numpy oracle (backend 'oracle', the same bytes) ran instead"
    if reason not in _warned:
        _warned.add(reason)
        log.warning("fused_logp: %s", reason)
    return get_backend("oracle"), reason


def select_backend(name: str, device, strict: bool):
    """Return (backend, fallback_reason_or_None) for a request. Raises in strict mode on non-contract backends.

    'auto' on CUDA inputs is the SM90 kernel or nothing: where it is unavailable (another GPU, no built
    extension) the request is refused, in strict mode and outside it, because the contract's other backend, the
    CPU oracle, would move every call to the host. The oracle runs for CUDA inputs only when asked for by name
    (backend='oracle', YAML `backend: oracle`, FUSED_LOGP_BACKEND=oracle).

    'auto' on CPU inputs is the compiled CPU oracle (see _cpu_default)."""
    if name == "auto":
        ok, why = device_status(device)
        if ok:
            return get_backend("sm90"), None
        if device.type == "cuda":
            msg = (f"backend 'auto' on CUDA inputs ({device}) needs the SM90 kernel, which is unavailable: {why}. "
                   f"The contract's only other backend is the CPU oracle, which copies every call's rows and the "
                   f"weight to the host and computes [N, V] logits in float64 there (far too slow for training "
                   f"or serving); it is not chosen silently. To run it anyway ask for it by name: backend='oracle' "
                   f"(YAML `backend: oracle`, FUSED_LOGP_BACKEND=oracle)"
                   + ("" if strict else "; or backend='torch' (GPU, not contract-bearing) outside strict mode"))
            raise (StrictModeError if strict else BackendUnavailableError)(msg)
        return _cpu_default(strict)
    if name in ("oracle", "oracle-fast") and getattr(device, "type", None) == "cuda":
        log.warning(f"fused_logp: backend {name!r} requested for CUDA inputs (%s): the op runs on the CPU "
                    "(contract bytes, host speed)", device)
    backend = get_backend(name)
    if strict and not backend.contract_bearing:
        raise StrictModeError(f"backend {name!r} does not carry the contract; strict mode accepts only "
                              f"{tuple(n for n in _BACKENDS if n != 'torch')} (or 'auto')")
    ok, why = backend.available(device)
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} is unavailable here: {why}")
    if not backend.contract_bearing:
        log.warning("fused_logp: backend %r is not contract-bearing; its bytes are not the contract's", name)
    return backend, None


# ---------------------------------------------------------------------------------------------------------
# a call's backend and provenance
# ---------------------------------------------------------------------------------------------------------

_provenance: dict = {}
_resolved_cuda: dict = {}


def resolve(backend, strict, device) -> tuple[object, Provenance]:
    """(backend, provenance) of a call on `device`: `backend` None or a registry name or 'auto' (None: the
    configuration's), `strict` None or a bool (None: the configuration's). On CUDA the answer for a device is
    settled once (sm90.available), then read from a table."""
    if backend is not None and not isinstance(backend, str):
        raise ContractInputError(f"backend must be None or one of {tuple(_BACKENDS)} or 'auto'; got "
                                 f"{type(backend).__name__} {backend!r}")
    if strict is not None and not isinstance(strict, bool):
        raise ContractInputError(f"strict must be None, True or False; got {type(strict).__name__} {strict!r}")
    cfg = get_config()
    if device.type == "cuda":
        hit = _resolved_cuda.get((backend, strict, device))
        if hit is not None and hit[0] is cfg:
            return hit[1], hit[2]
        be, prov = _resolve_new(cfg, backend, strict, device)
        if be.name == "sm90":
            _resolved_cuda[(backend, strict, device)] = (cfg, be, prov)
        return be, prov
    return _resolve_new(cfg, backend, strict, device)


def _resolve_new(cfg, backend, strict, device):
    strict = cfg.strict if strict is None else strict
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
