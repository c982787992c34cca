"""The prompt-logprob surface: V1 `GPUModelRunner._get_prompt_logprobs_dict` (with `Sampler.gather_logprobs`)
and MRV2 `PromptLogprobsWorker` (with its module's `compute_topk_scores`). A prompt row is scored as vLLM defines
prompt logprobs: the model's distribution, without any sampling processor (log softmax(z) at T = 1 in both
*_logprobs modes, the logits z in both *_logits modes; scoring.PROMPT_MODE), whatever the request's temperature
and transform program."""
from __future__ import annotations

import functools

from .policy import request_info
from .scoring import rescore
from .state import PROMPT_CTX, PromptCtx, mark_of


def install_v1() -> None:
    from vllm.v1.sample.sampler import Sampler
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    orig_gather = Sampler.gather_logprobs
    orig_prompt = GPUModelRunner._get_prompt_logprobs_dict

    @functools.wraps(orig_gather)
    def gather_logprobs(logprobs, num_logprobs, token_ids):
        lt = orig_gather(logprobs, num_logprobs, token_ids)
        ctx = PROMPT_CTX.get()
        if ctx is None or ctx.last_logits is None:
            return lt
        z, ctx.last_logits = ctx.last_logits, None
        mark = mark_of(z)
        if mark is None or not ctx.queue:
            return lt
        req_id, n, info = ctx.queue.pop(0)
        if n != z.shape[0]:
            raise RuntimeError(f"fused_logp: prompt logprob rows out of step for request {req_id} "
                               f"({z.shape[0]} rows, expected {n})")
        return rescore(lt, z, None, mark, req_ids=[req_id] * n, kind="prompt", mode=ctx.mode, infos=[info] * n)

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
                info = getattr(req, "_fused_logp_info", None) or request_info(req.sampling_params)
                queue.append((req_id, n, info))
        if not queue:
            return orig_prompt(self, hidden_states, num_scheduled_tokens, *args, **kwargs)
        mode = getattr(getattr(self, "model_config", None), "logprobs_mode", None)
        token = PROMPT_CTX.set(PromptCtx(queue, mode=mode))
        try:
            return orig_prompt(self, hidden_states, num_scheduled_tokens, *args, **kwargs)
        finally:
            PROMPT_CTX.reset(token)

    Sampler.gather_logprobs = staticmethod(gather_logprobs)
    GPUModelRunner._get_prompt_logprobs_dict = _get_prompt_logprobs_dict


def install_mrv2() -> None:
    from vllm.v1.worker.gpu.sample import prompt_logprob as pl

    W = pl.PromptLogprobsWorker
    orig_add, orig_compute = W.add_request, W.compute_prompt_logprobs
    orig_topk = pl.compute_topk_scores

    @functools.wraps(orig_add)
    def add_request(self, req_id, req_idx, sampling_params, *args, **kwargs):
        self.__dict__.setdefault("_fused_logp_info", {})[req_idx] = request_info(sampling_params)
        return orig_add(self, req_id, req_idx, sampling_params, *args, **kwargs)

    @functools.wraps(orig_compute)
    def compute_prompt_logprobs(self, logits_fn, hidden_states, input_batch, *args, **kwargs):
        uses = getattr(self, "uses_prompt_logprobs", None)
        if uses is not None and not uses[input_batch.idx_mapping_np].any():
            return orig_compute(self, logits_fn, hidden_states, input_batch, *args, **kwargs)
        infos = self.__dict__.get("_fused_logp_info", {})
        qsl = input_batch.query_start_loc_np
        # vLLM scores every row of the batch and keeps, per request that wants prompt logprobs and is still in
        # its prompt, the rows up to its last prompt position (the last query row predicts a sampled token);
        # only those rows carry a request id (and are captured)
        prompt_lens = kwargs.get("prompt_lens", args[2] if len(args) > 2 else None)
        computed = getattr(input_batch, "num_computed_prefill_tokens_np", None)
        scheduled = getattr(input_batch, "num_scheduled_tokens", None)
        req_rows, info_rows = [], []
        for i, req_id in enumerate(input_batch.req_ids):
            n = int(qsl[i + 1] - qsl[i])
            req_idx = int(input_batch.idx_mapping_np[i])
            wanted = bool(uses[req_idx]) if uses is not None else True
            real = n - 1
            if prompt_lens is not None and computed is not None and scheduled is not None:
                plen = int(prompt_lens[req_idx])
                wanted = wanted and int(computed[i]) < plen
                if int(computed[i]) + int(scheduled[i]) < plen:
                    real = n                                  # a prompt chunk: every row is a prompt row
            req_rows += [req_id if wanted and j < real else None for j in range(n)]
            info_rows += [infos.get(req_idx)] * n
        token = PROMPT_CTX.set(PromptCtx([], rows=req_rows, req_rows=req_rows, info_rows=info_rows,
                                         mode=getattr(self, "logprobs_mode", None)))
        try:
            return orig_compute(self, logits_fn, hidden_states, input_batch, *args, **kwargs)
        finally:
            PROMPT_CTX.reset(token)

    @functools.wraps(orig_topk)
    def compute_topk_scores(logits, *args, **kwargs):
        lt = orig_topk(logits, *args, **kwargs)
        ctx = PROMPT_CTX.get()
        mark = mark_of(logits)
        if ctx is None or ctx.rows is None or mark is None:
            return lt
        n, o = logits.shape[0], ctx.offset
        ctx.offset += n
        return rescore(lt, logits, None, mark, req_ids=ctx.req_rows[o:o + n], kind="prompt", mode=ctx.mode,
                       infos=ctx.info_rows[o:o + n])

    W.add_request = add_request
    W.compute_prompt_logprobs = compute_prompt_logprobs
    pl.compute_topk_scores = compute_topk_scores
