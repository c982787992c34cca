"""Sampling-transform program (CONTRACT.md section 13): rollout- and trainer-side bytes agree, the kept set
matches a float64 reference except where contract rounding decides a boundary, and the refusals."""
import numpy as np
import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits
from fused_logp.shared_contract.errors import ContractInputError

from helpers import bits_equal

V, D = 700, 32
PROGRAMS = [
    TransformProgram(1.0, top_k=1), TransformProgram(0.7, top_k=5), TransformProgram(1.3, top_k=50),
    TransformProgram(1.0, top_p=0.5), TransformProgram(0.8, top_p=0.9), TransformProgram(1.0, top_p=0.99),
    TransformProgram(1.0, min_p=0.01), TransformProgram(0.6, min_p=0.1),
    TransformProgram(0.9, top_k=50, top_p=0.9), TransformProgram(1.1, top_k=50, top_p=0.99, min_p=0.01),
    TransformProgram(0.7, top_p=0.9, min_p=0.1),
]


def _data(gen, n=12, scale=2.0):
    h = (torch.randn(n, D, generator=gen) * scale).bfloat16()
    w = torch.randn(V, D, generator=gen).bfloat16()
    return h, w


def _sampled(keep, gen):
    """One kept token per row, as a sampler drawing from the kept set would return."""
    idx = [np.flatnonzero(row) for row in keep.numpy()]
    return torch.tensor([int(i[torch.randint(0, len(i), (1,), generator=gen)]) for i in idx])


@pytest.mark.parametrize("program", PROGRAMS, ids=str)
def test_rollout_and_trainer_bytes_identical(gen, program):
    h, w = _data(gen)
    rollout = linear_logp(h, w, torch.zeros(12, dtype=torch.long), return_logits=True)    # the plugin's call
    keep = kept_mask(rollout.logits, program)
    targets = _sampled(keep, gen)
    r_logp, r_lse, _ = program_logp_from_logits(rollout.logits, targets, program)
    trainer = linear_logp_program(h, w, targets, program, rows_per_chunk=5)                # chunked, other batching
    assert bits_equal(trainer.logp, r_logp) and bits_equal(trainer.lse, r_lse)
    full_lse = linear_logp(h, w, targets, temperature=program.temperature).lse
    assert (r_logp <= 0).all() and (r_lse <= full_lse).all()           # the kept set is a subset


def test_neutral_program_equals_the_plain_op(gen):
    h, w = _data(gen)
    t = torch.randint(0, V, (12,), generator=gen)
    plain = linear_logp(h, w, t, temperature=0.7)
    prog = linear_logp_program(h, w, t, TransformProgram(0.7, top_k=V, top_p=1.0, min_p=0.0))
    assert bits_equal(prog.logp, plain.logp) and bits_equal(prog.lse, plain.lse)


def _reference_keep(z64: np.ndarray, p: TransformProgram) -> np.ndarray:
    zs = z64 / float(np.float32(p.temperature))
    keep = np.ones_like(zs, dtype=bool)
    order = np.lexsort((np.arange(zs.shape[1])[None, :].repeat(zs.shape[0], 0), -zs), axis=1)
    rows = np.arange(zs.shape[0])[:, None]
    if p.top_k:
        keep[rows, order[:, p.top_k:]] = False
    if p.top_p is not None and p.top_p < 1:
        e = np.where(keep, np.exp(zs - zs.max(1, keepdims=True)), 0.0)
        c = np.cumsum((e / e.sum(1, keepdims=True))[rows, order], axis=1)
        first = (c >= p.top_p).argmax(axis=1)
        keep[rows, order] &= np.arange(zs.shape[1])[None, :] <= first[:, None]
    if p.min_p:
        m = np.where(keep, zs, -np.inf).max(1, keepdims=True)
        keep &= zs - m >= np.log(p.min_p)
    return keep


def test_kept_set_matches_float64_except_at_rounding_boundaries(gen):
    """Same FP32 logits, float64 decisions: differing rows must be rare and only where float64's margin at the
    boundary is within a few FP32 rounding steps."""
    h, w = _data(gen, n=64)
    z = linear_logp(h, w, torch.zeros(64, dtype=torch.long), return_logits=True).logits
    differing, rows = 0, 0
    for p in PROGRAMS:
        got = kept_mask(z, p).numpy()
        want = _reference_keep(z.numpy().astype(np.float64), p)
        differing += int((got != want).any(axis=1).sum())
        rows += got.shape[0]
    assert differing <= 0.02 * rows, f"{differing} of {rows} rows differ"


def test_ties_break_toward_the_lower_id():
    z = torch.zeros(1, 10)
    z[0, [2, 5, 7]] = 3.0
    keep = kept_mask(z, TransformProgram(top_k=2))
    assert keep[0].nonzero().flatten().tolist() == [2, 5]


def test_target_outside_kept_set_is_refused(gen):
    h, w = _data(gen, n=3)
    z = linear_logp(h, w, torch.zeros(3, dtype=torch.long), return_logits=True).logits
    keep = kept_mask(z, TransformProgram(top_k=1))
    outside = torch.tensor([int((~keep[i]).nonzero()[0]) for i in range(3)])
    with pytest.raises(ContractInputError, match=r"outside its row's kept set"):
        linear_logp_program(h, w, outside, TransformProgram(top_k=1))


@pytest.mark.parametrize("kwargs, msg", [({"top_k": 0}, "top_k"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
                                         ({"min_p": -0.1}, "min_p"), ({"temperature": 0.0}, "temperature"),
                                         ({"version": "transform-program-v0"}, "version")])
def test_program_arguments_checked(kwargs, msg):
    with pytest.raises(ContractInputError, match=msg):
        TransformProgram(**kwargs)


def test_several_ids_per_row_equal_one_id_calls(gen):
    """The [N, C] form (kept set once per row) gives each column the bytes of its own single-id call."""
    h, w = _data(gen, n=5)
    z = linear_logp(h, w, torch.zeros(5, dtype=torch.long), return_logits=True).logits
    program = TransformProgram(0.9, top_k=50, top_p=0.9)
    ids = torch.randint(0, V, (5, 4), generator=gen)
    ids[:, 0] = kept_mask(z, program).float().argmax(dim=1)
    lp, lse, kept = program_logp_from_logits(z, ids, program, require_kept=False)
    assert lp.shape == (5, 4) and kept.shape == (5, 4) and kept[:, 0].all()
    for c in range(4):
        one, lse1, kept1 = program_logp_from_logits(z, ids[:, c], program, require_kept=False)
        assert bits_equal(lp[:, c].contiguous(), one) and bits_equal(lse, lse1) and torch.equal(kept[:, c], kept1)
