"""The backends and the one door to them. Strict mode selects contract-bearing backends only; everything else raises.

  sm90         the fused wgmma kernel (contract-bearing; CUDA, compute capability 9.0)
  oracle       the CPU oracle, numpy (contract-bearing; any device, computes on the CPU): the readable reference
  oracle-fast  the same bytes compiled (kernel/cpu, C++/AVX-512, threads); needs a C++ compiler and ninja.
               What 'auto' selects for CPU inputs (every contract test runs on both CPU backends)
  torch        fp32 matmul + log_softmax (NOT contract-bearing; refused in strict mode)

Every backend has `name`, `contract_bearing`, `available(device=None) -> (ok, why)`, `describe()` and the
contract entries `linear_logp`, `shard_stats`, `merge_stats(tile_max, tile_sum, target_logit) -> (logp, lse)`
and `stats_from_logits` (the torch backend: `linear_logp` and `stats_from_logits` only). A device backend (sm90)
also has the auxiliary entries whose bytes do not depend on where they run: `tile_stats_from_logits`,
`topp_crossing`, `backward_dz` and `fingerprint_rows`; `device_backend(device)` returns it for tensors on an SM90
GPU, and the backward, the transform program and the fingerprint use it there (elsewhere their torch/host
formulation of the same arithmetic). Nothing outside this package reaches a compiled extension directly.
"""
from __future__ import annotations

import importlib
import logging

import torch

from ..shared_contract.errors import BackendUnavailableError, StrictModeError

log = logging.getLogger("fused_logp")

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


def _sm90_status(device):
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
    device = torch.device(device)
    return get_backend("sm90") if _sm90_status(device)[0] else None


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
        ok, why = _sm90_status(device)
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
