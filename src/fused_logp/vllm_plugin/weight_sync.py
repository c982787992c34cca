"""The weight-sync surface: the lm_head fingerprint, recomputed from the bytes after vLLM's weight-update paths.

The weight version that is compared with the trainer is the fingerprint itself (content-addressed): a trainer step
that leaves the lm_head bytes unchanged keeps the same version. `fingerprint_changes` counts how often the
bytes changed in this worker; it is an informational label, never compared."""
from __future__ import annotations

import functools

from .. import weight_fingerprint
from .state import HeadState

WEIGHT_UPDATE_METHODS = ("reload_weights", "update_weights", "finish_weight_update")


def lm_head_fingerprint(lm_head) -> str:
    """weight_fingerprint of the real-vocab rows the op reads, summed over the tensor-parallel group."""
    si = lm_head.shard_indices
    group = None
    if lm_head.tp_size > 1:
        from vllm.distributed.parallel_state import get_tp_group
        group = get_tp_group().device_group
    return weight_fingerprint(lm_head.weight.data[: si.num_org_elements], vocab_start=si.org_vocab_start_index,
                              vocab_size=lm_head.org_vocab_size, group=group)


def refresh_fingerprint(st: HeadState) -> str | None:
    """Fingerprint the lm_head bytes now; count a change."""
    head = st.lm_head() if st.lm_head is not None else None
    if head is None:
        return st.fingerprint
    fp = lm_head_fingerprint(head)
    if st.fingerprint is not None and fp != st.fingerprint:
        st.fingerprint_changes += 1
    st.fingerprint = fp
    return fp


def heads(worker) -> list[HeadState]:
    """The plugin's head states in a worker's model (a head is any module carrying `_fl_state`)."""
    import weakref

    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    model = worker.model_runner.get_model()
    out = [m._fl_state for m in model.modules() if getattr(m, "_fl_state", None) is not None]
    lm_head = getattr(model, "lm_head", None)
    for st in out:                    # before the first forward: the model's own lm_head
        if st.lm_head is None and isinstance(lm_head, VocabParallelEmbedding):
            st.lm_head = weakref.ref(lm_head)
    return out


def install() -> None:
    """Refresh the fingerprint after each of vLLM's worker weight-update methods this vLLM has."""
    from vllm.v1.worker.gpu_worker import Worker

    for name in WEIGHT_UPDATE_METHODS:
        orig = getattr(Worker, name, None)
        if orig is None:
            continue

        def make(orig):
            @functools.wraps(orig)
            def wrapped(self, *args, **kwargs):
                out = orig(self, *args, **kwargs)
                for st in heads(self):
                    refresh_fingerprint(st)
                return out
            return wrapped
        setattr(Worker, name, make(orig))
