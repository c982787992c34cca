"""The written backend interface (kernel/backends.py): every registered backend declares its entries, the
declaration matches its methods and the protocols, and every entry returns a typed result (no dict)."""
import dataclasses

import pytest
import torch

from fused_logp.kernel import backends
from fused_logp.kernel.backends import (ENTRIES, SERVING_ENTRIES, Backend, Forward, Merged, ServingBackend,
                                        TileStats, TileStatsBackend)
from fused_logp.kernel.oracle import OracleBackend
from fused_logp.kernel.sm90 import SM90Backend
from fused_logp.kernel.torch_backend import TorchBackend

CLASSES = {"oracle": OracleBackend, "sm90": SM90Backend, "torch": TorchBackend}


def _instances():
    out = {name: cls() for name, cls in CLASSES.items()}
    from fused_logp.kernel.oracle_fast import OracleFastBackend
    out["oracle-fast"] = OracleFastBackend()
    return out


@pytest.mark.parametrize("name", backends.backend_names())
def test_declared_entries_are_the_methods(name):
    be = _instances()[name]
    assert isinstance(be.entries, frozenset) and isinstance(be.multi_target, bool)
    assert be.entries <= set(ENTRIES) | set(SERVING_ENTRIES)
    assert {"linear_logp", "stats_from_logits"} <= be.entries
    methods = {e for e in (*ENTRIES, *SERVING_ENTRIES) if callable(getattr(type(be), e, None))}
    assert methods == be.entries, f"{name}: declares {sorted(be.entries)}, has {sorted(methods)}"
    assert isinstance(be, Backend)
    assert isinstance(be, TileStatsBackend) == ({"shard_stats", "merge_stats"} <= be.entries)
    assert isinstance(be, ServingBackend) == (set(SERVING_ENTRIES) <= be.entries)


def test_undeclared_entry_is_refused_naming_backend_and_entry():
    from fused_logp.shared_contract.errors import ContractInputError
    with pytest.raises(ContractInputError, match=r"backend 'torch' has no shard_stats entry"):
        backends.require(TorchBackend(), "shard_stats")


@pytest.mark.parametrize("name", ["oracle", "oracle-fast", "torch"])
def test_entries_return_typed_results(name, gen):
    be = backends.get_backend(name)
    h, w = torch.randn(3, 32, generator=gen).bfloat16(), torch.randn(130, 32, generator=gen).bfloat16()
    t, temp = torch.tensor([0, 64, 129]), torch.full((3,), 0.7)
    out = be.linear_logp(h, w, t, bias=None, temperature=temp, return_logits=True, vocab_size=130)
    assert isinstance(out, Forward) and out.logits.shape == (3, 130)
    assert isinstance(be.stats_from_logits(out.logits, t, temperature=temp, vocab_size=130), Merged)
    if "shard_stats" in be.entries:
        st = be.shard_stats(h, w[64:], t, vocab_start=64, vocab_size=130, bias=None, temperature=temp,
                            return_logits=False)
        assert isinstance(st, TileStats) and not isinstance(st, dict) and st.tile_offset == 1
        assert st["tile_max"] is st.tile_max                  # read access by field name
        with pytest.raises(dataclasses.FrozenInstanceError):
            st.tile_offset = 0
        assert isinstance(be.merge_stats(st.tile_max, st.tile_sum, st.target_logit), Merged)


def test_sm90_auxiliary_kernels_and_hooks_live_outside_the_class():
    from fused_logp.kernel.sm90_aux import SM90Aux, SM90TestHooks
    be = SM90Backend()
    assert isinstance(be.aux, SM90Aux) and isinstance(be.hooks, SM90TestHooks)
    for cls in (SM90Aux, SM90TestHooks):
        names = [n for n, v in vars(cls).items() if callable(v) and not n.startswith("_")]
        assert names
        for name in names:
            assert name not in vars(SM90Backend) or isinstance(vars(SM90Backend)[name], property), name
            assert getattr(be, name).__func__ is getattr(cls, name), name


def test_device_status_and_kernels_on_a_cpu_device():
    ok, why = backends.device_status(torch.device("cpu"))
    assert not ok and "not CUDA" in why
    assert backends.device_kernels("cpu") is None and backends.device_backend("cpu") is None
