"""Megatron plugin on real megatron-core (0.16.1 in CI; also run on 0.19.2), world size 1 over gloo, CPU oracle
backend: the arguments, the hook's installation, the processor's keywords, the output-layer refusals, the
fingerprint's staleness, and setup (the real vocabulary, the refusals naming a Megatron flag). The checks through
a whole GPTModel that also run on the H200 (bytes, temperature, padding, gradients, refusals, strict mode, the
fingerprint after a step) are test_megatron_model.py's, one body for both devices."""
from __future__ import annotations

import argparse
import copy
import warnings
from pathlib import Path

import pytest
import torch

megatron_core = pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", module="megatron")

import megatron_shims as ms  # noqa: E402

import fused_logp  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402
from fused_logp.shared_contract.config import Config, get_config, set_config  # noqa: E402
from fused_logp.shared_contract.errors import (ContractInputError, FingerprintMismatchError,  # noqa: E402
                                               StrictModeError)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PADDED, REAL, B, S, D = 512, 500, 2, 8, 64


@pytest.fixture(scope="module", autouse=True)
def dist_world_1():
    with ms.model_parallel_world("cpu"):
        yield


@pytest.fixture(autouse=True)
def clean_plugin_state():
    with ms.fresh_plugin_state():
        yield


@pytest.fixture(scope="module")
def tied():
    return ms.build_tiny_gpt(vocab_size=PADDED, tied=True)


@pytest.fixture(scope="module")
def untied():
    return ms.build_tiny_gpt(vocab_size=PADDED, tied=False, seed=99)


# ---------------------------------------------------------------------------------------------------------
# arguments
# ---------------------------------------------------------------------------------------------------------

def test_args_extra_args_provider():
    parser = mp.add_logp_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(["--logp-backend", "contract", "--logp-temperature", "0.7", "--logp-vocab-size", "500"])
    s = mp.setup_from_args(args)
    assert (s.backend, s.temperature, s.vocab_size) == ("contract", 0.7, 500)
    assert mp.get_settings() == s and mp.hook.is_installed()
    assert s.op_backend() == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--logp-backend", "cublas"])
    off = mp.setup_from_args(parser.parse_args([]))
    assert not off.enabled


def test_args_chain_and_vocab_fallback():
    def other(parser):
        parser.add_argument("--vocab-size", type=int, default=None)
        return parser

    parser = mp.chain_args_providers(other, mp.add_logp_args)(argparse.ArgumentParser())
    s = mp.args.settings_from_args(parser.parse_args(["--logp-backend", "torch", "--vocab-size", "321"]))
    assert (s.backend, s.vocab_size) == ("torch", 321) and s.op_backend() == "torch"


def test_args_yaml_config_and_strict_refuses_torch():
    parser = mp.add_logp_args(argparse.ArgumentParser())
    s = mp.setup_from_args(parser.parse_args(["--logp-config", str(CONFIGS / "strict.yaml"),
                                              "--logp-vocab-size", "500"]))
    assert s.backend == "contract" and get_config().strict
    with pytest.raises(StrictModeError, match="strict"):
        mp.setup_from_args(parser.parse_args(["--logp-config", str(CONFIGS / "strict.yaml"),
                                              "--logp-backend", "torch"]))
    with pytest.raises(StrictModeError):
        mp.configure("torch")
    with pytest.raises(ValueError):
        mp.configure("contract", temperature=0.0)


# ---------------------------------------------------------------------------------------------------------
# the hook
# ---------------------------------------------------------------------------------------------------------

def test_hook_point_for_this_megatron():
    from megatron.core.models.gpt.gpt_model import GPTModel

    expect = "forward" if mp.megatron_core_version() >= (0, 18) else "_postprocess"
    assert mp.hook.has_output_processor_hook() == (expect == "forward")
    orig = GPTModel.__dict__[expect]
    assert mp.install() == expect
    wrapped = GPTModel.__dict__[expect]
    assert wrapped is not orig and mp.install() == expect and GPTModel.__dict__[expect] is wrapped   # idempotent
    mp.uninstall()
    assert GPTModel.__dict__[expect] is orig and not mp.hook.is_installed()
    mp.uninstall()                                                                                   # idempotent


def test_per_model_enable(tied, untied):
    ids, pos, mask, labels = ms.batch(B, S, REAL)
    mp.enable(untied[0], mp.LogpSettings(backend="contract", vocab_size=REAL))
    try:
        with torch.no_grad():
            assert isinstance(untied[0](ids, pos, mask, labels=labels), mp.LogpOutput)
            loss = tied[0](ids, pos, mask, labels=labels)          # global settings: off
        assert isinstance(loss, torch.Tensor) and loss.shape == (B, S)
    finally:
        untied[1]._fused_logp_settings = None


def test_output_processor_keyword_contract(untied):
    """The processor as megatron-core >= 0.18 calls it (every keyword GPTModel._postprocess passes)."""
    _, gpt = untied
    g = torch.Generator().manual_seed(2)
    h = (torch.randn(S, B, D, generator=g) * 0.5).bfloat16()
    labels = torch.randint(0, REAL, (B, S), generator=g)
    out = mp.logp_output_processor(
        hidden_states=h, output_layer=gpt.output_layer, output_weight=None, labels=labels, loss_mask=None,
        input_ids=None, position_ids=None, attention_mask=None, decoder_input=None, inference_context=None,
        packed_seq_params=None, runtime_gather_output=None, context={"temperature": 0.9, "vocab_size": REAL},
        compute_language_model_loss=gpt.compute_language_model_loss, scale_logits=lambda x: x, config=gpt.config)
    ref = fused_logp.linear_logp(h.reshape(-1, D), gpt.output_layer.weight.detach(), ms.op_rows(labels, None),
                                 temperature=0.9, vocab_size=REAL)
    assert torch.equal(ms.op_rows(out.logp, None), ref.logp) and torch.equal(ms.op_rows(out.lse, None), ref.lse)


# ---------------------------------------------------------------------------------------------------------
# refusals
# ---------------------------------------------------------------------------------------------------------


def test_refuses_uncovered_output_layers(untied):
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    _, gpt = untied
    h = torch.zeros(S, B, D, dtype=torch.bfloat16)
    labels = torch.zeros(B, S, dtype=torch.int64)
    mp.configure("contract", vocab_size=REAL)
    call = dict(hidden_states=h, labels=labels, config=gpt.config)
    w = gpt.output_layer.weight
    with pytest.raises(mp.UnsupportedMegatronConfigError, match="float8"):
        mp.logp_output_processor(output_layer=gpt.output_layer, output_weight=w.detach().to(torch.float8_e4m3fn),
                                 **call)
    with pytest.raises(mp.UnsupportedMegatronConfigError, match="bf16"):
        mp.logp_output_processor(output_layer=gpt.output_layer, output_weight=w.detach().float(), **call)

    class MXFP8LMHead(ColumnParallelLinear):          # stands for TELMHeadColumnParallelLinear and kin
        pass

    head = copy.copy(gpt.output_layer)
    head.__class__ = MXFP8LMHead
    with pytest.raises(mp.UnsupportedMegatronConfigError, match="MXFP8LMHead"):
        mp.logp_output_processor(output_layer=head, **call)
    with pytest.raises(mp.UnsupportedMegatronConfigError, match="bf16"):
        mp.logp_output_processor(output_layer=gpt.output_layer, **dict(call, hidden_states=h.float()))


# ---------------------------------------------------------------------------------------------------------
# fingerprint and weight version
# ---------------------------------------------------------------------------------------------------------


def test_fingerprint_cannot_pass_stale():
    """Weights changed outside a tracked step (a checkpoint load, an in-place edit) are seen at the next check; a
    step that leaves the lm_head bytes unchanged raises no mismatch; get_model's list is accepted."""
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=PADDED, tied=False, seed=22)
    mp.configure("contract", vocab_size=REAL)
    opt = torch.optim.SGD([gpt.output_layer.weight], lr=0.0)
    fp = mp.track_lm_head([wrapped], opt)
    loaded = fp.fingerprint
    assert fp.model is gpt
    opt.step()                                                             # lr 0: the bytes do not change
    assert fp.version == 1 and fp.fingerprint == loaded and fp.check_rollout(loaded, rollout_weight_version=0)
    state = {k: v.clone() for k, v in gpt.state_dict().items() if k == "output_layer.weight"}
    state["output_layer.weight"][3, :5] += 0.25
    gpt.load_state_dict(state, strict=False)                               # a checkpoint load, no optimizer step
    with pytest.raises(FingerprintMismatchError) as err:
        fp.check_rollout(loaded, strict=True)
    msg = str(err.value)
    assert f"rollout recorded {loaded}" in msg and f"trainer now {fp.fingerprint}" in msg
    assert "without a tracked optimizer step" in msg and "the trainer's weights moved" in msg
    assert fp.fingerprint == fused_logp.weight_fingerprint(gpt.output_layer.weight.detach(), vocab_size=REAL)
    assert fp.check_rollout(fp.fingerprint)                                # the fresh one passes
    with torch.no_grad():
        gpt.output_layer.weight.data[4, 0] += 1.0                          # in place through .data: no autograd trace
    assert not fp.check_rollout(loaded, strict=False) and fp.fingerprint != loaded
    with pytest.raises(ValueError, match="last pipeline stage"):
        gpt.post_process = False
        try:
            mp.track_lm_head([wrapped])
        finally:
            gpt.post_process = True
    fp.detach()


# ---------------------------------------------------------------------------------------------------------
# setup: the real vocabulary and the refusals, each naming the Megatron flag
# ---------------------------------------------------------------------------------------------------------

def _args(*flags, **megatron):
    """Parsed arguments as Megatron-LM has them after initialize_megatron (its fields set directly)."""
    args = mp.add_logp_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args(list(flags))
    for k, v in dict(dict(padded_vocab_size=PADDED, tensor_model_parallel_size=1), **megatron).items():
        setattr(args, k, v)
    return args


def _null_vocab_flag(real: int) -> int:
    """The --vocab-size whose NullTokenizer has `real` ids (EOD the last) on the installed megatron-core."""
    return real - (mp.null_tokenizer_vocab_size(real) - real)


def test_real_vocab_from_the_tokenizer_and_null_tokenizer():
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    tok = NullTokenizer(_null_vocab_flag(REAL))         # REAL ids in all, EOD = REAL-1
    assert tok.vocab_size == REAL and tok.eod == REAL - 1
    s = mp.setup_from_args(_args("--logp-backend", "contract"), tokenizer=tok)
    assert s.vocab_size == REAL
    assert mp.real_vocab_from_args(_args(), tokenizer=tok)[1].startswith("the tokenizer")
    # without a tokenizer object: --vocab-size of a NullTokenizer run, this megatron-core's rule
    args = _args("--logp-backend", "contract", vocab_size=_null_vocab_flag(REAL), tokenizer_type="NullTokenizer")
    assert mp.setup_from_args(args).vocab_size == REAL
    assert mp.setup_from_args(_args("--logp-backend", "contract", vocab_size=REAL)).vocab_size == REAL
    # --logp-vocab-size wins over both
    args = _args("--logp-backend", "contract", "--logp-vocab-size", "400", vocab_size=_null_vocab_flag(REAL),
                 tokenizer_type="NullTokenizer")
    assert mp.setup_from_args(args, tokenizer=tok).vocab_size == 400


def test_null_tokenizer_eod_label_accepted(untied):
    """The EOD id of a NullTokenizer (its last id) is a real label, not refused as padding."""
    wrapped, _ = untied
    mp.setup_from_args(_args("--logp-backend", "contract", vocab_size=_null_vocab_flag(REAL),
                             tokenizer_type="NullTokenizer"))
    ids, pos, mask, labels = ms.batch(B, S, REAL)
    labels[0, 2] = REAL - 1
    with torch.no_grad():
        out = wrapped(ids, pos, mask, labels=labels)
    assert bool(torch.isfinite(out.logp).all())


def test_padding_rows_warn_outside_strict(untied):
    from fused_logp.megatron_plugin import settings as mps

    mps._warned_padding.clear()
    with pytest.warns(mp.PaddingRowsWarning, match="padding"):
        mp.setup_from_args(_args("--logp-backend", "contract"))                   # no vocabulary anywhere
    mps._warned_padding.clear()
    wrapped, _ = untied
    ids, pos, mask, labels = ms.batch(B, S, REAL)
    with pytest.warns(mp.PaddingRowsWarning, match="--logp-vocab-size"), torch.no_grad():
        wrapped(ids, pos, mask, labels=labels)


@pytest.mark.parametrize("megatron, flag", [
    ({"mtp_num_layers": 1}, "--mtp-num-layers"),
    ({"defer_embedding_wgrad_compute": True}, "--defer-embedding-wgrad-compute"),
    ({"padded_vocab_size": 480, "logp_vocab_size": 500}, "--logp-vocab-size"),
    ({"padded_vocab_size": 192, "tensor_model_parallel_size": 2, "make_vocab_size_divisible_by": 48},
     "--make-vocab-size-divisible-by"),
])
def test_setup_refusals_name_the_flag(megatron, flag):
    args = _args("--logp-backend", "contract", "--logp-vocab-size", "100", **megatron)
    with pytest.raises(ContractInputError, match=flag):
        mp.setup_from_args(args)
    assert not mp.hook.is_installed()


def test_strict_config_without_the_plugin_refused_at_setup(tmp_path):
    set_config(Config(strict=True, source="FUSED_LOGP_STRICT"))
    with pytest.raises(StrictModeError, match="--logp-backend contract"):
        mp.setup_from_args(_args())
    with pytest.raises(ContractInputError, match="--logp-vocab-size"):
        mp.setup_from_args(_args("--logp-backend", "contract"))                  # strict: no guessing
    s = mp.setup_from_args(_args("--logp-backend", "contract", "--logp-vocab-size", str(REAL)))
    assert s.enabled and s.vocab_size == REAL


def test_check_model_at_setup(untied):
    wrapped, gpt = untied
    mp.configure("contract", vocab_size=REAL)
    mp.check_model([wrapped])
    mp.configure("contract", vocab_size=PADDED + 1)
    with pytest.raises(ContractInputError, match="exceeds"):
        mp.check_model(wrapped)
    mp.configure("contract", vocab_size=REAL)
    saved = gpt.config
    gpt.config = copy.copy(saved)
    gpt.config.mtp_num_layers = 1
    try:
        with pytest.raises(mp.UnsupportedMegatronConfigError, match="multi-token"):
            mp.check_model(wrapped)
    finally:
        gpt.config = saved


def test_unlabelled_call_with_plugin_on_is_said_once(tied, caplog):
    """An RL framework's log-prob step calls the model without labels: Megatron's logits come back, and the log
    says so (once) and points at the scoring API."""
    import logging

    from fused_logp.megatron_plugin import hook

    wrapped, _ = tied
    ids, pos, mask, _ = ms.batch(B, S, REAL)
    mp.configure("contract", vocab_size=REAL)
    mp.install()
    hook._warned_unlabelled = False
    with caplog.at_level(logging.WARNING, logger="fused_logp"), torch.no_grad():
        logits = wrapped(ids, pos, mask)
        wrapped(ids, pos, mask)
    assert logits.shape == (B, S, PADDED)
    said = [r for r in caplog.records if "without labels" in r.getMessage()]
    assert len(said) == 1 and "megatron_plugin.score" in said[0].getMessage()
