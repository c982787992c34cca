"""The peers of the two linear_logp benchmarks: Liger-Kernel's fused linear cross-entropy and Apple's Cut
Cross-Entropy, loaded when installed (`make peer-wheels`, `make bench-gpu`), with what was called recorded."""
from __future__ import annotations

import importlib.metadata
import inspect

import torch

NOT_INSTALLED = "not installed: not measured"


def err(e) -> str:
    return f"{type(e).__name__}: {e}"[:2000]


def dist_version(dist):
    try:
        return importlib.metadata.version(dist)
    except Exception as e:  # noqa: BLE001 - a version we cannot read is recorded, not fatal
        return err(e)


def _liger(reduction, no_grad):
    """Liger-Kernel's fused linear cross-entropy; its Module takes (lin_weight, _input, target)."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    mod = LigerFusedLinearCrossEntropyLoss(reduction=reduction)
    call = f'LigerFusedLinearCrossEntropyLoss(reduction="{reduction}")(w, h, t)'
    info = {"version": dist_version("liger-kernel"), "file": inspect.getfile(LigerFusedLinearCrossEntropyLoss),
            "call": ("with torch.no_grad(): " + call) if no_grad else call + ".backward()",
            "accum_dtype": repr(mod.accum_dtype)}
    return (lambda h, w, t: mod(w, h, t)), info


def _cce(reduction, no_grad):
    """Apple's Cut Cross-Entropy with its default impl and filter_eps (recorded; filter_eps acts on backward)."""
    import cut_cross_entropy
    from cut_cross_entropy import linear_cross_entropy

    params = inspect.signature(linear_cross_entropy).parameters
    impl, eps = params["impl"].default, params["filter_eps"].default
    call = f'linear_cross_entropy(h, w, t, reduction="{reduction}")'
    info = {"version": getattr(cut_cross_entropy, "__version__", None) or dist_version("cut-cross-entropy"),
            "file": inspect.getfile(linear_cross_entropy),
            "call": ("with torch.no_grad(): " + call) if no_grad else call + ".backward()",
            "impl": str(getattr(impl, "name", impl)).lower(), "filter_eps": eps}
    try:
        from cut_cross_entropy.utils import _handle_eps

        info["filter_eps_bf16"] = _handle_eps(eps, torch.bfloat16)
    except Exception as e:  # noqa: BLE001
        info["filter_eps_bf16"] = err(e)
    return (lambda h, w, t: linear_cross_entropy(h, w, t, reduction=reduction)), info


def load(reduction: str, *, no_grad: bool = False):
    """name -> (loss(h, w, t) or None, info): each peer's loss with `reduction`, under torch.no_grad when asked.
    An ImportError or any other failure is kept as the info's status string."""
    peers = {}
    for name, make in (("liger", _liger), ("cce", _cce)):
        try:
            fn, info = make(reduction, no_grad)
            if no_grad:
                fn = _no_grad(fn)
            peers[name] = (fn, dict(status="loaded", **info))
        except ImportError as e:
            peers[name] = (None, {"status": f"{NOT_INSTALLED} ({err(e)})"})
        except Exception as e:  # noqa: BLE001
            peers[name] = (None, {"status": f"failed to load: not measured ({err(e)})"})
    return peers


def _no_grad(fn):
    def run(h, w, t):
        with torch.no_grad():
            return fn(h, w, t)
    return run


def not_installed(peers) -> list[str]:
    return [name for name, (fn, info) in peers.items() if fn is None and info["status"].startswith(NOT_INSTALLED)]
