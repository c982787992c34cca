"""Invalid per-row values on a device (CONTRACT.md section 0.1): counted on the device, never asserted there.

A call on a CUDA device does not synchronise to look at its per-row arguments: a target outside [0, vocab_size)
or a temperature outside [TEMPERATURE_MIN, TEMPERATURE_MAX] makes its row invalid (a safe value takes its place
before any launch, the row's logp and lse become NaN) and the row is counted in a device counter. Each later call
reads the counters of finished calls without waiting (strict mode raises ContractInputError naming the argument,
otherwise a warning is logged); `check_input_errors` waits and raises.

    record_for(device, strict)  the device's record, after reporting what finished calls counted
    guard(device, strict, ...)  one call's masks counted; -> the combined invalid-row mask or None
    nan_rows / nan_result       the rows of a mask set to NaN
    check_input_errors(device)  synchronise and raise for every invalid row since the last check
"""
from __future__ import annotations

import dataclasses
import logging
import math

import torch

from ..shared_contract import constants as C
from ..shared_contract.config import get_config
from ..shared_contract.errors import ContractInputError

TEMPERATURE_MIN = getattr(C, "TEMPERATURE_MIN", 2.0 ** -20)
TEMPERATURE_MAX = getattr(C, "TEMPERATURE_MAX", 2.0 ** 20)
TEMPERATURE_RANGE = (f"[2**{math.log2(TEMPERATURE_MIN):.0f}, 2**{math.log2(TEMPERATURE_MAX):.0f}] "
                     f"(about [{TEMPERATURE_MIN:.2g}, {TEMPERATURE_MAX:.2g}])")

ROW_ARGS = ("targets", "temperature")
ROW_RANGE = {"targets": "must lie in the real vocabulary [0, vocab_size) of their call",
             "temperature": f"must be finite and > 0, within {TEMPERATURE_RANGE}, as binary32"}
_records: dict = {}
_log = logging.getLogger("fused_logp")


class RowErrors:
    """Invalid rows per argument on one device since the last check: a device counter, and its snapshot copied
    to pinned host memory after each call (no synchronisation) so that a later call can read it once done."""

    # The counter lives across calls made inside and outside torch.inference_mode (vLLM serves in it, a trainer
    # does not): it is an ordinary tensor, created and updated with inference mode off.
    # Kernels that count invalid target rows themselves (the serving merge of ids) use a second record: a running
    # device total with a block ticket (`ids`, never zeroed) that each launch also stores into pinned host memory
    # (`ids_mirror`), read here without a copy or an event; `ids_seen` is the total already reported.
    def __init__(self, device):
        with torch.inference_mode(False):
            self.count = torch.zeros(len(ROW_ARGS), dtype=torch.int64, device=device)
            self.snapshot = torch.zeros(len(ROW_ARGS), dtype=torch.int64, pin_memory=True)
            self.ids = torch.zeros(2, dtype=torch.int64, device=device)
            self.ids_mirror = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self.ids_mirror_np = self.ids_mirror.numpy()       # the same host memory, read without a torch call
        self.ids_seen = 0
        self.event = None

    def record(self, masks):
        with torch.inference_mode(False), torch.no_grad():
            for i, m in enumerate(masks):
                if m is not None:
                    self.count[i].add_(m.sum())
            self.snapshot.copy_(self.count, non_blocking=True)
        self.event = torch.cuda.Event()
        self.event.record(torch.cuda.current_stream(self.count.device))

    def take(self, wait):
        """Counts recorded so far (all of them with wait=True, which synchronises; else what a finished
        snapshot and the mirror show, or nothing); the counter restarts from zero once a non-zero count is returned,
        and the running total of the ids record is reported once."""
        ids_total = int(self.ids[0]) if wait else int(self.ids_mirror_np[0])   # int(self.ids[0]) synchronises
        new_ids = max(0, ids_total - self.ids_seen)
        self.ids_seen = max(self.ids_seen, ids_total)
        if wait:
            counts = [int(c) for c in self.count.tolist()]
        elif self.event is not None and self.event.query():
            counts = [int(c) for c in self.snapshot.tolist()]
            self.event = None
        else:
            counts = [0] * len(ROW_ARGS)
        if any(counts):
            with torch.inference_mode(False):
                self.count.zero_()
        counts[0] += new_ids
        return counts if any(counts) else None


def message(counts, device) -> str:
    return "; ".join(f"{arg} {ROW_RANGE[arg]}: {k} row(s) on {device} were not since the last check (their logp "
                     f"and lse are NaN)" for arg, k in zip(ROW_ARGS, counts) if k)


def _cuda_index(device: torch.device) -> torch.device:
    return torch.device(f"cuda:{torch.cuda.current_device()}") if device.index is None else device


def check_input_errors(device=None) -> None:
    """Synchronise with `device` (default: the current CUDA device) and raise ContractInputError naming the
    argument if any call since the last check had an invalid per-row value there (section 0.1). Calls on the
    CPU refuse such values on the host, so a CPU device (or a machine without CUDA) has nothing to report."""
    if device is None:
        if not torch.cuda.is_available():
            return
        dev = torch.device(f"cuda:{torch.cuda.current_device()}")
    else:
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ContractInputError(f"device must be None, a torch.device or a device string such as 'cuda:0'; "
                                     f"got {device!r}") from exc
    if dev.type != "cuda":
        return
    if dev.index is None:
        if not torch.cuda.is_available():
            return
        dev = _cuda_index(dev)
    errs = _records.get(dev)
    counts = errs.take(wait=True) if errs is not None else None
    if counts:
        raise ContractInputError(message(counts, dev))


def record_for(device, strict) -> RowErrors:
    """The invalid-row record of `device` (a CUDA device), after reading earlier calls' finished records without
    waiting: strict mode raises ContractInputError naming the argument, otherwise a warning is logged."""
    device = _cuda_index(device)
    errs = _records.get(device)
    if errs is None:
        errs = _records[device] = RowErrors(device)
    counts = errs.take(wait=False)
    if counts:
        if get_config().strict if strict is None else strict:
            raise ContractInputError(message(counts, device))
        _log.warning("fused_logp: %s", message(counts, device))
    return errs


def guard(device, strict, bad_targets, bad_temperature):
    """Invalid-row bookkeeping of one call on a device: earlier calls' finished records are read without
    waiting (record_for), this call's masks are counted on the device. -> the combined invalid-row mask [N], or
    None (nothing to mask)."""
    present = [m for m in (bad_targets, bad_temperature) if m is not None]
    if device.type == "cpu" or not present:
        return None
    record_for(device, strict).record((bad_targets, bad_temperature))
    return present[0] if len(present) == 1 else present[0] | present[1]


def nan_rows(bad, *tensors):
    """The tensors with the rows of `bad` set to NaN (None passes through)."""
    if bad is None:
        return tensors if len(tensors) > 1 else tensors[0]
    out = tuple(None if t is None else torch.where(bad.view(-1, *([1] * (t.dim() - 1))), float("nan"), t)
                for t in tensors)
    return out if len(out) > 1 else out[0]


def nan_result(bad, res):
    """A result (LogpResult) with the logp and lse of the rows of `bad` set to NaN."""
    if bad is None:
        return res
    logp, lse = nan_rows(bad, res.logp, res.lse)
    return dataclasses.replace(res, logp=logp, lse=lse)
