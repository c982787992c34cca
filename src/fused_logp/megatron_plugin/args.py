"""Command-line arguments: `--logp-backend {contract,torch}`, `--logp-config YAML`, `--logp-temperature`,
`--logp-vocab-size`.

Megatron:   initialize_megatron(extra_args_provider=add_logp_args)  (or pretrain(..., extra_args_provider=...)
            on <= 0.17, parse_and_validate_args(extra_args_provider=...) on >= 0.19), then
            setup_from_args(get_args()).
Own parser: add_logp_args(parser); args = parser.parse_args(); setup_from_args(args).
"""
from __future__ import annotations

import argparse

from ..shared_contract.config import load_config, set_config
from .settings import BACKEND_CHOICES, LogpSettings, configure


def add_logp_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """An `extra_args_provider`: adds the plugin's arguments and returns the parser."""
    g = parser.add_argument_group("fused-logp", "per-token logp/lse from the contract op instead of the "
                                                "output layer + vocab-parallel cross-entropy")
    g.add_argument("--logp-backend", choices=BACKEND_CHOICES, default=None,
                   help="contract: the op's contract backend (SM90 kernel on Hopper, CPU oracle elsewhere); "
                        "torch: fp32 matmul + log_softmax, not contract-bearing, refused in strict mode. "
                        "Unset: Megatron's own output layer and loss (unless --logp-config is given).")
    g.add_argument("--logp-config", default=None, metavar="YAML",
                   help="fused_logp YAML (strict: true|false, backend: auto|sm90|oracle|torch); given without "
                        "--logp-backend it turns the plugin on with its backend (torch -> torch, else contract)")
    g.add_argument("--logp-temperature", type=float, default=1.0,
                   help="the rollout temperature T: logp and lse of softmax(logits / T)")
    g.add_argument("--logp-vocab-size", type=int, default=None,
                   help="the real (unpadded) vocabulary size; rows at or above it are padding and never enter the "
                        "lse (default: --vocab-size when given; strict mode requires one of them)")
    return parser


def chain_args_providers(*providers):
    """One extra_args_provider from several (each takes and returns the parser)."""
    def provider(parser):
        for p in providers:
            if p is not None:
                parser = p(parser)
        return parser
    return provider


def settings_from_args(args) -> LogpSettings:
    """LogpSettings from parsed arguments (loads --logp-config into the fused_logp configuration)."""
    backend = getattr(args, "logp_backend", None)
    path = getattr(args, "logp_config", None)
    if path is not None:
        cfg = load_config(path)
        set_config(cfg)
        if backend is None:
            backend = "torch" if cfg.backend == "torch" else "contract"
    vocab = getattr(args, "logp_vocab_size", None)
    if vocab is None:
        vocab = getattr(args, "vocab_size", None)
    return LogpSettings(backend=backend, temperature=float(getattr(args, "logp_temperature", 1.0)),
                        vocab_size=vocab)


def setup_from_args(args, *, install_hook: bool = True) -> LogpSettings:
    """Configure the plugin process-wide from parsed arguments and, when enabled, install the GPTModel hook."""
    s = settings_from_args(args)
    s = configure(s.backend, temperature=s.temperature, vocab_size=s.vocab_size)
    if s.enabled and install_hook:
        from .hook import install
        install()
    return s
