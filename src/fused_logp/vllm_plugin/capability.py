"""Which shape of each vLLM hook this vLLM has, found by inspecting the hooks themselves (never the version
string), and what the plugin does with a shape it does not know: strict mode refuses it, naming the vLLM
version; otherwise that surface is left unwrapped and the status lists it.

Known shapes (vLLM 0.26, 0.32 and 0.33):
- head: `LogitsProcessor._get_logits(hidden_states, lm_head, embedding_bias[, skip_gather])` (0.32 added
  skip_gather).
- V1 sampler: `Sampler.forward(logits, sampling_metadata, ...)`, `Sampler.sample(logits, sampling_metadata, ...)`,
  static `Sampler.gather_logprobs(logprobs, num_logprobs, token_ids)`; runner `GPUModelRunner._sample(logits,
  spec_decode_metadata)` and `_get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens)`.
- Model Runner V2 sampler: `Sampler.__call__(logits, input_batch)`; `Sampler.add_request(req_idx,
  sampling_params)` (0.32) or `(req_idx, prompt_len, sampling_params)` (0.26, called positionally); whether a
  batch returns logprobs: `get_logprobs_dims(idx_mapping_np)` (0.32) or `returns_logprobs(idx_mapping_np)` (0.26).
- MRV2 prompt logprobs: `PromptLogprobsWorker.add_request(req_id, req_idx, sampling_params)`,
  `compute_prompt_logprobs(logits_fn, hidden_states, input_batch, ...)`, module-level `compute_topk_scores`.
- MRV2 logprob values: module-level `logprob.compute_token_logprobs(logits, token_ids)`, looked up by name in
  `compute_topk_scores` (both versions). Where it is, a sampler step's logprob columns are the contract's from the
  start (vLLM's own kernel is not run); where not, they are rescored after vLLM's (not a refusal).
- vLLM 0.33 (read from the 0.33.0 wheel; Model Runner V2 is its default runner where Triton is present): every
  hook above has the 0.32 shape; two additions. (a) V1 `Sampler.forward` first asks the module-level
  `mixed_sample_eligible(sampling_metadata, predict_bonus_token)` whether to sample the raw logits in one fused
  kernel (ROCm gfx1250), skipping `Sampler.sample`: the plugin wraps it to say no for a batch with a kept set
  (`v1_fused_raw_sample`); a forward that calls another such function by a name the plugin does not know is an
  unknown shape. (b) The Model Runner V2 custom logits-processor interface
  (`vllm/v1/worker/gpu/sample/logits_processor/interface.py`: `add_request(req_idx, sampling_params) -> bool`,
  `apply(logits, ctx)`, loaded from `--logits-processors` into `Sampler(custom_logits_processors=...)`; also in
  0.32, absent in 0.26): a processor changes the logits vLLM samples from, so an engine configured with one is
  outside the contract (policy.engine_reasons); `mrv2_custom_logits_processors` records that the interface exists.
"""
from __future__ import annotations

import dataclasses
import inspect
import logging

from ..shared_contract.errors import StrictModeError

log = logging.getLogger("vllm.fused_logp")


class UnsupportedVllmError(StrictModeError):
    """A vLLM hook has a shape the plugin does not know (strict mode)."""


@dataclasses.dataclass(frozen=True)
class HookShapes:
    vllm_version: str
    head_skip_gather: bool = False
    v1_sampler: bool = False
    v1_runner: bool = False
    mrv2: bool = False                       # the MRV2 sampler module imports and has a known shape
    mrv2_sp_index: int | None = None         # position of sampling_params in Sampler.add_request (after self)
    mrv2_logprobs_probe: str | None = None   # "get_logprobs_dims" | "returns_logprobs"
    mrv2_prompt: bool = False
    mrv2_token_logprobs: bool = False        # logprob.compute_token_logprobs(logits, token_ids), called by name
    v1_fused_raw_sample: bool = False        # 0.33: V1 Sampler.forward's mixed_sample_eligible(...), wrapped
    mrv2_custom_logits_processors: bool = False   # MRV2 Sampler(custom_logits_processors=...) (0.32, 0.33)
    problems: tuple = ()                     # unknown shapes, one sentence each
    absent: tuple = ()                       # surfaces this vLLM build does not have (not a refusal)

    def summary(self) -> dict:
        return dataclasses.asdict(self)


def _params(fn) -> list[str]:
    """Parameter names of a function or method, without self/cls and without *args / **kwargs."""
    fn = inspect.unwrap(fn)
    out = []
    for p in inspect.signature(fn).parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.name in ("self", "cls"):
            continue
        out.append(p.name)
    return out


def _starts(fn, names) -> bool:
    try:
        return _params(fn)[:len(names)] == list(names)
    except (TypeError, ValueError):
        return False


def head_shape(lp_cls, problems: list) -> bool:
    """True when _get_logits takes skip_gather."""
    fn = getattr(lp_cls, "_get_logits", None)
    if fn is None or not _starts(fn, ("hidden_states", "lm_head", "embedding_bias")):
        problems.append("LogitsProcessor._get_logits(hidden_states, lm_head, embedding_bias, ...) not found")
        return False
    return "skip_gather" in _params(fn)


def v1_sampler_shape(sampler_cls, problems: list) -> bool:
    ok = (_starts(getattr(sampler_cls, "forward", None), ("logits", "sampling_metadata"))
          and _starts(getattr(sampler_cls, "sample", None), ("logits", "sampling_metadata"))
          and _starts(getattr(sampler_cls, "gather_logprobs", None), ("logprobs", "num_logprobs", "token_ids")))
    if not ok:
        problems.append("V1 Sampler.forward/sample(logits, sampling_metadata) or "
                        "gather_logprobs(logprobs, num_logprobs, token_ids) not found")
    return ok


_V1_FUSED_SAMPLE = "mixed_sample_eligible"


def v1_fused_raw_sample_shape(sampler_cls, module, problems: list) -> bool:
    """True when V1 Sampler.forward calls the module's mixed_sample_eligible(sampling_metadata,
    predict_bonus_token) by name (vLLM 0.33); False when it calls no such function (0.26, 0.32). A forward that
    calls a module function whose name says it samples the raw logits in a fused kernel ('*sample_eligible*'), other
    than this one with this signature, is an unknown shape (a problem)."""
    fwd = getattr(sampler_cls, "forward", None)
    code = getattr(inspect.unwrap(fwd), "__code__", None) if callable(fwd) else None
    names = set(code.co_names) if code is not None else set()
    others = sorted(n for n in names if "sample_eligible" in n and n != _V1_FUSED_SAMPLE)
    if others:
        problems.append(f"V1 Sampler.forward calls {', '.join(others)} (a fused raw-logits sampling path the "
                        f"plugin does not know)")
        return False
    if _V1_FUSED_SAMPLE not in names:
        return False
    fn = getattr(module, _V1_FUSED_SAMPLE, None)
    if not callable(fn) or not _starts(fn, ("sm", "predict_bonus_token")) and \
            not _starts(fn, ("sampling_metadata", "predict_bonus_token")):
        problems.append(f"V1 sampler module's {_V1_FUSED_SAMPLE} is not (sampling_metadata, predict_bonus_token)")
        return False
    return True


def mrv2_custom_lp_shape(sampler_cls) -> bool:
    """True when the MRV2 Sampler takes custom logits processors (vLLM 0.32, 0.33)."""
    try:
        return "custom_logits_processors" in _params(sampler_cls.__init__)
    except (TypeError, ValueError):
        return False


def v1_runner_shape(runner_cls, problems: list) -> bool:
    ok = (_starts(getattr(runner_cls, "_sample", None), ("logits", "spec_decode_metadata"))
          and _starts(getattr(runner_cls, "_get_prompt_logprobs_dict", None),
                      ("hidden_states", "num_scheduled_tokens")))
    if not ok:
        problems.append("GPUModelRunner._sample(logits, spec_decode_metadata) or "
                        "_get_prompt_logprobs_dict(hidden_states, num_scheduled_tokens) not found")
    return ok


def mrv2_sampler_shape(sampler_cls, problems: list) -> tuple[int | None, str | None]:
    """(position of sampling_params in add_request, the logprobs probe), or (None, None) with a problem."""
    if not _starts(getattr(sampler_cls, "__call__", None), ("logits", "input_batch")):
        problems.append("MRV2 Sampler.__call__(logits, input_batch) not found")
        return None, None
    add = getattr(sampler_cls, "add_request", None)
    names = _params(add) if add is not None else []
    if names == ["req_idx", "sampling_params"]:
        sp = 1
    elif names == ["req_idx", "prompt_len", "sampling_params"]:
        sp = 2
    else:
        problems.append(f"MRV2 Sampler.add_request{tuple(names)} is neither (req_idx, sampling_params) nor "
                        f"(req_idx, prompt_len, sampling_params)")
        return None, None
    call_code = getattr(inspect.unwrap(sampler_cls.__call__), "__code__", None)
    if not (_starts(getattr(sampler_cls, "sample", None), ("logits",)) and call_code is not None
            and "sample" in call_code.co_names):
        problems.append("MRV2 Sampler.__call__ does not draw through self.sample(logits, ...)")
        return None, None
    if _starts(getattr(sampler_cls, "get_logprobs_dims", None), ("idx_mapping_np",)):
        probe = "get_logprobs_dims"
    elif _starts(getattr(sampler_cls, "returns_logprobs", None), ("idx_mapping_np",)):
        probe = "returns_logprobs"
    else:
        problems.append("MRV2 Sampler has neither get_logprobs_dims nor returns_logprobs(idx_mapping_np)")
        return None, None
    return sp, probe


def mrv2_token_logprobs_shape(module) -> bool:
    """True when the logprob module's compute_topk_scores looks compute_token_logprobs(logits, token_ids) up by
    name (so that the module attribute is what it calls)."""
    fn, topk = getattr(module, "compute_token_logprobs", None), getattr(module, "compute_topk_scores", None)
    code = getattr(inspect.unwrap(topk), "__code__", None) if callable(topk) else None
    return (callable(fn) and _starts(fn, ("logits", "token_ids")) and code is not None
            and "compute_token_logprobs" in code.co_names)


def mrv2_prompt_shape(worker_cls, module, problems: list) -> bool:
    ok = (_starts(getattr(worker_cls, "add_request", None), ("req_id", "req_idx", "sampling_params"))
          and _starts(getattr(worker_cls, "compute_prompt_logprobs", None),
                      ("logits_fn", "hidden_states", "input_batch"))
          and callable(getattr(module, "compute_topk_scores", None)))
    if not ok:
        problems.append("MRV2 PromptLogprobsWorker.add_request(req_id, req_idx, sampling_params) / "
                        "compute_prompt_logprobs(logits_fn, hidden_states, input_batch, ...) / "
                        "compute_topk_scores not found")
    return ok


_shapes: HookShapes | None = None


def detect() -> HookShapes:
    """The hook shapes of the installed vLLM (cached)."""
    global _shapes
    if _shapes is not None:
        return _shapes
    import vllm
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.v1.sample.sampler import Sampler as V1Sampler

    problems: list = []
    absent: list = []
    kw = {"vllm_version": getattr(vllm, "__version__", "unknown")}
    kw["head_skip_gather"] = head_shape(LogitsProcessor, problems)
    kw["v1_sampler"] = v1_sampler_shape(V1Sampler, problems)
    from vllm.v1.sample import sampler as v1_sampler_module
    kw["v1_fused_raw_sample"] = v1_fused_raw_sample_shape(V1Sampler, v1_sampler_module, problems)
    try:
        from vllm.v1.worker.gpu_model_runner import GPUModelRunner
        kw["v1_runner"] = v1_runner_shape(GPUModelRunner, problems)
    except ImportError as e:
        absent.append(f"V1 GPU model runner ({e})")
    try:
        from vllm.v1.worker.gpu.sample import logprob as lpm
        from vllm.v1.worker.gpu.sample import prompt_logprob as pl
        from vllm.v1.worker.gpu.sample.sampler import Sampler as V2Sampler
    except ImportError as e:               # MRV2 needs modules this vLLM build may lack: then it never runs
        absent.append(f"Model Runner V2 sampler ({e})")
    else:
        sp, probe = mrv2_sampler_shape(V2Sampler, problems)
        kw["mrv2_prompt"] = mrv2_prompt_shape(pl.PromptLogprobsWorker, pl, problems)
        kw["mrv2"] = sp is not None and kw["mrv2_prompt"]
        kw["mrv2_sp_index"], kw["mrv2_logprobs_probe"] = sp, probe
        kw["mrv2_token_logprobs"] = mrv2_token_logprobs_shape(lpm)
        kw["mrv2_custom_logits_processors"] = mrv2_custom_lp_shape(V2Sampler)
        if not kw["mrv2_token_logprobs"]:
            absent.append("MRV2 logprob.compute_token_logprobs(logits, token_ids) called by name (columns are "
                          "rescored after vLLM's)")
    _shapes = HookShapes(problems=tuple(problems), absent=tuple(absent), **kw)
    return _shapes


_warned = False


def require(strict: bool, shapes: HookShapes | None = None) -> HookShapes:
    """The shapes, after refusing unknown ones in strict mode (naming the vLLM version) or warning once."""
    global _warned
    s = shapes if shapes is not None else detect()
    if s.problems:
        msg = (f"fused_logp: vLLM {s.vllm_version} has hook shapes this plugin does not know: "
               f"{'; '.join(s.problems)}")
        if strict:
            raise UnsupportedVllmError(msg + ". Strict mode refuses to serve with those surfaces unwrapped; "
                                       "use a vLLM whose hooks the plugin supports (0.26, 0.32 and 0.33 are known).")
        if not _warned:
            _warned = True
            log.warning("%s; those surfaces are left unwrapped (their logprobs are vLLM's own).", msg)
    return s
