"""Plugin settings, read from vLLM's own configuration surface.

    --additional-config '{"fused_logp": {"enabled": true, "strict": false, "config": "configs/strict.yaml"}}'
    LLM(..., additional_config={"fused_logp": {...}})

Keys: enabled (bool), strict (bool; default: the YAML file's or FUSED_LOGP_STRICT), config (YAML path, read with
fused_logp.shared_contract.config.load_config), backend (auto | sm90 | oracle | torch), capture (bool: keep the
final hidden states of every scored row for audits; test and debugging use only).

Environment: FUSED_LOGP_VLLM=0 turns the plugin off everywhere (register() installs nothing and an enabled
configuration is ignored); FUSED_LOGP_VLLM=1 turns it on with defaults when additional_config has no entry.
"""
from __future__ import annotations

import dataclasses
import os

from ..shared_contract.config import get_config, load_config

CONFIG_KEY = "fused_logp"
ENV_SWITCH = "FUSED_LOGP_VLLM"
_KEYS = {"enabled", "strict", "config", "backend", "capture"}


@dataclasses.dataclass(frozen=True)
class PluginSettings:
    strict: bool
    backend: str
    capture: bool
    source: str


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


def settings_from_vllm_config(vllm_config) -> PluginSettings | None:
    """The plugin's settings for this engine, or None when the plugin is off for it."""
    switch = env_switch()
    if switch is False:
        return None
    extra = getattr(vllm_config, "additional_config", None) or {}
    entry = extra.get(CONFIG_KEY) if isinstance(extra, dict) else None
    if entry is None:
        if not switch:
            return None
        entry = {"enabled": True}
    if not isinstance(entry, dict):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}] must be a mapping; got {type(entry).__name__}")
    unknown = set(entry) - _KEYS
    if unknown:
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]: unknown keys {sorted(unknown)}; "
                         f"accepted keys are {sorted(_KEYS)}")
    if not entry.get("enabled", True) and not switch:
        return None
    base = load_config(entry["config"]) if entry.get("config") else get_config()
    strict = entry.get("strict", base.strict)
    if not isinstance(strict, bool):
        raise ValueError(f"additional_config[{CONFIG_KEY!r}]['strict'] must be true or false; got {strict!r}")
    backend = entry.get("backend", base.backend)
    capture = bool(entry.get("capture", False))
    return PluginSettings(strict=strict, backend=backend, capture=capture,
                          source=f"additional_config; base config {base.source}")
