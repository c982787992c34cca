"""The Model Runner V2 sampler surface (vllm/v1/worker/gpu/sample/sampler.py, vLLM's default runner on GPU).

`add_request` records each request's transform program and request-level non-contract features, and hands vLLM
sampling params with top-k / top-p / min-p off for a program request (temperature, seed and everything else as
given). `__call__` lets vLLM sample from each program row's kept set (the wrapped `Sampler.sample` draws from a
masked copy of the head's FP32 logits, so that vLLM's raw logprobs still rank and score the full row, as its own
raw modes do), checks that every program row's token is in its set, and rescores every logprob column with the
contract op. Both known add_request shapes are handled (capability.HookShapes.mrv2_sp_index) and both logprobs
probes (`get_logprobs_dims` / `returns_logprobs`).

Per step the wrapper works on per-request flags (numpy arrays indexed by vLLM's request slot, set once in
add_request), not on per-row Python loops: a batch without program rows, flagged requests or capture builds no
per-row lists; a batch whose rows are all scored at T = 1 (vLLM's host copy of the temperatures) reads its
logprob columns from the head call's statistics.

Where vLLM's logprob module has the known shape (capability.HookShapes.mrv2_token_logprobs) and vLLM reads the
raw logits (logprobs_mode raw_logprobs), a step without program rows or flagged requests does not rescore: its
logprob columns are the contract's from the start, because vLLM's own logprob kernel (compute_token_logprobs) is
replaced for that call by the contract columns of the same ids (scoring.contract_columns). vLLM never writes the
raw logits in that mode (it computes its raw logprobs from them after sampling), so they are read without a copy.
Such a step (`plain_step`, the common decode step) does nothing else around vLLM's sampler but the capture: its rows' summary
(_Summary: flags and whether every row's scoring temperature is 1) is kept from step to step while the batch's rows
and requests stay the same, and vLLM's answer whether logprobs are returned is read from its output."""
from __future__ import annotations

import functools
import threading

import numpy as np

from .policy import request_info, transform_reasons
from .scoring import (all_unit_temperature, check_sampled, contract_columns, effective_temperature, kept_rows,
                      program_groups, rescore)
from .state import is_vllm_warmup, mark_of

_NO_EPOCH = -1
_ANY_VOCAB = 1 << 62          # is_neutral at this size: only programs without any top-k / top-p / min-p


def row_temperature(sampler, input_batch):
    """Per-row scoring temperature of an MRV2 batch (greedy rows, T = 0 in vLLM's state, at 1)."""
    t = sampler.sampling_states.temperature.gpu[input_batch.expanded_idx_mapping]
    return effective_temperature(t, t.shape[0], t.device)


def host_temperature(sampler, idx):
    """vLLM's host copy of the batch rows' sampling temperatures (its source of truth), or None."""
    t = getattr(getattr(sampler, "sampling_states", None), "temperature", None)
    t = getattr(t, "np", None)
    return None if t is None else t[idx]


class _Summary:
    """What a step needs to know of its rows' flags, found once per (rows, flags version): any row with a program
    that may not be neutral, with non-contract features, with a program at all; and the (head state, programs-RPC
    epoch) at which these rows' programs were last recorded."""
    __slots__ = ("key", "version", "nonneutral", "flagged", "program", "recorded", "unit")

    def __init__(self, key, version, flags, rows):
        self.key, self.version, self.recorded = key, version, None     # recorded: (head state, programs epoch)
        # all_unit_temperature of vLLM's host temperatures of these rows, found at the first step that needs it.
        # vLLM writes a slot's temperature in its add_request only (0.26, 0.32), which bumps the version.
        self.unit = None
        self.nonneutral = bool(flags.nonneutral[rows].any())
        self.flagged = bool(flags.flagged[rows].any())
        self.program = bool(flags.program[rows].any())


class _Flags:
    """Per request slot (vLLM's req_idx): has a program that may not be neutral, has non-contract features, has a
    program at all, and the programs-RPC epoch at which its program was last recorded. `version` counts the
    add_request calls that set flags; a step's _Summary is reused while its rows and the version stay the same
    (a decode batch keeps both from step to step)."""

    def __init__(self, size: int):
        self.size = size
        self.program = np.zeros(size, dtype=bool)
        self.nonneutral = np.zeros(size, dtype=bool)
        self.flagged = np.zeros(size, dtype=bool)
        self.epoch = np.full(size, _NO_EPOCH, dtype=np.int64)
        self.version = 0
        self._summary: _Summary | None = None

    def grown(self, req_idx: int) -> "_Flags":
        if req_idx < self.size:
            return self
        new = _Flags(max(2 * self.size, req_idx + 1))
        for name in ("program", "nonneutral", "flagged", "epoch"):
            getattr(new, name)[: self.size] = getattr(self, name)
        return new

    def set(self, req_idx: int, prog, reasons) -> None:
        self.program[req_idx] = prog is not None
        self.nonneutral[req_idx] = prog is not None and not prog.is_neutral(_ANY_VOCAB)
        self.flagged[req_idx] = bool(reasons)
        self.epoch[req_idx] = _NO_EPOCH
        self.version += 1

    def covers(self, rows) -> bool:
        return len(rows) == 0 or int(rows.max()) < self.size

    def summary(self, rows) -> _Summary | None:
        """The _Summary of these rows (vLLM's request slots, a numpy int array), or None where a row's slot was
        never added (vLLM's dummy runs)."""
        key = rows.tobytes()
        sm = self._summary
        if sm is not None and sm.version == self.version and sm.key == key:
            return sm
        if not self.covers(rows):
            return None
        sm = self._summary = _Summary(key, self.version, self, rows)
        return sm

    def to_record(self, summary, idx, req_ids, progs, st) -> tuple:
        """The (request ids, programs) of the rows `idx` (whose summary is `summary`) not yet recorded for the
        programs RPC in this epoch of head state `st`, marked as recorded: each request's program once per epoch,
        and nothing at all for a batch without any program or already recorded in this epoch."""
        if not summary.program or summary.recorded == (st, st.programs_epoch):
            return (), ()
        new = np.nonzero(self.program[idx] & (self.epoch[idx] != st.programs_epoch))[0]
        self.epoch[idx[new]] = st.programs_epoch
        summary.recorded = (st, st.programs_epoch)
        return [req_ids[r] for r in new], [progs.get(int(idx[r])) for r in new]


class _Job:
    """One sampler step whose logprob columns the contract computes in place of vLLM's kernel."""
    __slots__ = ("logits", "mark", "unit", "temperature", "scored")

    def __init__(self, logits, mark, unit, temperature):
        self.logits, self.mark, self.unit, self.temperature, self.scored = logits, mark, unit, temperature, False


_job = threading.local()
_sample_keep = threading.local()          # the kept set [N, V] bool that the wrapped Sampler.sample draws from


def install_token_logprobs() -> None:
    """Wrap logprob.compute_token_logprobs: inside a sampler step that set a _Job, the call on that step's raw
    logits returns the contract columns of the same ids; every other call is vLLM's."""
    from vllm.v1.worker.gpu.sample import logprob

    orig = logprob.compute_token_logprobs

    @functools.wraps(orig)
    def compute_token_logprobs(logits, token_ids):
        job = getattr(_job, "job", None)
        if job is None or logits is not job.logits or job.scored:
            return orig(logits, token_ids)
        new = contract_columns(logits, token_ids, job.temperature, job.mark, unit_temperature=job.unit)
        job.scored = True
        return new

    logprob.compute_token_logprobs = compute_token_logprobs


def _infos(sampler, rows):
    """Per row (vLLM's request slots): the policy.RequestInfo its request was added with, or None."""
    infos = sampler.__dict__.get("_fused_logp_info", {})
    return [infos.get(int(i)) for i in rows]


def install(shapes) -> None:
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    orig_call = Sampler.__call__
    orig_add_request = Sampler.add_request
    orig_sample = Sampler.sample

    @functools.wraps(orig_sample)
    def sample(self, logits, *args, **kwargs):
        keep = getattr(_sample_keep, "keep", None)
        if keep is not None and keep.shape == logits.shape:
            # a masked copy: vLLM's raw logprobs are read from the caller's logits after the draw
            masked = logits.masked_fill(~keep, float("-inf"))
            mark = mark_of(logits)
            if mark is not None:
                masked._fused_logp = mark
            logits = masked
        return orig_sample(self, logits, *args, **kwargs)

    def call_keeping(self, logits, keep, args, kwargs):
        """vLLM's __call__ with its draw restricted to `keep` (None: unrestricted)."""
        _sample_keep.keep = keep
        try:
            return orig_call(self, logits, *args, **kwargs)
        finally:
            _sample_keep.keep = None
    sp_index = shapes.mrv2_sp_index                       # after self: 1 (0.32) or 2 (0.26)
    if shapes.mrv2_logprobs_probe == "get_logprobs_dims":
        def wants_logprobs(sampler, idx):
            return sampler.get_logprobs_dims(idx) is not None
    else:
        def wants_logprobs(sampler, idx):
            return bool(sampler.returns_logprobs(idx))

    token_logprobs = bool(shapes.mrv2_token_logprobs)
    if token_logprobs:
        install_token_logprobs()

    def raw_mode(sampler) -> bool:
        return getattr(sampler, "logprobs_mode", None) == "raw_logprobs"

    @functools.wraps(orig_add_request)
    def add_request(self, *args, **kwargs):
        if "sampling_params" in kwargs:
            params = kwargs["sampling_params"]
        else:
            params = args[sp_index]
        req_idx = int(kwargs["req_idx"] if "req_idx" in kwargs else args[0])
        d = self.__dict__
        info = request_info(params)
        prog, reasons = info.program, list(info.reasons)
        d.setdefault("_fused_logp_info", {})[req_idx] = info
        d.setdefault("_fused_logp_programs", {})[req_idx] = prog
        d.setdefault("_fused_logp_flagged", {})[req_idx] = reasons
        flags = d.get("_fused_logp_flags") or _Flags(256)
        flags = d["_fused_logp_flags"] = flags.grown(req_idx)
        flags.set(req_idx, prog, reasons)
        if prog is not None and transform_reasons(params):
            params = params.clone()
            params.top_k, params.top_p, params.min_p = 0, 1.0, 0.0
            if "sampling_params" in kwargs:
                kwargs["sampling_params"] = params
            else:
                args = args[:sp_index] + (params,) + args[sp_index + 1:]
        return orig_add_request(self, *args, **kwargs)

    def plain_step(self, logits, input_batch, idx, mark, flags, summary, args, kwargs):
        """A step whose logprob columns are the contract's from vLLM's own compute_token_logprobs call (no program
        row, no flagged request, raw logprobs mode): no check, copy or rescoring around vLLM's sampler (with capture
        on, the scored rows are captured after it)."""
        # raw_logprobs: log softmax(z) at T = 1 whatever the rows' temperatures (vLLM's raw mode)
        job = _Job(logits, mark, True, 1.0)
        _job.job = job
        try:
            out = orig_call(self, logits, input_batch, *args, **kwargs)
        finally:
            _job.job = None
        if out.logprobs_tensors is None:
            return out
        st = mark.state
        if not job.scored or st.settings.capture:
            # capture the scored rows; and rescore logprobs that vLLM did not take from its logprob kernel on these
            # logits (in raw mode vLLM never writes the logits it is given, so they are still the head's)
            out.logprobs_tensors = rescore(out.logprobs_tensors, logits, job.temperature, mark,
                                           req_ids=list(input_batch.req_ids), unit_temperature=job.unit,
                                           record=((), ()), scored=job.scored, mode="raw_logprobs",
                                           infos=_infos(self, idx) if st.settings.capture else None)
        st.record_programs(*flags.to_record(summary, idx, input_batch.req_ids,
                                            self.__dict__.get("_fused_logp_programs", {}), st))
        return out

    @functools.wraps(orig_call)
    def __call__(self, logits, input_batch, *args, **kwargs):
        mark = mark_of(logits)
        d = self.__dict__
        idx = input_batch.idx_mapping_np
        expanded = logits.shape[0] != len(idx)
        flags = d.get("_fused_logp_flags")
        if token_logprobs and mark is not None and flags is not None and not expanded and raw_mode(self):
            summary = flags.summary(idx)
            if summary is not None and not summary.nonneutral and not summary.flagged:
                return plain_step(self, logits, input_batch, idx, mark, flags, summary, args, kwargs)
        rows = input_batch.expanded_idx_mapping.cpu().numpy() if expanded else idx
        summary = None if flags is None else flags.summary(rows)
        if summary is None:
            flags = None                                  # a slot never added (vLLM's dummy runs): no shortcuts
        capture = mark is not None and mark.state.settings.capture
        progs = d.get("_fused_logp_programs", {})
        programs = None
        if flags is None or capture or expanded or summary.nonneutral:
            programs = [progs.get(int(i)) for i in rows]
        groups = program_groups(programs, logits.shape[1])
        keep = kept_rows(logits, groups)              # on the unscaled FP32 logits
        if mark is None:
            if keep is None:
                return orig_call(self, logits, input_batch, *args, **kwargs)
            # vLLM's own head (fallback): the neutralised request still samples from its program's kept set
            out = call_keeping(self, logits, keep, (input_batch,) + args, kwargs)
            check_sampled(keep, out.sampled_token_ids, groups, None)
            return out
        any_flagged = flags is None or (summary.flagged if not expanded else bool(flags.flagged[idx].any()))
        if any_flagged:
            flagged = d.get("_fused_logp_flagged", {})
            for i, rid in zip(idx, input_batch.req_ids):
                if flagged.get(int(i)) and not is_vllm_warmup(rid):     # vLLM's warm-up exercises every feature
                    mark.state.note(flagged[int(i)])
        want = wants_logprobs(self, idx)
        job = None
        if want and token_logprobs and keep is None and not expanded and not any_flagged and raw_mode(self):
            job = _Job(logits, mark, True, 1.0)
        z = (logits if job is not None else logits.clone()) if want else None
        if job is not None:
            _job.job = job
            try:
                out = orig_call(self, logits, input_batch, *args, **kwargs)
            finally:
                _job.job = None
        else:
            out = call_keeping(self, logits, keep, (input_batch,) + args, kwargs)
        if keep is not None:
            check_sampled(keep, out.sampled_token_ids, groups, mark)
        if z is not None and out.logprobs_tensors is not None:
            req_ids = list(input_batch.req_ids)
            record = None
            if flags is not None and programs is None and not expanded:
                # each request's program once per programs-RPC epoch (not a dict lookup per row per step)
                record = flags.to_record(summary, idx, req_ids, progs, mark.state)
            mode = getattr(self, "logprobs_mode", None) or "raw_logprobs"
            unit = job.unit if job is not None else mode in ("raw_logprobs", "raw_logits") or \
                (not expanded and all_unit_temperature(host_temperature(self, idx)))
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, lambda: row_temperature(self, input_batch),
                                           mark, req_ids=req_ids, programs=programs, unit_temperature=unit,
                                           record=record, scored=job is not None and job.scored, mode=mode,
                                           infos=_infos(self, rows) if capture else None)
        return out

    Sampler.__call__ = __call__
    Sampler.add_request = add_request
    Sampler.sample = sample
