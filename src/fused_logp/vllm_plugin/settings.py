"""Plugin settings, read from vLLM's own configuration surface, once per engine.

    --additional-config '{"fused_logp": {"enabled": true, "strict": false, "config": "configs/strict.yaml"}}'
    LLM(..., additional_config={"fused_logp": {...}})

Keys: enabled (bool), strict (bool; default: the YAML file's or FUSED_LOGP_STRICT), config (YAML path, read with
fused_logp.shared_contract.config.load_config), backend (auto | sm90 | oracle | torch), capture (bool: keep the
final hidden states of every scored row for audits), capture_limit (int, default 100000: the most captured rows
kept per worker; the oldest are dropped first and counted).

Environment: FUSED_LOGP_VLLM=0 turns the plugin off everywhere (register() installs only the start-up check below);
an engine whose configuration enables the plugin in strict mode is then refused at start (SettingsConflictError),
a non-strict one starts without the plugin and says so once. FUSED_LOGP_VLLM=1 turns the plugin on with defaults
when additional_config has no entry.
"""
from __future__ import annotations

import dataclasses
import logging
import os

from ..shared_contract.config import get_config, load_config
from ..shared_contract.errors import StrictModeError

log = logging.getLogger("vllm.fused_logp")

CONFIG_KEY = "fused_logp"
ENV_SWITCH = "FUSED_LOGP_VLLM"
CAPTURE_LIMIT = 100_000
_KEYS = {"enabled", "strict", "config", "backend", "capture", "capture_limit"}


class SettingsConflictError(StrictModeError):
    """The kill switch is set while the engine's configuration asks for the plugin in strict mode."""


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    strict: bool
    backend: str
    capture: bool
    source: str
    capture_limit: int = CAPTURE_LIMIT


def env_switch() -> bool | None:
    v = os.environ.get(ENV_SWITCH)
    if v is None or v.strip() == "":
        return None
    v = v.strip().lower()
    if v in ("0", "false", "no", "off"):
        return False
    if v in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"{ENV_SWITCH} must be 0/1/true/false/yes/no/on/off; got {os.environ[ENV_SWITCH]!r}")


def _entry(vllm_config):
    extra = getattr(vllm_config, "additional_config", None) or {}
    entry = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if entry is not None and not isinstance(entry, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a mapping; got {type(entry).__name__}")
    if entry is not None:
        unknown = set(entry) - _KEYS
        if unknown:
            raise ValueError(f"additional_config[{CONFIG_KEY!r}]: unknown keys {sorted(unknown)}; "
                             f"accepted keys are {sorted(_KEYS)}")
    return entry


def _build(entry: dict) -> PluginSettings:
    base = load_config(entry["config"]) if entry.get("config") else get_config()
    strict = entry.get("strict", base.strict)
    if not isinstance(strict, bool):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]['strict'] must be true or false; got {strict!r}")
    backend = entry.get("backend", base.backend)
    capture = entry.get("capture", False)
    if not isinstance(capture, bool):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]['capture'] must be true or false; got {capture!r}")
    limit = entry.get("capture_limit", CAPTURE_LIMIT)
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]['capture_limit'] must be an integer >= 1; got {limit!r}")
    return PluginSettings(strict=strict, backend=backend, capture=capture, capture_limit=limit,
                          source=f"additional_config; base config {base.source}")


def settings_from_vllm_config(vllm_config) -> PluginSettings | None:
    """The plugin's settings for this engine, or None when the plugin is off for it. Reads the YAML file named
    by `config`: call it once per engine (the head at construction, the admission check once per processor)."""
    switch = env_switch()
    entry = _entry(vllm_config)
    if switch is False:
        check_kill_switch(vllm_config)
        return None
    if entry is None:
        if not switch:
            return None
        entry = {"enabled": True}
    if not entry.get("enabled", True) and not switch:
        return None
    return _build(entry)


_kill_logged = False


def check_kill_switch(vllm_config) -> None:
    """With FUSED_LOGP_VLLM=0: refuse an engine configured for the plugin in strict mode (the operator asked
    for contract logprobs and would silently get vLLM's); log once that a non-strict one runs without it."""
    global _kill_logged
    if env_switch() is not False:
        return
    entry = _entry(vllm_config)
    if entry is None or not entry.get("enabled", True):
        return
    settings = _build(entry)
    if settings.strict:
        raise SettingsConflictError(
            f"fused_logp: {ENV_SWITCH}=0 (the kill switch) is set, but the engine's additional_config enables the "
            f"plugin in strict mode ({settings.source}); strict mode refuses to serve vLLM's own logprobs in its "
            f"place. Unset {ENV_SWITCH}, or set strict: false / enabled: false.")
    if not _kill_logged:
        _kill_logged = True
        log.warning("fused_logp: %s=0 (the kill switch) overrides the engine's non-strict fused_logp configuration: "
                    "the plugin is off and logprobs are vLLM's own", ENV_SWITCH)
