"""Golden fingerprints: sha256 of the logp/lse bytes of fixed, platform-independent inputs (inputs.py), stored per
contract version and backend in golden.json next to this file."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ..kernel.backends import get_backend
from ..kernel.op import linear_logp
from ..shared_contract.constants import CONTRACT_VERSION
from .inputs import CASES, case_inputs, digest

GOLDEN = Path(__file__).with_name("golden.json")


def _device(name):
    return torch.device("cuda") if name == "sm90" else torch.device("cpu")


def backend_device(name):
    """The device a backend's golden inputs are placed on."""
    return _device(name)


def resolve_backend(name: str) -> str:
    """The backend `name` runs here ('auto': the one auto selects for CPU inputs, else the SM90 kernel where it is
    available)."""
    if name != "auto":
        return name
    from ..kernel.backends import select_backend
    if torch.cuda.is_available():
        try:
            return select_backend("auto", torch.device("cuda"), strict=False)[0].name
        except Exception:           # no SM90 kernel here: auto serves CPU inputs
            pass
    return select_backend("auto", torch.device("cpu"), strict=False)[0].name


def backend_key(name) -> str:
    info = get_backend(name).describe()
    return f"{name}/{info['arch']}/{info['compute_capability']}"


def golden_digests(name) -> dict:
    out = {}
    dev = _device(name)
    for case in CASES:
        h, w, t, bias, temp, v = case_inputs(case)
        r = linear_logp(h.to(dev), w.to(dev), t.to(dev), bias=None if bias is None else bias.to(dev),
                        temperature=temp, vocab_size=v, backend=name)
        out[case] = digest(r.logp, r.lse)
    return out


def load_golden(path=None, missing_ok: bool = True) -> dict:
    """The stored digests {contract version: {backend key: {case: sha256}}}; ValueError naming the file when it
    cannot be read."""
    p = Path(GOLDEN if path is None else path)
    if not p.exists():
        if missing_ok:
            return {}
        raise ValueError(f"golden file {str(p)!r} does not exist; --golden-file takes a JSON file written by "
                         f"`fused-logp golden --write`")
    try:
        data = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"golden file {str(p)!r} cannot be read as JSON ({type(exc).__name__}: {exc}); it must "
                         f"hold {{contract version: {{backend: {{case: sha256}}}}}}") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) and all(isinstance(e, dict) for e in v.values())
                                             for v in data.values()):
        raise ValueError(f"golden file {str(p)!r} must hold {{contract version: {{backend: {{case: sha256}}}}}}")
    return data


def write_golden(name, path=None, digests=None) -> dict:
    """Store a backend's digests under this contract version (written to a temporary file, then renamed)."""
    from ..atomic_io import atomic_write_text
    p = Path(GOLDEN if path is None else path)
    data = load_golden(p)
    data.setdefault(CONTRACT_VERSION, {})[backend_key(name)] = digests if digests is not None else golden_digests(name)
    atomic_write_text(p, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data
