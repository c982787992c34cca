"""Backward of linear_logp on the CPU: correct against float64, deterministic, batch-invariant per row, and
TP shards assembled in rank order equal the unsharded gradients."""
import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel.autograd import logp_grads

from helpers import bits_equal

# the forward of every check runs on both CPU backends (tests/cpu_backends.py)
pytestmark = pytest.mark.usefixtures("cpu_backend")


class _Float64Op(torch.autograd.Function):
    """The backward formula of kernel/autograd.py around an exact float64 forward, for gradcheck."""

    @staticmethod
    def forward(ctx, h, w, b, targets, temp):
        z = (h @ w.T + b) / temp[:, None]
        lse = torch.logsumexp(z, dim=1)
        ctx.save_for_backward(h, w, b, targets, temp, lse)
        return z.gather(1, targets[:, None]).squeeze(1) - lse, lse

    @staticmethod
    def backward(ctx, g_logp, g_lse):
        h, w, b, targets, temp, lse = ctx.saved_tensors
        dh, dw, db = logp_grads(h, w, b, targets, temp, lse, g_logp, g_lse, vocab_start=0, n_real=w.shape[0], chunk=7)
        return dh, dw, db, None, None


def test_gradcheck_of_the_backward_formula(gen):
    h = torch.randn(3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(20, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(20, generator=gen, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 19, 7])
    temp = torch.tensor([0.7, 1.0, 1.9], dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h, w, b: _Float64Op.apply(h, w, b, t, temp), (h, w, b))


def _data(gen, n=6, v=300, d=32):
    h = torch.randn(n, d, generator=gen).bfloat16().requires_grad_()
    w = torch.randn(v, d, generator=gen).bfloat16().requires_grad_()
    b = torch.randn(v, generator=gen).requires_grad_()
    t = torch.randint(0, v, (n,), generator=gen)
    return h, w, b, t


def _grads(h, w, b, t, temp=0.7, mask=None, lse_weight=0.3):
    for x in (h, w, b):
        x.grad = None
    r = linear_logp(h, w, t, bias=b, temperature=temp)
    m = torch.ones_like(r.logp) if mask is None else mask
    ((r.logp * m).sum() + lse_weight * (r.lse * m).sum()).backward()
    return h.grad.clone(), w.grad.clone(), b.grad.clone()


def test_gradients_match_float64(gen):
    """Tolerance: hidden and weight gradients are returned in bf16 (their parameters' dtype), so up to 2^-8
    relative from that rounding, plus FP32 recompute error far below it; the fp32 bias gradient to 1e-5."""
    h, w, b, t = _data(gen)
    dh, dw, db = _grads(h, w, b, t)
    h2, w2, b2 = (x.detach().double().requires_grad_() for x in (h, w, b))
    z = (h2 @ w2.T + b2) / float(torch.tensor(0.7, dtype=torch.float32))
    lp = torch.log_softmax(z, 1).gather(1, t[:, None]).squeeze(1)
    (lp.sum() + 0.3 * torch.logsumexp(z, 1).sum()).backward()
    for got, want in ((dh, h2.grad), (dw, w2.grad)):
        assert ((got.double() - want).abs() <= 2.0 ** -8 * want.abs() + 1e-4).all()
    assert ((db.double() - b2.grad).abs() <= 1e-5 * (1 + b2.grad.abs())).all()


def test_backward_is_deterministic(gen):
    h, w, b, t = _data(gen)
    first = _grads(h, w, b, t)
    second = _grads(h, w, b, t)
    assert all(torch.equal(x.view(torch.int16) if x.dtype == torch.bfloat16 else x, y.view(torch.int16)
               if y.dtype == torch.bfloat16 else y) for x, y in zip(first, second))


def test_row_hidden_gradient_is_batch_invariant(gen):
    h, w, b, t = _data(gen, n=7)
    dh_all = _grads(h, w, b, t)[0]
    for i in (0, 3, 6):
        hi = h.detach()[i:i + 1].clone().requires_grad_()
        dh_one = _grads(hi, w, b, t[i:i + 1])[0]
        assert bits_equal(dh_one.float(), dh_all[i:i + 1].float()), i


def test_masked_positions_contribute_nothing(gen):
    h, w, b, t = _data(gen, n=6)
    mask = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0])
    dh, dw, db = _grads(h, w, b, t, mask=mask)
    assert (dh[[1, 4]] == 0).all()
    keep = [0, 2, 3, 5]
    hk = h.detach()[keep].clone().requires_grad_()
    dh_k, dw_k, db_k = _grads(hk, w, b, t[keep])
    assert torch.allclose(dw.float(), dw_k.float(), atol=1e-2, rtol=2 ** -7)
    assert torch.allclose(db, db_k, atol=1e-6, rtol=1e-5)


def test_tp_shards_assemble_to_unsharded_gradients(gen):
    """Each shard's backward (with the merged global lse) returns a partial hidden gradient and its own weight
    rows' gradient; partials summed once and weight rows concatenated in rank order equal the unsharded ones."""
    h, w, b, t = _data(gen, n=5, v=300)
    hd, wd, bd = h.detach(), w.detach(), b.detach()
    temp = torch.full((5,), 0.7)
    r = linear_logp(hd, wd, t, bias=bd, temperature=temp)
    g_logp, g_lse = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    full = logp_grads(hd, wd, bd, t, temp, r.lse, g_logp, g_lse, vocab_start=0, n_real=300)
    bounds = [0, 128, 256, 320]                        # padded to 320 rows; the last shard holds 44 real rows
    wp = torch.cat([wd, torch.randn(20, 32, generator=gen).bfloat16()])
    bp = torch.cat([bd, torch.randn(20, generator=gen)])
    parts = [logp_grads(hd, wp[a:c], bp[a:c], t, temp, r.lse, g_logp, g_lse, vocab_start=a,
                        n_real=max(0, min(c, 300) - a)) for a, c in zip(bounds, bounds[1:])]
    # Not bytes: each shard computes its logits with its own matrix-vector products, whose summation order the
    # CPU BLAS may pick by shape and alignment, so a logit can differ by an ulp and exp(z / T - lse) by a few
    # (relative), and a sum over rows can cancel. So the bound is relative to the gradient's largest entry.
    def close(a, b):
        return bool(((a - b).abs() <= 1e-5 * b.abs() + 1e-6 * b.abs().max()).all())

    dh = sum(p[0] for p in parts)
    assert close(dh, full[0])
    assert close(torch.cat([p[1] for p in parts])[:300], full[1])
    assert (torch.cat([p[1] for p in parts])[300:] == 0).all()
    assert close(torch.cat([p[2] for p in parts])[:300], full[2])
