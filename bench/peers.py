"""The peers of the two linear_logp benchmarks: Liger-Kernel's fused linear cross-entropy and Apple's Cut
Cross-Entropy, loaded when installed (`make peer-wheels`, `make bench-gpu`), with what was called recorded; and, in the
forward benchmark, QuACK's fused linear cross-entropy (`make peer-parts`: it travels to the GPU machine in parts)."""
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


def _quack(reduction, no_grad):
    """QuACK's fused linear cross-entropy, quack.linear_cross_entropy.chunked_linear_cross_entropy(x, weight, target,
    chunk_size, ignore_index, reduction, ...). Its reductions are "mean" and "sum" only (QuACK's per-token losses come
    from its module's unfused path, F.linear then cross_entropy, which is not this peer): for reduction="none" the
    peer computes the sum over tokens of the per-token loss, and info["output"] says "sum" so that the caller compares
    sums. Which of QuACK's paths ran is recorded at the first call (info["path"], from its own eligibility test):
    without gradients on SM90 in bf16 it is one GEMM whose epilogue keeps the online log-sum-exp partials and the
    target logit (the logits are not stored), then logsumexp of the partials minus the target logit, summed."""
    import quack
    from quack.linear_cross_entropy import chunked_linear_cross_entropy, scaled_exp_lce_supported

    red = reduction if reduction in ("mean", "sum") else "sum"
    chunk = inspect.signature(chunked_linear_cross_entropy).parameters["chunk_size"].default
    call = f'chunked_linear_cross_entropy(h, w, t, reduction="{red}")'
    info = {"version": getattr(quack, "__version__", None) or dist_version("quack-kernels"),
            "file": inspect.getfile(chunked_linear_cross_entropy),
            "call": ("with torch.no_grad(): " + call) if no_grad else call + ".backward()",
            "output": "per-token" if red == reduction else "sum",
            "computes": ("cross-entropy of each token, " + ("summed" if red == "sum" else "averaged")
                         + " over the tokens" + ("" if red == reduction else
                                                 f' (reduction="{reduction}" is not offered by QuACK\'s fused API)')),
            "chunk_size": chunk,
            "cutlass_dsl": dist_version("nvidia-cutlass-dsl-libs-base"),
            "cutlass_dsl_cu13": dist_version("nvidia-cutlass-dsl-libs-cu13"),
            "tvm_ffi": dist_version("apache-tvm-ffi")}

    def path(h, w):
        try:
            fused = scaled_exp_lce_supported(h, w, chunk, red)
        except Exception as e:  # noqa: BLE001 - recorded, the call goes on
            return f"eligibility test failed: {err(e)}"
        grads = torch.is_grad_enabled() and (h.requires_grad or w.requires_grad)
        if fused:
            return ("scaled-exp pipeline: GEMM + scaled-exp epilogue, dx/dw strip GEMMs" if grads else
                    "loss only: one GEMM with the online-LSE and target-logit epilogue (lse_target_epi, logits not "
                    "stored)")
        return ("chunked: cuBLAS logits per chunk, cross-entropy kernel, dx/dw GEMMs in the forward" if grads else
                "chunked loss only: cuBLAS logits per chunk of rows, then the cross-entropy kernel")

    def fn(h, w, t):
        if "path" not in info:
            info["path"] = path(h, w)
        return chunked_linear_cross_entropy(h, w, t, reduction=red)
    return fn, info


# every peer; the backward benchmark takes the first two unless it names QuACK too (its autograd path is the
# scaled-exp pipeline on SM90)
PEERS = (("liger", _liger), ("cce", _cce), ("quack", _quack))


def load(reduction: str, *, no_grad: bool = False, names=("liger", "cce")):
    """name -> (loss(h, w, t) or None, info): each named peer's loss with `reduction`, under torch.no_grad when asked.
    An ImportError or any other failure is kept as the info's status string."""
    peers = {}
    for name, make in PEERS:
        if name not in names:
            continue
        try:
            fn, info = make(reduction, no_grad)
            if no_grad:
                fn = _no_grad(fn)
            rest = dict(info)  # status first, in place: a peer may add to its info at its first call
            info.clear()
            info.update(status="loaded", **rest)
            peers[name] = (fn, info)
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
