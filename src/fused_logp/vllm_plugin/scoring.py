"""What both samplers and the prompt-logprob paths end in: every logprob column rescored with the contract op
(or the row's sampling-transform program), the program rows' kept sets, and the capture of scored rows.

Adapters hold no arithmetic: the values come from fused_logp.logp_from_logits / program_logp_from_logits, the
greedy and epsilon rules from fused_logp.shared_contract.sampling."""
from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch

from .. import logp_from_logits
from ..kernel.op import logp_of_ids
from ..kernel.transforms import kept_mask, program_logp_from_logits
from ..shared_contract.constants import CONTRACT_VERSION
from ..shared_contract.sampling import GREEDY_SCORING_TEMPERATURE, scoring_temperatures
from .state import Mark


def effective_temperature(temp, n: int, device) -> torch.Tensor:
    """Per-row FP32 scoring temperature [n] from vLLM's per-row sampling temperature (None when all greedy):
    shared_contract.sampling.scoring_temperatures."""
    return scoring_temperatures(temp, n, device)


def all_unit_temperature(host_temperature) -> bool:
    """True when every row's scoring temperature is 1, read from the engine's host copy of the per-row sampling
    temperatures (a numpy array; no device synchronisation): greedy rows count as 1
    (shared_contract.sampling.scoring_temperatures)."""
    if host_temperature is None:
        return False
    a = np.ascontiguousarray(host_temperature, dtype=np.float32)
    key = a.tobytes()                     # a batch keeps its temperatures from step to step: decided once
    unit = _UNIT_MEMO.get(key)
    if unit is None:
        t = torch.from_numpy(a.copy())
        unit = bool(scoring_temperatures(t, t.shape[0]).eq(GREEDY_SCORING_TEMPERATURE).all())
        if len(_UNIT_MEMO) >= 4096:
            _UNIT_MEMO.clear()
        _UNIT_MEMO[key] = unit
    return unit


_UNIT_MEMO: dict = {}                     # host temperature bytes -> all_unit_temperature (a pure function of them)


def host_scoring_temperature(host_temperature, device) -> torch.Tensor:
    """effective_temperature of the engine's host copy of the rows' sampling temperatures (a numpy array), as an
    FP32 tensor [n] on `device`: the same values as effective_temperature of the engine's per-row temperature
    tensor where that tensor is a copy of the host array (vLLM V1: InputBatch.temperature is copied from
    temperature_cpu). Computed once per (bytes, device) and reused by every step of the batch (no torch operation
    per step); the tensor is never written."""
    a = np.ascontiguousarray(host_temperature, dtype=np.float32)
    key = (a.tobytes(), str(device))
    t = _TEMPERATURE_MEMO.get(key)
    if t is None:
        with torch.inference_mode(False):
            t = effective_temperature(torch.from_numpy(a.copy()), a.shape[0], device)
        if len(_TEMPERATURE_MEMO) >= 4096:
            _TEMPERATURE_MEMO.clear()
        _TEMPERATURE_MEMO[key] = t
    return t


_TEMPERATURE_MEMO: dict = {}              # (host temperature bytes, device) -> host_scoring_temperature


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


def _head_stats(mark: Mark, z: torch.Tensor):
    """The head call's T = 1 statistics for the logits z (a copy of the head's logits taken before vLLM's sampler
    touched them), or None where they do not describe z row for row."""
    stats = mark.stats
    if stats is None or stats.tile_max.shape[0] != z.shape[0] or stats.logits is None \
            or stats.logits.shape != z.shape:
        return None
    return stats if stats.logits is z else dataclasses.replace(stats, logits=z)


def contract_columns(z: torch.Tensor, ids: torch.Tensor, temperature, mark: Mark, *, unit_temperature: bool = False):
    """[N, C] FP32 on z's device: the contract logp of every id column (ids [N, C] int32/int64) of the unscaled FP32
    logits z [N, V] at the rows' scoring temperature (a tensor [N], or a callable returning it). With
    unit_temperature (every row's scoring temperature known on the host to be 1) the columns come from the head
    call's own statistics (logp_of_ids, the same bytes) instead of a second pass over the row. The rows are counted
    in the head's record (rows_rescored; rows_head_stats for those read from the statistics)."""
    st = mark.state
    st.rows_rescored += int(z.shape[0])
    stats = _head_stats(mark, z) if unit_temperature else None
    if stats is not None:
        st.rows_head_stats += int(z.shape[0])
        ids = ids if ids.device == z.device else ids.to(z.device)
        return logp_of_ids(stats, ids, vocab_size=z.shape[1], backend=st.settings.backend,
                           strict=st.settings.strict).logp
    if callable(temperature):
        temperature = temperature()
    ids64 = ids.to(device=z.device, dtype=torch.int64)
    return logp_from_logits(z, ids64, temperature=temperature, vocab_size=z.shape[1], backend=st.settings.backend,
                            strict=st.settings.strict).logp


# the meaning of a prompt row's values in each logprobs mode: vLLM scores prompt tokens without any sampling
# processor (V1 GPUModelRunner._get_prompt_logprobs_dict, MRV2 PromptLogprobsWorker): log softmax(z) at T = 1 in
# both *_logprobs modes, the logits z in both *_logits modes
PROMPT_MODE = {"raw_logprobs": "raw_logprobs", "processed_logprobs": "raw_logprobs",
               "raw_logits": "raw_logits", "processed_logits": "raw_logits"}


def row_mode(mode: str | None, kind: str) -> str:
    """The logprobs mode a row's values follow: the engine's for sampled rows, PROMPT_MODE's for prompt rows
    (None: the engine's default, raw_logprobs)."""
    mode = mode or "raw_logprobs"
    return PROMPT_MODE.get(mode, mode) if kind == "prompt" else mode


def logit_columns(z: torch.Tensor, ids: torch.Tensor, temperature=None, groups=None) -> torch.Tensor:
    """[N, C] FP32: the op's logit of every id column (raw_logits), or, with `temperature` (a tensor [N] of the
    rows' scoring temperatures, or a callable returning it), the scaled logit z_id / T of CONTRACT.md section 3
    (one binary32 division) with -inf for an id outside its row's kept set (groups: program_groups), which is
    what vLLM's processed_logits are on those rows."""
    ids64 = ids.to(device=z.device, dtype=torch.int64)
    v = z.gather(1, ids64)
    if temperature is None:
        return v
    if callable(temperature):
        temperature = temperature()
    v = torch.div(v, temperature.to(device=v.device, dtype=torch.float32)[:, None])
    for prog, rows in (groups or {}).items():
        idx = torch.tensor(rows, dtype=torch.int64, device=z.device)
        kept = kept_mask(z.index_select(0, idx), prog).gather(1, ids64.index_select(0, idx))
        v[idx] = torch.where(kept, v.index_select(0, idx), torch.full_like(kept, float("-inf"), dtype=v.dtype))
    return v


def rescore(lt, z: torch.Tensor, temperature, mark: Mark, *, req_ids=None, kind="sample", programs=None,
            unit_temperature: bool = False, record=None, groups=None, scored: bool = False,
            mode: str | None = "processed_logprobs", infos=None):
    """LogprobsTensors with every column replaced by the contract value of its id in the logprobs mode `mode`
    (row_mode: prompt rows follow PROMPT_MODE), vLLM's meaning of each mode with the op's arithmetic:
    raw_logprobs: log softmax(z) at T = 1 over the full vocabulary, no program; processed_logprobs: the contract
    logp at the row's scoring temperature, or under its program (-inf for an id outside the kept set);
    raw_logits: z; processed_logits: z / T, -inf outside a program's kept set. Padding columns, -inf in vLLM's
    output, stay -inf. z [N, V] fp32 unscaled; temperature [N] fp32 (a tensor, or a callable returning it).
    unit_temperature: see contract_columns. record: the (request id, program) pairs to record for the programs RPC
    (default: every row's). groups: program_groups(programs, V) where the caller has it already. scored: lt's
    columns are contract_columns already (vLLM's logprob kernel was the contract's this step); only the programs
    record and the capture are done. infos: per row, the request's policy.RequestInfo (its effective sampling
    record and column counts, for the capture), or None."""
    st = mark.state
    if lt is None:
        return lt
    ids = lt.logprob_token_ids
    if ids.numel() == 0 or ids.shape[1] > z.shape[1]:
        st.note(["full-vocabulary logprobs (-1) are vLLM's"])
        return lt
    m = row_mode(mode, kind)
    processed = m in ("processed_logprobs", "processed_logits")
    if groups is None:
        groups = program_groups(programs, z.shape[1]) if processed else {}
    elif not processed:
        groups = {}
    if not processed:
        temperature, unit_temperature = None, True
    if scored:
        new = lt.logprobs
    else:
        old = lt.logprobs
        if m in ("raw_logits", "processed_logits"):
            st.rows_rescored += int(z.shape[0])
            new = logit_columns(z, ids, temperature if processed else None, groups)
        else:
            new = contract_columns(z, ids, 1.0 if temperature is None else temperature, mark,
                                   unit_temperature=unit_temperature)
            ids64 = None
            for prog, rows in groups.items():
                if ids64 is None:
                    ids64 = ids.to(device=z.device, dtype=torch.int64)
                idx = torch.tensor(rows, dtype=torch.int64, device=z.device)
                lp, _, kept = program_logp_from_logits(z.index_select(0, idx), ids64.index_select(0, idx), prog,
                                                       vocab_size=z.shape[1], require_kept=False)
                new[idx] = torch.where(kept, lp, torch.full_like(lp, float("-inf"))).to(new.device)
        if new.device != old.device:
            new = new.to(old.device)
        new = new.masked_fill(torch.isneginf(old), float("-inf"))
    if record is not None:
        st.record_programs(*record)
    elif programs is not None and req_ids is not None:
        st.record_programs(req_ids, programs)
    if st.settings.capture and mark.hidden is not None:
        if unit_temperature or temperature is None:
            temperature = torch.full((z.shape[0],), GREEDY_SCORING_TEMPERATURE, dtype=torch.float32)
        elif callable(temperature):
            temperature = temperature()
        capture(st, mark.hidden, temperature, ids.to(torch.int64), new, req_ids, kind,
                programs if processed else None, mode=m, infos=infos, vocab_size=int(z.shape[1]))
    return lt if scored else lt._replace(logprobs=new)


def json_float(v: float):
    """A float as JSON can carry it: finite values as they are, -inf / inf / nan as the strings '-inf', 'inf',
    'nan' (float() reads each back)."""
    return v if math.isfinite(v) else repr(v)


def capture(st, hidden, temperature, ids, logp, req_ids, kind, programs=None, *, vocab_size: int,
            mode="processed_logprobs", infos=None):
    """Append one record per row to the head's bounded capture buffer; every value JSON-safe. A row holds
    exactly the columns vLLM returns for its request (infos[r].sample_cols / prompt_cols; vLLM computes the
    batch's largest count for every row and keeps each request's own). `temperature` and `program` are what the
    values were computed at (T = 1 and None in the raw modes and for prompt rows), `logprobs_mode` what they are
    (row_mode), `sampling` the engine's effective sampling of the request (policy.RequestInfo.sampling),
    `vocab_size` the real vocabulary the values were computed over (the width of vLLM's logits) and
    `contract_version` the contract they follow, so that `fused-logp audit` needs neither as an option."""
    h = hidden.detach().cpu()
    t, i, lp = temperature.cpu().tolist(), ids.cpu().tolist(), logp.cpu().tolist()
    for r in range(len(i)):
        if kind == "prompt" and (req_ids is None or req_ids[r] is None):
            continue                              # a row vLLM scores but does not return
        info = None if infos is None else infos[r]
        cols = None if info is None else (info.prompt_cols if kind == "prompt" else info.sample_cols)
        ids_r, lp_r = (i[r], lp[r]) if cols is None else (i[r][:cols], lp[r][:cols])
        prog = None if programs is None or programs[r] is None else programs[r].to_dict()
        st.captured.append({
            "kind": kind, "req_id": None if req_ids is None else req_ids[r],
            "hidden": h[r].contiguous().view(torch.int16).tolist(),      # bf16 bit patterns
            "temperature": t[r], "ids": ids_r, "logprobs": [json_float(x) for x in lp_r],
            "program": prog,                      # TransformProgram.to_dict() the values are under, or None
            "logprobs_mode": mode,
            "sampling": None if info is None else info.sampling,
            "vocab_size": vocab_size, "contract_version": CONTRACT_VERSION,
        })
