"""Trainer-side scoring: a megatron-core GPTModel built from a Hugging Face Qwen3 checkpoint, scoring the tokens of
a rollout through the Megatron plugin (contract op) and through Megatron's own output layer + cross-entropy.

    model, info = build_megatron_qwen3(hf_dir)                # bf16 GPTModel, local spec, HF weights converted
    res = score_tokens(model, token_ids, temperature=0.7)     # body + output layer
    res = score_tokens(model, token_ids, hidden_states=rows)  # given final hidden states: the logp half alone

On a machine without CUDA, `fused_logp_jobs.megatron_cpu.install()` is applied first (CPU shims for megatron-core).
"""
from __future__ import annotations

import math
import socket

import torch

from . import megatron_cpu
from .tiny_model import load_state_dict, read_config, rope_theta

MAKE_VOCAB_SIZE_DIVISIBLE_BY = 128          # Megatron's default; the padded size is a multiple of this * TP
_INFO_ATTR = "_fused_logp_hf_info"


# ---------------------------------------------------------------------------------------------------------
# process groups
# ---------------------------------------------------------------------------------------------------------

def free_port() -> int:
    """A free TCP port on the loopback interface (process-group rendezvous of the harness and the tests)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_model_parallel(tp_group=None):
    """A gloo world of size 1 when no process group exists, and Megatron's model-parallel state (TP = world size
    when it has to be created). Returns the tensor-parallel group to build with."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=dist.get_world_size())
    mpu_tp = parallel_state.get_tensor_model_parallel_group()
    if tp_group is not None and tp_group is not mpu_tp:
        if dist.get_process_group_ranks(tp_group) != dist.get_process_group_ranks(mpu_tp):
            raise ValueError("tp_group must be Megatron's tensor-model-parallel group "
                             "(parallel_state.initialize_model_parallel(tensor_model_parallel_size=...))")
    return mpu_tp


# ---------------------------------------------------------------------------------------------------------
# conversion
# ---------------------------------------------------------------------------------------------------------

def padded_vocab_size(vocab: int, tp: int, divisible_by: int = MAKE_VOCAB_SIZE_DIVISIBLE_BY) -> int:
    mult = divisible_by * tp
    return int(math.ceil(vocab / mult) * mult)


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    if w.shape[0] == rows:
        return w
    return torch.cat([w, w.new_zeros(rows - w.shape[0], *w.shape[1:])], 0)


def _chunk(w: torch.Tensor, tp: int, rank: int, dim: int = 0) -> torch.Tensor:
    return torch.chunk(w, tp, dim=dim)[rank].contiguous()


def convert_hf_qwen3(sd: dict, cfg: dict, *, tp: int = 1, rank: int = 0, padded_vocab: int) -> dict:
    """HF Qwen3 tensors -> the state dict of a local-spec GPTModel shard (rank of tp).

    q/k/v go into linear_qkv in Megatron's grouped layout: for each KV group, its query heads, then its key head,
    then its value head (rows of head_dim each); gate/up go into linear_fc1 as [gate; up] (per TP shard)."""
    L = cfg["num_hidden_layers"]
    nq, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or cfg["hidden_size"] // nq
    D = cfg["hidden_size"]
    if nq % nkv or nkv % tp:
        raise ValueError(f"{nq} query heads / {nkv} KV heads cannot be split over TP={tp}")
    out = {}
    emb = _pad_rows(sd["model.embed_tokens.weight"], padded_vocab)
    out["embedding.word_embeddings.weight"] = _chunk(emb, tp, rank)
    for i in range(L):
        p, q = f"model.layers.{i}.", f"decoder.layers.{i}."
        wq = sd[p + "self_attn.q_proj.weight"].view(nkv, (nq // nkv) * hd, D)
        wk = sd[p + "self_attn.k_proj.weight"].view(nkv, hd, D)
        wv = sd[p + "self_attn.v_proj.weight"].view(nkv, hd, D)
        qkv = torch.cat([wq, wk, wv], dim=1).reshape(-1, D)
        out[q + "self_attention.linear_qkv.weight"] = _chunk(qkv, tp, rank)
        out[q + "self_attention.linear_proj.weight"] = _chunk(sd[p + "self_attn.o_proj.weight"], tp, rank, 1)
        out[q + "self_attention.q_layernorm.weight"] = sd[p + "self_attn.q_norm.weight"]
        out[q + "self_attention.k_layernorm.weight"] = sd[p + "self_attn.k_norm.weight"]
        out[q + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[q + "pre_mlp_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        gate = _chunk(sd[p + "mlp.gate_proj.weight"], tp, rank)
        up = _chunk(sd[p + "mlp.up_proj.weight"], tp, rank)
        out[q + "mlp.linear_fc1.weight"] = torch.cat([gate, up], 0)
        out[q + "mlp.linear_fc2.weight"] = _chunk(sd[p + "mlp.down_proj.weight"], tp, rank, 1)
    out["decoder.final_layernorm.weight"] = sd["model.norm.weight"]
    if not cfg.get("tie_word_embeddings", False):
        out["output_layer.weight"] = _chunk(_pad_rows(sd["lm_head.weight"], padded_vocab), tp, rank)
    return {k: v.to(torch.bfloat16).contiguous() for k, v in out.items()}


def qwen3_transformer_config(cfg: dict, tp: int = 1):
    """megatron-core TransformerConfig with the Qwen3 architecture of an HF config dict (bf16, no dropout)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cfg.get("attention_bias"):
        raise ValueError("Qwen3 checkpoints with attention biases are not supported")
    if cfg.get("use_sliding_window"):
        raise ValueError("sliding-window attention is not supported")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"activation {cfg.get('hidden_act')!r} is not SwiGLU")
    nq = cfg["num_attention_heads"]
    return TransformerConfig(
        num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"], num_attention_heads=nq,
        num_query_groups=cfg["num_key_value_heads"], kv_channels=cfg.get("head_dim") or cfg["hidden_size"] // nq,
        ffn_hidden_size=cfg["intermediate_size"], normalization="RMSNorm", layernorm_epsilon=cfg["rms_norm_eps"],
        qk_layernorm=True, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
        add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0, tensor_model_parallel_size=tp,
        use_cpu_initialization=not torch.cuda.is_available(), perform_initialization=False,
        params_dtype=torch.bfloat16, bf16=True, transformer_impl="local")


def build_megatron_qwen3(hf_dir, *, tp_group=None):
    """A bf16 megatron-core GPTModel (local spec, RoPE) with the weights of the HF Qwen3 checkpoint in `hf_dir`.

    Returns (model, info). The model's output layer has the padded vocabulary (a multiple of 128 * TP, zero
    rows beyond the checkpoint's); info["vocab_size"] is the real one."""
    import torch.distributed as dist
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    megatron_cpu.install()
    tp_group = ensure_model_parallel(tp_group)
    tp, rank = dist.get_world_size(tp_group), dist.get_rank(tp_group)
    cfg = read_config(hf_dir)
    if cfg.get("model_type") != "qwen3":
        raise ValueError(f"{hf_dir}: model_type {cfg.get('model_type')!r}, expected 'qwen3'")
    tied = bool(cfg.get("tie_word_embeddings", False))
    vocab = int(cfg["vocab_size"])
    padded = padded_vocab_size(vocab, tp)
    theta = rope_theta(cfg)
    tcfg = qwen3_transformer_config(cfg, tp)
    spec = get_gpt_layer_local_spec(qk_layernorm=True, normalization="RMSNorm")
    model = GPTModel(tcfg, spec, vocab_size=padded, max_sequence_length=int(cfg["max_position_embeddings"]),
                     position_embedding_type="rope", rotary_percent=1.0, rotary_base=theta,
                     share_embeddings_and_output_weights=tied, parallel_output=True)
    model = model.to(torch.bfloat16)
    state = convert_hf_qwen3(load_state_dict(hf_dir), cfg, tp=tp, rank=rank, padded_vocab=padded)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise RuntimeError(f"HF -> Megatron conversion: missing {missing}, unexpected {unexpected}")
    model.eval()
    info = dict(hf_dir=str(hf_dir), vocab_size=vocab, padded_vocab_size=padded, tp=tp, tp_rank=rank,
                tied=tied, rope_theta=theta, hidden_size=cfg["hidden_size"],
                num_layers=cfg["num_hidden_layers"], megatron_core=_mcore_version())
    setattr(model, _INFO_ATTR, info)
    return model, info


def _mcore_version() -> str:
    from megatron.core import package_info
    return package_info.__version__


# ---------------------------------------------------------------------------------------------------------
# scoring
# ---------------------------------------------------------------------------------------------------------

def lm_head_weight(model) -> torch.Tensor:
    """This rank's lm_head shard [V_padded / TP, D] bf16 (the embedding when tied)."""
    from fused_logp.megatron_plugin import unwrap_gpt_model

    gpt = unwrap_gpt_model(model)
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight


def megatron_logits(model, token_ids: torch.Tensor) -> torch.Tensor:
    """Megatron's own logits [B, S, V_padded / TP] (bf16) for token_ids [B, S] (no labels: the plugin passes)."""
    from fused_logp.megatron_plugin import unwrap_gpt_model

    gpt = unwrap_gpt_model(model)
    b, s = token_ids.shape
    with torch.no_grad():
        return gpt(token_ids, torch.arange(s).expand(b, s), None)


def _ordinary_logp(gpt, h_sbd, labels_bs, temperature, vocab):
    """Megatron's own path: output_layer logits, fp32, / T, vocab_parallel_cross_entropy; -loss [b, s].
    Padded vocabulary columns are set to -inf (the real vocabulary, as the rollout normalises over)."""
    from megatron.core import tensor_parallel

    w = lm_head_weight(gpt) if gpt.share_embeddings_and_output_weights else None
    logits, _ = gpt.output_layer(h_sbd, weight=w)
    logits = logits.float() / temperature
    v_local = logits.shape[-1]
    start = v_local * torch.distributed.get_rank(gpt.output_layer.tp_group)
    if start + v_local > vocab:
        cols = torch.arange(start, start + v_local, device=logits.device) >= vocab
        logits = logits.masked_fill(cols, float("-inf"))
    # 0.16 uses parallel_state's TP group (ensure_model_parallel checked it is the output layer's)
    loss = tensor_parallel.vocab_parallel_cross_entropy(logits, labels_bs.t().contiguous())
    return (-loss).t().contiguous()


def ordinary_logp(model, token_ids=None, *, hidden_states=None, targets=None, temperature: float = 1.0,
                  vocab_size: int | None = None) -> torch.Tensor:
    """Megatron's own path (output_layer logits, fp32, / T, vocab_parallel_cross_entropy over the real vocabulary):
    logp [B, S-1] of the next tokens of token_ids [B, S] (the body runs unlabelled, so the plugin stays out), or
    logp [N] of targets [N] after given final hidden rows [N, D]."""
    from fused_logp import megatron_plugin as mp

    gpt = mp.unwrap_gpt_model(model)
    vocab = vocab_size or (getattr(gpt, _INFO_ATTR, None) or {}).get("vocab_size") or mp.get_settings().vocab_size
    if hidden_states is not None:
        h = torch.as_tensor(hidden_states)
        with torch.no_grad():
            return _ordinary_logp(gpt, h.unsqueeze(1), torch.as_tensor(targets).unsqueeze(0), temperature, vocab)[0]
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    b, s = token_ids.shape
    captured = {}
    handle = gpt.decoder.register_forward_hook(
        lambda m, a, out: captured.__setitem__("h", out[0] if isinstance(out, tuple) else out))
    try:
        with torch.no_grad():
            gpt(token_ids, torch.arange(s).expand(b, s), None)
    finally:
        handle.remove()
    labels = torch.zeros_like(token_ids)
    labels[:, :-1] = token_ids[:, 1:]
    with torch.no_grad():
        return _ordinary_logp(gpt, captured["h"], labels, temperature, vocab)[:, :-1].contiguous()


def score_tokens(model, token_ids: torch.Tensor, *, temperature: float = 1.0, hidden_states=None,
                 ordinary_mask_padding: bool = True) -> dict:
    """Score token_ids [B, S] int64: for positions 0..S-2, the log-probability of token s+1.

    Returns (all on CPU, [B, S-1] unless noted):
      logp_contract, lse_contract  fp32, from the plugin's public scoring API (fused_logp.megatron_plugin.score /
                                   score_hidden_states: the contract op on the final hidden states and the lm_head
                                   weight, real vocabulary only)
      logp_ordinary                fp32, Megatron's output_layer logits + vocab_parallel_cross_entropy, fp32 logits
                                   divided by T before the loss (padded columns excluded)
      final_hidden                 bf16 [B, S, D]: the output layer's input (after the final norm)
      targets                      int64, the scored ids; provenance: the op's provenance; fingerprint: the lm_head's

    With hidden_states given, the body is not run: the rows go through the same output layer and plugin path.
    They are the final hidden states of positions 0..S-2, as [B, S-1, D], [B*(S-1), D] (sequence-major) or
    [B, S, D] (last position unused); or [N, D] rows with token_ids a 1-D tensor [N] of their target ids
    (then every result is [N] and final_hidden is [N, D])."""
    from fused_logp import megatron_plugin as mp

    gpt = mp.unwrap_gpt_model(model)
    info = getattr(gpt, _INFO_ATTR, None) or {}
    vocab = info.get("vocab_size") or mp.get_settings().vocab_size
    if vocab is None:
        raise ValueError("the model was not built by build_megatron_qwen3 and no --logp-vocab-size is configured")
    token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
    vocab_ord = vocab if ordinary_mask_padding else lm_head_weight(gpt).shape[0] * info.get("tp", 1)

    if hidden_states is None:
        if token_ids.dim() != 2 or token_ids.shape[1] < 2:
            raise ValueError(f"token_ids must be [B, S] with S >= 2; got {tuple(token_ids.shape)}")
        captured = {}

        def hook(module, args, output):
            captured["h"] = output[0] if isinstance(output, tuple) else output

        handle = gpt.decoder.register_forward_hook(hook)
        try:
            sc = mp.score(gpt, token_ids, temperature=temperature, vocab_size=vocab)
        finally:
            handle.remove()
        h = captured["h"]                                                  # [S, B, D] after the final norm
        with torch.no_grad():
            ordinary = _ordinary_logp(gpt, h, sc.targets, temperature, vocab_ord)
        return dict(logp_contract=sc.logp[:, :-1].contiguous(), lse_contract=sc.lse[:, :-1].contiguous(),
                    logp_ordinary=ordinary[:, :-1].contiguous(), final_hidden=h.transpose(0, 1).contiguous(),
                    targets=token_ids[:, 1:].contiguous(), provenance=sc.provenance, fingerprint=sc.fingerprint)

    h = torch.as_tensor(hidden_states)
    if h.dtype != torch.bfloat16:
        raise ValueError(f"hidden_states must be bf16 (the rollout's final hidden states); got {h.dtype}")
    d = gpt.config.hidden_size
    if token_ids.dim() == 1:
        if h.dim() != 2 or h.shape[0] != token_ids.shape[0]:
            raise ValueError(f"with 1-D target ids [N] the hidden states must be [N, {d}]; got {tuple(h.shape)}")
        h3, labels, flat = h.unsqueeze(0), token_ids.unsqueeze(0), True
    else:
        b, s = token_ids.shape
        if h.dim() == 3 and tuple(h.shape[:2]) == (b, s):
            h = h[:, :-1]
        if h.shape[-1] != d or h.numel() != b * (s - 1) * d:
            raise ValueError(f"hidden_states {tuple(hidden_states.shape)} do not match token_ids {(b, s)} "
                             f"and hidden size {d}")
        h3, labels, flat = h.reshape(b, s - 1, d), token_ids[:, 1:].contiguous(), False
    if h3.shape[-1] != d:
        raise ValueError(f"hidden size {h3.shape[-1]} != the model's {d}")
    h_sbd = h3.transpose(0, 1).contiguous()                                # Megatron's [s, b, h] layout
    sc = mp.score_hidden_states(gpt, h_sbd, labels, temperature=temperature, vocab_size=vocab)
    with torch.no_grad():
        ordinary = _ordinary_logp(gpt, h_sbd, labels, temperature, vocab_ord)
    res = dict(logp_contract=sc.logp, lse_contract=sc.lse, logp_ordinary=ordinary, final_hidden=h3,
               targets=labels, provenance=sc.provenance, fingerprint=sc.fingerprint)
    if flat:
        res = {k: (v[0] if torch.is_tensor(v) else v) for k, v in res.items()}
    return res


def hf_logits(hf_dir, token_ids: torch.Tensor, *, dtype=torch.bfloat16) -> torch.Tensor:
    """The transformers model's logits [B, S, V] (fp32 copy) for token_ids, eager attention, in `dtype`."""
    from transformers import Qwen3ForCausalLM

    m = Qwen3ForCausalLM.from_pretrained(str(hf_dir), dtype=dtype, attn_implementation="eager")
    m.eval()
    with torch.no_grad():
        return m(input_ids=token_ids).logits.float()


__all__ = ["build_megatron_qwen3", "convert_hf_qwen3", "ensure_model_parallel", "hf_logits", "lm_head_weight",
           "megatron_logits", "ordinary_logp", "padded_vocab_size", "qwen3_transformer_config", "score_tokens"]
