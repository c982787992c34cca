"""The output processor: final hidden states + lm_head weight -> per-token logp and lse, without logits.

`logp_output_processor` has the keyword signature of megatron-core's `output_processor` hook (>= 0.18); the
0.16/0.17 patch of `GPTModel._postprocess` calls it with the same keywords.
"""
from __future__ import annotations

import dataclasses

import torch

from ..shared_contract.config import get_config
from ..shared_contract.errors import ContractInputError
from .grad import _op_with_grad
from .guards import UnsupportedMegatronConfigError, check_config, check_output_layer
from .parallel import gather_sequence_parallel, group_rank, group_size
from .settings import LogpSettings, active_call_settings, call_extra, call_temperature, get_settings, resolve_vocab_size


@dataclasses.dataclass
class LogpOutput:
    """Per-token results in Megatron's [b, s] layout (labels' layout). Positions with loss_mask == 0 are not
    computed and hold 0.0 in both tensors."""
    logp: torch.Tensor                  # [b, s] fp32, log p(label) under softmax(z / T) over the real vocabulary
    lse: torch.Tensor                   # [b, s] fp32, logsumexp(z / T) over the real vocabulary
    loss_mask: torch.Tensor | None      # [b, s] as given, or None (every position computed)
    provenance: object = None           # the op's Provenance (backend, contract version, ...)

    def nll(self) -> torch.Tensor:
        """Per-token loss -logp [b, s] (the shape of Megatron's compute_language_model_loss output)."""
        return -self.logp


def _settings_from_context(context) -> LogpSettings:
    if isinstance(context, LogpSettings):
        return context
    base = active_call_settings() or get_settings()
    if isinstance(context, dict):
        known = {f.name for f in dataclasses.fields(LogpSettings)}
        over = {k: v for k, v in context.items() if k in known and not hasattr(v, "shape")}
        base = dataclasses.replace(base, **over)
    return base if base.enabled else dataclasses.replace(base, backend="contract")


def _temperature_rows(settings, context, b, s, rows, device):
    t = call_temperature()
    if t is None and isinstance(context, dict) and hasattr(context.get("temperature"), "shape"):
        t = context["temperature"]
    if t is None:
        t = settings.temperature
    if hasattr(t, "shape"):
        t = torch.as_tensor(t, device=device)
        if t.dim() == 0:
            t = t.reshape(1, 1).expand(b, s)
        if tuple(t.shape) != (b, s):
            raise ContractInputError(f"a per-token temperature must have the labels' shape [b, s]={(b, s)}; "
                                     f"got {tuple(t.shape)}")
        t = t.to(torch.float32).transpose(0, 1).reshape(-1)
        return t if rows is None else t.index_select(0, rows)
    n = b * s if rows is None else rows.numel()
    return torch.full((n,), float(t), dtype=torch.float32, device=device)


def _check_targets(targets, vocab_size, padded):
    if targets.numel() == 0:
        return
    ok = (targets >= 0) & (targets < vocab_size)
    msg = (f"labels at positions with loss_mask != 0 must lie in the real vocabulary [0, {vocab_size}) "
           f"(the output layer has {padded} rows; ids >= {vocab_size} are padding)")
    if targets.device.type == "cpu":
        if not bool(ok.all()):
            raise ContractInputError(f"{msg}; got {int(targets[~ok][0])}")
    # On a device the op itself handles such a row without a host synchronisation (CONTRACT.md section 0.1): its
    # logp and lse are NaN, a device counter records it, strict mode raises at its next call and
    # fused_logp.check_input_errors() raises at once.


def logp_output_processor(*, hidden_states, output_layer, output_weight=None, labels=None, loss_mask=None,
                          context=None, config=None, **_unused) -> LogpOutput:
    """Megatron output_processor: returns LogpOutput instead of the per-token cross-entropy.

    hidden_states [s, b, h] bf16 (post final norm; [s/TP, b, h] under sequence parallelism), labels [b, s]
    (already shifted and CP-sliced), loss_mask [b, s] or None. `context` may be a LogpSettings or a dict with
    `temperature` (number or fp32 tensor [b, s]), `vocab_size`, `backend`."""
    settings = _settings_from_context(context)
    if labels is None:
        raise ContractInputError("the logp output processor needs labels (the target ids, [b, s])")
    config = config if config is not None else getattr(output_layer, "config", None)
    if config is not None:
        check_config(config)
    weight = output_weight if output_weight is not None else getattr(output_layer, "weight", None)
    check_output_layer(output_layer, weight)
    if hidden_states.dtype != torch.bfloat16:
        raise UnsupportedMegatronConfigError(f"fused_logp Megatron plugin: hidden states of dtype "
                                             f"{hidden_states.dtype} are not supported: the contract covers bf16")

    tp_group = output_layer.tp_group
    tp, rank = group_size(tp_group), group_rank(tp_group)
    v_local = weight.shape[0]
    padded = v_local * tp
    vocab_size = resolve_vocab_size(settings, padded, get_config().strict)

    if getattr(output_layer, "sequence_parallel", False) and tp > 1:
        h = gather_sequence_parallel(hidden_states, tp_group)
        reduce_hidden = False            # the gather's backward reduce-scatters the partial gradient
    else:
        h = hidden_states
        reduce_hidden = True
    s, b, d = h.shape
    if tuple(labels.shape) != (b, s):
        raise ContractInputError(f"labels must be [b, s]={(b, s)} to match hidden states [s, b, h]={tuple(h.shape)}; "
                                 f"got {tuple(labels.shape)}")
    flat_labels = labels.transpose(0, 1).reshape(-1)
    h2 = h.reshape(s * b, d)
    rows = None
    if loss_mask is not None:
        if tuple(loss_mask.shape) != (b, s):
            raise ContractInputError(f"loss_mask must be [b, s]={(b, s)}; got {tuple(loss_mask.shape)}")
        rows = torch.nonzero(loss_mask.transpose(0, 1).reshape(-1) != 0).squeeze(1)
        h2 = h2.index_select(0, rows)
        flat_labels = flat_labels.index_select(0, rows)
    targets = flat_labels.to(torch.int64)
    _check_targets(targets, vocab_size, padded)
    program = call_extra().get("program")
    if program is None and isinstance(context, dict):
        program = context.get("program")
    if program is not None and not program.is_neutral(vocab_size):
        logp, lse, prov = _program_rows(h2, weight, targets, program, rank=rank, tp=tp, tp_group=tp_group,
                                        vocab_size=vocab_size, backend=settings.op_backend())
    else:
        if program is not None:
            settings = dataclasses.replace(settings, temperature=float(program.temperature))
        temperature = _temperature_rows(settings, context if program is None else None, b, s, rows, h.device)
        logp, lse, prov = _op_with_grad(h2, weight, targets, temperature=temperature, vocab_start=rank * v_local,
                                        vocab_size=vocab_size, tp_group=tp_group if tp > 1 else None,
                                        reduce_hidden_grad=reduce_hidden, backend=settings.op_backend())
    if rows is not None:
        logp = logp.new_zeros(s * b).index_put((rows,), logp)
        lse = lse.new_zeros(s * b).index_put((rows,), lse)
    return LogpOutput(logp=logp.view(s, b).t().contiguous(), lse=lse.view(s, b).t().contiguous(),
                      loss_mask=loss_mask, provenance=prov)


def _program_rows(h2, weight, targets, program, *, rank, tp, tp_group, vocab_size, backend):
    """A sampling-transform program with a truncation (top-k / top-p / min-p): the op's program entry on the
    rows, with the full lm_head (all-gathered over TP in rank order: [V_padded, D] bf16 on every rank). Scoring
    only: no gradient flows through the kept-set selection."""
    from ..kernel.op import linear_logp_program

    if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
        raise ContractInputError("a sampling-transform program with top-k / top-p / min-p is a scoring path (no "
                                 "gradient): call it under torch.no_grad(), or train on the temperature alone")
    w = weight.detach()
    if tp > 1:
        import torch.distributed as dist
        parts = [torch.empty_like(w) for _ in range(tp)]
        dist.all_gather(parts, w.contiguous(), group=tp_group)
        w = torch.cat(parts, 0)
    if h2.shape[0] == 0:
        empty = h2.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone(), None
    res = linear_logp_program(h2.detach(), w, targets, program, vocab_size=vocab_size, backend=backend)
    return res.logp, res.lse, res.provenance
