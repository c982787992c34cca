"""The provenance record attached to every result."""
from __future__ import annotations

import dataclasses
import json

from . import constants as C


@dataclasses.dataclass(frozen=True)
class Provenance:
    backend: str
    contract_bearing: bool
    contract_version: str | None          # None when the backend does not carry the contract
    arch: str
    compute_capability: str
    toolkit: str
    build: str
    strict: bool
    fallback: str | None = None           # why a different backend than asked for ran, if one did
    vocab_tile: int = C.VOCAB_TILE
    k_group: int = C.K_GROUP
    k_slab: int = C.K_SLAB
    n_split_policy: str = C.N_SPLIT_POLICY
    tree_id: str = C.TREE_ID
    merge_id: str = C.MERGE_ID
    transcendental_id: str = C.TRANSCENDENTAL_ID
    gemm_rule_id: str = C.GEMM_RULE_ID

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


def make_provenance(backend, *, strict: bool, fallback: str | None = None) -> Provenance:
    info = backend.describe()
    bearing = bool(backend.contract_bearing)
    return Provenance(
        backend=backend.name,
        contract_bearing=bearing,
        contract_version=C.CONTRACT_VERSION if bearing else None,
        arch=info["arch"],
        compute_capability=info["compute_capability"],
        toolkit=info["toolkit"],
        build=info["build"],
        strict=strict,
        fallback=fallback,
    )
