"""Class-level wrappers on vLLM 0.32, installed once per process. Each keeps the original and is a no-op for
logits that do not carry the processor's mark (plugin off).

- V1 sampler (vllm/v1/sample/sampler.py, CPU and the classic GPU runner) and Model Runner V2 sampler
  (vllm/v1/worker/gpu/sample/sampler.py): after vLLM samples, every logprob column (sampled token in column 0,
  top-k or requested ids after it) is replaced by the contract logp of that id at the row's temperature,
  computed from the processor's FP32 logits. V1 divides FP32 logits by T in place, so they are cloned first.
  Rewriting every column also defeats vLLM's id->logprob dict, where a top-k column overwrites the sampled id.
- Sampling-transform programs (CONTRACT.md section 13): a request with top-k / top-p / min-p is sampled from
  exactly its program's kept set (kept_mask on the op's unscaled FP32 logits; every other logit -inf), with
  vLLM's own top-k / top-p / min-p neutralised for that row and vLLM's temperature and random draw kept. Its
  logprob columns are the program's logp (-inf for an id outside the kept set); the sampled id is checked to
  be inside.
- Prompt logprobs: V1 `_get_prompt_logprobs_dict` and MRV2 `PromptLogprobsWorker.compute_prompt_logprobs`.
  A prompt row uses its request's temperature and program, like the sampled rows (greedy: T = 1).
- Request admission (InputProcessor._validate_params): strict mode refuses non-contract sampling parameters.
- Worker RPCs `fused_logp_status` / `fused_logp_captured`, and fingerprint refresh after vLLM's weight-update paths.
"""
from __future__ import annotations

import contextvars
import dataclasses
import functools
import logging
import os

import torch

from .. import logp_from_logits
from ..kernel.transforms import kept_mask, program_logp_from_logits
from ..shared_contract.constants import TRANSFORM_PROGRAM_VERSION
from .logits_processor import PROMPT_CTX, FusedLogpLogitsProcessor, Mark, refresh_fingerprint
from .policy import (StrictRequestError, refuse_or_warn, request_reasons, request_temperature, transform_program,
                     transform_reasons)
from .settings import settings_from_vllm_config

log = logging.getLogger("fused_logp.vllm")

_SAMPLING_EPS = 1e-5                  # vLLM: a temperature below this is greedy
ROW_REQS: contextvars.ContextVar = contextvars.ContextVar("fused_logp_rows", default=None)
ROW_PROGRAMS: contextvars.ContextVar = contextvars.ContextVar("fused_logp_programs", default=None)
_SAMPLE_KEEP: contextvars.ContextVar = contextvars.ContextVar("fused_logp_keep", default=None)
_installed = False


def effective_temperature(temp, n: int, device) -> torch.Tensor:
    """Per-row FP32 temperature [n]: vLLM's (None when all greedy), greedy rows (T < 1e-5) scored at T = 1."""
    if temp is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    t = temp.to(device=device, dtype=torch.float32)
    return torch.where(t < _SAMPLING_EPS, torch.ones_like(t), t)


def program_groups(programs, vocab: int) -> dict:
    """{program: [row, ...]} for the rows whose program is not neutral over `vocab` tokens."""
    groups: dict = {}
    for r, prog in enumerate(programs or ()):
        if prog is not None and not prog.is_neutral(vocab):
            groups.setdefault(prog, []).append(r)
    return groups


def kept_rows(z: torch.Tensor, groups: dict) -> torch.Tensor | None:
    """[N, V] bool: each program row's kept set (kept_mask on the unscaled FP32 logits z), True on other rows;
    None without program rows."""
    if not groups:
        return None
    keep = torch.ones(z.shape, dtype=torch.bool, device=z.device)
    for prog, rows in groups.items():
        idx = torch.tensor(rows, dtype=torch.int64, device=z.device)
        keep[idx] = kept_mask(z.index_select(0, idx), prog)
    return keep


def check_sampled(keep: torch.Tensor, sampled: torch.Tensor, groups: dict, mark) -> None:
    """Every program row's sampled id lies in its kept set."""
    rows = sorted(r for rs in groups.values() for r in rs)
    idx = torch.tensor(rows, dtype=torch.int64, device=keep.device)
    s = sampled.reshape(-1).to(device=keep.device, dtype=torch.int64).index_select(0, idx)
    ok = keep.index_select(0, idx).gather(1, s[:, None])[:, 0]
    if not bool(ok.all()):
        bad = rows[int((~ok).nonzero()[0])]
        raise RuntimeError(f"fused_logp: row {bad} sampled token {int(sampled.reshape(-1)[bad])} outside its "
                           f"transform program's kept set")
    if mark is not None:
        mark.state.rows_program += len(rows)


def rescore(lt, z: torch.Tensor, temperature: torch.Tensor, mark: Mark, *, req_ids=None, kind="sample",
            programs=None):
    """LogprobsTensors with every column replaced by the contract logp of its id (padding columns, -inf in
    vLLM's output, stay -inf). z [N, V] fp32 unscaled; temperature [N] fp32. A row whose program (programs[r])
    is not neutral gets the program's logp instead, -inf for an id outside its kept set."""
    st = mark.state
    if lt is None:
        return lt
    ids = lt.logprob_token_ids
    if ids.numel() == 0 or ids.shape[1] > z.shape[1]:
        st.note(["full-vocabulary logprobs (-1) are vLLM's"])
        return lt
    old = lt.logprobs
    ids64 = ids.to(device=z.device, dtype=torch.int64)
    new = logp_from_logits(z, ids64, temperature=temperature, vocab_size=z.shape[1],
                           backend=st.settings.backend, strict=st.settings.strict).logp
    for prog, rows in program_groups(programs, z.shape[1]).items():
        idx = torch.tensor(rows, dtype=torch.int64, device=z.device)
        lp, _, kept = program_logp_from_logits(z.index_select(0, idx), ids64.index_select(0, idx), prog,
                                               vocab_size=z.shape[1], require_kept=False)
        new[idx] = torch.where(kept, lp, torch.full_like(lp, float("-inf"))).to(new.device)
    new = new.to(old.device)
    new = torch.where(torch.isneginf(old), old, new)
    st.rows_rescored += int(new.shape[0])
    if programs is not None and req_ids is not None:
        st.record_programs(req_ids, programs)
    if st.settings.capture and mark.hidden is not None:
        _capture(st, mark.hidden, temperature, ids64, new, req_ids, kind, programs)
    return lt._replace(logprobs=new)


def _capture(st, hidden, temperature, ids, logp, req_ids, kind, programs=None):
    h = hidden.detach().cpu()
    t, i, lp = temperature.cpu().tolist(), ids.cpu().tolist(), logp.cpu().tolist()
    for r in range(len(i)):
        prog = None if programs is None or programs[r] is None else programs[r].to_dict()
        st.captured.append({
            "kind": kind, "req_id": None if req_ids is None else req_ids[r],
            "hidden": h[r].contiguous().view(torch.int16).tolist(),      # bf16 bit patterns
            "temperature": t[r], "ids": i[r], "logprobs": lp[r],
            "program": prog,                      # TransformProgram.to_dict(), None: vLLM's own sampling
        })


# -------------------------------------------------------------------------------------------------------
# V1
# -------------------------------------------------------------------------------------------------------

def _v1_min_p(md):
    from vllm.v1.sample.logits_processor.builtin import MinPLogitsProcessor

    for proc in md.logitsprocs.argmax_invariant:
        if isinstance(proc, MinPLogitsProcessor):
            return proc
    return None


def _v1_flags(md) -> list[str]:
    r = []
    if not md.all_greedy and (md.top_k is not None or md.top_p is not None):
        r.append("top-k/top-p")
    mp = _v1_min_p(md)
    if not md.all_greedy and mp is not None and mp.min_p_count and bool((mp.min_p != 0).any()):
        r.append("min-p")
    if not md.no_penalties:
        r.append("penalties")
    if md.bad_words_token_ids:
        r.append("bad_words")
    if md.allowed_token_ids_mask is not None:
        r.append("allowed_token_ids")
    return r


def _v1_neutralise(md, groups: dict, vocab: int):
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
    mp = _v1_min_p(md)
    restore = None
    if mp is not None and mp.min_p_count and mp.min_p.shape[0] > max(rows):
        saved = mp.min_p
        idx = torch.tensor(rows, dtype=torch.int64, device=saved.device)
        mp.min_p = saved.clone().index_fill_(0, idx, 0.0)

        def put_back():
            mp.min_p = saved
        restore = put_back
    return dataclasses.replace(md, top_k=top_k, top_p=top_p), restore


def _wrap_v1_sampler():
    from vllm.v1.sample.sampler import Sampler

    orig_forward = Sampler.forward
    orig_gather = Sampler.gather_logprobs
    orig_sample = Sampler.sample

    @functools.wraps(orig_forward)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        mark = getattr(logits, "_fused_logp", None)
        if mark is None:
            return orig_forward(self, logits, sampling_metadata, *args, **kwargs)
        md = sampling_metadata
        programs = ROW_PROGRAMS.get()
        if programs is not None and len(programs) != logits.shape[0]:
            if program_groups(programs, logits.shape[1]):
                raise RuntimeError(f"fused_logp: {logits.shape[0]} sampler rows for {len(programs)} requests; "
                                   f"transform programs cannot be mapped to rows")
            programs = None
        groups = program_groups(programs, logits.shape[1])
        keep = kept_rows(logits, groups)              # on the unscaled FP32 logits, before vLLM touches them
        restore = None
        if keep is not None:
            md, restore = _v1_neutralise(md, groups, logits.shape[1])
        mark.state.note(_v1_flags(md))
        want = md.max_num_logprobs is not None or bool(md.logprob_token_ids)
        z = logits.clone() if want else None          # the sampler divides FP32 logits by T in place
        token = _SAMPLE_KEEP.set(keep)
        try:
            out = orig_forward(self, logits, md, *args, **kwargs)
        finally:
            _SAMPLE_KEEP.reset(token)
            if restore is not None:
                restore()
        if keep is not None:
            check_sampled(keep, out.sampled_token_ids[:, 0], groups, mark)
        if want and out.logprobs_tensors is not None:
            t = effective_temperature(md.temperature, z.shape[0], z.device)
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, t, mark, req_ids=ROW_REQS.get(),
                                           programs=programs)
        return out

    @functools.wraps(orig_sample)
    def sample(self, logits, sampling_metadata, *args, **kwargs):
        keep = _SAMPLE_KEEP.get()
        if keep is not None and keep.shape == logits.shape:
            # after vLLM's raw logprobs (its top-k columns rank the full row), before greedy/temperature/draw
            logits = logits.masked_fill_(~keep, float("-inf"))
        return orig_sample(self, logits, sampling_metadata, *args, **kwargs)

    @functools.wraps(orig_gather)
    def gather_logprobs(logprobs, num_logprobs, token_ids):
        lt = orig_gather(logprobs, num_logprobs, token_ids)
        ctx = PROMPT_CTX.get()
        if ctx is None or ctx.last_logits is None:
            return lt
        z, ctx.last_logits = ctx.last_logits, None
        mark = getattr(z, "_fused_logp", None)
        if mark is None or not ctx.queue:
            return lt
        req_id, temp, n, prog = ctx.queue.pop(0)
        if n != z.shape[0]:
            raise RuntimeError(f"fused_logp: prompt logprob rows out of step for request {req_id} "
                               f"({z.shape[0]} rows, expected {n})")
        t = torch.full((n,), temp, dtype=torch.float32, device=z.device)
        return rescore(lt, z, t, mark, req_ids=[req_id] * n, kind="prompt", programs=[prog] * n)

    Sampler.forward = forward
    Sampler.sample = sample
    Sampler.gather_logprobs = staticmethod(gather_logprobs)


@dataclasses.dataclass
class _PromptCtx:
    queue: list                     # [(req_id, temperature, rows, program)] in the order vLLM scores them
    last_logits: object = None
    rows: list | None = None        # MRV2: per-row temperature, request id and program
    req_rows: list | None = None
    prog_rows: list | None = None
    offset: int = 0


_req_temperature = request_temperature


def _wrap_v1_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_sample = GPUModelRunner._sample
    orig_prompt = GPUModelRunner._get_prompt_logprobs_dict

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        req_ids = list(self.input_batch.req_ids)
        programs = [None if self.requests.get(r) is None else transform_program(self.requests[r].sampling_params)
                    for r in req_ids]
        token = ROW_REQS.set(req_ids)
        ptoken = ROW_PROGRAMS.set(None if spec_decode_metadata is not None else programs)
        try:
            return orig_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
            ROW_PROGRAMS.reset(ptoken)
            ROW_REQS.reset(token)

    @functools.wraps(orig_prompt)
    def _get_prompt_logprobs_dict(self, hidden_states, num_scheduled_tokens, *args, **kwargs):
        queue = []
        for req_id in (self.num_prompt_logprobs or {}):
            num_tokens = num_scheduled_tokens.get(req_id)
            req = self.requests.get(req_id)
            if num_tokens is None or req is None or req.prompt_token_ids is None:
                continue
            remaining = len(req.prompt_token_ids) - (req.num_computed_tokens + 1)
            n = num_tokens if num_tokens <= remaining else remaining
            if n > 0:
                queue.append((req_id, _req_temperature(req.sampling_params), n,
                              transform_program(req.sampling_params)))
        token = PROMPT_CTX.set(_PromptCtx(queue))
        try:
            return orig_prompt(self, hidden_states, num_scheduled_tokens, *args, **kwargs)
        finally:
            PROMPT_CTX.reset(token)

    GPUModelRunner._sample = _sample
    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict


# -------------------------------------------------------------------------------------------------------
# Model Runner V2 (GPU default)
# -------------------------------------------------------------------------------------------------------

def mrv2_row_temperature(sampler, input_batch) -> torch.Tensor:
    """Per-row temperature of an MRV2 batch, greedy rows (T = 0) at 1."""
    t = sampler.sampling_states.temperature.gpu[input_batch.expanded_idx_mapping]
    return effective_temperature(t, t.shape[0], t.device)


def _wrap_mrv2():
    from vllm.v1.worker.gpu.sample import prompt_logprob as pl
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    orig_call = Sampler.__call__
    orig_add_request = Sampler.add_request

    @functools.wraps(orig_add_request)
    def sampler_add_request(self, req_idx, sampling_params, *args, **kwargs):
        # A request with a transform program: vLLM's sampling states get top-k / top-p / min-p off (temperature,
        # seed and everything else as given); __call__ masks the logits to the program's kept set instead.
        progs = self.__dict__.setdefault("_fused_logp_programs", {})
        prog = transform_program(sampling_params)
        progs[req_idx] = prog
        if prog is not None and transform_reasons(sampling_params):
            sampling_params = sampling_params.clone()
            sampling_params.top_k, sampling_params.top_p, sampling_params.min_p = 0, 1.0, 0.0
        return orig_add_request(self, req_idx, sampling_params, *args, **kwargs)

    @functools.wraps(orig_call)
    def __call__(self, logits, input_batch, *args, **kwargs):
        mark = getattr(logits, "_fused_logp", None)
        idx = input_batch.idx_mapping_np
        progs = self.__dict__.get("_fused_logp_programs", {})
        rows = idx if logits.shape[0] == len(idx) else input_batch.expanded_idx_mapping.cpu().numpy()
        programs = [progs.get(int(i)) for i in rows]
        groups = program_groups(programs, logits.shape[1])
        keep = kept_rows(logits, groups)              # on the unscaled FP32 logits
        if mark is None:
            if keep is None:
                return orig_call(self, logits, input_batch, *args, **kwargs)
            # vLLM's own head (fallback): the neutralised request still samples from its program's kept set
            out = orig_call(self, logits.masked_fill(~keep, float("-inf")), input_batch, *args, **kwargs)
            check_sampled(keep, out.sampled_token_ids, groups, None)
            return out
        import numpy as np
        if np.any(self.needs_logits_processing[idx]):
            mark.state.note(["logits processing (bias/penalties/bad words/min-p/temperature)"])
        top_k, top_p = self.sampling_states.get_top_k_top_p(input_batch.expanded_idx_mapping, idx)
        if top_k is not None or top_p is not None:
            mark.state.note(["top-k/top-p"])
        z = logits.clone() if self.get_logprobs_dims(idx) is not None else None
        masked = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        if keep is not None:
            masked._fused_logp = mark
        out = orig_call(self, masked, input_batch, *args, **kwargs)
        if keep is not None:
            check_sampled(keep, out.sampled_token_ids, groups, mark)
        if z is not None and out.logprobs_tensors is not None:
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, mrv2_row_temperature(self, input_batch),
                                           mark, req_ids=list(input_batch.req_ids), programs=programs)
        return out

    Sampler.__call__ = __call__
    Sampler.add_request = sampler_add_request

    W = pl.PromptLogprobsWorker
    orig_add, orig_compute = W.add_request, W.compute_prompt_logprobs
    orig_topk = pl.compute_topk_scores

    @functools.wraps(orig_add)
    def add_request(self, req_id, req_idx, sampling_params, *args, **kwargs):
        temps = self.__dict__.setdefault("_fused_logp_temperature", {})
        temps[req_idx] = _req_temperature(sampling_params)
        self.__dict__.setdefault("_fused_logp_programs", {})[req_idx] = transform_program(sampling_params)
        return orig_add(self, req_id, req_idx, sampling_params, *args, **kwargs)

    @functools.wraps(orig_compute)
    def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch, *args, **kwargs):
        temps = self.__dict__.get("_fused_logp_temperature", {})
        progs = self.__dict__.get("_fused_logp_programs", {})
        qsl = input_batch.query_start_loc_np
        rows, req_rows, prog_rows = [], [], []
        for i, req_id in enumerate(input_batch.req_ids):
            n = int(qsl[i + 1] - qsl[i])
            req_idx = int(input_batch.idx_mapping_np[i])
            rows += [temps.get(req_idx, 1.0)] * n
            req_rows += [req_id] * n
            prog_rows += [progs.get(req_idx)] * n
        token = PROMPT_CTX.set(_PromptCtx([], rows=rows, req_rows=req_rows, prog_rows=prog_rows))
        try:
            return orig_compute(self, logits_fn, hidden_states, input_batch, *args, **kwargs)
        finally:
            PROMPT_CTX.reset(token)

    @functools.wraps(orig_topk)
    def compute_topk_scores(logits, *args, **kwargs):
        lt = orig_topk(logits, *args, **kwargs)
        ctx = PROMPT_CTX.get()
        mark = getattr(logits, "_fused_logp", None)
        if ctx is None or ctx.rows is None or mark is None:
            return lt
        n, o = logits.shape[0], ctx.offset
        ctx.offset += n
        t = torch.tensor(ctx.rows[o:o + n], dtype=torch.float32, device=logits.device)
        return rescore(lt, logits, t, mark, req_ids=ctx.req_rows[o:o + n], kind="prompt",
                       programs=ctx.prog_rows[o:o + n])

    W.add_request = add_request
    W.compute_prompt_logprobs = compute_prompt_logprobs
    pl.compute_topk_scores = compute_topk_scores


# -------------------------------------------------------------------------------------------------------
# admission, RPCs, weight updates
# -------------------------------------------------------------------------------------------------------

def _wrap_input_processor():
    from vllm.sampling_params import SamplingParams
    from vllm.v1.engine.input_processor import InputProcessor

    orig = InputProcessor._validate_params

    @functools.wraps(orig)
    def _validate_params(self, params, *args, **kwargs):
        out = orig(self, params, *args, **kwargs)
        if isinstance(params, SamplingParams):
            settings = settings_from_vllm_config(self.vllm_config)
            if settings is not None:
                refuse_or_warn(request_reasons(params), strict=settings.strict, where="the request",
                               error=StrictRequestError)
        return out

    InputProcessor._validate_params = _validate_params


def _heads(worker):
    import weakref

    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    heads = [m._fl_state for m in model.modules()
             if isinstance(m, FusedLogpLogitsProcessor) and m._fl_state is not None]
    lm_head = getattr(model, "lm_head", None)
    for st in heads:                  # before the first forward: the model's own lm_head
        if st.lm_head is None and isinstance(lm_head, VocabParallelEmbedding):
            st.lm_head = weakref.ref(lm_head)
    return heads


def fused_logp_status(self) -> dict:
    """RPC: whether the op serves this worker's lm_head, its provenance, and the lm_head fingerprint (recomputed
    from the bytes now) with its weight version."""
    heads = _heads(self)
    out = {"active": bool(heads), "pid": os.getpid(), "rank": getattr(self, "rank", None), "heads": []}
    for st in heads:
        refresh_fingerprint(st)
        out["heads"].append({
            "strict": st.settings.strict, "backend": st.settings.backend, "provenance": st.provenance,
            "fallback": st.fallback, "non_contract": sorted(st.notes), "op_calls": st.op_calls,
            "rows_rescored": st.rows_rescored, "rows_program": st.rows_program,
            "transform_program_version": TRANSFORM_PROGRAM_VERSION, "fingerprint": st.fingerprint,
            "weight_version": f"{st.weight_version}:{st.fingerprint}",
        })
    return out


def fused_logp_captured(self, clear: bool = True) -> list:
    """RPC: rows captured since the last call (settings `capture: true`)."""
    rows = []
    for st in _heads(self):
        rows += st.captured
        if clear:
            st.captured = []
    return rows


def fused_logp_programs(self, clear: bool = True) -> dict:
    """RPC: {vLLM request id: TransformProgram.to_dict()} of the requests scored since the last call (the
    program each one's logprobs were recorded under; the newest 65536 are kept)."""
    out = {}
    for st in _heads(self):
        out.update(st.programs)
        if clear:
            st.programs = {}
    return out


def _wrap_worker():
    from vllm.v1.worker.gpu_worker import Worker

    for name in ("reload_weights", "update_weights", "finish_weight_update"):
        orig = getattr(Worker, name, None)
        if orig is None:
            continue

        def make(orig):
            @functools.wraps(orig)
            def wrapped(self, *args, **kwargs):
                out = orig(self, *args, **kwargs)
                for st in _heads(self):
                    refresh_fingerprint(st)
                return out
            return wrapped
        setattr(Worker, name, make(orig))


def install_frontend() -> None:
    """Admission check and worker RPCs: installed by register() in every process, active or not."""
    from vllm.v1.worker.worker_base import WorkerBase

    _wrap_input_processor()
    WorkerBase.fused_logp_status = fused_logp_status
    WorkerBase.fused_logp_captured = fused_logp_captured
    WorkerBase.fused_logp_programs = fused_logp_programs


def install() -> None:
    """Install the engine-side wrappers (idempotent; needs vLLM's worker modules importable)."""
    global _installed
    if _installed:
        return
    _wrap_v1_sampler()
    _wrap_v1_runner()
    _wrap_worker()
    try:
        _wrap_mrv2()
    except ImportError as e:           # MRV2 needs modules this vLLM build may lack
        log.warning("fused_logp: Model Runner V2 sampler not wrapped (%s)", e)
    _installed = True
