"""The worker-RPC surface (`LLM.collective_rpc(name)`; on a server `POST /collective_rpc`, dev mode only):

- fused_logp_status: whether the op serves this worker's lm_head, its provenance, the lm_head fingerprint
  (recomputed from the bytes now; it is the weight version compared with the trainer) and counters.
- fused_logp_captured: the rows captured for audits (settings `capture: true`), every value JSON-safe.
  `clear=True` (default) drains them; to lose nothing on a failing transport, read with `clear=False` and then
  acknowledge what arrived with `fused_logp_captured_ack(n)`, which drops the oldest n rows of those the reads
  returned (never a row no read returned, whatever n is).
- fused_logp_programs: {vLLM request id: TransformProgram.to_dict()} of the requests scored since the last call.

Captured rows name the request by vLLM's internal request id (the caller's id plus '-' and 8 characters; a
request with n > 1 fans out into child requests '<index>_<internal id>'): `same_request(captured_id,
request_id)` matches a row to a request (any of its children), `completion_index(captured_id, request_id)` says
which of its completions (`CompletionOutput.index`) the row belongs to."""
from __future__ import annotations

import os

from ..shared_contract.constants import CONTRACT_VERSION, TRANSFORM_PROGRAM_VERSION
from . import capability
from .weight_sync import heads, refresh_fingerprint


def same_request(captured_id: str | None, request_id: str) -> bool:
    """True when a captured row's (internal) request id belongs to the caller's request id: equal, or the
    caller's id followed by '-' and vLLM's 8-character suffix, or a child '<index>_' of either (n > 1)."""
    return completion_index(captured_id, request_id) is not None


def _child(captured_id: str):
    """('<index>', '<parent id>') of a child request id '<index>_<parent id>', or None."""
    head, sep, rest = captured_id.partition("_")
    return (int(head), rest) if sep and head.isdigit() and rest else None


def _same_single(captured_id: str, request_id: str) -> bool:
    if captured_id == request_id:
        return True
    head, sep, tail = captured_id.rpartition("-")
    return bool(sep) and head == request_id and len(tail) == 8


def completion_index(captured_id: str | None, request_id: str) -> int | None:
    """Which completion of the caller's request `request_id` a captured row belongs to: 0 for a request with
    n = 1, the child's index for a request with n > 1 (vLLM's child id '<index>_<parent internal id>'), None when
    the row is not this request's."""
    if captured_id is None:
        return None
    if _same_single(captured_id, request_id):
        return 0
    child = _child(captured_id)
    if child is not None and _same_single(child[1], request_id):
        return child[0]
    return None


def head_status(st) -> dict:
    return {
        "strict": st.settings.strict, "backend": st.settings.backend, "contract_version": CONTRACT_VERSION,
        "provenance": None if st.provenance is None else st.provenance.to_dict(), "fallback": st.fallback, "non_contract": sorted(st.notes),
        "op_calls": st.op_calls, "rows_rescored": st.rows_rescored,
        "rows_head_stats": st.rows_head_stats, "rows_program": st.rows_program,
        "transform_program_version": TRANSFORM_PROGRAM_VERSION,
        "fingerprint": st.fingerprint, "weight_version": st.fingerprint,
        "fingerprint_changes": st.fingerprint_changes,
        "capture": st.settings.capture, "captured_rows": len(st.captured), "capture_limit": st.captured.limit,
        "captured_dropped": st.captured.dropped,
    }


def fused_logp_status(self) -> dict:
    hs = heads(self)
    out = {"active": bool(hs), "pid": os.getpid(), "rank": getattr(self, "rank", None),
           "vllm_hooks": capability.detect().summary(), "heads": []}
    for st in hs:
        refresh_fingerprint(st)
        out["heads"].append(head_status(st))
    return out


def fused_logp_captured(self, clear: bool = True) -> list:
    rows = []
    for st in heads(self):
        rows += st.captured.take() if clear else st.captured.peek()
    return rows


def fused_logp_captured_ack(self, n: int) -> dict:
    """Drop the oldest n of the captured rows that `clear=False` reads returned (in the order the read listed
    them, head after head); rows no read returned are never dropped, so an n larger than what arrived drops only
    what arrived. Returns {"acked": rows dropped, "left": rows still held, "unread": held rows no read returned}."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"fused_logp_captured_ack: n must be an integer >= 0; got {n!r}")
    acked = left = unread = 0
    for st in heads(self):
        acked += st.captured.ack(n - acked)
        left += len(st.captured)
        unread += len(st.captured) - st.captured.sent_unacked()
    return {"acked": acked, "left": left, "unread": unread}


def fused_logp_programs(self, clear: bool = True) -> dict:
    out = {}
    for st in heads(self):
        out.update(st.programs)
        if clear:
            st.programs = {}
            st.programs_epoch += 1          # requests scored after this call are recorded again
    return out


RPCS = (fused_logp_status, fused_logp_captured, fused_logp_captured_ack, fused_logp_programs)


def install() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for fn in RPCS:
        setattr(WorkerBase, fn.__name__, fn)
