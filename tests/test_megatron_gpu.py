"""Megatron plugin on an H200: megatron-core 0.19.x, NCCL at world size 1, the SM90 backend.

`make test-megatron-gpu` installs megatron-core from the wheel in build/wheels (the GPU machine has no package
index) into build/megatron-site and runs this file. The model is a GPTModel with the Qwen3-8B lm_head (hidden
4096, vocabulary 151936 padded to 152064; tied and untied) on a one-layer Qwen3-style body (RMSNorm, RoPE, GQA
with qk-norm, SwiGLU; Megatron's local spec, a small FFN), bf16 in Float16Module, on the GPU, with
`--logp-backend contract` (which resolves to the SM90 kernel here). Nothing of Megatron is shimmed: its CUDA RNG
tracker, default causal mask, RoPE and scratch buffers run as in training.

Mirrors tests/test_megatron_plugin.py: the model's logp/lse bytes equal the op called directly (backend sm90) on
the captured final hidden states and the lm_head's real-vocabulary rows; per-token temperature; padded rows never
enter the lse; gradients of the final hidden states and the lm_head against an FP32 torch reference; the flag off
leaves Megatron's output untouched; ids >= the real vocabulary rejected (in a child process: on CUDA the row is NaN and
check_input_errors() names the argument); strict mode; refusals; the fingerprint and
weight version after an optimizer step. Skipped without an SM90 GPU or without megatron-core.

FUSED_LOGP_TEST_MEGATRON_GPU_ON_CPU=1 runs the same checks on CPU at small shapes (gloo, the CPU oracle,
fused_logp_jobs.megatron_cpu's shims): a dry run of this file's own logic on a machine without a GPU.
"""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

megatron_core = pytest.importorskip("megatron.core", reason="megatron-core is not importable "
                                                            "(on the GPU machine: make test-megatron-gpu)")
warnings.filterwarnings("ignore", module="megatron")

import megatron_shims as ms  # noqa: E402
from helpers import bits_equal  # noqa: E402

import fused_logp  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402
from fused_logp.shared_contract.config import Config, set_config  # noqa: E402
from fused_logp.shared_contract.errors import (ContractInputError, FingerprintMismatchError,  # noqa: E402
                                               StrictModeError)

ON_CPU_VAR = "FUSED_LOGP_TEST_MEGATRON_GPU_ON_CPU"
ON_CPU = os.environ.get(ON_CPU_VAR) == "1"
pytestmark = [] if ON_CPU else pytest.mark.gpu

if ON_CPU:          # the dry run: small shapes, the oracle (a ragged last tile: 1000 = 15 * 64 + 40)
    DEV, BACKEND = "cpu", "oracle"
    PADDED, REAL, D, HEADS, GROUPS, FFN, B, S = 1024, 1000, 64, 4, 2, 128, 2, 8
else:               # Qwen3-8B: hidden 4096, 32 query / 8 KV heads of 128; vocabulary 151936 padded to 152064
    DEV, BACKEND = "cuda", "sm90"
    PADDED, REAL, D, HEADS, GROUPS, FFN, B, S = 152064, 151936, 4096, 32, 8, 1024, 2, 64
T = 0.7


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _build(tied: bool, seed: int):
    return ms.build_qwen3_style_gpt(vocab_size=PADDED, hidden=D, heads=HEADS, query_groups=GROUPS, ffn=FFN, seq=S,
                                    tied=tied, seed=seed, device=DEV)


def _batch(seed: int):
    return ms.token_batch(B, S, REAL, seed=seed, device=DEV)


def _ones():
    return torch.ones(B, S, device=DEV)


@pytest.fixture(scope="module", autouse=True)
def world_1():
    if not ON_CPU and not _sm90():
        pytest.skip("needs an SM90 (H100/H200) GPU")
    with ms.model_parallel_world(DEV):
        if not ON_CPU:                   # builds the SM90 extension on first use (about a minute)
            from fused_logp.kernel.backends import get_backend
            ok, why = get_backend("sm90").available()
            assert ok, why
        yield


@pytest.fixture(autouse=True)
def clean_plugin_state():
    with ms.fresh_plugin_state():
        yield


@pytest.fixture(scope="module")
def tied():
    return _build(True, 1234)


@pytest.fixture(scope="module")
def untied():
    return _build(False, 99)


def _check_provenance(prov):
    # on CPU `auto` is the compiled oracle (the numpy oracle's bytes); on the H200 the SM90 kernel
    assert prov.backend in ((BACKEND, "oracle-fast") if ON_CPU else (BACKEND,)), prov
    assert prov.contract_bearing and prov.fallback is None, prov
    assert prov.contract_version == fused_logp.CONTRACT_VERSION


# ---------------------------------------------------------------------------------------------------------
# the hook
# ---------------------------------------------------------------------------------------------------------

def test_processor_route_for_this_megatron(tied, monkeypatch):
    """>= 0.18 (0.19.x here): Megatron's own, unpatched _postprocess calls the processor through
    output_processor; 0.16/0.17: the plugin's _postprocess wrapper calls it."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from fused_logp.megatron_plugin import hook

    wrapped, _ = tied
    ids, pos, labels = _batch(13)
    settings = mp.configure("contract", temperature=T, vocab_size=REAL)
    orig_postprocess = GPTModel.__dict__["_postprocess"]
    calls = []

    def spy(**kw):
        calls.append((sys._getframe(1).f_code, kw))
        return mp.logp_output_processor(**kw)

    monkeypatch.setattr(hook, "logp_output_processor", spy)
    mp.install()
    with torch.no_grad():
        out = wrapped(ids, pos, None, labels=labels)
    assert isinstance(out, mp.LogpOutput) and len(calls) == 1
    _check_provenance(out.provenance)
    caller, kw = calls[0]
    if mp.megatron_core_version() < (0, 18):
        assert caller is GPTModel.__dict__["_postprocess"].__code__
        return
    assert GPTModel.__dict__["_postprocess"] is orig_postprocess and caller is orig_postprocess.__code__
    assert kw["context"] is settings
    mp.uninstall()
    with torch.no_grad():                            # passed directly, without install()
        direct = wrapped(ids, pos, None, labels=labels, output_processor=mp.logp_output_processor,
                         output_processor_context={"temperature": T, "vocab_size": REAL})
    assert bits_equal(direct.logp, out.logp) and bits_equal(direct.lse, out.lse)


def test_flag_off_leaves_megatron_untouched(tied):
    wrapped, gpt = tied
    ids, pos, labels = _batch(7)
    with torch.no_grad():
        loss0 = wrapped(ids, pos, None, labels=labels)
        logits0 = wrapped(ids, pos, None)
    assert loss0.shape == (B, S) and logits0.shape == (B, S, PADDED)
    assert bool(torch.isfinite(loss0).all())

    def same():
        with torch.no_grad():
            return (torch.equal(wrapped(ids, pos, None, labels=labels), loss0)
                    and torch.equal(wrapped(ids, pos, None), logits0))

    assert same()                                    # Megatron alone is repeatable on this device
    mp.install()                                     # installed, disabled
    assert same()
    mp.configure("contract", vocab_size=REAL)        # enabled: the unlabelled call still returns Megatron's logits
    with torch.no_grad():
        assert torch.equal(wrapped(ids, pos, None), logits0)
        assert isinstance(wrapped(ids, pos, None, labels=labels), mp.LogpOutput)
    mp.disable(wrapped)                              # per-model off
    assert same()
    gpt._fused_logp_settings = None
    mp.configure(None)
    assert same()
    mp.uninstall()
    assert same()


# ---------------------------------------------------------------------------------------------------------
# bytes
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["tied", "untied"])
def test_logp_lse_bytes_equal_the_op(which, request):
    wrapped, gpt = request.getfixturevalue(which)
    ids, pos, labels = _batch(3)
    loss_mask = _ones()
    loss_mask[0, :2] = 0
    loss_mask[1, -1] = 0
    mp.configure("contract", temperature=T, vocab_size=REAL)
    mp.install()
    cap = ms.CaptureFinalHidden(gpt)
    try:
        with torch.no_grad():
            out = wrapped(ids, pos, None, labels=labels, loss_mask=loss_mask)
    finally:
        cap.remove()
    assert isinstance(out, mp.LogpOutput) and out.logp.shape == (B, S) and out.lse.dtype == torch.float32
    assert out.logp.device.type == DEV
    _check_provenance(out.provenance)
    h, t = ms.op_hidden_rows(cap.value, loss_mask), ms.op_rows(labels, loss_mask)
    assert h.dtype == torch.bfloat16 and h.shape == (int(loss_mask.sum()), D)
    w = ms.lm_head_weight(gpt).detach()
    assert w.shape == (PADDED, D) and w.dtype == torch.bfloat16
    ref = fused_logp.linear_logp(h, w[:REAL], t, temperature=T, backend=BACKEND)       # the real rows only
    _check_provenance(ref.provenance)
    assert bits_equal(ms.op_rows(out.logp, loss_mask), ref.logp)
    assert bits_equal(ms.op_rows(out.lse, loss_mask), ref.lse)
    padded = fused_logp.linear_logp(h, w, t, temperature=T, vocab_size=REAL, backend=BACKEND)
    assert bits_equal(padded.logp, ref.logp) and bits_equal(padded.lse, ref.lse)
    assert bool(torch.isfinite(ref.lse).all()) and bool((ref.logp <= 0).all())
    assert bool((out.logp[loss_mask == 0] == 0).all()) and bool((out.lse[loss_mask == 0] == 0).all())
    loss, n, report = mp.logp_loss_func(loss_mask, out)
    assert int(n) == int(loss_mask.sum()) and torch.equal(loss, -(out.logp * loss_mask).sum())
    assert "lm loss" in report


def test_per_token_temperature(tied):
    wrapped, gpt = tied
    ids, pos, labels = _batch(11)
    temps = torch.linspace(0.5, 1.5, B * S).reshape(B, S).to(DEV)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    cap = ms.CaptureFinalHidden(gpt)
    try:
        with torch.no_grad(), mp.call_options(temperature=temps):
            out = wrapped(ids, pos, None, labels=labels)
    finally:
        cap.remove()
    ref = fused_logp.linear_logp(cap.value.reshape(-1, D), ms.lm_head_weight(gpt).detach()[:REAL],
                                 ms.op_rows(labels, None), temperature=ms.op_rows(temps, None), backend=BACKEND)
    assert bits_equal(ms.op_rows(out.logp, None), ref.logp) and bits_equal(ms.op_rows(out.lse, None), ref.lse)


def test_padded_rows_never_enter_lse(untied):
    wrapped, gpt = untied
    ids, pos, labels = _batch(5)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    w = gpt.output_layer.weight
    with torch.no_grad():
        before = wrapped(ids, pos, None, labels=labels)
        saved = w[REAL:].clone()
        w[REAL:] = 3.0                                   # padding rows with large logits
        try:
            after = wrapped(ids, pos, None, labels=labels)
        finally:
            w[REAL:] = saved
    assert bits_equal(before.logp, after.logp) and bits_equal(before.lse, after.lse)


# ---------------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------------

def test_gradients_match_fp32_reference(untied):
    """The whole model's backward through the plugin: the gradient reaching the final hidden states and the
    lm_head's gradient against FP32 torch (log_softmax over the real vocabulary, IEEE FP32 matmul) on the same
    hidden states and weight. Tolerance (megatron_shims.grad_close): 2^-6 of |ref| + max|ref| elementwise and
    2^-6 relative in norm, as tests/test_backward_gpu.py: the op's CUDA backward rounds dz to bf16 for its GEMMs
    and stores bf16 gradients (each a relative 2^-9), 8x below the bound."""
    wrapped, gpt = untied
    ids, pos, labels = _batch(4)
    mask = _ones()
    mask[1, :3] = 0
    mp.configure("contract", temperature=0.8, vocab_size=REAL)
    mp.install()
    wrapped.zero_grad(set_to_none=True)
    cap = ms.CaptureFinalHidden(gpt, retain_grad=True)
    try:
        out = wrapped(ids, pos, None, labels=labels, loss_mask=mask)
    finally:
        cap.remove()
    (-(out.logp * mask).sum() + 0.3 * (out.lse * mask).sum()).backward()
    with torch.no_grad():                                        # gradients do not change the forward bytes
        again = wrapped(ids, pos, None, labels=labels, loss_mask=mask)
    assert bits_equal(again.logp, out.logp.detach()) and bits_equal(again.lse, out.lse.detach())

    w = gpt.output_layer.weight
    gh, gw = ms.fp32_reference_grads(cap.value.detach().reshape(-1, D), w, labels.t().reshape(-1),
                                     mask.t().reshape(-1), 0.8, REAL, 0.3)
    dh = cap.value.grad
    assert dh is not None and dh.shape == (S, B, D)
    ok, worst, rel = ms.grad_close(dh.reshape(-1, D), gh)
    assert ok, f"hidden gradient: max |diff| {worst}, relative norm error {rel}"
    ok, worst, rel = ms.grad_close(w.grad[:REAL], gw[:REAL])
    assert ok, f"lm_head gradient: max |diff| {worst}, relative norm error {rel}"
    assert bool((w.grad[REAL:] == 0).all())                      # padding rows get no gradient
    assert bool((dh[:3, 1] == 0).all())                          # masked positions get no gradient
    assert gpt.decoder.layers[0].mlp.linear_fc1.weight.grad is not None     # the body is trained through it
    wrapped.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------

def _reject_child():
    """Run in a child process by test_label_outside_real_vocab_rejected."""
    ms.start_model_parallel(0, 1, device=DEV)
    wrapped, _ = _build(True, 1234)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    ids, pos, labels = _batch(9)
    lab, mask = labels.clone(), _ones()
    lab[0, 0], lab[0, 1], lab[1, -1] = REAL, PADDED + 7, -100       # ignored: masked out
    mask[0, :2] = 0
    mask[1, -1] = 0
    with torch.no_grad():
        out = wrapped(ids, pos, None, labels=lab, loss_mask=mask)
        finite = bool(torch.isfinite(out.logp).all())              # synchronises
    print(f"MASKED-OUT IDS ACCEPTED finite={finite}", flush=True)
    lab = labels.clone()
    lab[1, 3] = REAL                                              # the first padding id, at an unmasked position
    try:
        with torch.no_grad():
            out = wrapped(ids, pos, None, labels=lab)
            print(f"BAD ROW NAN={bool(torch.isnan(out.logp).any())} FINITE={int(torch.isfinite(out.logp).sum())}"
                  f" OF {out.logp.numel()}", flush=True)
        if DEV == "cuda":
            from fused_logp import check_input_errors
            check_input_errors()                                  # synchronises and raises for the bad row
    except Exception as exc:                                      # noqa: BLE001 - reported to the parent
        print(f"REJECTED: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}", flush=True)
        os._exit(0)
    print("NOT REJECTED", flush=True)
    os._exit(1)


def test_label_outside_real_vocab_rejected():
    """A label >= the real vocabulary at an unmasked position is refused; masked-out positions are not checked.
    On CUDA the op checks without a host synchronisation: the row's logp is NaN and check_input_errors() raises
    naming the argument; the CUDA context stays usable. It runs in a child process all the same."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
    if ON_CPU:
        env[ON_CPU_VAR] = "1"
    cmd = [sys.executable] + (["-P"] if sys.flags.safe_path else []) + [os.path.abspath(__file__), "--reject-child"]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    tail = (r.stdout + r.stderr)[-6000:]
    assert "MASKED-OUT IDS ACCEPTED finite=True" in r.stdout, tail
    assert r.returncode == 0 and "REJECTED:" in r.stdout, tail
    line = r.stdout.split("REJECTED:", 1)[1].splitlines()[0]
    if ON_CPU:
        assert "ContractInputError" in line and f"real vocabulary [0, {REAL})" in line, line
    else:
        assert "ContractInputError" in line and "targets" in line, line
        assert "BAD ROW NAN=True" in r.stdout, tail


@pytest.mark.parametrize("fields, match", [
    ({"mtp_num_layers": 1}, "multi-token prediction"),
    ({"use_mup": True, "mup_output_mult": 0.5}, "MuP"),
    ({"final_logit_softcapping": 30.0}, "soft-capping"),
    ({"fp8_output_proj": True, "fp8_recipe": "mxfp8"}, "quantized output projection"),
    ({"defer_embedding_wgrad_compute": True}, "deferred embedding wgrad"),
])
def test_refuses_uncovered_config(untied, fields, match):
    wrapped, gpt = untied
    ids, pos, labels = _batch(7)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    saved = gpt.config
    cfg = copy.copy(saved)
    for k, v in fields.items():
        setattr(cfg, k, v)
    gpt.config = cfg
    try:
        with torch.no_grad(), pytest.raises(mp.UnsupportedMegatronConfigError, match=match):
            wrapped(ids, pos, None, labels=labels)
    finally:
        gpt.config = saved


def test_strict_mode(tied):
    wrapped, _ = tied
    ids, pos, labels = _batch(7)
    set_config(Config(strict=True))
    with pytest.raises(StrictModeError):
        mp.enable(wrapped, mp.LogpSettings(backend="torch"))
    mp.configure("contract")                           # no real vocab size: strict refuses to guess
    mp.install()
    with torch.no_grad(), pytest.raises(ContractInputError, match="--logp-vocab-size"):
        wrapped(ids, pos, None, labels=labels)
    set_config(Config(strict=False))
    mp.configure("torch", vocab_size=REAL)             # the ordinary path, allowed when not strict
    with torch.no_grad():
        t = wrapped(ids, pos, None, labels=labels)
    mp.configure("contract", vocab_size=REAL)
    with torch.no_grad():
        c = wrapped(ids, pos, None, labels=labels)
    assert t.provenance.backend == "torch" and not t.provenance.contract_bearing
    _check_provenance(c.provenance)
    assert torch.allclose(t.logp, c.logp, atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# fingerprint and weight version
# ---------------------------------------------------------------------------------------------------------

def test_fingerprint_after_optimizer_step():
    wrapped, gpt = _build(True, 21)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    fp = mp.track_lm_head(wrapped, opt)
    first = fp.fingerprint
    assert fp.version == 0
    assert first == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach(), vocab_size=REAL)
    assert first == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach()[:REAL], vocab_size=REAL)
    assert fp.check_rollout(first, rollout_weight_version=0)

    ids, pos, labels = _batch(7)
    out = wrapped(ids, pos, None, labels=labels)
    loss, _, _ = mp.logp_loss_func(None, out)
    loss.backward()
    assert ms.lm_head_weight(gpt).grad is not None and gpt.decoder.layers[0].mlp.linear_fc1.weight.grad is not None
    opt.step()
    assert fp.version == 1 and fp.fingerprint != first
    assert fp.fingerprint == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach(), vocab_size=REAL)
    assert fp.check_rollout(fp.fingerprint)
    assert fp.check_rollout(fp.fingerprint, rollout_weight_version=0)      # the step count is a label only
    assert not fp.check_rollout(first, strict=False)
    set_config(Config(strict=True))
    with pytest.raises(FingerprintMismatchError, match="mismatch"):
        fp.check_rollout(first)
    fp.detach()
    opt.step()
    assert fp.version == 1


def test_fingerprint_with_megatron_style_step(untied):
    """An optimizer whose step() returns Megatron's (update_successful, grad_norm, num_zeros)."""
    _, gpt = untied
    mp.configure("contract", vocab_size=REAL)
    ms.check_megatron_style_step(gpt)


if __name__ == "__main__" and "--reject-child" in sys.argv:
    _reject_child()
