"""The Model Runner V2 sampler surface (vllm/v1/worker/gpu/sample/sampler.py, vLLM's default runner on GPU).

`add_request` records each request's transform program and request-level non-contract features, and hands vLLM
sampling params with top-k / top-p / min-p off for a program request (temperature, seed and everything else as
given). `__call__` masks the head's FP32 logits to each program row's kept set, lets vLLM sample, checks that
every program row's token is in its set, and rescores every logprob column with the contract op. Both known
add_request shapes are handled (capability.HookShapes.mrv2_sp_index) and both logprobs probes
(`get_logprobs_dims` / `returns_logprobs`)."""
from __future__ import annotations

import functools

from .policy import request_reasons, transform_program, transform_reasons
from .scoring import check_sampled, effective_temperature, kept_rows, program_groups, rescore
from .state import is_vllm_warmup, mark_of


def row_temperature(sampler, input_batch):
    """Per-row scoring temperature of an MRV2 batch (greedy rows, T = 0 in vLLM's state, at 1)."""
    t = sampler.sampling_states.temperature.gpu[input_batch.expanded_idx_mapping]
    return effective_temperature(t, t.shape[0], t.device)


def install(shapes) -> None:
    from vllm.v1.worker.gpu.sample.sampler import Sampler

    orig_call = Sampler.__call__
    orig_add_request = Sampler.add_request
    sp_index = shapes.mrv2_sp_index                       # after self: 1 (0.32) or 2 (0.26)
    if shapes.mrv2_logprobs_probe == "get_logprobs_dims":
        def wants_logprobs(sampler, idx):
            return sampler.get_logprobs_dims(idx) is not None
    else:
        def wants_logprobs(sampler, idx):
            return bool(sampler.returns_logprobs(idx))

    @functools.wraps(orig_add_request)
    def add_request(self, *args, **kwargs):
        if "sampling_params" in kwargs:
            params = kwargs["sampling_params"]
        else:
            params = args[sp_index]
        req_idx = kwargs["req_idx"] if "req_idx" in kwargs else args[0]
        d = self.__dict__
        prog = transform_program(params)
        d.setdefault("_fused_logp_programs", {})[int(req_idx)] = prog
        d.setdefault("_fused_logp_flagged", {})[int(req_idx)] = request_reasons(params)
        if prog is not None and transform_reasons(params):
            params = params.clone()
            params.top_k, params.top_p, params.min_p = 0, 1.0, 0.0
            if "sampling_params" in kwargs:
                kwargs["sampling_params"] = params
            else:
                args = args[:sp_index] + (params,) + args[sp_index + 1:]
        return orig_add_request(self, *args, **kwargs)

    @functools.wraps(orig_call)
    def __call__(self, logits, input_batch, *args, **kwargs):
        mark = mark_of(logits)
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
        flagged = self.__dict__.get("_fused_logp_flagged", {})
        for i, rid in zip(idx, input_batch.req_ids):
            if flagged.get(int(i)) and not is_vllm_warmup(rid):     # vLLM's warm-up exercises every feature
                mark.state.note(flagged[int(i)])
        z = logits.clone() if wants_logprobs(self, idx) else None
        masked = logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        if keep is not None:
            masked._fused_logp = mark
        out = orig_call(self, masked, input_batch, *args, **kwargs)
        if keep is not None:
            check_sampled(keep, out.sampled_token_ids, groups, mark)
        if z is not None and out.logprobs_tensors is not None:
            out.logprobs_tensors = rescore(out.logprobs_tensors, z, row_temperature(self, input_batch),
                                           mark, req_ids=list(input_batch.req_ids), programs=programs)
        return out

    Sampler.__call__ = __call__
    Sampler.add_request = add_request
