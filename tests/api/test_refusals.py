"""Every input outside the contract is refused with an error that names the argument and the accepted range."""
import pytest
import torch

from fused_logp import linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats
from fused_logp.shared_contract.errors import ContractInputError, StrictModeError


# every refusal is checked on both CPU backends (tests/cpu_backends.py)
pytestmark = pytest.mark.usefixtures("cpu_backend")


@pytest.fixture
def data(gen):
    h = torch.randn(3, 32, generator=gen).bfloat16()
    w = torch.randn(200, 32, generator=gen).bfloat16()
    t = torch.randint(0, 200, (3,), generator=gen)
    return h, w, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_hidden_not_bf16(data, dtype):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"hidden must be torch.bfloat16"):
        linear_logp(h.to(dtype), w, t)


def test_weight_not_bf16(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"weight must be torch.bfloat16"):
        linear_logp(h, w.float(), t)


def test_mismatched_hidden_size(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"D=32 columns"):
        linear_logp(h, w[:, :16].contiguous(), t)


def test_hidden_size_not_multiple_of_16(gen):
    h = torch.randn(2, 24, generator=gen).bfloat16()
    w = torch.randn(10, 24, generator=gen).bfloat16()
    with pytest.raises(ContractInputError, match=r"multiple of 16.*D=24"):
        linear_logp(h, w, torch.tensor([0, 1]))


def test_hidden_not_2d(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"hidden must be a 2-D tensor"):
        linear_logp(h[0], w, t[:1])


@pytest.mark.parametrize("bad", [200, 250, -1])
def test_target_outside_real_vocab(data, bad):
    h, w, t = data
    t = t.clone()
    t[1] = bad
    with pytest.raises(ContractInputError, match=r"targets must lie in the real vocabulary \[0, 200\)"):
        linear_logp(h, w, t)


def test_target_in_padding_rows(data):
    """Ids in the padded rows [vocab_size, V_rows) are outside the real vocabulary."""
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"\[0, 150\); got 170"):
        linear_logp(h, w, torch.tensor([0, 170, 2]), vocab_size=150)


def test_targets_wrong_dtype_or_length(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"targets must be torch.int64 or torch.int32"):
        linear_logp(h, w, t.float())
    with pytest.raises(ContractInputError, match=r"length N=3"):
        linear_logp(h, w, t[:2])


TEMPERATURE_RANGE = r"temperature must be finite and > 0, within \[2\*\*-20, 2\*\*20\]"


@pytest.mark.parametrize("temp", [0.0, -1.0, float("nan"), float("inf"), 1e-50, 1e39, 1e-45, 2.0 ** -21,
                                  2.0 ** 20 * 1.0001, 10 ** 400])
def test_temperature_out_of_range(data, temp):
    h, w, t = data
    with pytest.raises(ContractInputError, match=TEMPERATURE_RANGE):
        linear_logp(h, w, t, temperature=temp)


@pytest.mark.parametrize("temp", [2.0 ** -20, 2.0 ** 20])
def test_temperature_range_is_closed(data, temp):
    h, w, t = data
    assert linear_logp(h, w, t, temperature=temp).logp.shape == (3,)


def test_temperature_tensor_out_of_range(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=TEMPERATURE_RANGE + r".*got 0.0"):
        linear_logp(h, w, t, temperature=torch.tensor([1.0, 0.0, 1.0]))
    with pytest.raises(ContractInputError, match=TEMPERATURE_RANGE):
        linear_logp(h, w, t, temperature=torch.tensor([1.0, 2.0 ** -21, 1.0], dtype=torch.float64))
    with pytest.raises(ContractInputError, match=r"shape \[N\]=3"):
        linear_logp(h, w, t, temperature=torch.ones(2))


def test_vocab_size_out_of_range(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"vocab_size must be in \[1, 200\]"):
        linear_logp(h, w, t, vocab_size=201)


def test_bias_wrong(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"bias must be a 1-D tensor of 200 entries"):
        linear_logp(h, w, t, bias=torch.zeros(10))
    with pytest.raises(ContractInputError, match=r"bias must be bf16, fp16 or fp32"):
        linear_logp(h, w, t, bias=torch.zeros(200, dtype=torch.float64))


def test_shard_not_on_tile_boundary(data):
    """vLLM's TP=4 shards of 151936 start at 37984, not a multiple of 64."""
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"vocab_start must be a non-negative multiple of VOCAB_TILE=64"):
        shard_tile_stats(h, w[:100], t, vocab_start=100, vocab_size=200)


def test_shard_ending_mid_tile(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"end on a tile boundary"):
        shard_tile_stats(h, w[:100], t, vocab_start=0, vocab_size=200)


def test_shards_out_of_order_or_missing(data):
    h, w, t = data
    a = shard_tile_stats(h, w[:128], t, vocab_start=0, vocab_size=200)
    b = shard_tile_stats(h, w[128:], t, vocab_start=128, vocab_size=200)
    with pytest.raises(ContractInputError, match=r"consecutive and in rank order"):
        merge_shard_stats([b, a], vocab_size=200)
    with pytest.raises(ContractInputError, match=r"cover 2 tiles; vocab_size=200 needs 4"):
        merge_shard_stats([a], vocab_size=200)


def test_logits_not_fp32(data):
    h, w, t = data
    with pytest.raises(ContractInputError, match=r"logits must be torch.float32"):
        logp_from_logits(torch.randn(3, 200).bfloat16(), t)


def test_non_contract_backend_refused_in_strict_mode(data):
    h, w, t = data
    with pytest.raises(StrictModeError, match=r"'torch' does not carry the contract"):
        linear_logp(h, w, t, backend="torch", strict=True)


def test_non_contract_backend_runs_outside_strict_mode_and_says_so(data, caplog):
    h, w, t = data
    res = linear_logp(h, w, t, backend="torch", strict=False)
    assert res.provenance.contract_bearing is False and res.provenance.contract_version is None
    assert "not contract-bearing" in caplog.text


def test_unknown_backend(data):
    h, w, t = data
    with pytest.raises(ValueError, match=r"backend must be one of"):
        linear_logp(h, w, t, backend="cublas")
