"""Backend registry. Strict mode selects contract-bearing backends only; everything else raises.

Backends are named and imported lazily:
  sm90    the fused wgmma kernel (contract-bearing; CUDA, compute capability 9.0)
  oracle  the CPU oracle (contract-bearing; any device, computes on the CPU)
  torch   fp32 matmul + log_softmax (NOT contract-bearing; refused in strict mode)
"""
from __future__ import annotations

import importlib
import logging

from ..shared_contract.errors import BackendUnavailableError, StrictModeError

log = logging.getLogger("fused_logp")

_BACKENDS = {
    "sm90": "fused_logp.kernel.sm90:SM90Backend",
    "oracle": "fused_logp.kernel.oracle:OracleBackend",
    "torch": "fused_logp.kernel.torch_backend:TorchBackend",
}
_instances: dict = {}


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
    return backend.available()


def select_backend(name: str, device, strict: bool):
    """Return (backend, fallback_reason_or_None) for a request. Raises in strict mode on non-contract backends."""
    if name == "auto":
        ok, why = _sm90_status(device)
        if ok:
            return get_backend("sm90"), None
        if device.type == "cuda":
            reason = f"sm90 backend unavailable ({why}); the CPU oracle computes the same bytes, slowly"
            log.warning("fused_logp: %s", reason)
            return get_backend("oracle"), reason
        return get_backend("oracle"), None
    backend = get_backend(name)
    if strict and not backend.contract_bearing:
        raise StrictModeError(f"backend {name!r} does not carry the contract; strict mode accepts only "
                              f"{tuple(n for n in _BACKENDS if n != 'torch')} (or 'auto')")
    ok, why = backend.available()
    if not ok:
        raise BackendUnavailableError(f"backend {name!r} is unavailable here: {why}")
    if not backend.contract_bearing:
        log.warning("fused_logp: backend %r is not contract-bearing; its bytes are not the contract's", name)
    return backend, None
