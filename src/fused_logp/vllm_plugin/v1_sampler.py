"""The V1 sampler surface (vllm/v1/sample/sampler.py: CPU and the classic GPU runner, VLLM_USE_V2_MODEL_RUNNER=0).

After vLLM samples, every logprob column (sampled token in column 0, top-k or requested ids after it) is replaced
by the contract logp of that id at the row's scoring temperature, computed from the head's FP32 logits. V1 divides
FP32 logits by T in place, so they are cloned first. A request with a transform program is sampled from its kept
set: vLLM's top-k / top-p / min-p are turned off for that row and every logit outside the set is -inf before
vLLM's greedy / temperature / draw (Sampler.sample). The runner's `_sample` wrapper publishes the batch's rows
(state.RowBatch: request ids, programs, vLLM's host copy of the rows' temperatures).

Per step the wrappers do no per-row Python work while the batch is unchanged: the RowBatch (programs, program
groups) is built when the request ids in row order change, the programs are recorded for the programs RPC once per
RPC drain, whether every row is scored at T = 1 and the rows' scoring temperatures are decided once per distinct
host temperature values, and vLLM's min-p tensor is not read when every row has a program (the wrapper has
neutralised it)."""
from __future__ import annotations

import dataclasses
import functools

import torch

from .policy import request_info
from .scoring import (all_unit_temperature, check_sampled, effective_temperature, host_scoring_temperature, kept_rows,
                      program_groups, rescore)
from .state import ROW_BATCH, SAMPLE_KEEP, RowBatch, mark_of


_MIN_P_CLASS = []                     # vLLM's MinPLogitsProcessor class, imported once


def _min_p(md):
    if not _MIN_P_CLASS:
        from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor
        _MIN_P_CLASS.append(MinPLogitsProcessor)
    cls = _MIN_P_CLASS[0]
    for proc in md.logitsprocs.argmax_invariant:
        if isinstance(proc, cls):
            return proc
    return None


def non_contract_flags(md, all_programs: bool = False) -> list[str]:
    """What vLLM will apply to this batch that the contract does not replay. all_programs: every row of the batch
    has a transform program and `md` is neutralised for its program rows, so vLLM's min-p is 0 on every row (a row
    with a program has min-p only if its program does, which makes it a program row) and its per-row tensor is not
    read (a reduction and, on a GPU, a synchronisation per step)."""
    r = []
    if not md.all_greedy and (md.top_k is not None or md.top_p is not None):
        r.append("top-k/top-p")
    if not md.all_greedy and not all_programs:
        mp = _min_p(md)
        if mp is not None and mp.min_p_count and bool((mp.min_p != 0).any()):
            r.append("min-p")
    if not md.no_penalties:
        r.append("penalties")
    if md.bad_words_token_ids:
        r.append("bad_words")
    if md.allowed_token_ids_mask is not None:
        r.append("allowed_token_ids")
    return r


def neutralise(md, groups: dict, vocab: int):
    """SamplingMetadata with vLLM's top-k / top-p off for the program rows (other rows keep theirs), and the
    min-p processor's per-row tensor with those rows at 0; returns (metadata, restore)."""
    rows = sorted(r for rs in groups.values() for r in rs)
    top_k, top_p = md.top_k, md.top_p
    if top_k is not None:
        idx = torch.tensor(rows, dtype=torch.int64, device=top_k.device)
        top_k = top_k.clone().index_fill_(0, idx, vocab)
        top_k = None if bool((top_k >= vocab).all()) else top_k
    if top_p is not None:
        idx = torch.tensor(rows, dtype=torch.int64, device=top_p.device)
        top_p = top_p.clone().index_fill_(0, idx, 1.0)
        top_p = None if bool((top_p >= 1.0).all()) else top_p
    mp = _min_p(md)
    restore = None
    if mp is not None and mp.min_p_count and mp.min_p.shape[0] > max(rows):
        saved = mp.min_p
        idx = torch.tensor(rows, dtype=torch.int64, device=saved.device)
        mp.min_p = saved.clone().index_fill_(0, idx, 0.0)

        def put_back():
            mp.min_p = saved
        restore = put_back
    return dataclasses.replace(md, top_k=top_k, top_p=top_p), restore


def _logprobs_mode(sampler, args, kwargs):
    """The logprobs mode of this Sampler.forward call (its logprobs_mode_override, else the sampler's)."""
    override = kwargs.get("logprobs_mode_override", args[1] if len(args) > 1 else None)
    return override or getattr(sampler, "logprobs_mode", None) or "raw_logprobs"


def install_sampler(shapes=None) -> None:
    from vllm.v1.sample import sampler as sampler_module
    from vllm.v1.sample.sampler import Sampler

    orig_forward = Sampler.forward
    orig_sample = Sampler.sample
    if shapes is not None and shapes.v1_fused_raw_sample:
        # vLLM 0.33: Sampler.forward may sample from the raw logits in one fused kernel (mixed_sample_eligible,
        # ROCm gfx1250 only), skipping Sampler.sample: never for a batch with a kept set to sample from
        orig_eligible = sampler_module.mixed_sample_eligible

        @functools.wraps(orig_eligible)
        def mixed_sample_eligible(sampling_metadata, *args, **kwargs):
            if SAMPLE_KEEP.get() is not None:
                return False
            return orig_eligible(sampling_metadata, *args, **kwargs)

        sampler_module.mixed_sample_eligible = mixed_sample_eligible

    @functools.wraps(orig_forward)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        mark = mark_of(logits)
        if mark is None:
            return orig_forward(self, logits, sampling_metadata, *args, **kwargs)
        md = sampling_metadata
        rb = ROW_BATCH.get()                          # None: vLLM's dummy sampler run at start-up
        n, vocab = logits.shape
        programs = None if rb is None else rb.programs
        groups = {} if programs is None else rb.groups(vocab, program_groups)
        if programs is not None and len(programs) != n:
            if groups:
                raise RuntimeError(f"fused_logp: {n} sampler rows for {len(programs)} requests; "
                                   f"transform programs cannot be mapped to rows")
            programs = None
        keep = kept_rows(logits, groups)              # on the unscaled FP32 logits, before vLLM touches them
        restore = None
        if keep is not None:
            md, restore = neutralise(md, groups, vocab)
        if rb is not None:
            mark.state.note(non_contract_flags(md, all_programs=programs is not None and rb.all_programs))
            if rb.reasons:
                mark.state.note(rb.reasons)
        want = md.max_num_logprobs is not None or bool(md.logprob_token_ids)
        z = logits.clone() if want else None          # the sampler divides FP32 logits by T in place
        token = SAMPLE_KEEP.set(keep)
        try:
            out = orig_forward(self, logits, md, *args, **kwargs)
        finally:
            SAMPLE_KEEP.reset(token)
            if restore is not None:
                restore()
        if keep is not None:
            check_sampled(keep, out.sampled_token_ids[:, 0], groups, mark)
        if want and out.logprobs_tensors is not None:
            host_t = None if rb is None else rb.host_temperature
            if host_t is not None and len(host_t) == n:
                unit = bool(md.all_greedy) or all_unit_temperature(host_t)
                # md.temperature is vLLM's copy of these host values (InputBatch._make_sampling_metadata)
                temperature = functools.partial(host_scoring_temperature, host_t, z.device)
            else:
                unit = bool(md.all_greedy)
                temperature = functools.partial(effective_temperature, md.temperature, n, z.device)
            st = mark.state
            record = None if programs is None else rb.to_record(st)
            infos = None if rb is None or rb.infos is None or len(rb.infos) != n else rb.infos
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, temperature,
                                           mark, req_ids=None if rb is None else rb.req_ids, programs=programs,
                                           unit_temperature=unit, record=record, groups=groups,
                                           mode=_logprobs_mode(self, args, kwargs), infos=infos)
            if record is not None:
                rb.mark_recorded(st)
        return out

    @functools.wraps(orig_sample)
    def sample(self, logits, sampling_metadata, *args, **kwargs):
        keep = SAMPLE_KEEP.get()
        if keep is not None and keep.shape == logits.shape:
            # after vLLM's raw logprobs (its top-k columns rank the full row), before greedy/temperature/draw
            logits = logits.masked_fill_(~keep, float("-inf"))
        return orig_sample(self, logits, sampling_metadata, *args, **kwargs)

    Sampler.forward = forward
    Sampler.sample = sample


_UNSET = object()


def info_of(req):
    """A request's policy.RequestInfo (transform program, effective sampling, column counts), computed once per
    request (kept on vLLM's request state); None for a request state without sampling parameters."""
    if req is None or getattr(req, "sampling_params", None) is None:
        return None
    info = getattr(req, "_fused_logp_info", _UNSET)
    if info is _UNSET:
        info = request_info(req.sampling_params)
        try:
            req._fused_logp_info = info
        except AttributeError:            # a request state that takes no attributes: compute every step
            pass
    return info


def _program_of(req):
    info = info_of(req)
    return None if info is None else info.program


def install_runner() -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_sample = GPUModelRunner._sample

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        if mark_of(logits) is None:
            return orig_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        ib = self.input_batch
        req_ids = ib.req_ids
        with_programs = spec_decode_metadata is None
        rb = self.__dict__.get("_fused_logp_rows")
        if rb is None or not rb.same_rows(req_ids, with_programs):     # the batch changed: once per composition
            req_ids = list(req_ids)
            infos = [info_of(self.requests.get(r)) for r in req_ids]
            rb = self.__dict__["_fused_logp_rows"] = RowBatch(
                req_ids, [None if i is None else i.program for i in infos] if with_programs else None, infos)
        # vLLM's host copy of the rows' sampling temperatures (its source of truth for the batch)
        host_t = getattr(ib, "temperature_cpu", None)
        rb.host_temperature = None if host_t is None or not with_programs else host_t[: len(rb.req_ids)]
        token = ROW_BATCH.set(rb)
        try:
            return orig_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
            ROW_BATCH.reset(token)
            rb.host_temperature = None

    GPUModelRunner._sample = _sample
