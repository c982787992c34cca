"""What differs between the megatron-core releases the plugin runs on (0.16 to 0.19), in one place.

| rule | 0.16 / 0.17 | 0.18 / 0.19 |
| --- | --- | --- |
| hook | `GPTModel._postprocess` wrapped | `GPTModel.forward(..., output_processor=...)` |
| NullTokenizer vocabulary for `--vocab-size V` | V + 1 (ids 0..V, EOD = V) | V (EOD = V - 1) |
| Megatron-LM arguments | `pretrain(..., extra_args_provider=...)` | `parse_and_validate_args(extra_args_provider=...)` |
| setup after the model is built | in `model_provider` | a `model_cfg.post_wrap_hooks` entry |

Models the plugin does not serve (refused with `UnsupportedMegatronConfigError` when it is on): `HybridModel`
(0.19; Mamba / attention / MoE hybrids, what `pretrain_hybrid.py` builds; `MambaModel` is its subclass) and
0.16-0.18's `MambaModel`. Their forward calls the output layer and the loss itself, with no `output_processor` and
no `_postprocess` to wrap.
"""
from __future__ import annotations

import importlib

OUTPUT_PROCESSOR_FROM = (0, 18)           # GPTModel.forward takes output_processor= from this release on
NULL_TOKENIZER_EXACT_FROM = (0, 18)       # NullTokenizer(vocab_size=V) has V ids (EOD = V - 1) from this release on

# (module, class) of the models whose output layer the plugin cannot replace
UNSERVED_MODELS = (("megatron.core.models.hybrid.hybrid_model", "HybridModel"),
                   ("megatron.core.models.mamba.mamba_model", "MambaModel"))


def parse_version(text: str) -> tuple:
    """(major, minor) of a megatron-core version string ("0.19.2", "0.16.0rc0")."""
    parts = []
    for piece in str(text).split(".")[:2]:
        digits = ""
        for ch in piece:
            if not ch.isdigit():
                break
            digits += ch
        if not digits:
            break
        parts.append(int(digits))
    if len(parts) != 2:
        raise ValueError(f"not a megatron-core version: {text!r}")
    return tuple(parts)


def megatron_core_version() -> tuple:
    """(major, minor) of the installed megatron-core."""
    from megatron.core import package_info
    return parse_version(package_info.__version__)


def null_tokenizer_vocab_size(vocab_size: int, version: tuple | None = None) -> int:
    """The vocabulary of Megatron's NullTokenizer built with `--vocab-size vocab_size` on megatron-core `version`
    (default: the installed one): vocab_size + 1 before 0.18 (its EOD id is vocab_size), vocab_size from 0.18 on
    (its EOD id is vocab_size - 1)."""
    version = megatron_core_version() if version is None else tuple(version)
    return int(vocab_size) if version >= NULL_TOKENIZER_EXACT_FROM else int(vocab_size) + 1


def unserved_model_classes() -> list:
    """The importable classes of UNSERVED_MODELS in this megatron-core."""
    found = []
    for module, name in UNSERVED_MODELS:
        try:
            cls = getattr(importlib.import_module(module), name)
        except Exception:               # not in this release, or an optional dependency missing
            continue
        found.append(cls)
    return found


def unserved_model_message(model) -> str:
    name = type(model).__name__ if not isinstance(model, type) else model.__name__
    return (f"fused_logp Megatron plugin: {name} is not supported: its forward calls the output layer and "
            f"compute_language_model_loss itself, with no output_processor hook and no _postprocess to replace. "
            f"Train a GPTModel (Megatron-LM's pretrain_gpt.py) with --logp-backend, or run this model without "
            f"--logp-backend.")
