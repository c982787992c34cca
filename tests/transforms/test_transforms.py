"""Sampling-transform program (CONTRACT.md section 13): rollout- and trainer-side bytes agree, the kept set
matches a float64 reference except where contract rounding decides a boundary, and the refusals."""
import numpy as np
import pytest
import torch

from fused_logp import linear_logp
from fused_logp.kernel.op import linear_logp_program
from fused_logp.kernel.transforms import TransformProgram, kept_mask, program_logp_from_logits
from fused_logp.shared_contract.errors import ContractInputError

from helpers import bits_equal, same_bytes

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


@pytest.mark.usefixtures("cpu_backend")
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


@pytest.mark.usefixtures("cpu_backend")
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


@pytest.mark.usefixtures("cpu_backend")
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


@pytest.mark.usefixtures("cpu_backend")
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


# ---------------------------------------------------------------------------------------------------------
# The torch path (the device implementation, run here on CPU tensors) gives the numpy path's bytes.
# ---------------------------------------------------------------------------------------------------------

from fused_logp.kernel import transforms  # noqa: E402
from fused_logp.kernel.sm90 import SM90Backend  # noqa: E402
from fused_logp.kernel.transcendentals import contract_ex2_torch, contract_log_torch  # noqa: E402
from fused_logp.shared_contract import numpy_contract  # noqa: E402
from fused_logp.shared_contract.numpy_contract import contract_ex2, contract_log  # noqa: E402




def test_torch_exp_log_bits_equal_numpy(gen):
    bits = torch.randint(0, 2**32, (1 << 21,), generator=gen, dtype=torch.int64).to(torch.uint32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), -float("nan"), 1e-45,
                            -1e-45, 88.72284, 88.72283, 88.7229, -103.97208, -103.97207, -103.9721, 1.1754944e-38,
                            1.1754942e-38, 3.4028235e38])
    x = torch.cat([bits.view(torch.float32), special, -torch.rand(1 << 20, generator=gen) * 110.0,
                   torch.rand(1 << 19, generator=gen) * 4096.0, torch.rand(1 << 18, generator=gen) * 1e-37,
                   (torch.rand(1 << 18, generator=gen) - 0.5) * 0.1 + 1.0])
    xn = torch.where(x > 0, -x, x)                                # the exp2's domain: x <= 0
    assert bits_equal(contract_ex2_torch(xn), torch.from_numpy(contract_ex2(xn.numpy())))
    assert bits_equal(contract_log_torch(x), torch.from_numpy(contract_log(x.numpy())))
    y = xn[: 3 * 64 * 50].view(3, 50, 64).transpose(1, 2)         # strided input
    assert bits_equal(contract_ex2_torch(y), torch.from_numpy(contract_ex2(y.numpy())))


def _tricky_logits(gen, n, v):
    """Random rows with many exact ties, plus rows of signed zeros, constants, NaN/+-inf, a dominant token, a
    -0.0 maximum, subnormals and values whose z / T overflows."""
    z = torch.round(torch.randn(n, v, generator=gen) * 12) / 4          # quarter steps: ties everywhere
    z[0] = 0.0
    z[0, 1::3] = -0.0
    z[1] = 1.5
    z[2, 3] = float("nan")
    z[3, 5] = float("inf")
    z[4, 7] = float("-inf")
    z[5, 9], z[5, 10], z[5, 11] = float("nan"), float("-inf"), float("inf")
    z[6, : v // 2] = float("-inf")
    z[7, 17] = 40.0
    z[8] = -1.0 - z[8].abs()
    z[8, 0] = -0.0
    z[9] = torch.randn(v, generator=gen) * 1e-39
    z[10] = torch.randn(v, generator=gen) * 3e38
    z[11, 2], z[11, 600 % v] = z[11].max(), z[11].max()                 # a tie at the top
    return z


def _grid():
    temps = (0.7, 1.0, 1.3, 0.9)
    out = []
    for k in (None, 1, 5, 50):
        for p in (None, 0.5, 0.9, 0.99):
            for m in (None, 0.01, 0.1):
                out.append(TransformProgram(temps[len(out) % 4], top_k=k, top_p=p, min_p=m))
    return out


class FakeSM90:
    """The SM90 extension's entries that the torch path calls, on CPU tensors: the C++ argument checks and the
    kernels' arithmetic (the row merge and stats-from-logits are the oracle's; topp_crossing chains each row in
    32-wide groups with one binary32 add per step and stops at the first group holding a crossing, like the
    warp). Lets CI run the torch path's CUDA wiring on a CPU."""

    calls: dict

    def __init__(self):
        self.calls = {"merge_stats": 0, "logits_stats": 0, "topp_crossing": 0}

    @staticmethod
    def _f32(t, dim):
        assert t.dtype == torch.float32 and t.dim() == dim and t.is_contiguous(), (t.dtype, t.shape)

    def merge_stats(self, tile_max, tile_sum, target_logit, logp, lse):
        self.calls["merge_stats"] += 1
        self._f32(tile_max, 2), self._f32(tile_sum, 2), self._f32(target_logit, 1), self._f32(logp, 1), self._f32(lse, 1)
        n = tile_max.shape[0]
        assert tile_max.shape == tile_sum.shape and tile_max.shape[1] >= 1 and target_logit.numel() == logp.numel() == lse.numel() == n
        lp, ls = numpy_contract.merge(tile_max.numpy(), tile_sum.numpy(), target_logit.numpy())
        logp.copy_(torch.from_numpy(lp))
        lse.copy_(torch.from_numpy(ls))

    def logits_stats(self, logits, targets, temperature, vocab_size, tile_max, tile_sum, target_logit):
        self.calls["logits_stats"] += 1
        assert logits.dtype == torch.float32 and logits.dim() == 2 and logits.stride(1) == 1
        n = logits.shape[0]
        nt = -(-vocab_size // 64)
        assert 1 <= vocab_size <= logits.shape[1]
        assert targets.dtype == torch.int64 and targets.is_contiguous() and targets.numel() == n
        self._f32(temperature, 1), self._f32(tile_max, 2), self._f32(tile_sum, 2)
        assert temperature.numel() == n and tile_max.shape == tile_sum.shape == (n, nt) and target_logit.numel() == n
        tm, ts, zs = numpy_contract.tile_stats(logits.numpy()[:, :vocab_size], temperature.numpy(), vocab_size)
        tile_max.copy_(torch.from_numpy(tm))
        tile_sum.copy_(torch.from_numpy(ts))
        target_logit.copy_(torch.from_numpy(zs[np.arange(n), targets.numpy()]))

    def topp_crossing(self, q, p):
        self.calls["topp_crossing"] += 1
        assert q.dtype == torch.float32 and q.dim() == 2 and q.stride(1) == 1
        assert isinstance(p, float) and float(np.float32(p)) == p
        qn, p32 = q.numpy(), np.float32(p)
        first = np.full(qn.shape[0], -1, dtype=np.int64)
        c = np.zeros(qn.shape[0], dtype=np.float32)
        live = np.ones(qn.shape[0], dtype=bool)
        for j0 in range(0, qn.shape[1], 32):
            grp = np.concatenate([c[:, None], qn[:, j0:j0 + 32]], axis=1)
            run = np.cumsum(grp, axis=1, dtype=np.float32)[:, 1:]          # c + q_j0, + q_j0+1, ... in order
            hit = (run >= p32).any(axis=1) & live
            first[hit] = j0 + (run[hit] >= p32).argmax(axis=1)
            c = run[:, -1]
            live &= ~hit & ~np.isnan(c)
            if not live.any():
                break
        return torch.from_numpy(first)


class FakeSM90Backend(SM90Backend):
    """The real SM90 backend class (its entries, argument preparation and output buffers) over FakeSM90 in place of
    the compiled extension, so that the transform program's device wiring runs on a CPU through the backend door."""

    def __init__(self, ext):
        super().__init__()
        self.ext = ext
        self.calls = ext.calls

    def _module(self):
        return self.ext


# (name, _TOPP_PREFIX, _SPARSE_TILE_DIV, fake extension): the default schedule, the prefix rounds with sparse
# and with dense tile statistics, and the CUDA wiring (FakeSM90).
CONFIGS = [("default", 4096, 4, False), ("prefix7-sparse", 7, 1, False), ("prefix7-dense", 7, 10**9, True),
           ("default-ext", 4096, 4, True)]


def _run_both(z, targets, program, **kw):
    a = program_logp_from_logits(z, targets, program, require_kept=False, path="numpy", **kw)
    b = program_logp_from_logits(z, targets, program, require_kept=False, path="torch", **kw)
    return a, b


@pytest.mark.parametrize("program", _grid(), ids=str)
def test_torch_path_bytes_equal_numpy(gen, monkeypatch, program):
    """Kept masks, logp, lse_kept and kept flags: the torch path equals the numpy path byte for byte, on rows
    with ties, signed zeros and non-finite values, through every schedule of the torch path."""
    v = 700
    z = _tricky_logits(gen, 16, v)
    ids = torch.randint(0, v, (16, 3), generator=gen)
    want_keep = kept_mask(z, program, path="numpy")
    ids[:, 0] = torch.where(want_keep.any(dim=1), want_keep.to(torch.uint8).argmax(dim=1), ids[:, 0])
    want = program_logp_from_logits(z, ids, program, require_kept=False, path="numpy")
    for name, prefix, div, ext in CONFIGS:
        fake = FakeSM90Backend(FakeSM90()) if ext else None
        monkeypatch.setattr(transforms, "_TOPP_PREFIX", prefix)
        monkeypatch.setattr(transforms, "_SPARSE_TILE_DIV", div)
        monkeypatch.setattr(transforms, "_device_backend", lambda dev, f=fake: f)
        got_keep = kept_mask(z, program, path="torch", rows_per_chunk=5)
        got = program_logp_from_logits(z, ids, program, require_kept=False, path="torch", rows_per_chunk=5)
        assert torch.equal(got_keep, want_keep), name
        for what, x, y in zip(("logp", "lse", "kept"), got, want):
            assert same_bytes(x, y), f"{name}: {what} differs"
        if fake is not None:
            assert fake.calls["merge_stats"] > 0
            if program.top_p is not None:
                assert fake.calls["topp_crossing"] > 0


@pytest.mark.parametrize("program", [TransformProgram(1.0, top_p=0.9), TransformProgram(0.7, top_k=50, top_p=0.9),
                                     TransformProgram(1.0, min_p=0.1), TransformProgram(1.3, top_p=0.99, min_p=0.01),
                                     TransformProgram(0.9, top_k=5)], ids=str)
def test_torch_path_bytes_equal_numpy_at_qwen3_vocabulary(gen, program):
    """V = 151936 (Qwen3-8B), the default schedule: top-p rows longer than the first ordered prefix."""
    v = 151936
    z = torch.randn(3, v, generator=gen) * 2
    z[1] *= 4                                                            # a peaked row: top-p stops early
    z[2, 5], z[2, 77] = float("nan"), float("-inf")
    ids = torch.randint(0, v, (3, 2), generator=gen)
    a, b = _run_both(z, ids, program)
    assert all(same_bytes(x, y) for x, y in zip(a, b))
    assert torch.equal(kept_mask(z, program, path="torch"), kept_mask(z, program, path="numpy"))


def test_torch_path_chunking_is_bit_neutral(gen):
    z = _tricky_logits(gen, 13, 300)
    ids = torch.randint(0, 300, (13,), generator=gen)
    prog = TransformProgram(0.8, top_k=50, top_p=0.9, min_p=0.01)
    ref = program_logp_from_logits(z, ids, prog, require_kept=False, path="torch", rows_per_chunk=13)
    for rows in (1, 4):
        got = program_logp_from_logits(z, ids, prog, require_kept=False, path="torch", rows_per_chunk=rows)
        assert all(same_bytes(x, y) for x, y in zip(got, ref))
        assert torch.equal(kept_mask(z, prog, path="numpy", rows_per_chunk=rows), kept_mask(z, prog, path="numpy"))


def test_default_paths_and_refusals(gen):
    z = torch.randn(2, 100, generator=gen)
    assert transforms.resolve_path(None, z.device) == "numpy"
    assert transforms.resolve_path(None, "cuda") == "torch"
    assert transforms.resolve_path("torch", z.device) == "torch"
    assert transforms.describe_path("torch", "cpu").startswith("torch on cpu")
    with pytest.raises(ContractInputError, match="path"):
        kept_mask(z, TransformProgram(top_k=2), path="cupy")
    for path in transforms.PATHS:
        with pytest.raises(ContractInputError, match="real vocabulary"):
            program_logp_from_logits(z, torch.tensor([0, 100]), TransformProgram(top_k=2), path=path)
        lp, lse, kept = program_logp_from_logits(z[:0], torch.zeros(0, dtype=torch.long), TransformProgram(top_k=2),
                                                 path=path)
        assert lp.shape == lse.shape == kept.shape == (0,)


@pytest.mark.parametrize("path", transforms.PATHS)
def test_nonfinite_logits_follow_the_kept_set(gen, path):
    """A non-finite z' makes a row's lse NaN when it lies in a set whose statistics are taken (section 4: the
    tile's m_t is NaN), and not otherwise (non-kept lanes are padding):
    - top-k orders NaN last and -inf below every finite value, so k smaller than the finite count drops them;
      +inf is first and is kept;
    - top-p's lse_K is NaN when K holds a non-finite value: the sum never reaches p and K stays whole;
    - min-p's m is NaN or +inf when K holds a NaN or +inf: no token passes, the kept set is empty (lse NaN,
      every target outside it); an -inf is below any threshold and is dropped;
    - the neutral program is the plain contract: any non-finite logit gives NaN."""
    v = 200
    base = torch.randn(v, generator=gen)
    rows = base.repeat(4, 1)
    rows[0, 3] = float("nan")
    rows[1, 3] = float("inf")
    rows[2, 3] = float("-inf")
    rows[3, 3] = -1e30                                                  # finite stand-in, never kept
    t = torch.full((4,), int(base.argmax()))
    t[1] = 3

    def run(prog):
        lp, lse, kept = program_logp_from_logits(rows, t, prog, require_kept=False, path=path)
        other = program_logp_from_logits(rows, t, prog, require_kept=False,
                                         path="numpy" if path == "torch" else "torch")
        assert all(same_bytes(x, y) for x, y in zip((lp, lse, kept), other))
        return lp, lse, kept, kept_mask(rows, prog, path=path)

    lp, lse, kept, keep = run(TransformProgram(0.7, top_k=5))
    assert bits_equal(lse[[0, 2]], lse[[3, 3]]) and torch.isfinite(lp[[0, 2]]).all()
    assert torch.isnan(lse[1]) and torch.isnan(lp[1]) and bool(keep[1, 3])
    assert not keep[[0, 2], 3].any() and int(keep[0].sum()) == 5
    lp, lse, kept, keep = run(TransformProgram(1.0, top_p=0.9))
    assert torch.isnan(lse[:3]).all() and keep[:3].all() and torch.isfinite(lse[3]) and not keep[3].all()
    lp, lse, kept, keep = run(TransformProgram(1.0, min_p=0.1))
    assert torch.isnan(lse[0]) and not keep[0].any() and not kept[0]
    assert torch.isnan(lse[1]) and not keep[1].any()          # m = +inf: z' - m is -inf or (+inf - +inf) NaN
    assert bits_equal(lse[2:3], lse[3:4]) and not keep[2, 3]
    lp, lse, kept, keep = run(TransformProgram(0.7))
    assert torch.isnan(lse[:3]).all() and torch.isfinite(lse[3]) and keep.all()


@pytest.mark.parametrize("path", transforms.PATHS)
def test_signed_zeros(path):
    """-0.0 and +0.0 tie (the lower id first); a kept set {-0.0} has lse +0 and its logp is +0.0, as numpy's
    minimum(d, 0) returns for d = -0.0."""
    z = torch.full((2, 70), -3.0)
    z[0, 0], z[0, 1] = -0.0, 0.0
    z[1, 0], z[1, 1] = 0.0, -0.0
    z[1, 5] = -0.0
    for k, want in ((1, [[0], [0]]), (2, [[0, 1], [0, 1]]), (3, [[0, 1, 2], [0, 1, 5]])):
        keep = kept_mask(z, TransformProgram(top_k=k), path=path)
        assert [r.nonzero().flatten().tolist() for r in keep] == want
    lp, lse, _ = program_logp_from_logits(z, torch.tensor([0, 0]), TransformProgram(top_k=1), path=path)
    assert lse.view(torch.int32).tolist() == [0, 0] and lp.view(torch.int32).tolist() == [0, 0]
