"""CONTRACT.md section 2: the logits of both CPU backends (the numpy oracle and the compiled one) follow the Hopper
k16 rule, checked against an independent exact-rational transcription of the rule (tests/gemm_reference.py; the
edges are in test_contract_edges.py)."""
import numpy as np
import pytest
import torch

import gemm_reference as ref
from cpu_backends import hopper_logits

pytestmark = pytest.mark.usefixtures("cpu_backend")


def _bits16(x):
    return x.contiguous().view(torch.int16).numpy().view(np.uint16).tolist()


def _compare(h, w):
    got = hopper_logits(h, w).numpy().view(np.uint32)
    want = np.array(ref.logits_bits(_bits16(h), _bits16(w)), dtype=np.uint32)
    mism = np.flatnonzero(got != want)
    assert mism.size == 0, f"{mism.size} mismatches; first at {np.unravel_index(mism[0], got.shape)}: " \
                           f"{got.flat[mism[0]]:#010x} vs {want.flat[mism[0]]:#010x}"


@pytest.mark.parametrize("d", [16, 32, 64, 256])
def test_rule_on_gaussian_inputs(gen, d):
    h = torch.randn(3, d, generator=gen).bfloat16()
    w = torch.randn(37, d, generator=gen).bfloat16()
    _compare(h, w)


def test_rule_on_wide_dynamic_range_with_zeros(gen):
    """Values scaled by 2^-40..2^40 and 10% zeros: terms far below emax are truncated, zeros keep e=-126."""
    d = 128
    scale = torch.pow(2.0, torch.randint(-40, 41, (4, d), generator=gen).float())
    h = (torch.randn(4, d, generator=gen) * scale).bfloat16()
    h[torch.rand(4, d, generator=gen) < 0.1] = 0
    wscale = torch.pow(2.0, torch.randint(-40, 41, (29, d), generator=gen).float())
    w = (torch.randn(29, d, generator=gen) * wscale).bfloat16()
    w[torch.rand(29, d, generator=gen) < 0.1] = 0
    _compare(h, w)


def test_rule_with_subnormal_and_cancelling_inputs(gen):
    d = 64
    h = torch.randn(3, d, generator=gen).bfloat16()
    h[0, :8] = torch.tensor([1e-39, -2e-39, 3e-40, 5e-39, 1.0, -1.0, 2.0 ** -120, 2.0 ** -126]).bfloat16()
    w = torch.randn(21, d, generator=gen).bfloat16()
    w[:, 16:32] = w[:, 0:16]
    h[1, 16:32] = -h[1, 0:16]                                    # exact cancellation across groups
    w[3] = (torch.randn(d, generator=gen) * 1e-37).bfloat16()    # products deep in the subnormal range
    _compare(h, w)


def test_rule_is_not_round_to_nearest(gen):
    """The emulation must differ from a correctly rounded FP32 dot somewhere (the rule truncates)."""
    h = torch.randn(8, 256, generator=gen).bfloat16()
    w = torch.randn(64, 256, generator=gen).bfloat16()
    got = hopper_logits(h, w)
    rn = (h.double() @ w.double().T).float()
    assert not torch.equal(got, rn)
    assert ((got.double() - (h.double() @ w.double().T)).abs() <= 1e-4).all()


def test_logit_depends_only_on_its_row_and_column(gen):
    """z_v depends on (h, W_v) only: any subset of columns and rows gives the same bytes."""
    h = torch.randn(5, 96, generator=gen).bfloat16()
    w = torch.randn(50, 96, generator=gen).bfloat16()
    full = hopper_logits(h, w)
    part = hopper_logits(h[[4, 1]], w[[49, 7, 8, 0]])
    assert torch.equal(full[[4, 1]][:, [49, 7, 8, 0]].view(torch.int32), part.view(torch.int32))


def test_nonfinite_inputs(gen):
    """An infinite product decides its group and every later one (+inf and -inf together, inf * 0 or a NaN
    give NaN, 0x7FFFFFFF); other rows are unaffected."""
    h = torch.randn(3, 32, generator=gen).bfloat16()
    w = torch.randn(4, 32, generator=gen).bfloat16()
    w[1, 3] = 0
    h[0, 3] = float("inf")
    h[1, 5] = float("nan")
    z = hopper_logits(h, w)
    sign = torch.sign(w[:, 3].float())
    assert torch.equal(z[0, [0, 2, 3]], sign[[0, 2, 3]] * float("inf")) and torch.isnan(z[0, 1])
    assert (z[1].view(torch.int32) == 0x7FFFFFFF).all()
    assert torch.isfinite(z[2]).all()
    _compare(h, w)
