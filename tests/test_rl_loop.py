"""The on-policy RL loop on CPU with real vLLM and real megatron-core: exact zeros at every step, equal
fingerprints, an advancing weight version, and a stale weight push refused in strict mode."""
import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")


def _loop(tmp_path, **kw):
    # vLLM's in-process engine and Megatron's parallel state are process-wide: run each loop in a fresh process.
    import json
    import subprocess
    import sys

    code = ("import json, sys; from fused_logp_jobs.rl_loop import run_loop; "
            f"r = run_loop({str(tmp_path)!r}, quiet=True, **{kw!r}); print('RESULT' + json.dumps(r, default=str))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return json.loads(line[0][len("RESULT"):])


def test_loop_stays_exactly_on_policy(tmp_path):
    res = _loop(tmp_path, steps=3, strict=True)
    assert res["stopped"] is None and len(res["steps"]) == 3
    for i, s in enumerate(res["steps"]):
        half = s["contract_half"]
        assert half["tokens"] > 0 and half["mismatches"] == 0 and half["max_abs_delta"] == 0 and half["k3_max"] == 0
        assert s["fingerprints_equal"] and s["trainer_version"] == i and s["rollout_version"] == i
    fps = [s["trainer_fingerprint"] for s in res["steps"]]
    assert len(set(fps)) == 3                                   # every step changed the lm_head bytes
    assert (tmp_path / "rl_steps.png").stat().st_size > 1000


def test_stale_weight_push_is_refused_in_strict_mode(tmp_path):
    res = _loop(tmp_path, steps=4, strict=True, stale_at=2)
    assert res["stopped"] and res["stopped"].startswith("step 2") and "fingerprint mismatch" in res["stopped"]
    assert len(res["steps"]) == 3 and not res["steps"][2]["fingerprints_equal"]
