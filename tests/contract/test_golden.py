"""Golden fingerprints: sha256 of logp/lse bytes for fixed, platform-independent inputs, stored per contract
version and backend; and the ladder report."""
import json

from fused_logp import CONTRACT_VERSION
from fused_logp.golden.inputs import CASES, case_inputs
from fused_logp.golden import golden_digests, load_golden
from fused_logp_jobs.ladder import run_ladder


def test_golden_inputs_are_stable():
    h, w, t, bias, temp, v = case_inputs("small-T1")
    assert h.dtype.is_floating_point and h.shape == (4, 64) and w.shape == (1024, 64) and int(t[0]) == v - 1
    again = case_inputs("small-T1")
    assert (again[0].view(-1).view(dtype=again[0].dtype) == h.view(-1)).all()


def test_cpu_backends_match_stored_golden_fingerprints(cpu_backend):
    """Both CPU backends give the digests stored for the numpy oracle."""
    stored = load_golden()[CONTRACT_VERSION]["oracle/cpu/none"]
    assert set(stored) == set(CASES)
    assert golden_digests(cpu_backend) == stored


def test_every_stored_backend_agrees():
    """By the contract, every contract-bearing backend stores the same digests."""
    entries = list(load_golden()[CONTRACT_VERSION].values())
    assert all(e == entries[0] for e in entries)


def test_ladder_report(tmp_path, cpu_backend):
    rep = run_ladder(tmp_path, backends=[cpu_backend], quiet=True)
    assert rep["passed"], [c for c in rep["checks"] if not c["passed"]]
    assert (tmp_path / "ladder.md").read_text().startswith("# Validation ladder")
    assert json.loads((tmp_path / "ladder.json").read_text())["claim_boundary"]["not_claimed"]
