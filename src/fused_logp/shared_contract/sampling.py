"""Sampling rules that decide which bytes a rollout records, so the trainer must apply the same ones.

A rollout engine normalises a request's sampling parameters before it samples. The trainer must be told the
parameters the engine actually used, not the ones the caller sent. Two layers:

1. The engine's normalisation, one function per engine version (ENGINE_RULES, effective_sampling). vLLM 0.26,
   0.32 and 0.33 do the same in `SamplingParams.__post_init__` (0.26: lines 450-497 of vllm/sampling_params.py,
   0.32: 556-617, 0.33: 559-620): a temperature in (0, 0.01) is raised to 0.01 (`_MAX_TEMP`); then a temperature
   below 1e-5 (`_SAMPLING_EPS`; after the raise only 0, or -0.0) means greedy and top-k / top-p / min-p are reset
   to their neutral values (0, 1.0, 0.0); a temperature above 2 or below 0, or not finite, is refused. A request
   sent at T = 1e-6 or 5e-3 is therefore sampled at T = 0.01 on all three versions, not greedy.
2. The scoring rules on the effective temperature: SAMPLING_EPS (a temperature below 1e-5 is greedy, vLLM's own
   threshold in its samplers) and GREEDY_SCORING_TEMPERATURE (a greedy row is scored at T = 1).

The trainer reproduces a rollout's values with `effective_sampling(...)` of the request's parameters (or the
record the rollout stored with every row, which is the same) and the call that docs/vllm.md gives for the
engine's logprobs mode. This module imports nothing above the contract layer.
"""
from __future__ import annotations

import dataclasses
import math

import torch

SAMPLING_EPS = 1e-5
GREEDY_SCORING_TEMPERATURE = 1.0


def is_greedy(temperature: float | None) -> bool:
    """True when an *effective* sampling temperature means greedy sampling (None or T < SAMPLING_EPS)."""
    if temperature is None:
        return True
    t = float(temperature)
    if math.isnan(t):
        raise ValueError(f"temperature must be a number >= 0; got {temperature!r}")
    return t < SAMPLING_EPS


def scoring_temperature(temperature: float | None) -> float:
    """The temperature a row sampled at the *effective* temperature `temperature` is scored at:
    GREEDY_SCORING_TEMPERATURE for greedy rows, the temperature itself otherwise. A caller's nominal temperature
    goes through effective_sampling first (vLLM raises T = 1e-6 to 0.01, which is not greedy)."""
    return GREEDY_SCORING_TEMPERATURE if is_greedy(temperature) else float(temperature)


def scoring_temperatures(temperature: torch.Tensor | None, n: int, device=None) -> torch.Tensor:
    """Per-row FP32 scoring temperatures [n] for a batch whose effective sampling temperatures are
    `temperature` [n] (None: every row greedy). The comparison with SAMPLING_EPS is made in FP32, as the engines
    make it."""
    if temperature is None:
        return torch.full((n,), GREEDY_SCORING_TEMPERATURE, dtype=torch.float32, device=device)
    t = temperature.to(device=device if device is not None else temperature.device, dtype=torch.float32)
    if t.shape != (n,):
        raise ValueError(f"temperature must have shape ({n},); got {tuple(t.shape)}")
    return torch.where(t < SAMPLING_EPS, torch.full_like(t, GREEDY_SCORING_TEMPERATURE), t)


@dataclasses.dataclass(frozen=True)
class EffectiveSampling:
    """What the engine samples a request with after its own normalisation.

    temperature: the effective sampling temperature (0.0 for greedy); scoring_temperature: the temperature its
    rows are scored at (1.0 for greedy); top_k / top_p / min_p: None where neutral (greedy resets them)."""
    engine: str
    temperature: float
    greedy: bool
    scoring_temperature: float
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _vllm_post_init(engine: str, temperature, top_k, top_p, min_p) -> EffectiveSampling:
    """vLLM's SamplingParams.__post_init__ / _verify_args on (temperature, top_k, top_p, min_p), as written in
    0.26, 0.32 and 0.33 (module docstring)."""
    t = 1.0 if temperature is None else float(temperature)        # SamplingParams.from_optional: None -> 1.0
    if not math.isfinite(t):
        raise ValueError(f"{engine}: temperature must be a finite number, got {temperature!r}")
    if 0 < t < 1e-2:                                              # _MAX_TEMP
        t = 1e-2
    if t < 0.0:
        raise ValueError(f"{engine}: temperature must be non-negative, got {temperature!r}")
    if t > 2.0:
        raise ValueError(f"{engine}: temperature must be in [0, 2], got {temperature!r}")
    k = None if top_k in (None, 0, -1) else int(top_k)
    p = None if top_p in (None, 1.0) else float(top_p)
    m = None if min_p in (None, 0.0) else float(min_p)
    if t < SAMPLING_EPS:                                          # greedy: vLLM resets top-k / top-p / min-p
        return EffectiveSampling(engine, 0.0, True, GREEDY_SCORING_TEMPERATURE)
    return EffectiveSampling(engine, t, False, t, k, p, m)


def vllm_0_26(temperature=1.0, top_k=None, top_p=None, min_p=None) -> EffectiveSampling:
    """vLLM 0.26.0 (vllm/sampling_params.py __post_init__, lines 450-497; _verify_args line 550)."""
    return _vllm_post_init("vllm-0.26", temperature, top_k, top_p, min_p)


def vllm_0_32(temperature=1.0, top_k=None, top_p=None, min_p=None) -> EffectiveSampling:
    """vLLM 0.32.0 (vllm/sampling_params.py __post_init__, lines 556-617; _verify_args line 665)."""
    return _vllm_post_init("vllm-0.32", temperature, top_k, top_p, min_p)


def vllm_0_33(temperature=1.0, top_k=None, top_p=None, min_p=None) -> EffectiveSampling:
    """vLLM 0.33.0 (vllm/sampling_params.py __post_init__, lines 559-620; _verify_args line 668)."""
    return _vllm_post_init("vllm-0.33", temperature, top_k, top_p, min_p)


ENGINE_RULES = {"vllm-0.26": vllm_0_26, "vllm-0.32": vllm_0_32, "vllm-0.33": vllm_0_33}


def engine_key(engine: str, version: str) -> str:
    """'vllm', '0.32.0+cpu' -> 'vllm-0.32' (the key of ENGINE_RULES)."""
    parts = str(version).split("+", 1)[0].split(".")
    return f"{engine}-{'.'.join(parts[:2])}"


def effective_sampling(engine: str, version: str, temperature=1.0, top_k=None, top_p=None,
                       min_p=None) -> EffectiveSampling:
    """The sampling parameters the engine `engine` at `version` (e.g. 'vllm', '0.32.0') uses for a request sent
    with these ones. A version without a rule is refused (ValueError naming it): its normalisation is not known."""
    key = engine_key(engine, version)
    rule = ENGINE_RULES.get(key)
    if rule is None:
        raise ValueError(f"no sampling-parameter rule for {engine} {version} (known: {sorted(ENGINE_RULES)})")
    return rule(temperature, top_k, top_p, min_p)


__all__ = ["ENGINE_RULES", "EffectiveSampling", "GREEDY_SCORING_TEMPERATURE", "SAMPLING_EPS", "effective_sampling",
           "engine_key", "is_greedy", "scoring_temperature", "scoring_temperatures", "vllm_0_26", "vllm_0_32",
           "vllm_0_33"]
