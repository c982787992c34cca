"""Scoring for RL: per-token logp and lse of given targets under a Megatron GPTModel, through the plugin.

    from fused_logp import megatron_plugin as mp
    sc = mp.score(model, tokens, temperature=0.7)               # targets = next tokens; last position masked
    sc = mp.score(model, tokens, targets, loss_mask=response_mask, program=TransformProgram(0.7, top_p=0.9))
    sc.logp, sc.lse                                             # [b, s] fp32, 0.0 where loss_mask == 0
    sc.fingerprint                                              # the lm_head fingerprint the logp were computed with
    rows = mp.score_hidden_states(model, hidden_rows, targets, temperature=0.7)   # given final hidden states

An RL framework's log-prob step calls the model without labels (Megatron then returns full logits); `score`
supplies the labels and turns the plugin on for its own forward only (whatever `--logp-backend` says), so the
result is the contract op's bytes - the bytes a vLLM rollout with the fused_logp plugin records - for any
megatron-core GPTModel: tied or untied, tensor parallel (every TP rank gets the unsharded op's bytes), sequence
parallel (the hidden states are gathered), context parallel (full sequences in, Megatron's load-balanced split,
results gathered back to sequence order). Pipeline parallelism: call the model chunks through Megatron's
schedules with `call_settings` instead (one forward of a whole model is what `score` runs).

The fingerprint is recomputed from the lm_head at every call (a collective over the TP group, 0.43 ms for the
Qwen3-8B head on an H200), so it always names the bytes that produced these logp.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from ..shared_contract.config import get_config
from ..shared_contract.errors import ContractInputError
from .fingerprint import LmHeadFingerprint
from .hook import install, settings_for, unwrap_gpt_model
from .parallel import gather_context_parallel, group_size
from .processor import LogpOutput, logp_output_processor
from .settings import LogpSettings, call_options, call_settings, resolve_vocab_size


@dataclasses.dataclass
class Scores:
    """Per-token results in the tokens' layout [b, s] (or the rows' [N] for score_hidden_states)."""
    logp: torch.Tensor                  # fp32, log p(target) under the temperature / program, real vocabulary only
    lse: torch.Tensor                   # fp32, logsumexp of the scaled logits (over the kept set for a program)
    loss_mask: torch.Tensor             # which positions were scored (others hold 0.0)
    targets: torch.Tensor               # the scored ids
    fingerprint: str                    # fused_logp.weight_fingerprint of the lm_head's real-vocabulary rows, now
    weight_version: int | None          # the tracker's optimizer-step label, when a tracker was given
    provenance: object                  # the op's Provenance (backend, contract version, ...)
    vocab_size: int


def _program_and_temperature(temperature, program):
    if program is not None:
        from ..kernel.transforms import TransformProgram

        if not isinstance(program, TransformProgram):
            raise ContractInputError(f"program must be a fused_logp TransformProgram; got {type(program).__name__}")
        if temperature is not None:
            raise ContractInputError("give either temperature or program (which carries its own temperature)")
        return program, float(program.temperature)
    if temperature is None:
        return None, None
    if hasattr(temperature, "shape"):
        return None, temperature
    LogpSettings(temperature=float(temperature))            # validates
    return None, float(temperature)


def _real_vocab(gpt, vocab_size):
    settings = settings_for(gpt)
    vocab = vocab_size if vocab_size is not None else settings.vocab_size
    w = _lm_head(gpt)
    padded = w.shape[0] * group_size(gpt.output_layer.tp_group)
    return resolve_vocab_size(LogpSettings(vocab_size=vocab), padded, get_config().strict)


def _lm_head(gpt):
    return gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights \
        else gpt.output_layer.weight


def _backend(gpt):
    s = settings_for(gpt)
    return s.backend if s.enabled else "contract"


def _fingerprint(gpt, vocab, tracker):
    if tracker is not None:
        if tracker.model is not gpt:
            raise ContractInputError("tracker tracks another model's lm_head")
        return tracker.refresh(), tracker.version
    return LmHeadFingerprint(gpt, vocab_size=vocab).fingerprint, None


def _cp_group():
    from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_context_parallel_group()


def _cp_split(batch: dict, cp_group) -> dict:
    """Megatron's own load-balanced CP split of [b, s] tensors (rank r keeps chunks r and 2*CP-1-r)."""
    import inspect

    from megatron.core.utils import get_batch_on_this_cp_rank

    if "is_hybrid_cp" in inspect.signature(get_batch_on_this_cp_rank).parameters:
        return get_batch_on_this_cp_rank(dict(batch), is_hybrid_cp=False, cp_group=cp_group)
    return get_batch_on_this_cp_rank(dict(batch), cp_group=cp_group)


def score(model, tokens, targets=None, *, temperature=None, program=None, loss_mask=None, position_ids=None,
          attention_mask=None, packed_seq_params=None, vocab_size: int | None = None, tracker=None,
          with_grad: bool = False, cp_local: bool = False) -> Scores:
    """Score `targets` [b, s] (default: the next token of `tokens`, the last position unscored) after `tokens`
    [b, s] under `model` (a GPTModel, possibly wrapped in Float16Module / DDP, or `get_model`'s list).

    temperature: a number or an fp32 tensor [b, s]; program: a TransformProgram (temperature + top-k / top-p /
    min-p, as the rollout's sampler applied it; scoring only). loss_mask [b, s]: positions to score (e.g. the
    response tokens); unscored positions hold 0.0. vocab_size: the real vocabulary (default: the plugin's
    configured one; strict mode requires one). tracker: an LmHeadFingerprint, whose optimizer-step label is
    attached. with_grad: keep the autograd graph (an RL loss on `logp`); otherwise no gradient is recorded.
    Under context parallelism the tensors are full sequences (split here, results gathered) unless `cp_local`
    (then they are this rank's part, already split, e.g. THD with packed_seq_params, and so are the results)."""
    gpt = unwrap_gpt_model(model)
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise ContractInputError("score() runs one forward of a whole model; with pipeline parallelism call "
                                     "the chunks through Megatron's schedules under mp.call_settings(...)")
        model = model[0]
    if not (gpt.pre_process and gpt.post_process):
        raise ContractInputError("score() needs a model that holds both the embedding and the output layer "
                                 "(pipeline parallel size 1); under pipeline parallelism run Megatron's schedules "
                                 "with a forward_step that passes labels inside mp.call_settings(...)")
    tokens = torch.as_tensor(tokens)
    if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
        raise ContractInputError(f"tokens must be int ids [b, s]; got {tuple(tokens.shape)} {tokens.dtype}")
    b, s = tokens.shape
    if targets is None:
        if s < 2:
            raise ContractInputError(f"tokens must have s >= 2 to score next tokens; got {tuple(tokens.shape)}")
        targets = torch.zeros_like(tokens)
        targets[:, :-1] = tokens[:, 1:]
        default_mask = torch.ones(b, s, device=tokens.device)
        default_mask[:, -1] = 0
        loss_mask = default_mask if loss_mask is None else loss_mask * default_mask
    targets = torch.as_tensor(targets, device=tokens.device)
    if tuple(targets.shape) != (b, s):
        raise ContractInputError(f"targets must have the tokens' shape {(b, s)}; got {tuple(targets.shape)}")
    if loss_mask is None:
        loss_mask = torch.ones(b, s, device=tokens.device)
    loss_mask = torch.as_tensor(loss_mask, device=tokens.device).float()
    if tuple(loss_mask.shape) != (b, s):
        raise ContractInputError(f"loss_mask must have the tokens' shape {(b, s)}; got {tuple(loss_mask.shape)}")
    if position_ids is None:
        position_ids = torch.arange(s, device=tokens.device).expand(b, s).contiguous()
    program, temp = _program_and_temperature(temperature, program)
    vocab = _real_vocab(gpt, vocab_size)
    settings = LogpSettings(backend=_backend(gpt), vocab_size=vocab,
                            temperature=temp if isinstance(temp, float) else 1.0)

    batch = {"tokens": tokens, "labels": targets, "loss_mask": loss_mask, "position_ids": position_ids}
    if torch.is_tensor(temp):
        batch["temperature"] = torch.as_tensor(temp, device=tokens.device).float().expand(b, s).contiguous()
    cp_group = _cp_group()
    split = group_size(cp_group) > 1 and not cp_local
    if split:
        if packed_seq_params is not None:
            raise ContractInputError("with packed sequences (THD) under context parallelism pass this rank's "
                                     "already-split tensors with cp_local=True")
        if attention_mask is not None:
            batch["attention_mask"] = attention_mask
        batch = _cp_split(batch, cp_group)
        attention_mask = batch.pop("attention_mask", attention_mask)
    kwargs = {"labels": batch["labels"], "loss_mask": batch["loss_mask"]}
    if packed_seq_params is not None:
        kwargs["packed_seq_params"] = packed_seq_params
    install()
    temp_ctx = call_options(temperature=batch["temperature"]) if "temperature" in batch else contextlib.nullcontext()
    grad_ctx = contextlib.nullcontext() if with_grad else torch.no_grad()
    with grad_ctx, temp_ctx, call_settings(settings, program=program):
        out = model(batch["tokens"], batch["position_ids"], attention_mask, **kwargs)
    if not isinstance(out, LogpOutput):
        raise RuntimeError(f"the fused_logp plugin did not run on this forward (the model returned "
                           f"{type(out).__name__}); is it a megatron.core GPTModel?")
    logp, lse, mask, tgt = out.logp, out.lse, batch["loss_mask"], batch["labels"]
    if split:
        logp, lse = gather_context_parallel(logp, cp_group), gather_context_parallel(lse, cp_group)
        mask, tgt = loss_mask, targets
    fp, version = _fingerprint(gpt, vocab, tracker)
    return Scores(logp=logp, lse=lse, loss_mask=mask, targets=tgt, fingerprint=fp, weight_version=version,
                  provenance=out.provenance, vocab_size=vocab)


def score_hidden_states(model, hidden_states, targets, *, temperature=None, program=None,
                        vocab_size: int | None = None, tracker=None, with_grad: bool = False) -> Scores:
    """Score given final hidden states (after the final norm, bf16) against the model's lm_head: rows [N, D]
    with targets [N], or Megatron's layout [s, b, D] with targets [b, s]. Every TP rank passes the same rows
    (without sequence parallelism). E.g. a rollout's recorded hidden rows: the trainer's logp half."""
    gpt = unwrap_gpt_model(model)
    h = torch.as_tensor(hidden_states)
    t = torch.as_tensor(targets)
    flat = h.dim() == 2
    if flat:
        if t.dim() != 1 or t.shape[0] != h.shape[0]:
            raise ContractInputError(f"rows [N, D] need targets [N]; got hidden {tuple(h.shape)}, targets "
                                     f"{tuple(t.shape)}")
        h, t = h.unsqueeze(1), t.unsqueeze(0)
    elif h.dim() != 3 or tuple(t.shape) != (h.shape[1], h.shape[0]):
        raise ContractInputError(f"hidden states [s, b, D] need targets [b, s]; got hidden {tuple(h.shape)}, "
                                 f"targets {tuple(t.shape)}")
    if h.shape[-1] != gpt.config.hidden_size:
        raise ContractInputError(f"hidden states must have the model's hidden size {gpt.config.hidden_size}; "
                                 f"got {h.shape[-1]}")
    program, temp = _program_and_temperature(temperature, program)
    vocab = _real_vocab(gpt, vocab_size)
    settings = LogpSettings(backend=_backend(gpt), vocab_size=vocab,
                            temperature=temp if isinstance(temp, float) else 1.0)
    ctx = {"temperature": temp.unsqueeze(0) if flat else temp} if torch.is_tensor(temp) else settings
    layer = gpt.output_layer
    if getattr(layer, "sequence_parallel", False) and group_size(layer.tp_group) > 1:
        import copy
        layer = copy.copy(layer)                 # the rows are whole on every rank: no sequence-parallel gather
        layer.sequence_parallel = False
    w = _lm_head(gpt) if gpt.share_embeddings_and_output_weights else None
    grad_ctx = contextlib.nullcontext() if with_grad else torch.no_grad()
    with grad_ctx, call_settings(settings, program=program):
        out = logp_output_processor(hidden_states=h, output_layer=layer, output_weight=w, labels=t,
                                    loss_mask=None, context=ctx if isinstance(ctx, dict) else settings,
                                    config=gpt.config)
    logp, lse = (out.logp[0], out.lse[0]) if flat else (out.logp, out.lse)
    fp, version = _fingerprint(gpt, vocab, tracker)
    return Scores(logp=logp, lse=lse, loss_mask=torch.ones_like(logp), targets=t[0] if flat else t, fingerprint=fp,
                  weight_version=version, provenance=out.provenance, vocab_size=vocab)
