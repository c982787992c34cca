"""examples/pretrain_gpt_logp.py on a GPU: a few training steps of a GPTModel with the Qwen3-8B lm_head (hidden
4096, vocabulary 151936, a few small Qwen3-style layers) through megatron-core's get_forward_backward_func and
Megatron's DistributedDataParallel (FP32 main_grad buffers), then the RL scoring API against the SM90 op's bytes.

Checks (each recorded in the JSON):
  * train: `--logp-backend contract`, two micro-batches per step; the lm_head gradient lands in the FP32
    `main_grad` and equals the FP32 sum of the per-micro-batch gradients of the op itself (linear_logp on the
    captured final hidden states, the schedules' loss scaling); the loss decreases over the steps;
  * flag off on the same weights: Megatron's own output layer and cross-entropy (151936 = 1187 * 128, so no
    padding rows at TP=1: the same function; losses agree to 1e-2 relative);
  * score: mp.score (temperature 0.7; a top-p program) equals linear_logp / linear_logp_program with
    backend="sm90" on the captured final hidden states, byte for byte; the attached fingerprint equals
    weight_fingerprint of the lm_head; provenance backend "sm90".

    PYTHONPATH=src:tests:build/megatron-site python -P bench/megatron_h200_train.py --out $OUT
    python bench/megatron_h200_train.py --cpu --out out      # the same logic at small shapes on CPU (no DDP)
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT / "src", ROOT / "tests"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import megatron_shims as ms  # noqa: E402

import fused_logp  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402


def _example():
    spec = importlib.util.spec_from_file_location("pretrain_gpt_logp", ROOT / "examples" / "pretrain_gpt_logp.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(real, padded, backend):
    parser = mp.add_logp_args(argparse.ArgumentParser(allow_abbrev=False))
    flags = ["--logp-backend", backend, "--logp-vocab-size", str(real)] if backend else []
    args = parser.parse_args(flags)
    args.padded_vocab_size, args.tensor_model_parallel_size = padded, 1
    args.check_for_nan_in_loss_and_grad, args.check_for_spiky_loss = True, False
    return args


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="out")
    ap.add_argument("--cpu", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1.0)
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    dev = "cpu" if a.cpu else "cuda"
    if a.cpu:
        real = padded = 2048
        shape = dict(hidden=128, heads=4, query_groups=2, ffn=256, seq=32, layers=1)
        b = 2
    else:
        real = padded = 151936                      # Qwen3's vocabulary: 1187 * 128, no padding at TP=1
        shape = dict(hidden=4096, heads=32, query_groups=8, ffn=2048, seq=512, layers=2)
        b = 2
    s, micro = shape["seq"], 2
    ms.start_model_parallel(0, 1, device=dev)
    from megatron.core import package_info
    from megatron.core.pipeline_parallel import get_forward_backward_func

    wrapped, gpt = ms.build_qwen3_style_gpt(vocab_size=padded, tied=False, device=dev, init_std=0.02, **shape)
    model = wrapped
    if not a.cpu:
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        model = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                        module=wrapped)
    example = _example()
    res = {"device": torch.cuda.get_device_name() if not a.cpu else "cpu", "torch": torch.__version__,
           "megatron_core": package_info.__version__, "vocab": real, "padded_vocab": padded, "micro_batches": micro,
           "micro_batch": b, **shape}
    w = gpt.output_layer.weight
    g = torch.Generator().manual_seed(0)

    def batches():
        out = []
        for _ in range(micro):
            tok = torch.randint(0, real, (b, s + 1), generator=g)
            out.append({"tokens": tok[:, :-1].to(dev), "labels": tok[:, 1:].contiguous().to(dev),
                        "loss_mask": torch.ones(b, s, device=dev), "attention_mask": None,
                        "position_ids": torch.arange(s, device=dev).expand(b, s).contiguous()})
        return out

    def run(bt, backend, forward_only=False):
        args = _args(real, padded, backend)
        example.get_args = lambda: args
        mp.setup_from_args(args)
        hidden = []
        hk = gpt.decoder.register_forward_hook(
            lambda m, i, o: hidden.append((o[0] if isinstance(o, tuple) else o).detach()))
        if not a.cpu:
            model.zero_grad_buffer()
        for p in model.parameters():
            p.grad = None
        try:
            reports = get_forward_backward_func()(forward_step_func=example.forward_step, data_iterator=iter(bt),
                                                  model=[model], num_microbatches=micro, seq_length=s,
                                                  micro_batch_size=b, forward_only=forward_only)
        finally:
            hk.remove()
        if not a.cpu and not forward_only:
            model.finish_grad_sync()
        return reports, hidden

    def op_grad_sum(hidden, bt):
        """FP32 sum of the per-micro-batch lm_head gradients of the op itself, with the schedules' scaling."""
        total = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for h, x in zip(hidden, bt):
            wl = w.detach().clone().requires_grad_()
            rows = h.reshape(-1, h.shape[-1])
            r = fused_logp.linear_logp(rows, wl, x["labels"].t().reshape(-1), temperature=torch.ones(
                rows.shape[0], device=w.device), vocab_size=real)
            logp = r.logp.view(s, b).t().contiguous()
            loss, n, _ = example.loss_func(x["loss_mask"], -logp)
            loss = loss / torch.clamp(n, min=1) / micro
            (gw,) = torch.autograd.grad(loss, wl)
            total.add_(gw)
        return total

    steps = []
    fixed = batches()                                    # one batch, trained on repeatedly: its loss must fall
    for step in range(a.steps):
        bt = fixed
        t0 = time.perf_counter()
        reports, hidden = run(bt, "contract")
        if not a.cpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        grad = (w.main_grad if not a.cpu else w.grad).detach()
        rec = {"step": step, "loss": [float(r["lm loss"][0] / r["lm loss"][1]) for r in reports],
               "fwd_bwd_s": dt, "main_grad_dtype": str(grad.dtype)}
        if step == 0:
            ref = op_grad_sum(hidden, bt)
            # on CPU (no DDP) autograd accumulates the micro-batches in the bf16 .grad: close, not equal
            rec["lm_head_grad_equals_fp32_sum_of_op_grads"] = bool(torch.equal(grad.float(), ref)) if not a.cpu \
                else bool((grad.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max())
            rec["lm_head_grad_max_abs_diff"] = float((grad.float() - ref).abs().max())
            rec["lm_head_grad_max_abs"] = float(ref.abs().max())
            # flag off on the same weights and batch: Megatron's own output layer and loss
            off, _ = run(bt, None, forward_only=True)
            rec["loss_flag_off"] = [float(r["lm loss"][0] / r["lm loss"][1]) for r in off]
            rec["loss_on_off_max_rel"] = max(abs(x - y) / abs(y) for x, y in zip(rec["loss"], rec["loss_flag_off"]))
            reports, hidden = run(bt, "contract")          # the gradient again, for the update below
            grad = (w.main_grad if not a.cpu else w.grad).detach()
        with torch.no_grad():
            for p in gpt.parameters():
                gr = getattr(p, "main_grad", None) if not a.cpu else p.grad
                if gr is not None:
                    p.add_((-a.lr * gr.float()).to(p.dtype))
        steps.append(rec)
        print(json.dumps(rec), flush=True)
    res["steps"] = steps
    with torch.no_grad():
        final, _ = run(fixed, "contract", forward_only=True)
    res["loss_after_training"] = [float(r["lm loss"][0] / r["lm loss"][1]) for r in final]
    res["train_loss_decreased"] = sum(res["loss_after_training"]) < sum(steps[0]["loss"])

    # the RL scoring API against the SM90 op (the oracle on CPU)
    mp.configure(None)                                   # the plugin off process-wide: score turns it on per call
    backend = "oracle" if a.cpu else "sm90"
    tokens = torch.randint(0, real, (b, s), generator=g).to(dev)
    cap = ms.CaptureFinalHidden(gpt)
    t0 = time.perf_counter()
    sc = mp.score(model, tokens, temperature=0.7, vocab_size=real)
    if not a.cpu:
        torch.cuda.synchronize()
    res["score_s"] = time.perf_counter() - t0
    h = cap.value.detach()
    keep = sc.loss_mask.t().reshape(-1) != 0
    wd = w.detach()
    ref = fused_logp.linear_logp(h.reshape(-1, h.shape[-1])[keep], wd, sc.targets.t().reshape(-1)[keep],
                                 temperature=0.7, vocab_size=real, backend=backend)
    res["score_bytes_equal_op"] = (torch.equal(sc.logp.t().reshape(-1)[keep], ref.logp)
                                   and torch.equal(sc.lse.t().reshape(-1)[keep], ref.lse))
    res["score_backend"] = sc.provenance.backend
    res["score_fingerprint_equal"] = sc.fingerprint == fused_logp.weight_fingerprint(wd, vocab_size=real)
    with torch.no_grad():
        logits = wrapped(tokens, torch.arange(s, device=dev).expand(b, s), None)
    targets = logits[..., :real].argmax(-1)
    prog = fused_logp.TransformProgram(temperature=0.7, top_p=0.9)
    sp = mp.score(model, tokens, targets, program=prog, vocab_size=real)
    h = cap.value.detach()
    cap.remove()
    refp = fused_logp.linear_logp_program(h.reshape(-1, h.shape[-1]), wd, targets.t().reshape(-1), prog,
                                          vocab_size=real, backend=backend)
    res["score_program_bytes_equal_op"] = (torch.equal(sp.logp.t().reshape(-1), refp.logp)
                                           and torch.equal(sp.lse.t().reshape(-1), refp.lse))
    ok = (res["train_loss_decreased"] and steps[0]["lm_head_grad_equals_fp32_sum_of_op_grads"]
          and steps[0]["loss_on_off_max_rel"] < 1e-2 and res["score_bytes_equal_op"]
          and res["score_program_bytes_equal_op"] and res["score_fingerprint_equal"]
          and res["score_backend"] == backend and all(s["main_grad_dtype"] == ("torch.float32" if not a.cpu
                                                                               else str(w.dtype)) for s in steps))
    res["ok"] = bool(ok)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "megatron-h200-2026-12-01.json" if not a.cpu else "megatron-train-cpu.json"
    (out / name).write_text(json.dumps(res, indent=2) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "steps"}, indent=1))
    ms.stop_model_parallel()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
