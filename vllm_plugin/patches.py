"""Class-level wrappers on vLLM 0.32, installed once per process. Each keeps the original and is a no-op for
logits that do not carry the processor's mark (plugin off).

- V1 sampler (vllm/v1/sample/sampler.py, CPU and the classic GPU runner) and Model Runner V2 sampler
  (vllm/v1/worker/gpu/sample/sampler.py): after vLLM samples, every logprob column (sampled token in column 0,
  top-k or requested ids after it) is replaced by the contract logp of that id at the row's temperature,
  computed from the processor's FP32 logits. V1 divides FP32 logits by T in place, so they are cloned first.
  Rewriting every column also defeats vLLM's id->logprob dict, where a top-k column overwrites the sampled id.
- Prompt logprobs: V1 `_get_prompt_logprobs_dict` and MRV2 `PromptLogprobsWorker.compute_prompt_logprobs`.
  A prompt row uses its request's temperature, like the sampled rows (greedy: T = 1).
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
from .logits_processor import PROMPT_CTX, FusedLogpLogitsProcessor, Mark, refresh_fingerprint
from .policy import StrictRequestError, refuse_or_warn, request_reasons
from .settings import settings_from_vllm_config

log = logging.getLogger("fused_logp.vllm")

_SAMPLING_EPS = 1e-5                  # vLLM: a temperature below this is greedy
ROW_REQS: contextvars.ContextVar = contextvars.ContextVar("fused_logp_rows", default=None)
_installed = False


def effective_temperature(temp, n: int, device) -> torch.Tensor:
    """Per-row FP32 temperature [n]: vLLM's (None when all greedy), greedy rows (T < 1e-5) scored at T = 1."""
    if temp is None:
        return torch.ones(n, dtype=torch.float32, device=device)
    t = temp.to(device=device, dtype=torch.float32)
    return torch.where(t < _SAMPLING_EPS, torch.ones_like(t), t)


def rescore(lt, z: torch.Tensor, temperature: torch.Tensor, mark: Mark, *, req_ids=None, kind="sample"):
    """LogprobsTensors with every column replaced by the contract logp of its id (padding columns, -inf in
    vLLM's output, stay -inf). z [N, V] fp32 unscaled; temperature [N] fp32."""
    st = mark.state
    if lt is None:
        return lt
    ids = lt.logprob_token_ids
    if ids.numel() == 0 or ids.shape[1] > z.shape[1]:
        st.note(["full-vocabulary logprobs (-1) are vLLM's"])
        return lt
    old = lt.logprobs
    ids64 = ids.to(device=z.device, dtype=torch.int64)
    cols = []
    for c in range(ids64.shape[1]):
        res = logp_from_logits(z, ids64[:, c], temperature=temperature, vocab_size=z.shape[1],
                               backend=st.settings.backend, strict=st.settings.strict)
        cols.append(res.logp)
    new = torch.stack(cols, dim=1).to(old.device)
    new = torch.where(torch.isneginf(old), old, new)
    st.rows_rescored += int(new.shape[0])
    if st.settings.capture and mark.hidden is not None:
        _capture(st, mark.hidden, temperature, ids64, new, req_ids, kind)
    return lt._replace(logprobs=new)


def _capture(st, hidden, temperature, ids, logp, req_ids, kind):
    h = hidden.detach().cpu()
    t, i, lp = temperature.cpu().tolist(), ids.cpu().tolist(), logp.cpu().tolist()
    for r in range(len(i)):
        st.captured.append({
            "kind": kind, "req_id": None if req_ids is None else req_ids[r],
            "hidden": h[r].contiguous().view(torch.int16).tolist(),      # bf16 bit patterns
            "temperature": t[r], "ids": i[r], "logprobs": lp[r],
        })


# -------------------------------------------------------------------------------------------------------
# V1
# -------------------------------------------------------------------------------------------------------

def _v1_flags(md) -> list[str]:
    r = []
    if not md.all_greedy and (md.top_k is not None or md.top_p is not None):
        r.append("top-k/top-p")
    if not md.no_penalties:
        r.append("penalties")
    if md.bad_words_token_ids:
        r.append("bad_words")
    if md.allowed_token_ids_mask is not None:
        r.append("allowed_token_ids")
    return r


def _wrap_v1_sampler():
    from vllm.v1.sample.sampler import Sampler

    orig_forward = Sampler.forward
    orig_gather = Sampler.gather_logprobs

    @functools.wraps(orig_forward)
    def forward(self, logits, sampling_metadata, *args, **kwargs):
        mark = getattr(logits, "_fused_logp", None)
        if mark is None:
            return orig_forward(self, logits, sampling_metadata, *args, **kwargs)
        md = sampling_metadata
        mark.state.note(_v1_flags(md))
        want = md.max_num_logprobs is not None or bool(md.logprob_token_ids)
        z = logits.clone() if want else None          # the sampler divides FP32 logits by T in place
        out = orig_forward(self, logits, md, *args, **kwargs)
        if want and out.logprobs_tensors is not None:
            t = effective_temperature(md.temperature, z.shape[0], z.device)
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, t, mark, req_ids=ROW_REQS.get())
        return out

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
        req_id, temp, n = ctx.queue.pop(0)
        if n != z.shape[0]:
            raise RuntimeError(f"fused_logp: prompt logprob rows out of step for request {req_id} "
                               f"({z.shape[0]} rows, expected {n})")
        t = torch.full((n,), temp, dtype=torch.float32, device=z.device)
        return rescore(lt, z, t, mark, req_ids=[req_id] * n, kind="prompt")

    Sampler.forward = forward
    Sampler.gather_logprobs = staticmethod(gather_logprobs)


@dataclasses.dataclass
class _PromptCtx:
    queue: list                     # [(req_id, temperature, rows)] in the order vLLM scores them
    last_logits: object = None
    rows: list | None = None        # MRV2: per-row temperature and request id
    req_rows: list | None = None
    offset: int = 0


def _req_temperature(sp) -> float:
    t = float(getattr(sp, "temperature", 1.0) or 0.0)
    return 1.0 if t < _SAMPLING_EPS else t


def _wrap_v1_runner():
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_sample = GPUModelRunner._sample
    orig_prompt = GPUModelRunner._get_prompt_logprobs_dict

    @functools.wraps(orig_sample)
    def _sample(self, logits, spec_decode_metadata, *args, **kwargs):
        token = ROW_REQS.set(list(self.input_batch.req_ids))
        try:
            return orig_sample(self, logits, spec_decode_metadata, *args, **kwargs)
        finally:
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
                queue.append((req_id, _req_temperature(req.sampling_params), n))
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

    @functools.wraps(orig_call)
    def __call__(self, logits, input_batch, *args, **kwargs):
        mark = getattr(logits, "_fused_logp", None)
        if mark is None:
            return orig_call(self, logits, input_batch, *args, **kwargs)
        idx = input_batch.idx_mapping_np
        import numpy as np
        if np.any(self.needs_logits_processing[idx]):
            mark.state.note(["logits processing (bias/penalties/bad words/min-p/temperature)"])
        top_k, top_p = self.sampling_states.get_top_k_top_p(input_batch.expanded_idx_mapping, idx)
        if top_k is not None or top_p is not None:
            mark.state.note(["top-k/top-p"])
        z = logits.clone() if self.get_logprobs_dims(idx) is not None else None
        out = orig_call(self, logits, input_batch, *args, **kwargs)
        if z is not None and out.logprobs_tensors is not None:
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, mrv2_row_temperature(self, input_batch),
                                           mark, req_ids=list(input_batch.req_ids))
        return out

    Sampler.__call__ = __call__

    W = pl.PromptLogprobsWorker
    orig_add, orig_compute = W.add_request, W.compute_prompt_logprobs
    orig_topk = pl.compute_topk_scores

    @functools.wraps(orig_add)
    def add_request(self, req_id, req_idx, sampling_params, *args, **kwargs):
        temps = self.__dict__.setdefault("_fused_logp_temperature", {})
        temps[req_idx] = _req_temperature(sampling_params)
        return orig_add(self, req_id, req_idx, sampling_params, *args, **kwargs)

    @functools.wraps(orig_compute)
    def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch, *args, **kwargs):
        temps = self.__dict__.get("_fused_logp_temperature", {})
        qsl = input_batch.query_start_loc_np
        rows, req_rows = [], []
        for i, req_id in enumerate(input_batch.req_ids):
            n = int(qsl[i + 1] - qsl[i])
            rows += [temps.get(int(input_batch.idx_mapping_np[i]), 1.0)] * n
            req_rows += [req_id] * n
        token = PROMPT_CTX.set(_PromptCtx([], rows=rows, req_rows=req_rows))
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
        return rescore(lt, logits, t, mark, req_ids=ctx.req_rows[o:o + n], kind="prompt")

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
            "rows_rescored": st.rows_rescored, "fingerprint": st.fingerprint,
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
