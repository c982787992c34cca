"""The public RL scoring API (fused_logp.megatron_plugin.score / score_hidden_states) on a real megatron-core
GPTModel, world size 1 on CPU. Its TP=2 checks run in tests/megatron/test_megatron_plugin_dist.py's spawned world."""
from __future__ import annotations

import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", module="megatron")

import megatron_shims as ms  # noqa: E402

import fused_logp  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402
from fused_logp.kernel.op import linear_logp_program  # noqa: E402
from fused_logp.kernel.transforms import TransformProgram  # noqa: E402
from fused_logp.shared_contract.config import Config, set_config  # noqa: E402
from fused_logp.shared_contract.errors import ContractInputError  # noqa: E402

PADDED, REAL, B, S, D = 512, 500, 2, 8, 64


@pytest.fixture(scope="module")
def world():
    with ms.model_parallel_world("cpu"):
        yield


@pytest.fixture(autouse=True)
def clean(world):
    with ms.fresh_plugin_state():           # the plugin is off process-wide: score() turns it on for its call
        yield


@pytest.fixture(scope="module", params=["tied", "untied"])
def model(world, request):
    return ms.build_tiny_gpt(vocab_size=PADDED, tied=request.param == "tied", seed=41)


def _tokens(seed=5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, REAL, (B, S), generator=g)


def _score_with_hidden(wrapped, gpt, *args, **kw):
    cap = ms.CaptureFinalHidden(gpt)
    try:
        sc = mp.score(wrapped, *args, **kw)
    finally:
        cap.remove()
    return sc, cap.value


def test_score_next_tokens_bytes_equal_the_op(model):
    wrapped, gpt = model
    tokens = _tokens()
    sc, h = _score_with_hidden(wrapped, gpt, tokens, temperature=0.7, vocab_size=REAL)
    assert sc.logp.shape == (B, S) and sc.lse.dtype == torch.float32 and sc.provenance.contract_bearing
    assert bool((sc.loss_mask[:, -1] == 0).all()) and torch.equal(sc.targets[:, :-1], tokens[:, 1:])
    w = ms.lm_head_weight(gpt).detach()
    ref = fused_logp.linear_logp(ms.op_hidden_rows(h, sc.loss_mask), w, ms.op_rows(sc.targets, sc.loss_mask),
                                 temperature=0.7, vocab_size=REAL)
    assert torch.equal(ms.op_rows(sc.logp, sc.loss_mask), ref.logp)
    assert torch.equal(ms.op_rows(sc.lse, sc.loss_mask), ref.lse)
    assert bool((sc.logp[:, -1] == 0).all())
    assert sc.fingerprint == fused_logp.weight_fingerprint(w, vocab_size=REAL) and sc.weight_version is None
    assert not sc.logp.requires_grad
    # the ordinary unlabelled call (an RL framework's logits step) is untouched by the scoring API
    with torch.no_grad():
        logits = wrapped(tokens, torch.arange(S).expand(B, S), ms.causal_mask(B, S))
    assert logits.shape == (B, S, PADDED)


def test_score_targets_mask_per_token_temperature(model):
    wrapped, gpt = model
    tokens = _tokens(6)
    targets = torch.randint(0, REAL, (B, S), generator=torch.Generator().manual_seed(9))
    mask = torch.zeros(B, S)
    mask[:, 3:] = 1                                                          # the response positions
    temps = torch.linspace(0.5, 1.5, B * S).reshape(B, S)
    sc, h = _score_with_hidden(wrapped, gpt, tokens, targets, loss_mask=mask, temperature=temps, vocab_size=REAL)
    ref = fused_logp.linear_logp(ms.op_hidden_rows(h, mask), ms.lm_head_weight(gpt).detach(),
                                 ms.op_rows(targets, mask), temperature=ms.op_rows(temps, mask), vocab_size=REAL)
    assert torch.equal(ms.op_rows(sc.logp, mask), ref.logp) and torch.equal(ms.op_rows(sc.lse, mask), ref.lse)
    assert bool((sc.logp[mask == 0] == 0).all())


def test_score_program(model):
    wrapped, gpt = model
    tokens = _tokens(7)
    prog = TransformProgram(temperature=0.8, top_k=400, top_p=0.999)
    # targets inside the kept set: the argmax of the logits under the program's temperature
    with torch.no_grad():
        logits = wrapped(tokens, torch.arange(S).expand(B, S), ms.causal_mask(B, S))
    targets = logits[..., :REAL].argmax(-1)
    sc, h = _score_with_hidden(wrapped, gpt, tokens, targets, program=prog, vocab_size=REAL)
    ref = linear_logp_program(h.reshape(-1, D), ms.lm_head_weight(gpt).detach(), ms.op_rows(targets, None), prog,
                              vocab_size=REAL)
    assert torch.equal(ms.op_rows(sc.logp, None), ref.logp) and torch.equal(ms.op_rows(sc.lse, None), ref.lse)
    neutral = mp.score(wrapped, tokens, targets, program=TransformProgram(temperature=0.8), vocab_size=REAL)
    plain = mp.score(wrapped, tokens, targets, temperature=0.8, vocab_size=REAL)
    assert torch.equal(neutral.logp, plain.logp) and torch.equal(neutral.lse, plain.lse)
    with pytest.raises(ContractInputError, match="either temperature or program"):
        mp.score(wrapped, tokens, program=prog, temperature=0.8, vocab_size=REAL)


def test_score_with_grad_and_tracker(model):
    wrapped, gpt = model
    opt = torch.optim.SGD([ms.lm_head_weight(gpt)], lr=0.0)
    tracker = mp.track_lm_head(wrapped, opt, vocab_size=REAL)
    opt.step()
    sc = mp.score(wrapped, _tokens(8), vocab_size=REAL, tracker=tracker, with_grad=True)
    assert sc.logp.requires_grad and sc.weight_version == 1 and sc.fingerprint == tracker.fingerprint
    (-(sc.logp * sc.loss_mask).sum()).backward()
    w = ms.lm_head_weight(gpt)
    assert w.grad is not None and float(w.grad[:REAL].abs().sum()) > 0 and bool((w.grad[REAL:] == 0).all())
    w.grad = None
    tracker.detach()


def test_score_hidden_states_equal_the_op(model):
    wrapped, gpt = model
    g = torch.Generator().manual_seed(3)
    rows = (torch.randn(11, D, generator=g) * 0.5).bfloat16()
    targets = torch.randint(0, REAL, (11,), generator=g)
    sc = mp.score_hidden_states(wrapped, rows, targets, temperature=0.9, vocab_size=REAL)
    ref = fused_logp.linear_logp(rows, ms.lm_head_weight(gpt).detach(), targets, temperature=0.9, vocab_size=REAL)
    assert torch.equal(sc.logp, ref.logp) and torch.equal(sc.lse, ref.lse) and sc.logp.shape == (11,)
    t = torch.linspace(0.6, 1.2, 11)
    sc = mp.score_hidden_states(wrapped, rows, targets, temperature=t, vocab_size=REAL)
    ref = fused_logp.linear_logp(rows, ms.lm_head_weight(gpt).detach(), targets, temperature=t, vocab_size=REAL)
    assert torch.equal(sc.logp, ref.logp)
    with pytest.raises(ContractInputError, match="targets"):
        mp.score_hidden_states(wrapped, rows, targets[:-1], vocab_size=REAL)


def test_score_refusals(model):
    wrapped, gpt = model
    with pytest.raises(ContractInputError, match="tokens must be int ids"):
        mp.score(wrapped, torch.zeros(B, S), vocab_size=REAL)
    with pytest.raises(ContractInputError, match="real vocabulary"):
        mp.score(wrapped, _tokens(), torch.full((B, S), REAL + 3), vocab_size=REAL)
    set_config(Config(strict=True))
    with pytest.raises(ContractInputError, match="--logp-vocab-size"):
        mp.score(wrapped, _tokens())
