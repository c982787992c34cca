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


def rescore(lt, z: torch.Tensor, temperature, mark: Mark, *, req_ids=None, kind="sample", programs=None,
            unit_temperature: bool = False, record=None, groups=None, scored: bool = False):
    """LogprobsTensors with every column replaced by the contract logp of its id (padding columns, -inf in
    vLLM's output, stay -inf). z [N, V] fp32 unscaled; temperature [N] fp32 (a tensor, or a callable returning
    it). A row whose program (programs[r]) is not neutral gets the program's logp instead, -inf for an id outside
    its kept set. unit_temperature: see contract_columns. record: the (request id, program) pairs to record for the
    programs RPC (default: every row's). groups: program_groups(programs, V) where the caller has it already.
    scored: lt's columns are contract_columns already (vLLM's logprob kernel was the contract's this step); only
    the programs record and the capture are done."""
    st = mark.state
    if lt is None:
        return lt
    ids = lt.logprob_token_ids
    if ids.numel() == 0 or ids.shape[1] > z.shape[1]:
        st.note(["full-vocabulary logprobs (-1) are vLLM's"])
        return lt
    if scored:
        new = lt.logprobs
    else:
        old = lt.logprobs
        new = contract_columns(z, ids, temperature, mark, unit_temperature=unit_temperature)
        ids64 = None
        for prog, rows in (program_groups(programs, z.shape[1]) if groups is None else groups).items():
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
        capture(st, mark.hidden, temperature, ids.to(torch.int64), new, req_ids, kind, programs)
    return lt if scored else lt._replace(logprobs=new)


def json_float(v: float):
    """A float as JSON can carry it: finite values as they are, -inf / inf / nan as the strings '-inf', 'inf',
    'nan' (float() reads each back)."""
    return v if math.isfinite(v) else repr(v)


def capture(st, hidden, temperature, ids, logp, req_ids, kind, programs=None):
    """Append one record per row to the head's bounded capture buffer; every value JSON-safe."""
    h = hidden.detach().cpu()
    t, i, lp = temperature.cpu().tolist(), ids.cpu().tolist(), logp.cpu().tolist()
    for r in range(len(i)):
        if kind == "prompt" and (req_ids is None or req_ids[r] is None):
            continue                              # a row vLLM scores but does not return
        prog = None if programs is None or programs[r] is None else programs[r].to_dict()
        st.captured.append({
            "kind": kind, "req_id": None if req_ids is None else req_ids[r],
            "hidden": h[r].contiguous().view(torch.int16).tolist(),      # bf16 bit patterns
            "temperature": t[r], "ids": i[r], "logprobs": [json_float(x) for x in lp[r]],
            "program": prog,                      # TransformProgram.to_dict(), None: vLLM's own sampling
        })
