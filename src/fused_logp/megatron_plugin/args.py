"""Command-line arguments: `--logp-backend {contract,torch}`, `--logp-config YAML`, `--logp-temperature`,
`--logp-vocab-size`.

Megatron-LM 0.19 (pretrain_gpt.py):
            args = parse_and_validate_args(extra_args_provider=chain_args_providers(<the script's>, add_logp_args), ...)
            setup_from_args(args)
            model_cfg.post_wrap_hooks.append(check_model)
Megatron-LM 0.16 / 0.17: pretrain(..., extra_args_provider=add_logp_args), then setup_from_args(get_args()) in
            model_provider and check_model(model) on the built model.
Own parser: add_logp_args(parser); args = parser.parse_args(); setup_from_args(args).
"""
from __future__ import annotations

import argparse
import logging

from ..shared_contract.config import get_config, load_config, set_config
from ..shared_contract.constants import VOCAB_TILE
from ..shared_contract.errors import ContractInputError, StrictModeError
from .guards import UnsupportedMegatronConfigError
from .settings import (BACKEND_CHOICES, LogpSettings, active_call_settings, check_backend_allowed, configure,
                       get_settings, resolve_vocab_size)
from .versions import null_tokenizer_vocab_size

log = logging.getLogger("fused_logp")


def add_logp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An `extra_args_provider`: adds the plugin's arguments and returns the parser."""
    g = parser.add_argument_group("fused-logp", "per-token logp/lse from the contract op instead of the "
                                                "output layer + vocab-parallel cross-entropy")
    g.add_argument("--logp-backend", choices=BACKEND_CHOICES, default=None,
                   help="contract: the op's contract backend (the SM90 kernel on Hopper; the CPU oracle for CPU tensors; "
                        "on another CUDA GPU refused unless the YAML says backend: oracle); "
                        "torch: fp32 matmul + log_softmax, not contract-bearing, refused in strict mode. "
                        "Unset: Megatron's own output layer and loss (unless --logp-config is given).")
    g.add_argument("--logp-config", default=None, metavar="YAML",
                   help="fused_logp YAML (strict: true|false, backend: auto|sm90|oracle|torch); given without "
                        "--logp-backend it turns the plugin on with its backend (torch -> torch, else contract)")
    g.add_argument("--logp-temperature", type=float, default=1.0,
                   help="the rollout temperature T: logp and lse of softmax(logits / T)")
    g.add_argument("--logp-vocab-size", type=int, default=None,
                   help="the real (unpadded) vocabulary size; rows at or above it are padding and never enter the "
                        "lse (default: the tokenizer's size, else --vocab-size, plus one for NullTokenizer before "
                        "megatron-core 0.18; strict mode requires one of them)")
    return parser


def chain_args_providers(*providers):
    """One extra_args_provider from several (each takes and returns the parser)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def _global_tokenizer():
    """megatron.training's tokenizer when Megatron-LM built one (None with megatron-core alone or before
    initialize_megatron)."""
    try:
        from megatron.training import get_tokenizer
        return get_tokenizer()
    except Exception:                       # not installed, or not built yet (get_tokenizer asserts)
        return None


def real_vocab_from_args(args, tokenizer=None, *, version=None):
    """(real vocabulary size or None, where it came from): --logp-vocab-size, else the tokenizer's size (the one
    passed, else Megatron-LM's global tokenizer), else --vocab-size; with NullTokenizer the rule of megatron-core
    `version` (default: the installed one; versions.null_tokenizer_vocab_size): --vocab-size from 0.18 on (EOD is
    vocab_size - 1), --vocab-size + 1 before (EOD is vocab_size)."""
    v = getattr(args, "logp_vocab_size", None)
    if v is not None:
        return int(v), "--logp-vocab-size"
    tok = tokenizer if tokenizer is not None else _global_tokenizer()
    size = getattr(tok, "vocab_size", None) if tok is not None else None
    if size is not None:
        return int(size), f"the tokenizer ({type(tok).__name__}.vocab_size)"
    v = getattr(args, "vocab_size", None)
    if v is not None:
        if getattr(args, "tokenizer_type", None) == "NullTokenizer":
            n = null_tokenizer_vocab_size(v, version)
            if n == int(v):
                return n, "--vocab-size (NullTokenizer, megatron-core >= 0.18: ids 0..vocab_size-1, the last one EOD)"
            return n, "--vocab-size + 1 (NullTokenizer, megatron-core < 0.18: ids 0..vocab_size, the last one EOD)"
        return int(v), "--vocab-size"
    return None, None


def _flag_refusal(what, flag, why):
    raise UnsupportedMegatronConfigError(f"fused_logp Megatron plugin: {what} is not supported ({why}): turn off "
                                         f"{flag}, or run without --logp-backend")


def _this_rank_device() -> int:
    """This rank's GPU: the current device once torch.distributed is up; before it (Megatron-LM 0.19 parses and
    sets up before initialize_megatron selects the device) torchrun's LOCAL_RANK."""
    import os

    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.cuda.current_device()
    local = os.environ.get("LOCAL_RANK", "")
    if local.isdigit() and int(local) < torch.cuda.device_count():
        return int(local)
    return torch.cuda.current_device()


def _check_backend_here(settings: LogpSettings, strict: bool) -> None:
    """On a CUDA machine the contract backend must be the SM90 kernel (or the oracle by name): refused at setup,
    not at the first forward."""
    import torch

    if settings.backend != "contract" or not torch.cuda.is_available():
        return
    from ..kernel.backends import select_backend
    try:
        select_backend(settings.op_backend(), torch.device("cuda", _this_rank_device()), strict)
    except Exception as exc:
        raise type(exc)(f"--logp-backend contract on this GPU: {exc}") from exc


def check_args(args, settings: LogpSettings, vocab_source=None) -> None:
    """Every configuration refusal the arguments already decide, at setup (before a model is built), each
    naming the Megatron flag to change."""
    cfg = get_config()
    if not settings.enabled:
        if cfg.strict:
            raise StrictModeError(f"strict mode is set ({cfg.source}) but the fused_logp plugin is off, so Megatron's "
                                  f"ordinary output layer and cross-entropy would run: pass --logp-backend contract "
                                  f"(or unset strict mode)")
        return
    _check_backend_here(settings, cfg.strict)
    if getattr(args, "mtp_num_layers", None):
        _flag_refusal("multi-token prediction", "--mtp-num-layers",
                      "its heads call output_layer and compute_language_model_loss outside the contract op")
    if getattr(args, "defer_embedding_wgrad_compute", False):
        _flag_refusal("deferred embedding wgrad", "--defer-embedding-wgrad-compute",
                      "the plugin bypasses output_layer, so its deferred-wgrad buffers would stay empty")
    if getattr(args, "use_mup", False) and getattr(args, "mup_output_mult", 1.0) not in (None, 1.0):
        _flag_refusal("MuP logit scaling", "--use-mup", "the contract's logits are h.W / T with no multiplier")
    padded = getattr(args, "padded_vocab_size", None)
    tp = int(getattr(args, "tensor_model_parallel_size", 1) or 1)
    if padded:
        if settings.vocab_size is not None and settings.vocab_size > padded:
            raise ContractInputError(f"the real vocabulary size {settings.vocab_size} (from {vocab_source}) exceeds "
                                     f"the model's padded output size {padded}: fix --logp-vocab-size or "
                                     f"--vocab-size / --padded-vocab-size")
        if tp > 1 and (padded // tp) % VOCAB_TILE:
            div = getattr(args, "make_vocab_size_divisible_by", None)
            raise ContractInputError(f"the output layer's vocabulary shards ({padded} rows / TP={tp} = {padded / tp:g} "
                                     f"rows each) do not start on multiples of the contract's tile width {VOCAB_TILE}: "
                                     f"set --make-vocab-size-divisible-by to a multiple of {VOCAB_TILE} (it is {div}), "
                                     f"or --padded-vocab-size to a multiple of {VOCAB_TILE * tp}")
        if settings.vocab_size is None:
            resolve_vocab_size(settings, padded, cfg.strict)        # strict: refuses; otherwise: the loud warning
    elif settings.vocab_size is None and cfg.strict:
        raise ContractInputError("strict mode needs the real (unpadded) vocabulary size: pass --logp-vocab-size "
                                 "(or run with a Megatron tokenizer, or --vocab-size)")


def settings_from_args(args, tokenizer=None) -> LogpSettings:
    """LogpSettings from parsed arguments (loads --logp-config into the fused_logp configuration)."""
    backend = getattr(args, "logp_backend", None)
    path = getattr(args, "logp_config", None)
    if path is not None:
        cfg = load_config(path)
        set_config(cfg)
        if backend is None:
            backend = "torch" if cfg.backend == "torch" else "contract"
    vocab, _ = real_vocab_from_args(args, tokenizer)
    return LogpSettings(backend=backend, temperature=float(getattr(args, "logp_temperature", 1.0)),
                        vocab_size=vocab)


def setup_from_args(args, *, tokenizer=None, install_hook: bool = True) -> LogpSettings:
    """Configure the plugin process-wide from parsed arguments, refuse what the contract does not cover (naming
    the flag), copy Megatron's loss-check switches, and, when enabled, install the GPTModel hook."""
    from .training import loss_checks_from_args

    s = settings_from_args(args, tokenizer)
    check_backend_allowed(s.backend)
    _, source = real_vocab_from_args(args, tokenizer)
    check_args(args, s, source)
    s = configure(s.backend, temperature=s.temperature, vocab_size=s.vocab_size)
    loss_checks_from_args(args)
    if s.enabled:
        log.info("fused_logp: Megatron plugin on (backend %s, temperature %g, real vocabulary %s from %s)",
                 s.backend, s.temperature, s.vocab_size, source)
    if s.enabled and install_hook:
        from .hook import install
        install()
    return s


def check_model(model, settings: LogpSettings | None = None):
    """The model-level refusals at setup (after get_model / Float16Module / DDP, before training): a model the plugin
    does not serve (HybridModel, MambaModel), uncovered TransformerConfig features, the output layer's class / bias /
    dtype, the real vocabulary against the output rows and the shard alignment. `model` may be get_model's list.
    Returns `model`, so that it is a megatron-core 0.19 post-wrap hook as it is
    (`model_cfg.post_wrap_hooks.append(check_model)`). With the plugin off it checks nothing."""
    from .guards import check_config, check_output_layer
    from .hook import settings_for, unwrap_gpt_model
    from .parallel import group_size

    if settings is None and not (active_call_settings() or get_settings()).enabled:
        return model
    chunks = list(model) if isinstance(model, (list, tuple)) else [model]
    gpts = [unwrap_gpt_model(chunk) for chunk in chunks]
    for gpt in gpts:
        check_config(gpt.config)
    last = [gpt for gpt in gpts if gpt.post_process]
    if not last:                    # a pipeline stage without the output layer
        return model
    gpt = last[-1]
    settings = settings or settings_for(gpt)
    if not settings.enabled:
        return model
    w = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight
    check_output_layer(gpt.output_layer, w)
    tp = group_size(gpt.output_layer.tp_group)
    if tp > 1 and w.shape[0] % VOCAB_TILE:
        raise ContractInputError(f"the output layer's vocabulary shards have {w.shape[0]} rows (TP={tp}), not a "
                                 f"multiple of the contract's tile width {VOCAB_TILE}: set "
                                 f"--make-vocab-size-divisible-by to a multiple of {VOCAB_TILE}")
    resolve_vocab_size(settings, w.shape[0] * tp, get_config().strict)
    return model
