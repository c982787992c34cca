"""Building a compiled backend (the SM90 kernel, the compiled CPU oracle) on first use, with one check: the
contract constants compiled into it must be shared_contract/constants.py's. No fallback: a failed build or a
differing constant is returned as the reason the backend is unavailable."""
from __future__ import annotations

import os

from ..shared_contract.constants import CONTRACT_VERSION


def build_checked(what: str, want_constants, **load_kwargs):
    """torch.utils.cpp_extension.load(**load_kwargs), then its contract_constants() against want_constants.
    -> (module, None), or (None, the reason naming `what`)."""
    try:
        from torch.utils.cpp_extension import load

        ext = load(verbose=bool(os.environ.get("FUSED_LOGP_BUILD_VERBOSE")), **load_kwargs)
    except Exception as exc:  # the reason is reported by the backend's available()
        return None, f"building {what} failed: {type(exc).__name__}: {exc}"
    got = [int(v) for v in ext.contract_constants()]
    want = list(want_constants)
    if got != want:
        return None, (f"{what}'s contract constants differ from shared_contract/constants.py ({CONTRACT_VERSION}): "
                      f"{got} != {want}")
    return ext, None
