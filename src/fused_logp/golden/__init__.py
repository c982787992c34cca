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


def load_golden() -> dict:
    return json.loads(GOLDEN.read_text()) if GOLDEN.exists() else {}


def write_golden(name) -> dict:
    data = load_golden()
    data.setdefault(CONTRACT_VERSION, {})[backend_key(name)] = golden_digests(name)
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return data
