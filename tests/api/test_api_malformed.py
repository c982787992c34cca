"""Every public entry refuses a malformed argument with ContractInputError (a ValueError) naming that argument,
never with another exception: wrong types, dtypes, devices (meta), shapes, non-bool flags and out-of-range numbers.
The named cases first, then a hypothesis property test that draws one malformed argument per call."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fused_logp
from fused_logp import (ContractInputError, TransformProgram, check_input_errors, linear_logp, linear_logp_program,
                        logits_and_stats, logp_from_logits, logp_of_ids, merge_shard_stats, shard_tile_stats,
                        weight_fingerprint)

N, D, V = 3, 32, 130
_g = torch.Generator().manual_seed(3)
H = torch.randn(N, D, generator=_g).bfloat16()
W = torch.randn(V, D, generator=_g).bfloat16()
T = torch.tensor([0, 64, 129])
Z = torch.randn(N, V, generator=_g)
META = torch.device("meta")


def _named(arg, call):
    with pytest.raises(ContractInputError) as err:
        call()
    assert arg in str(err.value), f"{arg!r} not named in: {err.value}"
    return str(err.value)


# ---------------------------------------------------------------------------------------------------------
# the named cases
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arg", ["hidden", "weight", "targets", "bias", "temperature"])
def test_meta_tensors_are_refused_naming_the_argument(arg):
    kw = dict(bias=torch.zeros(V), temperature=torch.ones(N))
    h, w, t = H, W, T
    if arg == "hidden":
        h = H.to(META)
    elif arg == "weight":
        w = W.to(META)
    elif arg == "targets":
        t = T.to(META)
    else:
        kw[arg] = kw[arg].to(META)
    _named(arg, lambda: linear_logp(h, w, t, backend="oracle", **kw))


def test_meta_logits_and_weight_shard():
    _named("logits", lambda: logp_from_logits(Z.to(META), T, backend="oracle"))
    _named("weight_shard", lambda: shard_tile_stats(H, W[:64].to(META), T, vocab_start=0, vocab_size=V))
    _named("weight_shard", lambda: weight_fingerprint(W.to(META)))


@pytest.mark.parametrize("value", ["false", "true", 0, 1, None])
def test_non_bool_strict_is_refused(value):
    if value is None:                               # None: the configuration's
        assert linear_logp(H, W, T, strict=None, backend="oracle").logp.shape == (N,)
        return
    msg = _named("strict", lambda: linear_logp(H, W, T, strict=value, backend="oracle"))
    assert repr(value) in msg


@pytest.mark.parametrize("value", ["false", 1, None])
def test_non_bool_return_logits_is_refused(value):
    _named("return_logits", lambda: linear_logp(H, W, T, return_logits=value, backend="oracle"))


@pytest.mark.parametrize("kw", [dict(vocab_start=-1), dict(vocab_start=1.5), dict(vocab_start=True),
                                dict(vocab_size=0), dict(vocab_size="130")])
def test_weight_fingerprint_arguments(kw):
    _named(next(iter(kw)), lambda: weight_fingerprint(W, **kw))


def test_weight_fingerprint_refusals_are_value_errors():
    with pytest.raises(ValueError, match="weight_shard"):
        weight_fingerprint(W.float())


def test_check_input_errors_without_cuda(monkeypatch):
    """On a CPU-only torch there is no device record to read: no CUDA assertion, nothing raised."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert check_input_errors() is None
    assert check_input_errors("cpu") is None and check_input_errors("meta") is None
    _named("device", lambda: check_input_errors("nope"))


def test_logp_from_logits_names_its_columns_not_a_weight():
    msg = _named("vocab_size", lambda: logp_from_logits(Z, T, vocab_size=V + 1, backend="oracle"))
    assert "weight" not in msg and "logits' columns" in msg


def test_logp_of_ids_names_ids():
    st_ = logits_and_stats(H, W, backend="oracle")
    _named("ids", lambda: logp_of_ids(st_, torch.tensor([0, V, 1]), vocab_size=V, backend="oracle"))
    _named("ids", lambda: logp_of_ids(st_, T.float(), vocab_size=V, backend="oracle"))
    _named("vocab_size", lambda: logp_of_ids(st_, T, vocab_size="130", backend="oracle"))


def test_tiny_temperature_refused_at_the_host():
    """T = 1e-45 (a subnormal binary32) is outside [2**-20, 2**20]: refused, not all-NaN rows."""
    msg = _named("temperature", lambda: linear_logp(H, W, T, temperature=1e-45, backend="oracle"))
    assert "2**-20" in msg and "2**20" in msg


def test_merge_and_program_arguments():
    _named("stats", lambda: merge_shard_stats("x", vocab_size=V))
    _named("stats", lambda: merge_shard_stats([H], vocab_size=V))
    _named("program", lambda: linear_logp_program(H, W, T, None, backend="oracle"))
    _named("rows_per_chunk", lambda: linear_logp_program(H, W, T, TransformProgram(1.0), rows_per_chunk=0,
                                                         backend="oracle"))
    _named("backend", lambda: linear_logp(H, W, T, backend=["oracle"]))


# ---------------------------------------------------------------------------------------------------------
# the property: one malformed argument per call, drawn
# ---------------------------------------------------------------------------------------------------------

def _bad_tensors(dtype, shape):
    return [torch.zeros(shape, dtype=dtype, device=META), torch.zeros((*shape, 2), dtype=dtype),
            torch.zeros((0,) * (len(shape) + 1), dtype=dtype), "x", None, 3, [1, 2, 3]]


BAD = {
    "hidden": _bad_tensors(torch.bfloat16, (N, D)) + [H.float(), H[:, :24], H[0], H.to(torch.int32)],
    "weight": _bad_tensors(torch.bfloat16, (V, D)) + [W.float(), W[:, :16], W[0], W.half()],
    "targets": [None, [0, 1, 2], T.float(), T[:2], T.view(N, 1).expand(N, 2).contiguous()[:, :0], T.to(META),
                torch.tensor([0, -1, 2]), torch.tensor([0, V, 2]), T.bool(), T.to(torch.uint8), 1.0],
    "temperature": ["1", None, True, 0.0, -1.0, float("nan"), float("inf"), 1e-30, 1e30, 10 ** 400, 2.0 ** -21,
                    torch.ones(N + 1), torch.ones(N, dtype=torch.int64), torch.ones(N).to(META),
                    torch.tensor([1.0, 0.0, 1.0]), torch.ones(N, 1), torch.tensor([1.0, 2.0 ** 21, 1.0])],
    "bias": [torch.zeros(V - 1), torch.zeros(V, dtype=torch.float64), [0.0] * V, torch.zeros(V).to(META),
             torch.zeros(V, 1), "b", torch.zeros(V, dtype=torch.int32)],
    "vocab_size": [0, -3, 1.5, "10", True, V + 1, [V]],
    "return_logits": ["false", 1, None, 0.0],
    "strict": ["false", 1, [], 0.5],
    "backend": ["nope", 5, [], ("oracle",)],
    "vocab_start": [-64, 1, 32, True, "0", 64.0],
    "logits": [Z.bfloat16(), Z[0], Z.to(META), [[0.0]], None, Z.double()],
}
BASE = {"hidden": H, "weight": W, "targets": T, "temperature": 0.7, "bias": torch.zeros(V), "backend": "oracle"}
ENTRIES = {
    "linear_logp": (lambda a: linear_logp(a["hidden"], a["weight"], a["targets"], **_kw(a, "bias", "temperature",
                    "vocab_size", "return_logits", "strict", "backend")),
                    ["hidden", "weight", "targets", "temperature", "bias", "vocab_size", "return_logits", "strict",
                     "backend"]),
    "shard_tile_stats": (lambda a: shard_tile_stats(a["hidden"], a["weight"], a["targets"], vocab_start=a["vocab_start"],
                         vocab_size=a.get("vocab_size", V), **_kw(a, "bias", "temperature", "return_logits",
                                                                   "strict", "backend")),
                         ["hidden", "weight", "targets", "temperature", "bias", "vocab_start", "vocab_size",
                          "return_logits", "strict", "backend"]),
    "logp_from_logits": (lambda a: logp_from_logits(a["logits"], a["targets"], **_kw(a, "temperature", "vocab_size",
                                                                                    "strict", "backend")),
                         ["logits", "targets", "temperature", "vocab_size", "strict", "backend"]),
    "logits_and_stats": (lambda a: logits_and_stats(a["hidden"], a["weight"], **_kw(a, "bias", "vocab_size", "strict",
                                                                                   "backend")),
                         ["hidden", "weight", "bias", "vocab_size", "strict", "backend"]),
}
# the argument's name in the message (weight_shard is shard_tile_stats's weight)
NAMES = {("shard_tile_stats", "weight"): "weight_shard"}


def _kw(a, *names):
    return {k: a[k] for k in names if k in a}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_one_malformed_argument_is_refused_naming_it(data):
    entry = data.draw(st.sampled_from(sorted(ENTRIES)), label="entry")
    call, args = ENTRIES[entry]
    arg = data.draw(st.sampled_from(args), label="argument")
    bad = data.draw(st.sampled_from(range(len(BAD[arg]))), label="value")
    a = dict(BASE, vocab_start=64, logits=Z)
    if entry == "shard_tile_stats":
        a["weight"] = W[64:]
        a["bias"] = torch.zeros(V - 64)
    a[arg] = BAD[arg][bad]
    if entry == "shard_tile_stats" and arg == "vocab_size" and a[arg] == V + 1:
        a[arg] = 0                                  # a shard's vocab_size may exceed its rows
    name = NAMES.get((entry, arg), arg)
    try:
        call(a)
    except ValueError as exc:
        text = str(exc)
        if arg == "backend" and isinstance(a[arg], str):
            assert "backend must be one of" in text
        else:
            assert name in text or (arg == "hidden" and "hidden size D" in text) \
                or (arg == "weight" and "D=" in text), f"{entry}({arg}={a[arg]!r}): {text}"
        return
    except Exception as exc:                        # anything but a ValueError naming the argument fails
        pytest.fail(f"{entry}({arg}={a[arg]!r}) raised {type(exc).__name__}: {exc}")
    pytest.fail(f"{entry}({arg}={a[arg]!r}) was accepted")


def test_every_public_entry_is_exported():
    for name in ("linear_logp", "linear_logp_program", "linear_logp_tp", "logp_from_logits", "logits_and_stats",
                 "logp_of_ids", "shard_tile_stats", "merge_shard_stats", "check_input_errors", "weight_fingerprint"):
        assert name in fused_logp.__all__ and callable(getattr(fused_logp, name))
