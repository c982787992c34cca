"""The training-script side: a loss function and a forward_step wrapper that work with `--logp-backend` on and off.

With the plugin on, a labelled GPTModel forward returns a `LogpOutput` (per-token logp and lse); with it off,
Megatron's per-token cross-entropy `[b, s]`. Two ways to keep one training script for both:

* `logp_forward_step(forward_step)` wraps the script's own `forward_step`: the loss function it returns (usually
  `partial(loss_func, loss_mask, model=model)`) receives the per-token loss `-logp` `[b, s]` fp32 in place of a
  `LogpOutput`, so the script's `loss_func` - its `output_tensor.view(-1)`, its NaN / Inf / spiky-loss checks -
  runs unchanged. With the plugin off nothing changes.
* `logp_loss_func(loss_mask, output_tensor, model=None)` is a loss function of pretrain_gpt's shape (the 3-tuple
  `(loss, num_tokens, {'lm loss': ...})`) with pretrain_gpt's checks through Megatron's rerun state machine, for
  either output.

The check switches follow Megatron's arguments `--check-for-nan-in-loss-and-grad` (default on) and
`--check-for-spiky-loss` (default off); `setup_from_args` copies them, `set_loss_checks` sets them directly.
"""
from __future__ import annotations

import dataclasses
import functools

import torch

from .processor import LogpOutput

SPIKY_LOSS_FACTOR = 10          # pretrain_gpt's threshold: a loss 10x the running maximum is "spiky"


@dataclasses.dataclass
class LossChecks:
    nan: bool = True            # --check-for-nan-in-loss-and-grad (Megatron's default: on)
    spiky: bool = False         # --check-for-spiky-loss


_checks = LossChecks()


def set_loss_checks(*, nan: bool | None = None, spiky: bool | None = None) -> LossChecks:
    if nan is not None:
        _checks.nan = bool(nan)
    if spiky is not None:
        _checks.spiky = bool(spiky)
    return dataclasses.replace(_checks)


def loss_checks_from_args(args) -> LossChecks:
    return set_loss_checks(nan=getattr(args, "check_for_nan_in_loss_and_grad", None),
                           spiky=getattr(args, "check_for_spiky_loss", None))


def per_token_loss(output_tensor) -> torch.Tensor:
    """The per-token loss [b, s] of either output: -logp (fp32) for a LogpOutput, the tensor itself otherwise."""
    if isinstance(output_tensor, LogpOutput):
        return output_tensor.nll()
    return output_tensor


def validate_loss(loss: torch.Tensor, checks: LossChecks | None = None) -> None:
    """pretrain_gpt's checks of a rank's local loss before the data-parallel reduction, through Megatron's rerun
    state machine: NaN and Inf fatal, a spiky loss reported (not fatal)."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    checks = checks or _checks
    machine = get_rerun_state_machine()
    if checks.nan:
        machine.validate_result(result=loss, rejection_func=torch.isnan,
                                message="found NaN in local forward loss calculation", tolerance=0.0, fatal=True)
        machine.validate_result(result=loss, rejection_func=torch.isinf,
                                message="found Inf in local forward loss calculation", tolerance=0.0, fatal=True)
    if checks.spiky:
        machine.validate_result(result=loss,
                                rejection_func=functools.partial(machine.is_unexpectedly_large,
                                                                 threshold=SPIKY_LOSS_FACTOR, context="loss"),
                                message="Spiky loss", tolerance=0.0, fatal=False)


def logp_loss_func(loss_mask, output_tensor, model=None, *, checks: LossChecks | None = None):
    """pretrain_gpt's loss function for either output (LogpOutput or Megatron's per-token loss [b, s]):
    (sum of the masked per-token loss, token count, {'lm loss': [loss, tokens]}), after the NaN / Inf /
    spiky-loss checks. `model` is accepted as pretrain_gpt passes it (`partial(loss_func, loss_mask,
    model=model)`) and not used."""
    del model
    if loss_mask is None and isinstance(output_tensor, LogpOutput):
        loss_mask = output_tensor.loss_mask
    losses = per_token_loss(output_tensor).reshape(-1).float()
    mask = torch.ones_like(losses) if loss_mask is None else loss_mask.reshape(-1).float()
    loss = torch.sum(losses * mask)
    validate_loss(loss, checks)
    num_tokens = mask.sum().clone().detach().to(torch.int)
    report = torch.cat([loss.clone().detach().view(1), num_tokens.float().view(1)])
    return loss, num_tokens, {"lm loss": report}


def logp_loss_adapter(loss_func):
    """The script's own loss function, fed the per-token loss tensor when the model returned a LogpOutput.
    Keyword arguments (`non_loss_data=True` from the schedules, ...) pass through."""
    if getattr(loss_func, "__fused_logp_adapter__", False):
        return loss_func

    @functools.wraps(loss_func)
    def adapted(output_tensor, *args, **kwargs):
        return loss_func(per_token_loss(output_tensor), *args, **kwargs)

    adapted.__fused_logp_adapter__ = True
    return adapted


def logp_forward_step(forward_step):
    """Decorator for a pretrain_gpt-shaped `forward_step(data_iterator, model, ...) -> (output, loss_func)`:
    the returned loss function sees Megatron's per-token loss tensor with the plugin on or off (so the script's
    loss_func and its checks are untouched). A forward_step whose loss function wants the LogpOutput itself
    (e.g. to use the lse) is simply left undecorated."""
    if getattr(forward_step, "__fused_logp_adapter__", False):
        return forward_step

    @functools.wraps(forward_step)
    def wrapped(*args, **kwargs):
        out = forward_step(*args, **kwargs)
        if isinstance(out, tuple) and len(out) == 2 and callable(out[1]):
            return out[0], logp_loss_adapter(out[1])
        return out

    wrapped.__fused_logp_adapter__ = True
    return wrapped
