"""Status readable in production, without vLLM's dev mode.

- Prometheus: the frontend process (the OpenAI server, whose /metrics serves the default registry, or the
  offline LLM) exports `fused_logp_info{contract_version, strict, backend, weight_version} 1` once an engine
  with the plugin enabled starts (no series without it). `backend` is the backend that served the lm_head (the
  op's provenance, not the configured `auto`): "pending" until the first forward (vLLM's profile run, before the
  server answers). The worker reports it to the frontend through a file named by FUSED_LOGP_SERVED_FILE, which
  the frontend sets before vLLM starts the engine's processes (they inherit it); in one process it is set
  directly.
- vLLM's weight-version label (vLLM versions that have one, EngineCore.set_weight_version): after the engine
  starts and after every worker RPC (reload_weights, update_weights, ...), the engine core sets the label to
  the lm_head fingerprint, unless the operator set a label of their own. Every completion then carries it
  (`CompletionOutput.weight_versions`), and `weight_version` in fused_logp_info follows it.
"""
from __future__ import annotations

import functools
import logging
import os
import tempfile
import time

log = logging.getLogger("vllm.fused_logp")

METRIC = "fused_logp_info"
SERVED_ENV = "FUSED_LOGP_SERVED_FILE"
PENDING = "pending"
_gauge = None
_labels: dict | None = None
_served: str | None = None            # the backend that served this process's lm_head, once known
_polled = 0.0


def _get_gauge():
    global _gauge
    if _gauge is None:
        from prometheus_client import Gauge
        _gauge = Gauge(METRIC, "fused_logp vLLM plugin: 1 while the contract op serves the lm_head "
                       "(labels: contract version, strict, backend, weight version = lm_head fingerprint)",
                       ["contract_version", "strict", "backend", "weight_version"])
    return _gauge


def publish(settings, weight_version: str | None = None) -> None:
    """Set fused_logp_info for this process's engine (replacing the previous label set)."""
    global _labels
    from ..shared_contract.constants import CONTRACT_VERSION

    try:
        g = _get_gauge()
    except ImportError:                  # prometheus_client is one of vLLM's requirements; keep going without it
        return
    labels = {"contract_version": CONTRACT_VERSION, "strict": str(settings.strict).lower(),
              "backend": _served or (_labels or {}).get("backend") or PENDING,
              "weight_version": weight_version or (_labels or {}).get("weight_version", "pending")}
    if labels == _labels:
        return
    if _labels is not None:
        try:
            g.remove(*_labels.values())
        except KeyError:
            pass
    g.labels(**labels).set(1)
    _labels = labels


def prepare_frontend() -> None:
    """Frontend, before vLLM starts the engine's processes: name the file through which a worker reports the
    backend that served (inherited through the environment; kept if the operator set one)."""
    if not os.environ.get(SERVED_ENV):
        fd, path = tempfile.mkstemp(prefix="fused_logp_served_")
        os.close(fd)
        os.unlink(path)
        os.environ[SERVED_ENV] = path


def served(backend: str) -> None:
    """Worker, after the op served the lm_head: the backend's name (its provenance) for fused_logp_info."""
    global _served
    if not backend or backend == _served:
        return
    _served = backend
    path = os.environ.get(SERVED_ENV)
    if path:
        try:
            tmp = f"{path}.{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(backend)
            os.replace(tmp, path)
        except OSError as exc:
            log.debug("fused_logp: cannot report the served backend to the frontend (%s)", exc)
    if _labels is not None and _labels["backend"] != backend:
        _relabel(backend=backend)


def poll_served(min_interval_s: float = 0.5) -> None:
    """Frontend: while the series says backend="pending", read the worker's report (at most every
    min_interval_s)."""
    global _polled
    if _labels is None or _labels["backend"] != PENDING:
        return
    now = time.monotonic()
    if now - _polled < min_interval_s:
        return
    _polled = now
    path = os.environ.get(SERVED_ENV)
    if not path:
        return
    try:
        with open(path) as f:
            name = f.read().strip()
    except OSError:
        return
    if name:
        _relabel(backend=name)


def current_labels() -> dict | None:
    return None if _labels is None else dict(_labels)


def _sync_weight_version(core) -> None:
    """Engine core: set vLLM's weight-version label to the fingerprint, unless the operator set their own."""
    current = getattr(core, "_weight_version", None)
    if current is None:
        return
    ours = core.__dict__.get("_fused_logp_label")
    if current not in ("default", ours):
        return
    try:
        status = core.model_executor.collective_rpc("fused_logp_status")
    except Exception as exc:            # a worker without the plugin's RPCs: nothing to publish
        log.debug("fused_logp: no status for the weight-version label (%s)", exc)
        return
    fps = {h["fingerprint"] for s in status if s and s.get("active") for h in s["heads"] if h["fingerprint"]}
    if len(fps) == 1:
        fp = fps.pop()
        core._weight_version = fp
        core.__dict__["_fused_logp_label"] = fp


def install_engine_core() -> None:
    from vllm.v1.engine.core import EngineCore

    if not hasattr(EngineCore, "set_weight_version"):
        return                           # this vLLM has no weight-version label
    orig_kv = EngineCore._initialize_kv_caches
    orig_rpc = EngineCore.collective_rpc

    @functools.wraps(orig_kv)
    def _initialize_kv_caches(self, *args, **kwargs):
        out = orig_kv(self, *args, **kwargs)
        if self.vllm_config.additional_config and _plugin_on(self.vllm_config):
            _sync_weight_version(self)
        return out

    @functools.wraps(orig_rpc)
    def collective_rpc(self, method, *args, **kwargs):
        out = orig_rpc(self, method, *args, **kwargs)
        if not (isinstance(method, str) and method.startswith("fused_logp")) and _plugin_on(self.vllm_config):
            _sync_weight_version(self)
        return out

    EngineCore._initialize_kv_caches = _initialize_kv_caches
    EngineCore.collective_rpc = collective_rpc


def _plugin_on(vllm_config) -> bool:
    cached = vllm_config.__dict__.get("_fused_logp_on") if hasattr(vllm_config, "__dict__") else None
    if cached is None:
        from .settings import settings_from_vllm_config
        cached = settings_from_vllm_config(vllm_config) is not None
        try:
            vllm_config.__dict__["_fused_logp_on"] = cached
        except (AttributeError, TypeError):
            pass
    return cached


def install_frontend() -> None:
    """The frontend's OutputProcessor: follow the weight-version label in fused_logp_info."""
    from vllm.v1.engine.output_processor import OutputProcessor

    orig = OutputProcessor.process_outputs

    @functools.wraps(orig)
    def process_outputs(self, *args, **kwargs):
        if _labels is not None and _labels["backend"] == PENDING:
            poll_served()
        wv = kwargs.get("weight_version")
        if wv is not None and _labels is not None and wv != _labels["weight_version"] and wv != "default":
            _labels_update(wv)
        return orig(self, *args, **kwargs)

    OutputProcessor.process_outputs = process_outputs


def _labels_update(weight_version: str) -> None:
    _relabel(weight_version=weight_version)


def _relabel(**changes) -> None:
    global _labels
    g = _get_gauge()
    old = _labels
    new = dict(old, **changes)
    try:
        g.remove(*old.values())
    except KeyError:
        pass
    g.labels(**new).set(1)
    _labels = new


def install() -> None:
    install_engine_core()
    try:
        install_frontend()
    except (ImportError, AttributeError):
        pass
