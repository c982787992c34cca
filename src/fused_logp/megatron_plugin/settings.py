"""What the plugin does: backend, rollout temperature, real vocabulary size. One process-wide value, optionally
overridden per model (`hook.enable(model, settings)`) or per call (`call_options`)."""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import math
import warnings

from ..shared_contract.config import get_config, load_config, set_config
from ..shared_contract.errors import ContractInputError, StrictModeError

log = logging.getLogger("fused_logp")

BACKEND_CHOICES = ("contract", "torch")


@dataclasses.dataclass(frozen=True)
class LogpSettings:
    backend: str | None = None        # None: disabled (Megatron's own output layer and loss)
    temperature: float = 1.0          # the rollout temperature, applied as z / T
    vocab_size: int | None = None     # real (unpadded) vocabulary; rows >= it are padding

    def __post_init__(self):
        if self.backend is not None and self.backend not in BACKEND_CHOICES:
            raise ValueError(f"logp backend must be one of {BACKEND_CHOICES} or None; got {self.backend!r}")
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 0:
            raise ValueError(f"logp temperature must be a finite number > 0; got {t!r}")
        if self.vocab_size is not None and (not isinstance(self.vocab_size, int) or self.vocab_size < 1):
            raise ValueError(f"logp vocab_size must be a positive int or None; got {self.vocab_size!r}")

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def op_backend(self) -> str:
        """The registry name handed to the op."""
        if self.backend == "torch":
            return "torch"
        configured = get_config().backend
        return configured if configured in ("sm90", "oracle") else "auto"


_settings = LogpSettings()
_call_temperature: contextvars.ContextVar = contextvars.ContextVar("fused_logp_megatron_temperature", default=None)
_call_settings: contextvars.ContextVar = contextvars.ContextVar("fused_logp_megatron_settings", default=None)
_call_extra: contextvars.ContextVar = contextvars.ContextVar("fused_logp_megatron_extra", default=None)
_warned_padding: set = set()


def check_backend_allowed(backend: str | None) -> None:
    if backend == "torch" and get_config().strict:
        raise StrictModeError("--logp-backend torch is the ordinary fp32 matmul + log_softmax path, which does not "
                              "carry the contract; strict mode (YAML `strict: true` or FUSED_LOGP_STRICT) refuses it. "
                              "Use --logp-backend contract.")


def configure(backend: str | None = "contract", *, temperature: float = 1.0, vocab_size: int | None = None,
              config_path: str | None = None) -> LogpSettings:
    """Set the process-wide settings. `config_path` loads a fused_logp YAML (strict, backend) first."""
    if config_path is not None:
        set_config(load_config(config_path))
    settings = LogpSettings(backend=backend, temperature=float(temperature), vocab_size=vocab_size)
    check_backend_allowed(settings.backend)
    global _settings
    _settings = settings
    return settings


def get_settings() -> LogpSettings:
    return _settings


def set_settings(settings: LogpSettings) -> None:
    check_backend_allowed(settings.backend)
    global _settings
    _settings = settings


@contextlib.contextmanager
def call_options(*, temperature=None):
    """Per-call temperature for forwards inside the block: a number or an fp32 tensor [b, s] (one per token, in
    the labels' layout). Needed on megatron-core < 0.18, whose forward has no output_processor_context."""
    if temperature is not None and not hasattr(temperature, "shape"):
        LogpSettings(temperature=float(temperature))          # validates
    token = _call_temperature.set(temperature)
    try:
        yield
    finally:
        _call_temperature.reset(token)


def call_temperature():
    return _call_temperature.get()


@contextlib.contextmanager
def call_settings(settings: LogpSettings, **extra):
    """Settings for every GPTModel forward inside the block, over the per-model and process-wide ones (the scoring
    API turns the plugin on for its own calls this way). `extra` reaches the processor (e.g. `program=`)."""
    check_backend_allowed(settings.backend)
    token = _call_settings.set(settings)
    token2 = _call_extra.set(extra or None)
    try:
        yield settings
    finally:
        _call_extra.reset(token2)
        _call_settings.reset(token)


def active_call_settings():
    return _call_settings.get()


def call_extra() -> dict:
    return _call_extra.get() or {}


def resolve_vocab_size(settings: LogpSettings, padded_vocab: int, strict: bool) -> int:
    """The real vocabulary the statistics run over. Unknown outside strict mode: every output row, with a loud
    warning (once per padded size) that Megatron's padding rows, if any, enter the lse."""
    if settings.vocab_size is not None:
        if settings.vocab_size > padded_vocab:
            raise ContractInputError(f"the real vocab size {settings.vocab_size} (--logp-vocab-size, or the "
                                     f"tokenizer's) exceeds the model's padded output size {padded_vocab} "
                                     f"(--padded-vocab-size / --vocab-size / --make-vocab-size-divisible-by)")
        return settings.vocab_size
    if strict:
        raise ContractInputError(f"strict mode needs the real (unpadded) vocab size: pass --logp-vocab-size (the "
                                 f"model's output layer has {padded_vocab} rows, which may include padding)")
    if padded_vocab not in _warned_padding:
        _warned_padding.add(padded_vocab)
        msg = (f"fused_logp Megatron plugin: the real vocabulary size is unknown (no --logp-vocab-size, no "
               f"tokenizer); all {padded_vocab} output rows enter the lse, including any rows Megatron added as "
               f"padding (--make-vocab-size-divisible-by): logp differ from a rollout over the real vocabulary. "
               f"Pass --logp-vocab-size.")
        log.warning(msg)
        warnings.warn(msg, PaddingRowsWarning, stacklevel=3)
    return padded_vocab


class PaddingRowsWarning(UserWarning):
    """Padding rows of the output layer may enter the statistics (the real vocabulary size is unknown)."""
