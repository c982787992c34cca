"""The on-policy RL loop on CPU with real vLLM and real megatron-core: exact zeros at every step, equal
fingerprints, an advancing weight version, and a stale weight push refused in strict mode. One loop (one vLLM
engine start) serves both tests: three on-policy steps, then the push before step 3 is skipped."""
import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")


@pytest.fixture(scope="module")
def loop(tmp_path_factory):
    # vLLM's in-process engine and Megatron's parallel state are process-wide: run the loop in a fresh process.
    import json
    import subprocess
    import sys

    out = tmp_path_factory.mktemp("rl")
    kw = dict(steps=4, strict=True, stale_at=3)
    code = ("import json, sys; from fused_logp_jobs.rl_loop import run_loop; "
            f"r = run_loop({str(out)!r}, quiet=True, **{kw!r}); print('RESULT' + json.dumps(r, default=str))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=900)
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    return out, json.loads(line[0][len("RESULT"):])


def test_loop_stays_exactly_on_policy(loop):
    out, res = loop
    steps = [s for s in res["steps"] if "contract_half" in s]
    assert len(steps) == 3
    for i, s in enumerate(steps):
        half = s["contract_half"]
        assert half["tokens"] > 0 and half["mismatches"] == 0 and half["max_abs_delta"] == 0 and half["k3_max"] == 0
        assert s["fingerprints_equal"] and s["scored_fingerprint_equal"]
        assert s["trainer_version"] == i and s["rollout_version"] == i
    fps = [s["trainer_fingerprint"] for s in steps]
    assert len(set(fps)) == 3                                   # every step changed the lm_head bytes
    assert (out / "rl_steps.png").stat().st_size > 1000


def test_stale_weight_push_is_refused_in_strict_mode(loop):
    _, res = loop
    assert res["stopped"] and res["stopped"].startswith("step 3") and "fingerprint mismatch" in res["stopped"]
    assert "rollout recorded" in res["stopped"] and "trainer now" in res["stopped"]
    assert len(res["steps"]) == 4 and not res["steps"][3]["fingerprints_equal"]
