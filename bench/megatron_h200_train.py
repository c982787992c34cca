"""Megatron-LM 0.19's own training loop with the fused_logp Megatron plugin, on one GPU: `megatron.training.pretrain`
run by Megatron-LM's pretrain_gpt.py (branch core_r0.19.0) for a few iterations of a tiny GPT on mock data
(`--transformer-impl local`, NullTokenizer, vocabulary 50257 padded to 50304), each run its own torchrun process.

Runs (the same arguments; `--logp-backend contract` where it says "on"):
  unmodified     pretrain_gpt.py as it is
  patched-off    pretrain_gpt.py with examples/pretrain_gpt_logp.patch applied (the lines marked `# fused-logp`)
  patched-on     the same, --logp-backend contract
  example-off    examples/pretrain_gpt_logp.py (pretrain_gpt.py imported, its __main__ with the plugin's lines)
  example-on     the same, --logp-backend contract
Checks, each in the JSON:
  * flag off: lm loss and grad norm of every iteration bit-identical to the unmodified script (both scripts);
  * flag on: every lm loss finite, the last below the first (it trains); the example equals the patched script bit
    for bit; the op's provenance backend is sm90; iteration 1's loss against the unmodified script's (the padding
    rows 50257..50303 no longer in the lse);
  * after patched-on's training, on the trained model that pretrain() built: mp.score (temperature 0.7, and a top-p
    program) equals linear_logp / linear_logp_program with backend="sm90" on the same rows (the final hidden states
    captured from the same forward), byte for byte; the attached fingerprint equals weight_fingerprint.

Each iteration's loss and grad norm are taken from the arguments of Megatron's own training_log (recorded as
float.hex by the process wrapper, `--child`); the scripts themselves run unchanged under runpy.

    PYTHONPATH=src:tests:build/megatron-site python -P bench/megatron_h200_train.py --megatron-lm build/megatron-lm \\
        --out $OUT

`--megatron-lm DIR` holds Megatron-LM's pretrain_gpt.py, gpt_builders.py and model_provider.py at core_r0.19.0
(their git blob ids are checked). megatron-core 0.19's wheel lacks the Makefile that initialize_megatron runs with
`make -C .../megatron/core/datasets` (its compiled helpers are in the wheel): `make test-megatron-gpu` writes a no-op
one into build/megatron-site before this runs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATCH = ROOT / "examples" / "pretrain_gpt_logp.patch"
EXAMPLE = ROOT / "examples" / "pretrain_gpt_logp.py"

# git blob ids of Megatron-LM's files at core_r0.19.0
UPSTREAM = {"pretrain_gpt.py": "47c1935eb90ccac190b8c2934193e0d91bf99199",
            "gpt_builders.py": "3512918efe6aa9a934aba0f14fe6aba987ec9cf9",
            "model_provider.py": "c7d3b1353d335d19870e579794582981d9ef9d73"}
VOCAB, PADDED = 50257, 50304
MEGATRON_ARGS = [
    "--num-layers", "2", "--hidden-size", "256", "--num-attention-heads", "4", "--seq-length", "128",
    "--max-position-embeddings", "128", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--min-lr", "1e-3", "--lr-decay-style", "constant", "--weight-decay", "0.0",
    "--clip-grad", "1.0", "--bf16", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
    "--transformer-impl", "local", "--no-persist-layer-norm", "--no-gradient-accumulation-fusion",
    "--no-masked-softmax-fusion",                 # its CUDA extension (scaled_masked_softmax_cuda) is not in the wheel
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000000", "--distributed-timeout-minutes", "5",
]


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def apply_patch(text: str, patch: str) -> str:
    """Apply a unified diff of one file; every context and removed line must match where the hunk says."""
    lines = text.split("\n")
    out, pos = [], 0
    plines = patch.split("\n")
    i = 0
    while i < len(plines):
        line = plines[i]
        if not line.startswith("@@"):
            i += 1
            continue
        start = int(line.split()[1].split(",")[0][1:]) - 1
        out.extend(lines[pos:start])
        pos = start
        i += 1
        while i < len(plines) and not plines[i].startswith("@@"):
            h = plines[i]
            if h.startswith("+"):
                out.append(h[1:])
            elif h.startswith("-") or h.startswith(" ") or h == "":
                if h == "" and i == len(plines) - 1:
                    break
                want = h[1:] if h else ""
                if lines[pos] != want:
                    raise ValueError(f"{PATCH.name} does not apply at line {pos + 1}: {lines[pos]!r} != {want!r}")
                if not h.startswith("-"):
                    out.append(lines[pos])
                pos += 1
            i += 1
    out.extend(lines[pos:])
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------------------
# the process wrapper: records training_log's arguments, then runs a script as __main__
# ---------------------------------------------------------------------------------------------------------

def _hex(x):
    if x is None:
        return None
    return float(x).hex()


def child(record_path: str, script: str, workdir: str, argv: list, score: bool) -> int:
    sys.path.insert(0, workdir)
    import megatron.training.training as mtt

    t_start = time.perf_counter()
    rec = {"iterations": [], "processor_backends": [], "extension_log": []}
    captured = {}

    class Keep(logging.Handler):                   # the extension cache's INFO line: built, or loaded
        def emit(self, record):
            msg = record.getMessage()
            if "extension" in msg:
                rec["extension_log"].append(msg)
    logging.getLogger("fused_logp").addHandler(Keep())
    logging.getLogger("fused_logp").setLevel(logging.INFO)
    orig_log, orig_setup = mtt.training_log, mtt.setup_model_and_optimizer

    def training_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                     skipped_iter, grad_norm, *args, **kwargs):
        loss = loss_dict.get("lm loss")
        rec["iterations"].append({"iteration": int(iteration), "t_s": round(time.perf_counter() - t_start, 3),
                                  "lm_loss": None if loss is None else float(loss),
                                  "lm_loss_hex": _hex(loss), "grad_norm": None if grad_norm is None else float(grad_norm),
                                  "grad_norm_hex": _hex(grad_norm), "skipped": int(skipped_iter)})
        return orig_log(loss_dict, total_loss_dict, learning_rate, iteration, loss_scale, report_memory_flag,
                        skipped_iter, grad_norm, *args, **kwargs)

    def setup_model_and_optimizer(*args, **kwargs):
        out = orig_setup(*args, **kwargs)
        rec["setup_done_s"] = round(time.perf_counter() - t_start, 3)
        captured["model"] = out[0]
        hook = sys.modules.get("fused_logp.megatron_plugin.hook")
        if hook is not None:                       # the plugin's scripts: note the op's backend of each call
            proc = hook.logp_output_processor

            def recording(**kw):
                res = proc(**kw)
                b = getattr(res.provenance, "backend", None)
                if b not in rec["processor_backends"]:
                    rec["processor_backends"].append(b)
                return res

            hook.logp_output_processor = recording
        return out

    mtt.training_log, mtt.setup_model_and_optimizer = training_log, setup_model_and_optimizer
    sys.argv = [script] + argv
    t0 = time.perf_counter()
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        rec["wall_s"] = time.perf_counter() - t0
        Path(record_path).write_text(json.dumps(rec, indent=1) + "\n")
    if score:
        try:
            rec["score"] = score_checks(captured["model"])
        except Exception as exc:            # recorded; the driver's checks then fail
            import traceback
            traceback.print_exc()
            rec["score"] = {"error": f"{type(exc).__name__}: {exc}"}
        Path(record_path).write_text(json.dumps(rec, indent=1) + "\n")
    return 0


def score_checks(model) -> dict:
    """mp.score on the model pretrain() trained against the op called directly on the same rows (sm90)."""
    import torch

    import fused_logp
    import megatron_shims as ms
    from fused_logp import megatron_plugin as mp

    gpt = mp.unwrap_gpt_model(model)
    gpt.eval()
    real = mp.get_settings().vocab_size
    w = (gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
         else gpt.output_layer.weight).detach()
    g = torch.Generator().manual_seed(5)
    b, s = 2, 128
    tokens = torch.randint(0, real, (b, s), generator=g).cuda()
    res = {"vocab_size": real, "lm_head_rows": int(w.shape[0])}
    cap = ms.CaptureFinalHidden(gpt)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device="cuda"), 1).expand(b, 1, s, s)
    sc = mp.score(model, tokens, temperature=0.7, attention_mask=mask)
    h = cap.value.detach()
    keep = sc.loss_mask.t().reshape(-1) != 0
    rows = h.reshape(-1, h.shape[-1])[keep]
    ref = fused_logp.linear_logp(rows, w, sc.targets.t().reshape(-1)[keep], temperature=0.7, vocab_size=real,
                                 backend="sm90")
    res["rows"] = int(rows.shape[0])
    res["score_bytes_equal_op"] = bool(torch.equal(sc.logp.t().reshape(-1)[keep], ref.logp)
                                       and torch.equal(sc.lse.t().reshape(-1)[keep], ref.lse))
    res["score_backend"] = sc.provenance.backend
    res["score_fingerprint_equal"] = sc.fingerprint == fused_logp.weight_fingerprint(w, vocab_size=real)
    with torch.no_grad():
        logits = model[0](tokens, torch.arange(s, device="cuda").expand(b, s), mask)
    targets = logits[..., :real].argmax(-1)
    prog = fused_logp.TransformProgram(temperature=0.7, top_p=0.9)
    sp = mp.score(model, tokens, targets, program=prog, attention_mask=mask)
    h = cap.value.detach()
    cap.remove()
    refp = fused_logp.linear_logp_program(h.reshape(-1, h.shape[-1]), w, targets.t().reshape(-1), prog,
                                          vocab_size=real, backend="sm90")
    res["score_program_bytes_equal_op"] = bool(torch.equal(sp.logp.t().reshape(-1), refp.logp)
                                               and torch.equal(sp.lse.t().reshape(-1), refp.lse))
    res["logp_mean"] = float(sc.logp.t().reshape(-1)[keep].mean())
    return res


# ---------------------------------------------------------------------------------------------------------
# the driver
# ---------------------------------------------------------------------------------------------------------

def prepare(megatron_lm: Path, work: Path) -> dict:
    blobs = {}
    for name, want in UPSTREAM.items():
        src = megatron_lm / name
        if not src.exists():
            raise SystemExit(f"{src} is missing: put Megatron-LM's {', '.join(UPSTREAM)} (branch core_r0.19.0) in "
                             f"{megatron_lm}")
        data = src.read_bytes()
        blobs[name] = git_blob_id(data)
        if blobs[name] != want:
            raise SystemExit(f"{src} is not Megatron-LM core_r0.19.0's {name} (git blob {blobs[name]}, want {want})")
        shutil.copy(src, work / name)
    patched = apply_patch((work / "pretrain_gpt.py").read_text(), PATCH.read_text())
    (work / "pretrain_gpt_logp_patched.py").write_text(patched)
    marked = [ln.strip() for ln in patched.split("\n") if "# fused-logp" in ln]
    return {"upstream_blobs": blobs, "patched_lines": marked}


def run_one(name, script, extra, iters, work: Path, logdir: Path, timeout: int, score=False) -> dict:
    record = work / f"{name}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           str(Path(__file__).resolve()), "--child", str(record), "--workdir", str(work)]
    if score:
        cmd.append("--score")
    cmd += ["--", str(script)] + MEGATRON_ARGS + ["--train-iters", str(iters)] + extra
    env = dict(os.environ, PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1",
               NVSHMEM_DISABLE_NVLS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    t0 = time.perf_counter()
    with open(logdir / f"{name}.log", "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(work),
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    out = json.loads(record.read_text()) if record.exists() else {"iterations": []}
    out.update(rc=rc, process_s=round(time.perf_counter() - t0, 1), script=str(Path(script).name),
               extra_args=extra)
    print(f"{name}: rc {rc}, {len(out['iterations'])} iterations, {out['process_s']} s", flush=True)
    return out


def same_bits(a, b) -> bool:
    ia, ib = a["iterations"], b["iterations"]
    return bool(ia) and len(ia) == len(ib) and all(
        x["lm_loss_hex"] == y["lm_loss_hex"] and x["grad_norm_hex"] == y["grad_norm_hex"] for x, y in zip(ia, ib))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--megatron-lm", default=str(ROOT / "build" / "megatron-lm"))
    ap.add_argument("--out", default="out")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--timeout", type=int, default=240, help="seconds per run")
    ap.add_argument("--name", default="megatron-pretrain-h200")
    ap.add_argument("--jobs", type=int, default=1, help="runs at once (one GPU holds all five; 1: one after another, "
                    "so that the first flag-on run meets a cold extension cache and the second a warm one)")
    a = ap.parse_args()
    import torch
    from megatron.core import package_info

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "megatron_core": package_info.__version__, "megatron_lm_branch": "core_r0.19.0", "vocab_size": VOCAB,
           "padded_vocab": PADDED, "iterations": a.iters, "megatron_args": MEGATRON_ARGS}
    with tempfile.TemporaryDirectory(prefix="megatron-pretrain-") as tmp:
        work = Path(tmp)
        logdir = work / "logs"
        logdir.mkdir()
        res.update(prepare(Path(a.megatron_lm), work))
        on = ["--logp-backend", "contract"]
        plan = [("unmodified", work / "pretrain_gpt.py", [], False),
                ("patched-off", work / "pretrain_gpt_logp_patched.py", [], False),
                ("patched-on", work / "pretrain_gpt_logp_patched.py", on, True),
                ("example-off", EXAMPLE, [], False),
                ("example-on", EXAMPLE, on, False)]
        runs = {}

        def save():
            res["runs"] = {k: runs[k] for k, *_ in plan if k in runs}     # what has run so far
            (out / f"{a.name}.json").write_text(json.dumps(res, indent=1) + "\n")
            logs = [f"==================== {p.stem} ====================\n{p.read_text()}"
                    for p in sorted(logdir.glob("*.log"))]
            (out / f"{a.name}.log").write_text("\n".join(logs))

        res["jobs"] = a.jobs
        if a.jobs <= 1:
            for name, script, extra, score in plan:
                runs[name] = run_one(name, script, extra, a.iters, work, logdir, a.timeout, score=score)
                save()
        else:
            from concurrent.futures import ThreadPoolExecutor
            with ThreadPoolExecutor(a.jobs) as pool:
                futures = {name: pool.submit(run_one, name, script, extra, a.iters, work, logdir, a.timeout,
                                             score=score) for name, script, extra, score in plan}
                for name, fut in futures.items():
                    runs[name] = fut.result()
            save()

    base, on_run = runs["unmodified"], runs["patched-on"]
    losses = [x["lm_loss"] for x in on_run["iterations"]]
    checks = {
        "all_runs_exit_0": all(r["rc"] == 0 for r in runs.values()),
        "all_runs_logged_every_iteration": all(len(r["iterations"]) == a.iters for r in runs.values()),
        "flag_off_bit_identical_patched": same_bits(runs["patched-off"], base),
        "flag_off_bit_identical_example": same_bits(runs["example-off"], base),
        "flag_on_finite": bool(losses) and all(x is not None and math.isfinite(x) for x in losses),
        "flag_on_trains": len(losses) >= 2 and losses[-1] < losses[0],
        "example_on_bit_identical_patched_on": same_bits(runs["example-on"], on_run),
        "flag_on_backend_sm90": on_run.get("processor_backends") == ["sm90"]
        and runs["example-on"].get("processor_backends") == ["sm90"],
        "flag_off_plugin_not_called": not runs["patched-off"].get("processor_backends")
        and not runs["example-off"].get("processor_backends"),
    }
    sc = on_run.get("score", {})
    checks["score_bytes_equal_op"] = bool(sc.get("score_bytes_equal_op"))
    checks["score_program_bytes_equal_op"] = bool(sc.get("score_program_bytes_equal_op"))
    checks["score_fingerprint_equal"] = bool(sc.get("score_fingerprint_equal"))
    checks["score_backend_sm90"] = sc.get("score_backend") == "sm90"
    if base["iterations"] and on_run["iterations"]:
        x0, y0 = on_run["iterations"][0]["lm_loss"], base["iterations"][0]["lm_loss"]
        res["iteration1_loss_on_minus_unmodified"] = x0 - y0
        res["iteration1_loss_on_vs_unmodified_rel"] = abs(x0 - y0) / abs(y0)
    res["loss_unmodified"] = [x["lm_loss"] for x in base["iterations"]]
    res["loss_flag_on"] = losses
    res["grad_norm_unmodified"] = [x["grad_norm"] for x in base["iterations"]]
    res["grad_norm_flag_on"] = [x["grad_norm"] for x in on_run["iterations"]]
    res["first_step_s"] = {k: round(r["iterations"][0]["t_s"] - r["setup_done_s"], 3)
                           for k, r in runs.items() if r.get("iterations") and "setup_done_s" in r}
    res["extension_log"] = {k: r.get("extension_log") for k, r in runs.items() if r.get("extension_log")}
    res["runs"] = runs
    res["checks"] = checks
    res["ok"] = all(checks.values())
    (out / f"{a.name}.json").write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({"checks": checks, "ok": res["ok"], "loss_unmodified": res["loss_unmodified"],
                      "loss_flag_on": losses, "score": sc}, indent=1))
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    if "--child" in sys.argv:
        p = argparse.ArgumentParser()
        p.add_argument("--child", required=True)
        p.add_argument("--workdir", required=True)
        p.add_argument("--score", action="store_true")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        c = p.parse_args()
        rest = c.rest[1:] if c.rest and c.rest[0] == "--" else c.rest
        sys.exit(child(c.child, rest[0], c.workdir, rest[1:], c.score))
    sys.exit(main())
