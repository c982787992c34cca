"""Sampling rules that decide which bytes a rollout records, so the trainer must apply the same ones.

A rollout engine reports, for every sampled row, the contract logp at the temperature the row was *scored* at.
Two rules map a request's sampling temperature to that scoring temperature:

1. SAMPLING_EPS: a temperature below 1e-5 means greedy sampling. This is vLLM's own threshold
   (`vllm.sampling_params._SAMPLING_EPS`, `vllm.v1.sample.sampler._SAMPLING_EPS`); a rollout at T = 0.5e-5 is
   greedy, one at T = 1e-5 is not.
2. GREEDY_SCORING_TEMPERATURE: a greedy row is scored at T = 1 (log softmax of the unscaled logits), never at its
   nominal temperature (which may be 0, and log softmax(z / 0) is not defined).

The trainer reproduces a rollout's logp with `linear_logp(..., temperature=scoring_temperature(T))`.
This module imports nothing above the contract layer.
"""
from __future__ import annotations

import math

import torch

SAMPLING_EPS = 1e-5
GREEDY_SCORING_TEMPERATURE = 1.0


def is_greedy(temperature: float | None) -> bool:
    """True when a request's sampling temperature means greedy sampling (None or T < SAMPLING_EPS)."""
    if temperature is None:
        return True
    t = float(temperature)
    if math.isnan(t):
        raise ValueError(f"temperature must be a number >= 0; got {temperature!r}")
    return t < SAMPLING_EPS


def scoring_temperature(temperature: float | None) -> float:
    """The temperature a row sampled at `temperature` is scored at: GREEDY_SCORING_TEMPERATURE for greedy
    rows, the temperature itself otherwise."""
    return GREEDY_SCORING_TEMPERATURE if is_greedy(temperature) else float(temperature)


def scoring_temperatures(temperature: torch.Tensor | None, n: int, device=None) -> torch.Tensor:
    """Per-row FP32 scoring temperatures [n] for a batch whose sampling temperatures are `temperature` [n]
    (None: every row greedy). The comparison with SAMPLING_EPS is made in FP32, as the engines make it."""
    if temperature is None:
        return torch.full((n,), GREEDY_SCORING_TEMPERATURE, dtype=torch.float32, device=device)
    t = temperature.to(device=device if device is not None else temperature.device, dtype=torch.float32)
    if t.shape != (n,):
        raise ValueError(f"temperature must have shape ({n},); got {tuple(t.shape)}")
    return torch.where(t < SAMPLING_EPS, torch.full_like(t, GREEDY_SCORING_TEMPERATURE), t)


__all__ = ["GREEDY_SCORING_TEMPERATURE", "SAMPLING_EPS", "is_greedy", "scoring_temperature", "scoring_temperatures"]
