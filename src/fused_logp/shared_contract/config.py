"""YAML configuration: `strict: true|false`, the backend choice, and nothing bit-relevant.

Sources, in order: `configs/default.yaml` semantics (the defaults below), a YAML file named by
FUSED_LOGP_CONFIG or passed to `load_config`, then FUSED_LOGP_STRICT / FUSED_LOGP_BACKEND. A key that names a
contract constant raises ContractOverrideError (its value is frozen by the contract version).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import yaml

from .constants import check_no_overrides

log = logging.getLogger("fused_logp")

BACKEND_CHOICES = ("auto", "sm90", "oracle", "oracle-fast", "torch")


@dataclasses.dataclass(frozen=True)
class Config:
    strict: bool = False
    backend: str = "auto"          # auto | sm90 | oracle | torch (torch is not contract-bearing)
    source: str = "defaults"

    def __post_init__(self):
        if self.backend not in BACKEND_CHOICES:
            raise ValueError(f"backend must be one of {BACKEND_CHOICES}, got {self.backend!r}")
        if not isinstance(self.strict, bool):
            raise ValueError(f"strict must be true or false, got {self.strict!r}")


_FIELDS = {f.name for f in dataclasses.fields(Config)} - {"source"}
_current: Config | None = None


def _parse_bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"{name} must be one of 1/0/true/false/yes/no/on/off, got {value!r}")


def _read_yaml(path) -> dict:
    """The mapping of a YAML configuration file; ValueError naming the file and what is accepted otherwise."""
    p = Path(path)
    accepted = f"a YAML mapping with the keys {sorted(_FIELDS)}"
    if not p.exists():
        raise ValueError(f"configuration file {str(path)!r} does not exist; {accepted} is expected")
    if p.is_dir():
        raise ValueError(f"configuration file {str(path)!r} is a folder; {accepted} is expected")
    try:
        data = yaml.safe_load(p.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"configuration file {str(path)!r} is not UTF-8 text; {accepted} is expected") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"configuration file {str(path)!r} is not valid YAML{at}: {problem}; {accepted} is "
                         f"expected") from None
    except OSError as exc:
        raise ValueError(f"configuration file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"configuration file {str(path)!r} holds a YAML {type(data).__name__}; {accepted} is "
                         f"expected")
    return data


def load_config(path: str | os.PathLike | None = None) -> Config:
    """Read a YAML configuration (or only the environment when path is None) and return it."""
    check_no_overrides(None)
    values: dict = {}
    source = "defaults"
    path = path if path is not None else os.environ.get("FUSED_LOGP_CONFIG")
    if path:
        data = _read_yaml(path)
        check_no_overrides(data, source=f"YAML file {path}")
        unknown = set(data) - _FIELDS
        if unknown:
            raise ValueError(f"configuration file {str(path)!r}: unknown keys {sorted(map(str, unknown))}; accepted "
                             f"keys are {sorted(_FIELDS)}")
        values.update(data)
        source = str(path)
        try:
            return _with_env(values, source)
        except ValueError as exc:
            raise ValueError(f"configuration file {str(path)!r}: {exc}") from None
    return _with_env(values, source)


def _with_env(values: dict, source: str) -> Config:
    if "FUSED_LOGP_STRICT" in os.environ:
        values["strict"] = _parse_bool("FUSED_LOGP_STRICT", os.environ["FUSED_LOGP_STRICT"])
        source += "+env"
    if "FUSED_LOGP_BACKEND" in os.environ:
        values["backend"] = os.environ["FUSED_LOGP_BACKEND"]
        source += "+env"
    return Config(source=source, **values)


def get_config() -> Config:
    global _current
    if _current is None:
        _current = load_config()
    return _current


def set_config(config: Config | None) -> None:
    """Install a configuration for this process (None: re-read the environment on next use)."""
    global _current
    _current = config
