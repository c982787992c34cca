"""The per-release rules of the Megatron plugin (megatron_plugin/versions.py) and its public surface, against the
installed megatron-core (0.16.1 on CPU; 0.19.2 under make test-megatron-gpu)."""
from __future__ import annotations

import argparse
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
warnings.filterwarnings("ignore", module="megatron")

import megatron_shims as ms  # noqa: E402

from fused_logp import megatron_plugin as mp  # noqa: E402
from fused_logp.megatron_plugin import versions  # noqa: E402

PUBLIC = {
    "add_logp_args", "chain_args_providers", "setup_from_args", "check_model", "logp_forward_step", "logp_loss_func",
    "LogpOutput", "score", "score_hidden_states", "Scores", "track_lm_head", "LmHeadFingerprint", "configure",
    "get_settings", "LogpSettings", "enable", "disable", "call_settings", "call_options", "install", "uninstall",
    "logp_output_processor", "unwrap_gpt_model", "UnsupportedMegatronConfigError", "PaddingRowsWarning",
    "megatron_core_version", "null_tokenizer_vocab_size", "real_vocab_from_args",
}


def test_public_surface_is_the_deliberate_list():
    assert set(mp.__all__) == PUBLIC and len(mp.__all__) == len(PUBLIC)
    for name in PUBLIC:
        assert getattr(mp, name) is not None


@pytest.mark.parametrize("text,expect", [("0.16.1", (0, 16)), ("0.19.2", (0, 19)), ("0.16.0rc0.dev100085", (0, 16)),
                                         ("0.18.0rc1", (0, 18)), ("1.0.0", (1, 0))])
def test_parse_version(text, expect):
    assert versions.parse_version(text) == expect


@pytest.mark.parametrize("text", ["", "dev", "0", "x.1"])
def test_parse_version_refuses(text):
    with pytest.raises(ValueError):
        versions.parse_version(text)


@pytest.mark.parametrize("version,expect", [((0, 16), 50258), ((0, 17), 50258), ((0, 18), 50257), ((0, 19), 50257),
                                            ((1, 0), 50257)])
def test_null_tokenizer_rule_per_release(version, expect):
    assert mp.null_tokenizer_vocab_size(50257, version) == expect


def test_null_tokenizer_rule_matches_this_megatron_core():
    """The rule for the installed release equals what its own NullTokenizer says (vocabulary, EOD the last id)."""
    from megatron.core.tokenizers.text.libraries.null_tokenizer import NullTokenizer

    for v in (100, 50257):
        tok = NullTokenizer(v)
        assert tok.vocab_size == mp.null_tokenizer_vocab_size(v)
        assert tok.eod == tok.vocab_size - 1


def _args(**fields):
    args = mp.add_logp_args(argparse.ArgumentParser(allow_abbrev=False)).parse_args([])
    for k, v in fields.items():
        setattr(args, k, v)
    return args


@pytest.mark.parametrize("version,expect", [((0, 16), 1001), ((0, 19), 1000)])
def test_real_vocab_without_a_tokenizer_per_release(version, expect, monkeypatch):
    from fused_logp.megatron_plugin import args as mpa

    monkeypatch.setattr(mpa, "_global_tokenizer", lambda: None)         # no Megatron-LM tokenizer built yet
    size, source = mp.real_vocab_from_args(_args(vocab_size=1000, tokenizer_type="NullTokenizer"), version=version)
    assert size == expect and "NullTokenizer" in source and ("+ 1" in source) == (expect == 1001)
    # other tokenizers: --vocab-size as it is, on every release
    assert mp.real_vocab_from_args(_args(vocab_size=1000, tokenizer_type="HuggingFaceTokenizer"),
                                   version=version) == (1000, "--vocab-size")


def test_hook_route_per_release():
    from fused_logp.megatron_plugin import hook

    expect = "forward" if mp.megatron_core_version() >= versions.OUTPUT_PROCESSOR_FROM else "_postprocess"
    assert hook.has_output_processor_hook() == (expect == "forward")
    try:
        assert mp.install() == expect
    finally:
        mp.uninstall()


# ---------------------------------------------------------------------------------------------------------
# models the plugin does not serve: refused with a message when it is on, untouched when it is off
# ---------------------------------------------------------------------------------------------------------

def _unserved():
    classes = versions.unserved_model_classes()
    if not classes:
        pytest.skip("no HybridModel / MambaModel in this megatron-core")
    cls = classes[0]
    return cls, cls.__new__(cls)        # the real class, not built: the refusal comes before any of its code runs


@pytest.fixture()
def world():
    with ms.model_parallel_world("cpu"), ms.fresh_plugin_state():
        yield


def test_unserved_model_refused_by_name(world):
    cls, model = _unserved()
    mp.configure("contract", vocab_size=100)
    for call in (lambda: mp.unwrap_gpt_model(model), lambda: mp.check_model([model]),
                 lambda: mp.score(model, torch.zeros(1, 4, dtype=torch.long))):
        with pytest.raises(mp.UnsupportedMegatronConfigError, match=f"{cls.__name__} is not supported.*GPTModel"):
            call()


def test_unserved_model_forward_refused_when_on(world):
    cls, model = _unserved()
    mp.configure("contract", vocab_size=100)
    mp.install()
    ids = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(mp.UnsupportedMegatronConfigError, match=f"{cls.__name__} is not supported"):
        cls.forward(model, ids, ids, None, labels=ids)
    # the plugin off: the model's own forward runs (here it fails on the unbuilt module, past the guard)
    mp.configure(None)
    with pytest.raises(Exception) as exc:
        cls.forward(model, ids, ids, None, labels=ids)
    assert not isinstance(exc.value, mp.UnsupportedMegatronConfigError)
    mp.uninstall()
    assert not getattr(cls.__dict__["forward"], "__fused_logp_wrapper__", False)


def test_check_model_is_a_post_wrap_hook(world):
    """check_model returns the model it was given (megatron-core 0.19's post_wrap_hooks contract) and checks
    nothing with the plugin off."""
    wrapped, gpt = ms.build_tiny_gpt(vocab_size=256, tied=False, seed=3)
    models = [wrapped]
    mp.configure("contract", vocab_size=250)
    assert mp.check_model(models) is models
    mp.configure("contract", vocab_size=300)
    with pytest.raises(Exception, match="exceeds"):
        mp.check_model(models)
    mp.configure(None)
    assert mp.check_model(models) is models                 # off: no refusal even for a wrong vocabulary
    with torch.no_grad():                                   # off: an fp32 head is Megatron's business, not ours
        gpt.output_layer.weight.data = gpt.output_layer.weight.data.float()
    assert mp.check_model(models) is models
    mp.configure("contract", vocab_size=250)
    with pytest.raises(mp.UnsupportedMegatronConfigError, match="dtype"):
        mp.check_model(models)
