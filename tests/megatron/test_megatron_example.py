"""examples/megatron_core_logp_step.py (a pretrain_gpt.py-shaped training step) through megatron-core's own schedules
(get_forward_backward_func), with --logp-backend on and off, on CPU at world size 1 (real megatron-core 0.16.1;
the CUDA-only pieces replaced as fused_logp_jobs.megatron_cpu lists)."""
from __future__ import annotations

import argparse
import importlib.util
import warnings
from functools import partial
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", module="megatron")

import megatron_shims as ms  # noqa: E402

import fused_logp  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PADDED, REAL, B, S, D, MICRO = 512, 500, 2, 8, 64, 2


def _load_example():
    path = ROOT / "examples" / "megatron_core_logp_step.py"
    spec = importlib.util.spec_from_file_location("megatron_core_logp_step", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def world():
    with ms.model_parallel_world("cpu"):
        yield


@pytest.fixture(scope="module")
def example(world):
    return _load_example()


@pytest.fixture(autouse=True)
def clean(world):
    with ms.fresh_plugin_state():
        yield


def _megatron_args(*logp_flags, **extra):
    """The parsed arguments a Megatron-LM run would have: Megatron's loss-check switches and vocab fields, plus
    the plugin's flags through its extra_args_provider."""
    parser = argparse.ArgumentParser(allow_abbrev=False)
    parser.add_argument("--check-for-nan-in-loss-and-grad", type=bool, default=True)
    parser.add_argument("--check-for-spiky-loss", action="store_true")
    parser = mp.add_logp_args(parser)
    args = parser.parse_args(list(logp_flags))
    args.padded_vocab_size, args.tensor_model_parallel_size = PADDED, 1
    for k, v in extra.items():
        setattr(args, k, v)
    return args


def _batches(seed=0):
    out = []
    for i in range(MICRO):
        ids, pos, mask, labels = ms.batch(B, S, REAL, seed=seed + i)
        loss_mask = torch.ones(B, S)
        loss_mask[i % B, : 2 + i] = 0
        out.append({"tokens": ids, "labels": labels, "loss_mask": loss_mask, "attention_mask": mask,
                    "position_ids": pos})
    return out


def _train_step(example, model, batches, forward_step=None, forward_only=False):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    for p in model.parameters():
        p.grad = None
    fb = get_forward_backward_func()
    return fb(forward_step_func=forward_step or example.forward_step, data_iterator=iter(batches), model=[model],
              num_microbatches=len(batches), seq_length=S, micro_batch_size=B, forward_only=forward_only)


@pytest.fixture(scope="module")
def model(world):
    return ms.build_tiny_gpt(vocab_size=PADDED, tied=False, seed=31)


def _run(example, monkeypatch, model, flags, **extra):
    args = _megatron_args(*flags, **extra)
    monkeypatch.setattr(example, "get_args", lambda: args)
    mp.setup_from_args(args)
    wrapped, gpt = model
    batches = _batches()
    cap = ms.CaptureFinalHidden(gpt)
    hidden = []
    h = gpt.decoder.register_forward_hook(lambda m, a, o: hidden.append((o[0] if isinstance(o, tuple) else o)
                                                                          .detach()))
    try:
        reports = _train_step(example, wrapped, batches)
    finally:
        h.remove()
        cap.remove()
    grad = gpt.output_layer.weight.grad.detach().clone()
    return reports, hidden, batches, grad


def test_flag_on_is_the_contract_op_and_flag_off_is_megatron(example, model, monkeypatch):
    # flag on: each micro-batch's reported loss is the masked sum of -logp with the op's bytes
    on, hidden, batches, grad_on = _run(example, monkeypatch, model,
                                        ["--logp-backend", "contract", "--logp-vocab-size", str(REAL)])
    w = ms.lm_head_weight(model[1]).detach()
    for rep, h, bt in zip(on, hidden, batches):
        ref = fused_logp.linear_logp(ms.op_hidden_rows(h, bt["loss_mask"]), w, ms.op_rows(bt["labels"],
                                     bt["loss_mask"]), vocab_size=REAL)
        keep = bt["loss_mask"].t().reshape(-1) != 0
        logp_bs = torch.zeros(S * B).index_put((keep.nonzero().squeeze(1),), ref.logp).view(S, B).t()
        assert torch.equal(rep["lm loss"][0], torch.sum(-logp_bs.reshape(-1) * bt["loss_mask"].reshape(-1)))
        assert int(rep["lm loss"][1]) == int(bt["loss_mask"].sum())
    assert bool((grad_on[REAL:] == 0).all()) and float(grad_on[:REAL].abs().sum()) > 0

    # flag off: Megatron's own output layer and cross-entropy (the same script, nothing else changed)
    off, _, _, grad_off = _run(example, monkeypatch, model, [])
    wrapped, _ = model
    for rep, bt in zip(off, batches):
        with torch.no_grad():
            per_token = wrapped(bt["tokens"], bt["position_ids"], bt["attention_mask"], labels=bt["labels"])
        assert torch.equal(rep["lm loss"][0], torch.sum(per_token.view(-1).float() * bt["loss_mask"].view(-1)))
    assert float(grad_off[REAL:].abs().sum()) > 0                     # Megatron's softmax includes padding rows

    # with the real vocabulary = every row, the two paths compute the same function: losses and gradients agree
    full, _, _, grad_full = _run(example, monkeypatch, model,
                                 ["--logp-backend", "contract", "--logp-vocab-size", str(PADDED)])
    for a, b in zip(full, off):
        assert torch.allclose(a["lm loss"], b["lm loss"], rtol=2e-3, atol=0)
    assert (grad_full.float() - grad_off.float()).abs().max() <= 2 ** -6 * grad_off.float().abs().max()


@pytest.mark.parametrize("flags", [["--logp-backend", "contract", "--logp-vocab-size", str(REAL)], []],
                         ids=["on", "off"])
def test_megatron_nan_check_kept(example, monkeypatch, flags):
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=False, seed=32)
    args = _megatron_args(*flags)
    monkeypatch.setattr(example, "get_args", lambda: args)
    mp.setup_from_args(args)
    with torch.no_grad():
        gpt.output_layer.weight[7] = float("nan")
    with pytest.raises(RuntimeError, match="found NaN in local forward loss calculation"):
        _train_step(example, wrapped, _batches(), forward_only=True)


@pytest.mark.parametrize("flags", [["--logp-backend", "contract", "--logp-vocab-size", str(REAL)], []],
                         ids=["on", "off"])
def test_plugin_loss_func_with_model_keyword(model, flags):
    """mp.logp_loss_func as pretrain_gpt passes its loss function: partial(loss_func, loss_mask, model=model)."""
    wrapped, _ = model
    mp.setup_from_args(_megatron_args(*flags))

    def forward_step(data_iterator, model):
        bt = next(data_iterator)
        out = model(bt["tokens"], bt["position_ids"], bt["attention_mask"], labels=bt["labels"],
                    loss_mask=bt["loss_mask"])
        assert isinstance(out, mp.LogpOutput) == bool(flags)
        return out, partial(mp.logp_loss_func, bt["loss_mask"], model=model)

    reports = _train_step(None, wrapped, _batches(), forward_step=forward_step)
    assert len(reports) == MICRO and all(torch.isfinite(r["lm loss"]).all() for r in reports)
    mp.training.set_loss_checks(nan=True)
    nan = mp.LogpOutput(logp=torch.full((B, S), float("nan")), lse=torch.zeros(B, S), loss_mask=None)
    with pytest.raises(RuntimeError, match="found NaN"):
        mp.logp_loss_func(torch.ones(B, S), nan, model=wrapped)
    mp.training.set_loss_checks(nan=False)
    try:
        assert torch.isnan(mp.logp_loss_func(torch.ones(B, S), nan, model=wrapped)[0])
    finally:
        mp.training.set_loss_checks(nan=True)


def test_spiky_loss_check_reported(monkeypatch, caplog):
    """--check-for-spiky-loss: Megatron's rerun state machine sees the loss (non-fatal)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    mp.training.set_loss_checks(spiky=True)
    seen = []
    machine = get_rerun_state_machine()
    orig = machine.validate_result
    monkeypatch.setattr(machine, "validate_result", lambda **kw: (seen.append(kw["message"]), orig(**kw)))
    try:
        out = mp.LogpOutput(logp=-torch.rand(B, S), lse=torch.zeros(B, S), loss_mask=None)
        mp.logp_loss_func(torch.ones(B, S), out)
    finally:
        mp.training.set_loss_checks(spiky=False)
    assert seen == ["found NaN in local forward loss calculation", "found Inf in local forward loss calculation",
                    "Spiky loss"]
