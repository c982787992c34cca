"""The main job end to end on CPU: real vLLM (plugin) rollout, real megatron-core trainer, same weights."""
import json

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

from fused_logp_jobs.agreement import run  # noqa: E402


def test_rollout_and_trainer_agree_exactly_on_the_logp_half(tmp_path):
    res = run(tmp_path, strict=True)
    rows = res["rows"]
    half = rows["contract, logp half (trainer scores the rollout's hidden states)"]
    assert half["tokens"] > 0 and half["mismatches"] == 0 and half["max_abs_delta"] == 0 and half["k3_max"] == 0
    assert res["ok"]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["weight fingerprints"]["equal"] is True
    assert report["provenance"]["rollout"]["contract_version"] == report["provenance"]["trainer"]["contract_version"]
    for png in ("drift_cdf.png", "drift_by_position.png", "k3.png"):
        assert (tmp_path / png).stat().st_size > 1000
    # the body's drift is reported separately and is not claimed
    assert rows["contract, end to end (trainer's own hidden states)"]["tokens"] == half["tokens"]
