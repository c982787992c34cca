"""Installs the engine-side wrappers once per process, for the hook shapes capability.detect() found.
Each wrapper keeps vLLM's original and passes logits without the head's mark through unchanged."""
from __future__ import annotations

from . import mrv2_sampler, prompt_logprobs, v1_sampler, weight_sync

_installed = False


def install(shapes) -> None:
    """Idempotent; surfaces whose shape is unknown (shapes.problems) or absent are left alone."""
    global _installed
    if _installed:
        return
    if shapes.v1_sampler:
        v1_sampler.install_sampler(shapes)
    if shapes.v1_runner:
        v1_sampler.install_runner()
        if shapes.v1_sampler:
            prompt_logprobs.install_v1()
    if shapes.mrv2:
        mrv2_sampler.install(shapes)
        prompt_logprobs.install_mrv2()
    weight_sync.install()
    _installed = True


def installed() -> bool:
    return _installed
