"""The Megatron plugin through a whole GPTModel, one set of test bodies run on two rigs (the `rig` fixture).

- `cpu`: the installed megatron-core (0.16.1 in CI; also run on 0.19.2), world size 1 over gloo, a tiny bf16
  GPTModel (megatron_shims.build_tiny_gpt: one layer, learned absolute positions, an explicit causal mask),
  vocabulary 500 padded to 512, the CPU backends: `--logp-backend contract` resolves to the compiled oracle, and
  the reference op calls run the numpy oracle.
- `sm90` (marker `gpu`; `make test-megatron-gpu`): megatron-core 0.19.x installed from the wheel in build/wheels
  (the GPU machine has no package index), NCCL at world size 1, the SM90 backend. The model is a GPTModel with the
  Qwen3-8B lm_head (hidden 4096, vocabulary 151936 padded to 152064; tied and untied) on a one-layer Qwen3-style
  body (RMSNorm, RoPE, GQA with qk-norm, SwiGLU; Megatron's local spec, a small FFN), bf16 in Float16Module, on the
  GPU, with `--logp-backend contract` (the SM90 kernel here). Nothing of Megatron is shimmed: its CUDA RNG tracker,
  default causal mask, RoPE and scratch buffers run as in training.

On both: the processor route for the installed release; the flag off leaves Megatron's output untouched; the
model's logp/lse bytes equal the op called directly on the captured final hidden states and the lm_head's
real-vocabulary rows (and on the padded weight with vocab_size); per-token temperature; padded rows never enter
the lse; refusals of uncovered configurations; strict mode; the fingerprint and weight version after an optimizer
step. Two checks differ by rig, one test each: the gradients (cpu: through the output processor against float64;
sm90: the whole model's backward against FP32 torch) and a label outside the real vocabulary (cpu: refused at
the call; sm90: in a child process, where the row is NaN and check_input_errors() names the argument). The
plugin's CPU-only checks (arguments, setup, hook installation, output-layer refusals) are in
test_megatron_plugin.py.

FUSED_LOGP_TEST_MEGATRON_GPU_ON_CPU=1 runs the `sm90` rig's checks on CPU at small shapes (gloo, the CPU oracle,
fused_logp_jobs.megatron_cpu's shims), unmarked: a dry run of its logic on a machine without a GPU.
"""
from __future__ import annotations

import copy
import dataclasses
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
T = 0.7


@dataclasses.dataclass(frozen=True)
class Rig:
    """One device's model and shapes. backend: the op's backend for the reference calls; qwen3: the Qwen3-style
    body with Megatron's default causal mask (else the tiny model with an explicit mask)."""
    name: str
    dev: str
    backend: str
    padded: int
    real: int
    d: int
    b: int
    s: int
    qwen3: bool
    heads: int = 4
    groups: int = 4
    ffn: int = 0

    def build(self, tied: bool, seed: int):
        if not self.qwen3:
            return ms.build_tiny_gpt(vocab_size=self.padded, hidden=self.d, tied=tied, seed=seed)
        return ms.build_qwen3_style_gpt(vocab_size=self.padded, hidden=self.d, heads=self.heads,
                                        query_groups=self.groups, ffn=self.ffn, seq=self.s, tied=tied, seed=seed,
                                        device=self.dev)

    def batch(self, seed: int = 7):
        """(input ids, position ids, attention mask or None, labels), [b, s] each, on the rig's device."""
        if not self.qwen3:
            return ms.batch(self.b, self.s, self.real, seed=seed)
        ids, pos, labels = ms.token_batch(self.b, self.s, self.real, seed=seed, device=self.dev)
        return ids, pos, None, labels

    def ones(self):
        return torch.ones(self.b, self.s, device=self.dev)

    def check_provenance(self, prov):
        # on CPU `auto` is the compiled oracle (the numpy oracle's bytes); on the H200 the SM90 kernel
        assert prov.backend in ((self.backend, "oracle-fast") if self.dev == "cpu" else (self.backend,)), prov
        assert prov.contract_bearing and prov.fallback is None, prov
        assert prov.contract_version == fused_logp.CONTRACT_VERSION


RIGS = {
    "cpu": Rig("cpu", "cpu", "oracle", padded=512, real=500, d=64, b=2, s=8, qwen3=False),
    # the dry run: small shapes, the oracle (a ragged last tile: 1000 = 15 * 64 + 40)
    "sm90": (Rig("sm90", "cpu", "oracle", padded=1024, real=1000, d=64, b=2, s=8, qwen3=True, heads=4, groups=2,
                 ffn=128) if ON_CPU else
             # Qwen3-8B: hidden 4096, 32 query / 8 KV heads of 128; vocabulary 151936 padded to 152064
             Rig("sm90", "cuda", "sm90", padded=152064, real=151936, d=4096, b=2, s=64, qwen3=True, heads=32,
                 groups=8, ffn=1024)),
}
RIG_PARAMS = {"cpu": pytest.param("cpu", id="cpu"),
              "sm90": pytest.param("sm90", id="sm90", marks=() if ON_CPU else pytest.mark.gpu)}


def on(name: str):
    """A test for one rig only (its counterpart for the other rig is the test beside it)."""
    return pytest.mark.parametrize("rig", [RIG_PARAMS[name]], indirect=True)


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module", params=list(RIG_PARAMS.values()))
def rig(request):
    r = RIGS[request.param]
    if r.dev == "cuda" and not _sm90():
        pytest.skip("needs an SM90 (H100/H200) GPU")
    with ms.model_parallel_world(r.dev):
        if r.dev == "cuda":                   # builds the SM90 extension on first use (about a minute)
            from fused_logp.kernel.backends import get_backend
            ok, why = get_backend("sm90").available()
            assert ok, why
        yield r


@pytest.fixture(autouse=True)
def clean_plugin_state():
    with ms.fresh_plugin_state():
        yield


@pytest.fixture(scope="module")
def tied(rig):
    return rig.build(True, 1234)


@pytest.fixture(scope="module")
def untied(rig):
    return rig.build(False, 99)


# ---------------------------------------------------------------------------------------------------------
# the hook
# ---------------------------------------------------------------------------------------------------------

def test_processor_route_for_this_megatron(rig, tied, monkeypatch):
    """>= 0.18: Megatron's own, unpatched _postprocess calls the processor through output_processor;
    0.16/0.17: the plugin's _postprocess wrapper calls it."""
    from megatron.core.models.gpt.gpt_model import GPTModel

    from fused_logp.megatron_plugin import hook

    wrapped, _ = tied
    ids, pos, mask, labels = rig.batch(13)
    settings = mp.configure("contract", temperature=T, vocab_size=rig.real)
    orig_postprocess = GPTModel.__dict__["_postprocess"]
    calls = []

    def spy(**kw):
        calls.append((sys._getframe(1).f_code, kw))
        return mp.logp_output_processor(**kw)

    monkeypatch.setattr(hook, "logp_output_processor", spy)
    mp.install()
    with torch.no_grad():
        out = wrapped(ids, pos, mask, labels=labels)
    assert isinstance(out, mp.LogpOutput) and len(calls) == 1
    rig.check_provenance(out.provenance)
    caller, kw = calls[0]
    if mp.megatron_core_version() < (0, 18):
        assert caller is GPTModel.__dict__["_postprocess"].__code__
        return
    assert GPTModel.__dict__["_postprocess"] is orig_postprocess and caller is orig_postprocess.__code__
    assert kw["context"] is settings and "scale_logits" in kw
    mine = object()
    with torch.no_grad():                            # a caller's own output_processor is left alone
        assert wrapped(ids, pos, mask, labels=labels, output_processor=lambda **_: mine) is mine
    mp.uninstall()
    with torch.no_grad():                            # passed directly, without install()
        direct = wrapped(ids, pos, mask, labels=labels, output_processor=mp.logp_output_processor,
                         output_processor_context={"temperature": T, "vocab_size": rig.real})
    assert bits_equal(direct.logp, out.logp) and bits_equal(direct.lse, out.lse)


def test_flag_off_leaves_megatron_untouched(rig, tied):
    wrapped, gpt = tied
    ids, pos, mask, labels = rig.batch(7)
    with torch.no_grad():
        loss0 = wrapped(ids, pos, mask, labels=labels)
        logits0 = wrapped(ids, pos, mask)
    assert loss0.shape == (rig.b, rig.s) and logits0.shape == (rig.b, rig.s, rig.padded)
    assert bool(torch.isfinite(loss0).all())

    def same():
        with torch.no_grad():
            return (torch.equal(wrapped(ids, pos, mask, labels=labels), loss0)
                    and torch.equal(wrapped(ids, pos, mask), logits0))

    assert same()                                    # Megatron alone is repeatable on this device
    mp.install()                                     # installed, disabled
    assert same()
    mp.configure("contract", vocab_size=rig.real)    # enabled: the unlabelled call still returns Megatron's logits
    with torch.no_grad():
        assert torch.equal(wrapped(ids, pos, mask), logits0)
        assert isinstance(wrapped(ids, pos, mask, labels=labels), mp.LogpOutput)
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
def test_logp_lse_bytes_equal_the_op(rig, which, request):
    wrapped, gpt = request.getfixturevalue(which)
    ids, pos, mask, labels = rig.batch(3)
    loss_mask = rig.ones()
    loss_mask[0, :2] = 0
    loss_mask[1, -1] = 0
    labels[0, 0], labels[0, 1], labels[1, -1] = -100, rig.real + 5, rig.padded + 7    # ignored: masked out
    mp.configure("contract", temperature=T, vocab_size=rig.real)
    mp.install()
    cap = ms.CaptureFinalHidden(gpt)
    try:
        with torch.no_grad():
            out = wrapped(ids, pos, mask, labels=labels, loss_mask=loss_mask)
    finally:
        cap.remove()
    assert isinstance(out, mp.LogpOutput) and out.logp.shape == (rig.b, rig.s) and out.lse.dtype == torch.float32
    assert out.logp.device.type == rig.dev
    rig.check_provenance(out.provenance)
    h, t = ms.op_hidden_rows(cap.value, loss_mask), ms.op_rows(labels, loss_mask)
    assert h.dtype == torch.bfloat16 and h.shape == (int(loss_mask.sum()), rig.d)
    w = ms.lm_head_weight(gpt).detach()
    assert w.shape == (rig.padded, rig.d) and w.dtype == torch.bfloat16
    ref = fused_logp.linear_logp(h, w[:rig.real], t, temperature=T, backend=rig.backend)     # the real rows only
    rig.check_provenance(ref.provenance)
    assert bits_equal(ms.op_rows(out.logp, loss_mask), ref.logp)
    assert bits_equal(ms.op_rows(out.lse, loss_mask), ref.lse)
    for backend in dict.fromkeys((rig.backend, None)):          # the padded weight; the default backend too
        padded = fused_logp.linear_logp(h, w, t, temperature=T, vocab_size=rig.real, backend=backend)
        assert bits_equal(padded.logp, ref.logp) and bits_equal(padded.lse, ref.lse)
    assert bool(torch.isfinite(ref.lse).all()) and bool((ref.logp <= 0).all())
    assert bool((out.logp[loss_mask == 0] == 0).all()) and bool((out.lse[loss_mask == 0] == 0).all())
    loss, n, report = mp.logp_loss_func(loss_mask, out)
    assert int(n) == int(loss_mask.sum()) and torch.equal(loss, -(out.logp * loss_mask).sum())
    assert "lm loss" in report


def test_per_token_temperature(rig, tied):
    wrapped, gpt = tied
    ids, pos, mask, labels = rig.batch(11)
    temps = torch.linspace(0.5, 1.5, rig.b * rig.s).reshape(rig.b, rig.s).to(rig.dev)
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    cap = ms.CaptureFinalHidden(gpt)
    try:
        with torch.no_grad(), mp.call_options(temperature=temps):
            out = wrapped(ids, pos, mask, labels=labels)
    finally:
        cap.remove()
    h, w = cap.value.reshape(-1, rig.d), ms.lm_head_weight(gpt).detach()
    t, tt = ms.op_rows(labels, None), ms.op_rows(temps, None)
    for ref in (fused_logp.linear_logp(h, w[:rig.real], t, temperature=tt, backend=rig.backend),
                fused_logp.linear_logp(h, w, t, temperature=tt, vocab_size=rig.real)):
        assert bits_equal(ms.op_rows(out.logp, None), ref.logp) and bits_equal(ms.op_rows(out.lse, None), ref.lse)


def test_padded_rows_never_enter_lse(rig, untied):
    wrapped, gpt = untied
    ids, pos, mask, labels = rig.batch(5)
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    w = gpt.output_layer.weight
    with torch.no_grad():
        before = wrapped(ids, pos, mask, labels=labels)
        saved = w[rig.real:].clone()
        w[rig.real:] = 3.0                               # padding rows with large logits
        try:
            after = wrapped(ids, pos, mask, labels=labels)
        finally:
            w[rig.real:] = saved
    assert bits_equal(before.logp, after.logp) and bits_equal(before.lse, after.lse)


# ---------------------------------------------------------------------------------------------------------
# gradients
# ---------------------------------------------------------------------------------------------------------

def _float64_reference(h_sbd, w, labels, mask, temperature, vocab, c_lse, d):
    h64 = h_sbd.detach().double().reshape(-1, d).requires_grad_()
    w64 = w.detach().double().requires_grad_()
    z = (h64 @ w64[:vocab].t()) / temperature
    lse = torch.logsumexp(z, dim=1)
    t = labels.t().reshape(-1).clamp(0, vocab - 1)
    logp = z.gather(1, t[:, None]).squeeze(1) - lse
    m = mask.t().reshape(-1).double()
    (-(logp * m).sum() + c_lse * (lse * m).sum()).backward()
    return h64.grad.reshape(h_sbd.shape), w64.grad


def _close(got, ref):
    """bf16 gradients against float64: |got - ref| <= 2^-7 |ref| + 2^-7 max|ref| (bf16 output rounding plus the
    bf16 rounding of the inputs seen by the reference)."""
    got, ref = got.double(), ref.double()
    tol = ref.abs() * 2 ** -7 + ref.abs().max() * 2 ** -7
    return bool(((got - ref).abs() <= tol).all()), float((got - ref).abs().max())


@on("cpu")
def test_gradients_match_float64_reference(rig, untied):
    """The output processor's backward (hidden states and lm_head) against float64 on the same bf16 inputs."""
    _, gpt = untied
    b, s, d, real = rig.b, rig.s, rig.d, rig.real
    g = torch.Generator().manual_seed(4)
    h = (torch.randn(s, b, d, generator=g) * 0.5).bfloat16().requires_grad_()
    w = (gpt.output_layer.weight.detach().clone() * 4).requires_grad_()
    labels = torch.randint(0, real, (b, s), generator=g)
    mask = torch.ones(b, s)
    mask[1, :3] = 0
    mp.configure("contract", vocab_size=real, temperature=0.8)
    out = mp.logp_output_processor(hidden_states=h, output_layer=gpt.output_layer, output_weight=w, labels=labels,
                                   loss_mask=mask, config=gpt.config)
    (-(out.logp * mask).sum() + 0.3 * (out.lse * mask).sum()).backward()
    gh, gw = _float64_reference(h, w, labels, mask, 0.8, real, 0.3, d)
    assert _close(h.grad, gh)[0], _close(h.grad, gh)
    assert _close(w.grad[:real], gw[:real])[0], _close(w.grad[:real], gw[:real])
    assert bool((w.grad[real:] == 0).all())                      # padding rows get no gradient
    assert bool((h.grad[:3, 1] == 0).all())                      # masked positions get no gradient


@on("sm90")
def test_gradients_match_fp32_reference(rig, untied):
    """The whole model's backward through the plugin: the gradient reaching the final hidden states and the
    lm_head's gradient against FP32 torch (log_softmax over the real vocabulary, IEEE FP32 matmul) on the same
    hidden states and weight. Tolerance (megatron_shims.grad_close): 2^-6 of |ref| + max|ref| elementwise and
    2^-6 relative in norm, as tests/backward/test_backward_gpu.py: the op's CUDA backward rounds dz to bf16 for
    its GEMMs and stores bf16 gradients (each a relative 2^-9), 8x below the bound."""
    wrapped, gpt = untied
    ids, pos, _, labels = rig.batch(4)
    mask = rig.ones()
    mask[1, :3] = 0
    mp.configure("contract", temperature=0.8, vocab_size=rig.real)
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
    gh, gw = ms.fp32_reference_grads(cap.value.detach().reshape(-1, rig.d), w, labels.t().reshape(-1),
                                     mask.t().reshape(-1), 0.8, rig.real, 0.3)
    dh = cap.value.grad
    assert dh is not None and dh.shape == (rig.s, rig.b, rig.d)
    ok, worst, rel = ms.grad_close(dh.reshape(-1, rig.d), gh)
    assert ok, f"hidden gradient: max |diff| {worst}, relative norm error {rel}"
    ok, worst, rel = ms.grad_close(w.grad[:rig.real], gw[:rig.real])
    assert ok, f"lm_head gradient: max |diff| {worst}, relative norm error {rel}"
    assert bool((w.grad[rig.real:] == 0).all())                  # padding rows get no gradient
    assert bool((dh[:3, 1] == 0).all())                          # masked positions get no gradient
    assert gpt.decoder.layers[0].mlp.linear_fc1.weight.grad is not None     # the body is trained through it
    wrapped.zero_grad(set_to_none=True)


# ---------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------

@on("cpu")
def test_label_outside_real_vocab_rejected(rig, tied):
    wrapped, _ = tied
    ids, pos, mask, labels = rig.batch(7)
    labels[1, 3] = rig.real + 1                           # a padded-vocab id at an unmasked position
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    with torch.no_grad(), pytest.raises(ContractInputError, match=rf"real vocabulary \[0, {rig.real}\)"):
        wrapped(ids, pos, mask, labels=labels)


def _reject_child(rig: Rig):
    """Run in a child process by test_label_outside_real_vocab_rejected_in_a_child."""
    ms.start_model_parallel(0, 1, device=rig.dev)
    wrapped, _ = rig.build(True, 1234)
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    ids, pos, mask_attn, labels = rig.batch(9)
    lab, mask = labels.clone(), rig.ones()
    lab[0, 0], lab[0, 1], lab[1, -1] = rig.real, rig.padded + 7, -100       # ignored: masked out
    mask[0, :2] = 0
    mask[1, -1] = 0
    with torch.no_grad():
        out = wrapped(ids, pos, mask_attn, labels=lab, loss_mask=mask)
        finite = bool(torch.isfinite(out.logp).all())              # synchronises
    print(f"MASKED-OUT IDS ACCEPTED finite={finite}", flush=True)
    lab = labels.clone()
    lab[1, 3] = rig.real                                          # the first padding id, at an unmasked position
    try:
        with torch.no_grad():
            out = wrapped(ids, pos, mask_attn, labels=lab)
            print(f"BAD ROW NAN={bool(torch.isnan(out.logp).any())} FINITE={int(torch.isfinite(out.logp).sum())}"
                  f" OF {out.logp.numel()}", flush=True)
        if rig.dev == "cuda":
            from fused_logp import check_input_errors
            check_input_errors()                                  # synchronises and raises for the bad row
    except Exception as exc:                                      # noqa: BLE001 - reported to the parent
        print(f"REJECTED: {type(exc).__name__}: {str(exc).strip().splitlines()[0]}", flush=True)
        os._exit(0)
    print("NOT REJECTED", flush=True)
    os._exit(1)


@on("sm90")
def test_label_outside_real_vocab_rejected_in_a_child(rig):
    """A label >= the real vocabulary at an unmasked position is refused; masked-out positions are not checked.
    On CUDA the op checks without a host synchronisation: the row's logp is NaN and check_input_errors() raises
    naming the argument; the CUDA context stays usable. It runs in a child process all the same."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), PYTHONUNBUFFERED="1")
    if ON_CPU:
        env[ON_CPU_VAR] = "1"
    cmd = [sys.executable] + (["-P"] if sys.flags.safe_path else []) + [os.path.abspath(__file__), "--reject-child",
                                                                         rig.name]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=540)
    tail = (r.stdout + r.stderr)[-6000:]
    assert "MASKED-OUT IDS ACCEPTED finite=True" in r.stdout, tail
    assert r.returncode == 0 and "REJECTED:" in r.stdout, tail
    line = r.stdout.split("REJECTED:", 1)[1].splitlines()[0]
    if rig.dev == "cpu":
        assert "ContractInputError" in line and f"real vocabulary [0, {rig.real})" in line, line
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
def test_refuses_uncovered_config(rig, untied, fields, match):
    wrapped, gpt = untied
    ids, pos, mask, labels = rig.batch(7)
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    saved = gpt.config
    cfg = copy.copy(saved)
    for k, v in fields.items():
        setattr(cfg, k, v)
    gpt.config = cfg
    try:
        with torch.no_grad(), pytest.raises(mp.UnsupportedMegatronConfigError, match=match):
            wrapped(ids, pos, mask, labels=labels)
    finally:
        gpt.config = saved


def test_strict_mode(rig, tied):
    wrapped, _ = tied
    ids, pos, mask, labels = rig.batch(7)
    set_config(Config(strict=True))
    with pytest.raises(StrictModeError):
        mp.enable(wrapped, mp.LogpSettings(backend="torch"))
    mp.configure("contract")                           # no real vocab size: strict refuses to guess
    mp.install()
    with torch.no_grad(), pytest.raises(ContractInputError, match="--logp-vocab-size"):
        wrapped(ids, pos, mask, labels=labels)
    set_config(Config(strict=False))
    mp.configure("torch", vocab_size=rig.real)         # the ordinary path, allowed when not strict
    with torch.no_grad():
        t = wrapped(ids, pos, mask, labels=labels)
    mp.configure("contract", vocab_size=rig.real)
    with torch.no_grad():
        c = wrapped(ids, pos, mask, labels=labels)
    assert t.provenance.backend == "torch" and not t.provenance.contract_bearing
    rig.check_provenance(c.provenance)
    assert torch.allclose(t.logp, c.logp, atol=1e-3, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# fingerprint and weight version
# ---------------------------------------------------------------------------------------------------------

def test_fingerprint_after_optimizer_step(rig):
    wrapped, gpt = rig.build(True, 21)
    mp.configure("contract", vocab_size=rig.real)
    mp.install()
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.5)
    fp = mp.track_lm_head(wrapped, opt)
    first = fp.fingerprint
    assert fp.version == 0
    assert first == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach(), vocab_size=rig.real)
    assert first == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach()[:rig.real], vocab_size=rig.real)
    assert fp.check_rollout(first, rollout_weight_version=0)

    ids, pos, mask, labels = rig.batch(7)
    out = wrapped(ids, pos, mask, labels=labels)
    loss, _, _ = mp.logp_loss_func(None, out)
    loss.backward()
    assert ms.lm_head_weight(gpt).grad is not None and gpt.decoder.layers[0].mlp.linear_fc1.weight.grad is not None
    opt.step()
    assert fp.version == 1 and fp.fingerprint != first
    assert fp.fingerprint == fused_logp.weight_fingerprint(ms.lm_head_weight(gpt).detach(), vocab_size=rig.real)
    assert fp.check_rollout(fp.fingerprint)
    assert fp.check_rollout(fp.fingerprint, rollout_weight_version=0)      # the step count is a label only
    assert not fp.check_rollout(first, strict=False)
    set_config(Config(strict=True))
    with pytest.raises(FingerprintMismatchError, match="mismatch"):
        fp.check_rollout(first)
    fp.detach()
    opt.step()
    assert fp.version == 1


def test_fingerprint_with_megatron_style_step(rig, untied):
    """An optimizer whose step() returns Megatron's (update_successful, grad_norm, num_zeros)."""
    _, gpt = untied
    mp.configure("contract", vocab_size=rig.real)
    ms.check_megatron_style_step(gpt)


if __name__ == "__main__" and "--reject-child" in sys.argv:
    _reject_child(RIGS[sys.argv[sys.argv.index("--reject-child") + 1]])
