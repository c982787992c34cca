"""What the contract covers in a vLLM engine, and what strict mode refuses.

The plugin reports log softmax(z / T) over the full real vocabulary, z the op's unscaled FP32 logits, or, for a
request with top-k / top-p / min-p, the logp under its sampling-transform program (CONTRACT.md section 13), whose
kept set the sampler then draws from. Anything else that makes vLLM sample from another distribution (penalties,
biases, masks, grammars), changes z (soft-cap, scale, LoRA or quantized heads) or samples elsewhere (speculative
decoding) is outside the contract: strict mode refuses it with StrictModeError, otherwise it runs with a warning
and provenance that lists it.
"""
from __future__ import annotations

import dataclasses
import logging

import torch

from ..kernel.transforms import TransformProgram
from ..shared_contract.errors import StrictModeError
from ..shared_contract.sampling import EffectiveSampling, effective_sampling, scoring_temperature

log = logging.getLogger("vllm.fused_logp")

# vLLM's logprobs modes (vllm.config.model.LogprobsMode), each served in vLLM's meaning (docs/vllm.md)
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs", "raw_logits", "processed_logits")


try:
    from vllm.exceptions import VLLMValidationError as _RequestError
except ImportError:
    _RequestError = ValueError


class StrictRequestError(_RequestError, StrictModeError):
    """A request that strict mode refuses (a vLLM validation error: the servers answer 400 Bad Request)."""


def transform_reasons(params) -> list[str]:
    """The request's non-neutral top-k / top-p / min-p (vLLM's neutral values: top_k 0 or -1, top_p 1, min_p 0)."""
    r = []
    if params.top_k not in (0, -1):
        r.append(f"top_k={params.top_k}")
    if params.top_p != 1.0:
        r.append(f"top_p={params.top_p}")
    if params.min_p != 0.0:
        r.append(f"min_p={params.min_p}")
    return r


def request_temperature(params) -> float:
    """The temperature the plugin scores a request at under a processed logprobs mode
    (shared_contract.sampling.scoring_temperature of the engine's effective temperature)."""
    return request_sampling(params).scoring_temperature


_VERSION: list = []


def engine_version() -> str:
    """The installed vLLM's version string (read once)."""
    if not _VERSION:
        try:
            import vllm
            _VERSION.append(getattr(vllm, "__version__", "unknown"))
        except ImportError:
            _VERSION.append("unknown")
    return _VERSION[0]


def request_sampling(params, version: str | None = None) -> EffectiveSampling:
    """The sampling parameters this vLLM uses for a SamplingParams, from the engine version's rule
    (shared_contract.sampling.effective_sampling). vLLM has already applied it to `params` (SamplingParams.__post_init__),
    so this is the same values read back through the rule the trainer is given; a vLLM version without a rule
    falls back to the newest known one (capability.require has named the version in the log)."""
    t = getattr(params, "temperature", 1.0)
    k, p, m = getattr(params, "top_k", None), getattr(params, "top_p", None), getattr(params, "min_p", None)
    v = version or engine_version()
    try:
        return effective_sampling("vllm", v, t, k, p, m)
    except ValueError as e:
        if "no sampling-parameter rule" not in str(e):
            raise
        return effective_sampling("vllm", "0.33", t, k, p, m)


@dataclasses.dataclass(frozen=True)
class RequestInfo:
    """What the plugin needs of one request, computed once per request: its transform program (None: vLLM
    samples on its own), the engine's effective sampling record, the number of logprob columns vLLM returns for
    its sampled and prompt tokens (None: none), and its non-contract features."""
    program: TransformProgram | None
    sampling: dict
    sample_cols: int | None
    prompt_cols: int | None
    reasons: tuple


def request_info(params) -> RequestInfo:
    n = getattr(params, "logprobs", None)
    if n is None and getattr(params, "logprob_token_ids", None):
        n = len(params.logprob_token_ids)
    np_ = getattr(params, "prompt_logprobs", None)
    prog = transform_program(params)
    samp = request_sampling(params).to_dict()
    samp["program"] = None if prog is None or prog.is_neutral(1 << 62) else prog.to_dict()
    return RequestInfo(program=prog, sampling=samp,
                       sample_cols=None if n is None or n < 0 else 1 + int(n),
                       prompt_cols=None if np_ is None or np_ < 0 else 1 + int(np_),
                       reasons=tuple(request_reasons(params)))


def transform_program(params) -> TransformProgram | None:
    """The sampling-transform program the plugin replays for a request: TransformProgram(temperature, top_k,
    top_p, min_p) with vLLM's neutral values as None and greedy at T = 1. None when the request also uses
    something the program cannot express (request_reasons): vLLM then samples as it would without the plugin,
    and the recorded logprobs are the plain contract ones."""
    if request_reasons(params):
        return None
    return TransformProgram(
        temperature=request_temperature(params),
        top_k=None if params.top_k in (0, -1) else int(params.top_k),
        top_p=None if params.top_p == 1.0 else float(params.top_p),
        min_p=None if params.min_p == 0.0 else float(params.min_p))


def request_reasons(params) -> list[str]:
    """Features of one SamplingParams that neither the contract nor the transform program covers. Non-neutral
    top-k / top-p / min-p are listed only next to one of those (then vLLM applies them itself)."""
    r = []
    if params.presence_penalty != 0.0:
        r.append(f"presence_penalty={params.presence_penalty}")
    if params.frequency_penalty != 0.0:
        r.append(f"frequency_penalty={params.frequency_penalty}")
    if params.repetition_penalty != 1.0:
        r.append(f"repetition_penalty={params.repetition_penalty}")
    if params.logit_bias:
        r.append("logit_bias")
    if params.bad_words or getattr(params, "_bad_words_token_ids", None):
        r.append("bad_words")
    if params.allowed_token_ids:
        r.append("allowed_token_ids")
    if getattr(params, "structured_outputs", None) is not None:
        r.append("structured_outputs (grammar mask)")
    if params.min_tokens:
        r.append(f"min_tokens={params.min_tokens}")
    if params.logprobs == -1:
        r.append("logprobs=-1 (full-vocabulary logprobs come from vLLM)")
    if params.prompt_logprobs == -1:
        r.append("prompt_logprobs=-1 (full-vocabulary logprobs come from vLLM)")
    if getattr(params, "prompt_logprob_token_ids", None) is not None:
        r.append("prompt_logprob_token_ids (scored by vLLM)")
    if r:
        r += [f"{t} (applied by vLLM, not replayed)" for t in transform_reasons(params)]
    return r


def engine_reasons(vllm_config, *, scale: float = 1.0, soft_cap=None, logits_as_input: bool = False) -> list[str]:
    """Non-contract features of an engine configuration and of one LogitsProcessor's arguments."""
    r = []
    if getattr(vllm_config, "speculative_config", None) is not None:
        r.append("speculative decoding")
    if getattr(vllm_config, "lora_config", None) is not None:
        r.append("LoRA (may wrap the lm_head)")
    if soft_cap is not None:
        r.append(f"logit soft-capping (soft_cap={soft_cap})")
    if scale != 1.0:
        r.append(f"logit scale {scale}")
    if logits_as_input:
        r.append("logits_as_input")
    mc = getattr(vllm_config, "model_config", None)
    if mc is not None:
        if mc.dtype != torch.bfloat16:
            r.append(f"model dtype {mc.dtype} (the contract covers bf16 hidden states and weights)")
        if getattr(mc, "logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            r.append(f"logprobs_mode={mc.logprobs_mode} (not one of {', '.join(LOGPROBS_MODES)})")
        if getattr(mc, "logits_processors", None):
            r.append("custom logits processors (--logits-processors)")
        if getattr(mc, "quantization", None):
            r.append(f"quantization={mc.quantization}")
    pc = getattr(vllm_config, "parallel_config", None)
    if pc is not None and getattr(pc, "enable_batch_sharded_sampling", False):
        r.append("batch-sharded sampling")
    return r


def head_reasons(lm_head, embedding_bias, skip_gather: bool) -> list[str]:
    """Non-contract features of the lm_head the op would read."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    r = []
    qm = getattr(lm_head, "quant_method", None)
    if not isinstance(qm, UnquantizedEmbeddingMethod):
        r.append(f"quantized lm_head ({type(qm).__name__})")
    w = getattr(lm_head, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dtype != torch.bfloat16:
        r.append(f"lm_head weight dtype {getattr(w, 'dtype', None)} (the contract covers bf16)")
    si = getattr(lm_head, "shard_indices", None)
    if si is not None and getattr(si, "num_added_elements", 0):
        r.append("added (LoRA) vocabulary in the lm_head")
    if skip_gather:
        r.append("skip_gather (batch-sharded sampling)")
    if embedding_bias is not None and getattr(lm_head, "tp_size", 1) > 1:
        r.append("embedding bias under tensor parallelism")
    return r


_warned: set[str] = set()


def reason_kind(reason: str) -> str:
    """The kind of a reason, without its value: 'presence_penalty=0.5' -> 'presence_penalty'."""
    return reason.split("=", 1)[0].split(" (", 1)[0].strip()


def warn_once_per_kind(reasons, where: str) -> list[str]:
    """Log a warning for the reasons whose kind (at `where`) was not logged before in this process; returns
    them."""
    new = []
    for r in reasons:
        key = f"{where}:{reason_kind(r)}"
        if key not in _warned:
            _warned.add(key)
            new.append(r)
    if new:
        log.warning("fused_logp: %s uses %s, which the contract does not cover; running outside the contract "
                    "(non-strict), the status lists it under non_contract. Logged once per kind.",
                    where, ", ".join(new))
    return new


def refuse_or_warn(reasons: list[str], *, strict: bool, where: str, error=StrictModeError) -> None:
    if not reasons:
        return
    msg = (f"fused_logp: {where} uses {', '.join(reasons)}, which the contract does not cover "
           f"(the contract is log softmax(z / T) over the full real vocabulary, z the op's logits, or the logp under "
           f"a temperature/top-k/top-p/min-p transform program)")
    if strict:
        raise error(msg + "; strict mode refuses it. Remove it, or run with strict: false.")
    warn_once_per_kind(reasons, where)
