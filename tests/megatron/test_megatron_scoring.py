"""Trainer-side scoring with a real megatron-core GPTModel converted from the tiny HF Qwen3 (CPU, world size 1)."""
from __future__ import annotations

import math
import warnings

import pytest
import torch

pytest.importorskip("megatron.core")
pytest.importorskip("transformers")
warnings.filterwarnings("ignore", module="megatron")

import fused_logp  # noqa: E402
from fused_logp_jobs import megatron_cpu  # noqa: E402
from fused_logp import megatron_plugin as mp  # noqa: E402
from fused_logp_jobs import megatron_scoring as msc  # noqa: E402
from fused_logp_jobs.tiny_model import VOCAB, lm_head_weight, make_tiny_qwen3, read_config  # noqa: E402

B, S = 2, 16
LOUD = dict(initializer_range=0.1, rope_theta=1e6)    # every block moves the logits: a layout error shows


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    import torch.distributed as dist
    from megatron.core import parallel_state

    created = not dist.is_initialized()
    root = tmp_path_factory.mktemp("qwen3")
    default_dir = make_tiny_qwen3(root / "default")
    loud_dir = make_tiny_qwen3(root / "loud_tied", seed=1, tie=True, **LOUD)
    models = {"default": (default_dir, *msc.build_megatron_qwen3(default_dir)),
              "loud_tied": (loud_dir, *msc.build_megatron_qwen3(loud_dir))}
    yield models
    mp.uninstall()
    megatron_cpu.uninstall()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    if created and dist.is_initialized():
        dist.destroy_process_group()


def _tokens(seed=0, b=B, s=S):
    return torch.randint(0, VOCAB, (b, s), generator=torch.Generator().manual_seed(seed))


def _bf16_ulp(x: float) -> float:
    return 2.0 ** (math.floor(math.log2(x)) - 7)


def _hf_final_hidden(hf_dir, ids):
    """transformers' own final hidden states (after model.norm), bf16 [B, S, D]: stands in for a rollout's."""
    from transformers import Qwen3ForCausalLM

    m = Qwen3ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.bfloat16, attn_implementation="eager").eval()
    got = {}
    h = m.model.norm.register_forward_hook(lambda mod, a, out: got.__setitem__("h", out))
    with torch.no_grad():
        m(input_ids=ids)
    h.remove()
    return got["h"]


# ---------------------------------------------------------------------------------------------------------

def test_tiny_model_deterministic(tmp_path, env):
    from safetensors.torch import load_file

    a = load_file(str(make_tiny_qwen3(tmp_path / "a") / "model.safetensors"))
    b = load_file(str(env["default"][0] / "model.safetensors"))
    d = load_file(str(make_tiny_qwen3(tmp_path / "d", seed=5) / "model.safetensors"))
    bits = lambda t: t.view(torch.int16)  # noqa: E731
    assert a.keys() == b.keys()
    assert all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
    assert not torch.equal(bits(a["lm_head.weight"]), bits(d["lm_head.weight"]))
    assert all(t.dtype == torch.bfloat16 for t in a.values())
    cfg = read_config(tmp_path / "a")
    assert cfg["torch_dtype"] == "bfloat16" and cfg["vocab_size"] == VOCAB and not cfg["tie_word_embeddings"]
    assert "lm_head.weight" not in load_file(str(env["loud_tied"][0] / "model.safetensors"))


def test_build_info(env):
    _, model, info = env["default"]
    assert (info["vocab_size"], info["padded_vocab_size"], info["tp"], info["tied"]) == (1000, 1024, 1, False)
    assert model.output_layer.weight.shape == (1024, 64) and model.output_layer.weight.dtype == torch.bfloat16
    assert bool((model.output_layer.weight[1000:] == 0).all())
    assert model.position_embedding_type == "rope" and model.config.qk_layernorm
    _, tied, tinfo = env["loud_tied"]
    assert tinfo["tied"] and tinfo["rope_theta"] == 1e6 and tied.output_layer.weight is None


@pytest.mark.parametrize("which", ["default", "loud_tied"])
def test_conversion_matches_transformers(env, which):
    """Megatron's bf16 logits vs transformers' on the same tokens and weights.

    Tolerance: both engines run the same bf16 weights with differently ordered bf16 arithmetic (torch RMSNorm
    rounds once, HF's rounds before the weight multiply; attention softmax precision; RoPE cos/sin rounding)
    and both round every logit to bf16. So (a) max |Δ| <= 4 bf16 ulps of the largest |logit|, and (b) against
    an fp32 run of the same weights, Megatron's error is at most twice transformers' own bf16 error. A wrong
    layout (see the next test) is two orders of magnitude above both."""
    hf_dir, model, info = env[which]
    ids = _tokens(1)
    meg = msc.megatron_logits(model, ids)
    assert meg.shape == (B, S, info["padded_vocab_size"]) and meg.dtype == torch.bfloat16
    assert bool((meg[..., VOCAB:] == 0).all())                 # zero padding rows
    meg = meg[..., :VOCAB].float()
    hf = msc.hf_logits(hf_dir, ids)
    hf32 = msc.hf_logits(hf_dir, ids, dtype=torch.float32)
    tol = 4 * _bf16_ulp(hf.abs().max().item())
    assert (meg - hf).abs().max().item() <= tol
    assert (meg - hf32).abs().max().item() <= 2 * (hf - hf32).abs().max().item()
    assert (meg.argmax(-1) == hf.argmax(-1)).float().mean().item() >= 0.9


def test_conversion_check_detects_a_layout_error(env):
    hf_dir, _, _ = env["loud_tied"]
    model, _ = msc.build_megatron_qwen3(hf_dir)
    w = model.decoder.layers[0].mlp.linear_fc1.weight
    with torch.no_grad():
        w.copy_(torch.cat([w[w.shape[0] // 2:], w[:w.shape[0] // 2]]))        # [up; gate] instead of [gate; up]
    ids = _tokens(1)
    hf = msc.hf_logits(hf_dir, ids)
    bad = msc.megatron_logits(model, ids)[..., :VOCAB].float()
    assert (bad - hf).abs().max().item() > 10 * 4 * _bf16_ulp(hf.abs().max().item())


@pytest.mark.parametrize("which,temperature", [("default", 0.7), ("loud_tied", 1.0)])
def test_contract_logp_equals_the_op_bytes(env, which, temperature):
    hf_dir, model, _ = env[which]
    ids = _tokens(2)
    res = msc.score_tokens(model, ids, temperature=temperature)
    assert res["logp_contract"].shape == res["lse_contract"].shape == res["logp_ordinary"].shape == (B, S - 1)
    assert res["final_hidden"].shape == (B, S, 64) and res["final_hidden"].dtype == torch.bfloat16
    assert torch.equal(res["targets"], ids[:, 1:])
    assert res["provenance"].contract_bearing
    w = lm_head_weight(hf_dir)                                  # the checkpoint's lm_head, as vLLM uses it
    ref = fused_logp.linear_logp(res["final_hidden"][:, :-1].reshape(-1, 64), w, ids[:, 1:].reshape(-1),
                                 temperature=temperature)
    assert torch.equal(res["logp_contract"].reshape(-1), ref.logp)
    assert torch.equal(res["lse_contract"].reshape(-1), ref.lse)
    # the ordinary path: close (bf16 logits, each off by <= half an ulp) but not the same bits
    z = res["final_hidden"][:, :-1].float() @ w.float().t()
    bound = _bf16_ulp(z.abs().max().item()) / temperature
    diff = (res["logp_ordinary"] - res["logp_contract"]).abs()
    assert diff.max().item() <= bound
    assert bool((diff > 0).any())


def test_given_hidden_states_equal_the_op_bytes(env):
    """Attribution: hidden states from another engine (here transformers') scored by Megatron's output layer +
    plugin, without the body, give the op's bytes on those rows."""
    hf_dir, model, _ = env["default"]
    ids = _tokens(3)
    h = _hf_final_hidden(hf_dir, ids)                          # [B, S, D] bf16
    rows = h[:, :-1].reshape(-1, 64).contiguous()
    w = lm_head_weight(hf_dir)
    ref = fused_logp.linear_logp(rows, w, ids[:, 1:].reshape(-1), temperature=0.9)
    res = msc.score_tokens(model, ids, temperature=0.9, hidden_states=rows)
    assert torch.equal(res["logp_contract"].reshape(-1), ref.logp)
    assert torch.equal(res["lse_contract"].reshape(-1), ref.lse)
    same = msc.score_tokens(model, ids, temperature=0.9, hidden_states=h)                       # [B, S, D]
    flat = msc.score_tokens(model, ids[:, 1:].reshape(-1), temperature=0.9, hidden_states=rows)  # [N] targets
    assert torch.equal(same["logp_contract"], res["logp_contract"])
    assert torch.equal(flat["logp_contract"], ref.logp) and torch.equal(flat["lse_contract"], ref.lse)
    assert torch.equal(flat["logp_ordinary"], res["logp_ordinary"].reshape(-1))
    assert (res["logp_ordinary"] - res["logp_contract"]).abs().max().item() < 0.1
    with pytest.raises(ValueError, match="bf16"):
        msc.score_tokens(model, ids, hidden_states=rows.float())
    with pytest.raises(ValueError, match="do not match"):
        msc.score_tokens(model, ids, hidden_states=rows[:-1])


def test_cpu_shims_install_uninstall(env):
    import megatron.core.utils as mu
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    if torch.cuda.is_available():
        assert megatron_cpu.install() is False
        return
    assert megatron_cpu.is_installed()
    patched = (mu.GlobalMemoryBuffer.get_tensor, RotaryEmbedding.get_emb)
    assert megatron_cpu.install() is True
    assert (mu.GlobalMemoryBuffer.get_tensor, RotaryEmbedding.get_emb) == patched            # idempotent
    megatron_cpu.uninstall()
    assert not megatron_cpu.is_installed()
    assert mu.GlobalMemoryBuffer.get_tensor is not patched[0] and RotaryEmbedding.get_emb is not patched[1]
    megatron_cpu.uninstall()                                                                  # idempotent
    megatron_cpu.install()
    assert mu.GlobalMemoryBuffer.get_tensor is patched[0]


# ---------------------------------------------------------------------------------------------------------
# TP=2 (two spawned processes, gloo)
# ---------------------------------------------------------------------------------------------------------

TP2_MODEL = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16, initializer_range=0.1)


def _tp2_worker(rank, port, hf_dir, outdir):
    import os

    import torch.distributed as dist
    warnings.filterwarnings("ignore")
    res = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
        model, info = msc.build_megatron_qwen3(hf_dir)
        ids = _tokens(4)
        res["info"] = info
        res["logits"] = msc.megatron_logits(model, ids)
        out = msc.score_tokens(model, ids, temperature=0.7)
        res["score"] = {k: v for k, v in out.items() if torch.is_tensor(v)}
        res["given"] = msc.score_tokens(model, ids, temperature=0.7, hidden_states=out["final_hidden"])["logp_contract"]
    except BaseException as exc:                       # reported by the parent
        import traceback
        res["error"] = "".join(traceback.format_exception(exc))
    finally:
        torch.save(res, os.path.join(outdir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.destroy_process_group()


def test_tp2_model_matches_transformers_and_contract_bytes_equal_tp1(env, tmp_path):
    """TP=2: the converted shards give transformers' logits (same criterion as TP=1), both ranks return the same
    bytes, and those equal the TP=1 model's plugin path and the op on the same final hidden states."""
    import torch.multiprocessing as tmp

    hf_dir = make_tiny_qwen3(tmp_path / "tp2", **TP2_MODEL)
    tmp.spawn(_tp2_worker, args=(msc.free_port(), str(hf_dir), str(tmp_path)), nprocs=2, join=True)
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r in res:
        assert "error" not in r, r["error"]
    assert [r["info"]["tp"] for r in res] == [2, 2] and res[0]["info"]["padded_vocab_size"] == 1024
    ids = _tokens(4)
    meg = torch.cat([res[0]["logits"], res[1]["logits"]], -1)[..., :VOCAB].float()
    hf = msc.hf_logits(hf_dir, ids)
    hf32 = msc.hf_logits(hf_dir, ids, dtype=torch.float32)
    assert (meg - hf).abs().max().item() <= 4 * _bf16_ulp(hf.abs().max().item())
    assert (meg - hf32).abs().max().item() <= 2 * (hf - hf32).abs().max().item()
    s0, s1 = res[0]["score"], res[1]["score"]
    assert all(torch.equal(s0[k], s1[k]) for k in s0)
    assert torch.equal(res[0]["given"], s0["logp_contract"])
    tp1, _ = msc.build_megatron_qwen3(hf_dir)
    one = msc.score_tokens(tp1, ids, temperature=0.7, hidden_states=s0["final_hidden"])
    assert torch.equal(one["logp_contract"], s0["logp_contract"]) and torch.equal(one["lse_contract"],
                                                                                   s0["lse_contract"])
    ref = fused_logp.linear_logp(s0["final_hidden"][:, :-1].reshape(-1, 64), lm_head_weight(hf_dir),
                                 ids[:, 1:].reshape(-1), temperature=0.7)
    assert torch.equal(ref.logp, s0["logp_contract"].reshape(-1)) and torch.equal(ref.lse,
                                                                                  s0["lse_contract"].reshape(-1))
    assert (one["logp_ordinary"] - s0["logp_ordinary"]).abs().max().item() < 1e-4
