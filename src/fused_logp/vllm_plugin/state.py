"""State shared by the plugin's vLLM surfaces: the per-head record, the mark on the op's logits, and the
context variables through which a runner wrapper tells a sampler wrapper which request each row belongs to.

Imports nothing else of the plugin (the other modules import it)."""
from __future__ import annotations

import collections
import contextvars
import dataclasses

import torch

from .policy import warn_once_per_kind
from .settings import PluginSettings

# Set by the V1 runner's _sample wrapper: the RowBatch of the rows it samples (request ids, programs, vLLM's host
# copy of their sampling temperatures); None outside it (vLLM's dummy sampler runs).
ROW_BATCH: contextvars.ContextVar = contextvars.ContextVar("fused_logp_row_batch", default=None)
# Set by the V1 sampler wrapper around vLLM's forward: the kept-set mask Sampler.sample applies.
SAMPLE_KEEP: contextvars.ContextVar = contextvars.ContextVar("fused_logp_keep", default=None)
# Set by the prompt-logprob wrappers; the head leaves its last logits there.
PROMPT_CTX: contextvars.ContextVar = contextvars.ContextVar("fused_logp_prompt", default=None)

PROGRAMS_KEPT = 65536                 # newest request programs kept for the fused_logp_programs RPC


_NOT_RECORDED = (None, -1)


class RowBatch:
    """The rows of a V1 runner's batch as the sampler wrapper needs them, built once per batch composition (the
    request ids in row order) and reused by every step that keeps it: a request's program is fixed for its life,
    so the per-row programs, the program groups and whether every row has a program are computed once, not per
    step. `host_temperature` (vLLM's host copy of the rows' sampling temperatures) is set on every step.
    `recorded` is the (head state, programs-RPC epoch) at which these rows' programs were last recorded: they are
    recorded once per epoch, not on every step."""

    __slots__ = ("req_ids", "programs", "all_programs", "host_temperature", "recorded", "_groups", "infos",
                 "reasons")

    def __init__(self, req_ids: list, programs: list | None, infos: list | None = None):
        self.req_ids = req_ids
        self.programs = programs
        self.infos = infos                # per row: policy.RequestInfo of its request (or None)
        # the non-contract features of the batch's requests (the status's non_contract list)
        self.reasons = sorted({r for i in (infos or ()) if i is not None for r in i.reasons})
        self.all_programs = programs is not None and all(p is not None for p in programs)
        self.host_temperature = None
        self.recorded = _NOT_RECORDED
        self._groups: dict = {}

    def same_rows(self, req_ids, with_programs: bool) -> bool:
        return (self.programs is not None) == with_programs and self.req_ids == req_ids

    def groups(self, vocab: int, program_groups) -> dict:
        """program_groups(self.programs, vocab), computed once per vocabulary size."""
        g = self._groups.get(vocab)
        if g is None:
            g = self._groups[vocab] = program_groups(self.programs, vocab)
        return g

    def to_record(self, st) -> tuple | None:
        """The (request ids, programs) to record for the programs RPC at this step: all rows once per (head,
        epoch), then nothing until the programs RPC drains them (None: no programs)."""
        if self.programs is None:
            return None
        if self.recorded[0] is st and self.recorded[1] == st.programs_epoch:
            return [], []
        return self.req_ids, self.programs

    def mark_recorded(self, st) -> None:
        self.recorded = (st, st.programs_epoch)


@dataclasses.dataclass
class PromptCtx:
    queue: list                     # V1: [(req_id, rows, info)] in the order vLLM scores them
    last_logits: object = None
    rows: list | None = None        # MRV2: per-row temperature, request id and program
    req_rows: list | None = None
    prog_rows: list | None = None
    info_rows: list | None = None   # MRV2: per-row policy.RequestInfo
    mode: str | None = None         # the engine's logprobs mode
    offset: int = 0


class CaptureBuffer:
    """The rows kept for audits (settings `capture: true`), bounded: at most `limit` rows; when full, the
    oldest rows are dropped first and counted in `dropped` (the status and every drain report it).

    A read that does not drain (peek) marks the rows it returned as sent; ack(n) then drops at most n of the
    oldest rows *sent* and never a row no read has returned (one appended after the read, or beyond it)."""

    def __init__(self, limit: int):
        if not isinstance(limit, int) or limit < 1:
            raise ValueError(f"capture_limit must be an integer >= 1; got {limit!r}")
        self.limit = limit
        self.rows: collections.deque = collections.deque()
        self.dropped = 0
        self._first = 0                   # sequence number of rows[0]
        self._sent = 0                    # rows with a sequence number below this were returned by a read

    def append(self, row: dict) -> None:
        if len(self.rows) >= self.limit:
            self.rows.popleft()
            self._first += 1
            self.dropped += 1
        self.rows.append(row)

    def take(self, n: int | None = None) -> list:
        """Remove and return the oldest n rows (all with None)."""
        n = len(self.rows) if n is None else min(n, len(self.rows))
        self._first += n
        return [self.rows.popleft() for _ in range(n)]

    def peek(self, n: int | None = None) -> list:
        n = len(self.rows) if n is None else min(n, len(self.rows))
        self._sent = max(self._sent, self._first + n)
        return [self.rows[i] for i in range(n)]

    def sent_unacked(self) -> int:
        """Rows returned by a read and still held."""
        return max(0, min(self._sent - self._first, len(self.rows)))

    def ack(self, n: int) -> int:
        """Drop the oldest min(n, sent_unacked()) rows; returns how many were dropped."""
        k = min(n, self.sent_unacked())
        self.take(k)
        return k

    def __len__(self):
        return len(self.rows)


@dataclasses.dataclass
class HeadState:
    """Per-processor record, read through the workers' fused_logp_status RPC."""
    settings: PluginSettings
    notes: set = dataclasses.field(default_factory=set)        # non-contract features seen
    provenance: object = None                                  # the op's last Provenance
    fingerprint: str | None = None
    fingerprint_changes: int = 0                               # informational: how often the bytes changed
    op_calls: int = 0
    rows_rescored: int = 0
    rows_head_stats: int = 0                                   # of those, read from the head call's statistics
    rows_program: int = 0                                      # sampled rows drawn from a program's kept set
    programs: dict = dataclasses.field(default_factory=dict)   # req_id -> program dict (bounded, newest last)
    programs_epoch: int = 0                                    # bumped when the programs RPC drains `programs`
    fallback: str | None = None                                # why vLLM's own head ran, if it did
    captured: CaptureBuffer | None = None
    lm_head: object = None                                     # weakref to the lm_head module
    head_checked: tuple | None = None                          # the (lm_head, bias, skip_gather) found contract
    zeros: torch.Tensor | None = None                          # the head call's targets (id 0), reused per step

    def __post_init__(self):
        if self.captured is None:
            self.captured = CaptureBuffer(self.settings.capture_limit)

    def note(self, reasons):
        new = [r for r in reasons if r not in self.notes]
        if new:
            self.notes.update(new)
            warn_once_per_kind(new, "the sampler")

    def record_programs(self, req_ids, programs, limit: int = PROGRAMS_KEPT):
        for rid, prog in zip(req_ids, programs):
            if rid is not None and prog is not None and rid not in self.programs:
                self.programs[rid] = prog.to_dict()
        while len(self.programs) > limit:
            self.programs.pop(next(iter(self.programs)))

    def head_targets(self, n: int, device) -> torch.Tensor:
        """int64 zeros [n] on `device` (the head call's targets: it reads the logits and the statistics, not a
        target's logp), one buffer grown as needed instead of a new tensor every step."""
        z = self.zeros
        if z is None or z.device != torch.device(device) or z.shape[0] < n:
            with torch.inference_mode(False):
                z = self.zeros = torch.zeros(max(n, 256), dtype=torch.int64, device=device)
        return z[:n]


@dataclasses.dataclass
class Mark:
    """Attached to the head's FP32 logits (`logits._fused_logp`): the sampler wrappers act only on marked
    logits."""
    state: HeadState
    hidden: torch.Tensor | None        # [N, D] bf16, kept only when capturing
    stats: object = None               # the head call's ShardStats at T = 1 (whole vocabulary), or None


# vLLM's own warm-up requests (Model Runner V2 warm-up; "for_sampler_warmup" exercises every sampling feature)
WARMUP_PREFIXES = ("_warmup_", "_v2_mixed_warmup")


def is_vllm_warmup(req_id) -> bool:
    """True for the ids of the requests vLLM makes up during its start-up warm-up (not the caller's)."""
    return isinstance(req_id, str) and req_id.startswith(WARMUP_PREFIXES)


def mark_of(logits):
    return getattr(logits, "_fused_logp", None)
