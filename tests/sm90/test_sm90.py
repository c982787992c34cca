"""The SM90 kernel against the contract: repeatability, batch invariance, dual entry, oracle bytes, TP shards,
stats-from-logits and epilogue edge cases. Runs only on an SM90 GPU (H100/H200); elsewhere it skips.

Outputs are poisoned with a NaN sentinel before every kernel run (SM90Backend.poison) and every test checks
that no sentinel survives. Inputs are fresh random draws (never zeros); the seed is in the test report.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from helpers import bits_equal

pytestmark = pytest.mark.gpu

SENTINEL = 0x7FBADBAD          # a NaN payload no arithmetic produces
# sm90.LAUNCHES, besides "auto"
VARIANTS = ("cta-128x256", "cta-64x256", "cta-64x128", "pingpong-128x192", "swapab-128", "pingpong-128x192-dyn",
            "pingpong-128x192-mc2")
M_LIST = list(range(1, 18)) + [31, 63, 64, 65, 127, 128, 129, 255, 257, 1000, 4096]


def _cuda_ok():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.fixture(scope="module")
def be():
    if not _cuda_ok():
        pytest.skip("needs an SM90 (H100/H200) GPU")
    from fused_logp.kernel.sm90 import SM90Backend
    b = SM90Backend()
    ok, why = b.available()
    assert ok, why
    b.poison = SENTINEL
    b.allow_candidates = True          # a configuration not yet through this suite runs here first
    yield b
    b.launch = "auto"


@pytest.fixture(scope="module")
def oracle():
    from fused_logp.kernel.oracle import OracleBackend
    return OracleBackend()


@pytest.fixture
def cgen(gen):
    """A CUDA generator seeded from the test's CPU generator."""
    g = torch.Generator(device="cuda")
    g.manual_seed(int(torch.randint(0, 2**31 - 1, (1,), generator=gen)))
    return g


def beq(a, b):
    """Bitwise equality; NaN matches NaN whatever its payload."""
    a = a.detach().contiguous().cpu()
    b = b.detach().contiguous().cpu()
    if a.shape != b.shape:
        return False
    na, nb = torch.isnan(a), torch.isnan(b)
    if not torch.equal(na, nb):
        return False
    return torch.equal(torch.where(na, 0, a.view(torch.int32)), torch.where(nb, 0, b.view(torch.int32)))


def no_sentinel(*ts):
    for t in ts:
        if t is None:
            continue
        assert not bool((t.contiguous().view(torch.int32) == SENTINEL).any()), "an output element was not written"


def make_inputs(cgen, n, d, v_rows, *, scale_h=1.0, scale_w=0.02, temp="mixed", bias=False):
    h = (torch.randn(n, d, generator=cgen, device="cuda") * scale_h).to(torch.bfloat16)
    w = (torch.randn(v_rows, d, generator=cgen, device="cuda") * scale_w).to(torch.bfloat16)
    if temp == "one":
        t = torch.ones(n, device="cuda")
    else:
        t = torch.rand(n, generator=cgen, device="cuda") * 1.7 + 0.3
        t[::3] = 1.0
    b = torch.randn(v_rows, generator=cgen, device="cuda") if bias else None
    return h, w, t, b


def targets_for(cgen, n, v):
    return torch.randint(0, v, (n,), generator=cgen, device="cuda", dtype=torch.int64)


def run(be, h, w, tg, t, b, v, logits=False, variant="auto"):
    """linear_logp under configuration `variant`. Where the configuration refuses the shape (sm90: one that takes D
    and V in multiples of 64 only), the refusal, naming the argument, is checked and the call runs under
    cta-128x256."""
    from fused_logp.kernel import sm90
    if variant in sm90._MULTIPLE_OF_64 and (h.shape[1] % 64 or v % 64):
        be.launch = variant
        with pytest.raises(ValueError, match="multiples of 64, got D = "):
            be.linear_logp(h, w, tg, bias=b, temperature=t, return_logits=logits, vocab_size=v)
        variant = "cta-128x256"
    be.launch = variant
    out = be.linear_logp(h, w, tg, bias=b, temperature=t, return_logits=logits, vocab_size=v)
    no_sentinel(*out)
    return out


def cublas_logits(h, w):
    try:
        return torch.mm(h, w.t(), out_dtype=torch.float32)
    except TypeError:
        pytest.skip("torch.mm has no out_dtype here")


# ---------------------------------------------------------------------------------------------------------

def test_constants_checked_at_build(be):
    from fused_logp.kernel import sm90
    assert [int(x) for x in sm90._ext.contract_constants()] == sm90.expected_constants()


def test_device_ex2_log_match_cpu(be, gen):
    from fused_logp.shared_contract.numpy_contract import contract_ex2, contract_log
    bits = torch.randint(0, 2**32, (1 << 22,), generator=gen, dtype=torch.int64).to(torch.uint32)
    x = bits.view(torch.float32)
    special = torch.tensor([0.0, -0.0, 1.0, -1.0, float("inf"), float("-inf"), float("nan"), 1e-45, -1e-45,
                            -126.0, -126.5, -149.0, 1.1754944e-38, 1.1754942e-38])
    dom = torch.cat([x, special, -torch.rand(1 << 20, generator=gen) * 160.0,
                     torch.rand(1 << 20, generator=gen) * 4096.0])
    e, l = be.device_ex2log(dom.cuda())
    assert beq(l, torch.from_numpy(contract_log(dom.numpy())))
    nonpos = ~(dom > 0)                                 # the exp2's domain (NaN included)
    assert beq(e.cpu()[nonpos], torch.from_numpy(contract_ex2(dom[nonpos].numpy())))


def test_device_ex2_selftest_passes_and_is_in_provenance(be):
    """The first-use check (CONTRACT.md section 6): this GPU's ex2.approx.ftz.f32 equals the model on every
    binary32 x <= 0 and every x in [0, 2^-23); the record names the device and reaches the provenance."""
    from fused_logp.kernel import sm90
    ok, record = sm90.ex2_check(torch.device("cuda"))
    assert ok, record
    assert f"{(1 << 31) + 0x34000000} arguments, 0 differ" in record and torch.cuda.get_device_name() in record
    assert be.describe()["ex2_check"] == record


def test_device_ex2_selftest_detects_a_different_table(be):
    from fused_logp.kernel import sm90
    from fused_logp.shared_contract.ex2_table import table_bits
    t = torch.from_numpy(np.array(table_bits()).view(np.int32)).cuda()
    t[1000] += 1
    counts = sm90._ext.ex2_selftest(t).cpu()
    assert int(counts[1]) > 0 and int(counts[0]) == (1 << 31) + 0x34000000


@pytest.mark.parametrize("variant", VARIANTS)
def test_row_division_guard_edges(be, oracle, cgen, variant):
    """Rows of logits above 2^100 or below 2^-100 in magnitude, exact zeros and the temperature range's ends beside
    ordinary rows: the bytes equal the oracle's, and the logits are the same under every configuration."""
    n, d, v = 24, 256, 1000
    h, w, t, b = make_inputs(cgen, n, d, v, scale_w=0.5)
    scale = torch.ones(n, 1, device="cuda")
    scale[0:4] = 1e31                     # logits ~1e32 > 2^100
    scale[4:8] = 1e-33                    # logits ~1e-32 < 2^-100
    scale[8:10] = 0.0                     # exact zeros
    h = (h.float() * scale).to(torch.bfloat16)
    t = torch.rand(n, generator=cgen, device="cuda") + 0.5       # guarded-out logits above at T in [0.5, 1.5)
    t[12:18] = torch.tensor([2.0 ** -19, 2.0 ** 19, 2.0 ** -20, 2.0 ** 20, 0.7, 1.0], device="cuda")   # ordinary logits
    tg = targets_for(cgen, n, v)
    base = run(be, h, w, tg, t, None, v, logits=True, variant="cta-128x256")
    out = run(be, h, w, tg, t, None, v, logits=True, variant=variant)
    for a, c in zip(base, out):
        assert beq(a, c)
    _oracle_compare(be, oracle, h, w, tg, t, None, v, variants=(variant,))


@pytest.mark.parametrize("variant", ("auto",) + VARIANTS)
def test_l1_repeat_100(be, cgen, variant):
    n, d, v = 129, 4096, 151936
    h, w, t, b = make_inputs(cgen, n, d, v)
    tg = targets_for(cgen, n, v)
    ref = run(be, h, w, tg, t, b, v, variant=variant)
    for _ in range(99 if variant == "auto" else 19):
        out = run(be, h, w, tg, t, b, v, variant=variant)
        assert bits_equal(out[0], ref[0]) and bits_equal(out[1], ref[1])


@pytest.mark.parametrize("shape", [(1024, 32003), (4096, 151936)])
def test_l2_batch_invariance(be, cgen, shape):
    d, v = shape
    pool = 16384 if d == 4096 else 4096
    h, w, t, _ = make_inputs(cgen, pool, d, v)
    tg = targets_for(cgen, pool, v)
    ref_logp, ref_lse, _ = run(be, h, w, tg, t, None, v)
    ms = M_LIST + ([16384] if d == 4096 else [])
    for variant in ("auto",) + VARIANTS:
        for m in ms:
            if d == 4096 and variant != "auto" and m > 1000:
                continue
            idx = torch.randperm(pool, device="cuda", generator=cgen)[:m]
            logp, lse, _ = run(be, h[idx].contiguous(), w, tg[idx].contiguous(), t[idx].contiguous(), None, v,
                               variant=variant)
            assert bits_equal(logp, ref_logp[idx]), (variant, m)
            assert bits_equal(lse, ref_lse[idx]), (variant, m)


@pytest.mark.parametrize("bias", [False, True])
def test_dual_entry_and_cublas_logits(be, cgen, bias):
    n, d, v = 300, 4096, 151936
    h, w, t, b = make_inputs(cgen, n, d, v, bias=bias)
    tg = targets_for(cgen, n, v)
    for variant in ("auto",) + VARIANTS:
        a = run(be, h, w, tg, t, b, v, logits=False, variant=variant)
        c = run(be, h, w, tg, t, b, v, logits=True, variant=variant)
        assert a[2] is None and c[2].shape == (n, v)
        assert bits_equal(a[0], c[0]) and bits_equal(a[1], c[1])
        z = cublas_logits(h, w)
        if b is not None:
            z = z + b[None, :]
        assert bits_equal(c[2], z), f"variant {variant}: logits differ from cuBLAS on " \
            f"{int((c[2].view(torch.int32) != z.view(torch.int32)).sum())} of {z.numel()}"


def _oracle_compare(be, oracle, h, w, tg, t, b, v, variants=("auto",) + VARIANTS):
    ref = oracle.linear_logp(h.cpu(), w.cpu(), tg.cpu(), bias=None if b is None else b.cpu(),
                             temperature=t.cpu(), return_logits=True, vocab_size=v)
    for variant in variants:
        out = run(be, h, w, tg, t, b, v, logits=True, variant=variant)
        assert beq(out[2], ref[2]), f"logits differ from the oracle (variant {variant}) on " \
            f"{int((out[2].cpu().view(torch.int32) != ref[2].view(torch.int32)).sum())} of {ref[2].numel()}"
        assert beq(out[1], ref[1]), f"lse differs (variant {variant})"
        assert beq(out[0], ref[0]), f"logp differs (variant {variant})"


# The CPU oracle emulates every k16 step: keep rows x cols x D/16 small (about 20 us each on one core). The last
# shape is one that every configuration takes (D and V multiples of 64; weight rows beyond V).
@pytest.mark.parametrize("n,d,v_rows,v", [(1, 16, 64, 64), (5, 48, 100, 97), (70, 64, 1000, 1000),
                                          (33, 80, 200, 131), (130, 256, 160, 160), (3, 4096, 130, 130),
                                          (66, 208, 300, 257), (70, 128, 704, 640)])
@pytest.mark.parametrize("bias", [False, True])
def test_oracle_small_shapes(be, oracle, cgen, n, d, v_rows, v, bias):
    h, w, t, b = make_inputs(cgen, n, d, v_rows, scale_h=1.0, scale_w=0.5, bias=bias)
    tg = targets_for(cgen, n, v)
    _oracle_compare(be, oracle, h, w, tg, t, b, v)


def test_oracle_full_size_sampled_rows(be, oracle, cgen):
    """D=4096, V=151936: logits of every row equal cuBLAS; 2 rows x 1024 sampled columns through the oracle
    GEMM; the statistics and merge of 64 rows through the oracle's numpy code over the kernel's logits."""
    from fused_logp.shared_contract.numpy_contract import merge, tile_stats
    n, d, v = 256, 4096, 151936
    h, w, t, _ = make_inputs(cgen, n, d, v)
    tg = targets_for(cgen, n, v)
    logp, lse, z = run(be, h, w, tg, t, None, v, logits=True)
    assert bits_equal(z, cublas_logits(h, w))
    rows = torch.randperm(n, generator=cgen, device="cuda")[:64].cpu()
    zc = z.cpu()[rows].numpy()
    tc = t.cpu()[rows].numpy()
    tmax, tsum, zs = tile_stats(zc, tc, v)
    tl = zs[np.arange(len(rows)), tg.cpu()[rows].numpy()]
    rl, rs = merge(tmax, tsum, tl)
    assert beq(logp.cpu()[rows], torch.from_numpy(rl)) and beq(lse.cpu()[rows], torch.from_numpy(rs))
    from fused_logp.shared_contract.gemm_rule import hopper_logits
    two = rows[:2].cuda()
    cols = torch.randperm(v, generator=cgen, device="cuda")[:1024]
    cols[:4] = torch.tensor([0, 63, 64, v - 1], device="cuda")
    ref = hopper_logits(h[two].cpu(), w[cols].cpu())
    assert beq(z[two][:, cols], ref)


def _tp(be, h, w, tg, t, b, v, ranks, rows_total):
    width = rows_total // ranks
    tms, tss, tl = [], [], None
    for r in range(ranks):
        start = r * width
        st = be.shard_stats(h, w[start:start + width].contiguous(), tg, vocab_start=start, vocab_size=v,
                            bias=None if b is None else b[start:start + width].contiguous(), temperature=t,
                            return_logits=False)
        no_sentinel(st["tile_max"], st["tile_sum"], st["target_logit"])
        assert st["tile_offset"] == start // 64
        tms.append(st["tile_max"])
        tss.append(st["tile_sum"])
        tl = st["target_logit"] if tl is None else torch.where(st["target_owned"], st["target_logit"], tl)
    return be.merge_stats(torch.cat(tms, 1), torch.cat(tss, 1), tl)


@pytest.mark.parametrize("d", [512, 4096])
def test_tp_shards_and_megatron_padding(be, cgen, d):
    n, v, padded = 77, 151936, 152064
    h, w, t, b = make_inputs(cgen, n, d, padded, bias=True)
    tg = targets_for(cgen, n, v)
    tg[:4] = torch.tensor([0, v - 1, 76031, 76032], device="cuda")
    ref = run(be, h, w[:v].contiguous(), tg, t, b[:v].contiguous(), v)
    pad = run(be, h, w, tg, t, b, v)
    assert bits_equal(pad[0], ref[0]) and bits_equal(pad[1], ref[1])
    for ranks in (2, 4, 8):
        logp, lse = _tp(be, h, w, tg, t, b, v, ranks, padded)
        no_sentinel(logp, lse)
        assert bits_equal(logp, ref[0]) and bits_equal(lse, ref[1]), ranks


def test_shard_start_must_be_tile_aligned(be, cgen):
    h, w, t, _ = make_inputs(cgen, 3, 64, 128)
    with pytest.raises(ValueError):
        be.shard_stats(h, w, targets_for(cgen, 3, 128), vocab_start=32, vocab_size=256, bias=None,
                       temperature=t, return_logits=False)


@pytest.mark.parametrize("n,d,v", [(200, 4096, 151936), (40, 256, 1000)])
def test_stats_from_logits_equal_fused(be, oracle, cgen, n, d, v):
    h, w, t, b = make_inputs(cgen, n, d, v, bias=True)
    tg = targets_for(cgen, n, v)
    logp, lse, z = run(be, h, w, tg, t, b, v, logits=True)
    wide = torch.randn(n, v + 13, generator=cgen, device="cuda")
    wide[:, :v] = z                           # columns beyond vocab_size never enter a statistic
    be.launch = "auto"
    l2, s2 = be.stats_from_logits(wide, tg, temperature=t, vocab_size=v)
    no_sentinel(l2, s2)
    assert bits_equal(l2, logp) and bits_equal(s2, lse)
    if v <= 1000:
        ro = oracle.stats_from_logits(wide.cpu(), tg.cpu(), temperature=t.cpu(), vocab_size=v)
        assert beq(l2, ro[0]) and beq(s2, ro[1])


def test_epilogue_extremes(be, oracle, cgen):
    """Logits near +-1300, all-negative logits with a ragged last tile, targets at tile edges."""
    n, d, v = 16, 256, 1000
    h = (torch.rand(n, d, generator=cgen, device="cuda") + 0.5).to(torch.bfloat16)
    w = (torch.rand(v, d, generator=cgen, device="cuda") * 4.0 + 1.0).to(torch.bfloat16)
    sign = torch.where(torch.rand(n, 1, generator=cgen, device="cuda") < 0.5, -1.0, 1.0)
    h = (h.float() * sign).to(torch.bfloat16)                     # row logits all +~1300 or all -~1300
    t = torch.ones(n, device="cuda")
    t[1::2] = torch.rand(n // 2, generator=cgen, device="cuda") + 0.5
    edges = torch.tensor([0, v - 1, 63, 64, 7, 8, 15, 16], device="cuda")
    tg = edges.repeat(2)
    ref = oracle.linear_logp(h.cpu(), w.cpu(), tg.cpu(), bias=None, temperature=t.cpu(), return_logits=True,
                             vocab_size=v)
    z = ref[2]
    assert float(z.abs().min()) > 500 and float(z.abs().max()) < 3000
    for variant in ("auto",) + VARIANTS:
        out = run(be, h, w, tg, t, None, v, logits=True, variant=variant)
        assert beq(out[2], ref[2]) and beq(out[1], ref[1]) and beq(out[0], ref[0]), variant
    # all-negative logits, ragged last tile
    h2 = (torch.rand(n, d, generator=cgen, device="cuda") + 0.1).to(torch.bfloat16)
    w2 = (-torch.rand(v, d, generator=cgen, device="cuda") * 0.05 - 0.01).to(torch.bfloat16)
    _oracle_compare(be, oracle, h2, w2, tg, t, None, v)


def test_nonfinite_rows_are_nan_and_isolated(be, oracle, cgen):
    n, d, v = 12, 128, 300
    h, w, t, _ = make_inputs(cgen, n, d, v, scale_w=0.5)
    tg = targets_for(cgen, n, v)
    clean = run(be, h, w, tg, t, None, v)
    h2 = h.clone()
    h2[3, 5] = float("inf")
    h2[7, 9] = float("nan")
    t2 = t.clone()
    big = run(be, h2, w, tg, t2, None, v, logits=True)
    for r in (3, 7):
        assert math.isnan(float(big[0][r])) and math.isnan(float(big[1][r]))
    keep = [i for i in range(n) if i not in (3, 7)]
    assert bits_equal(big[0][keep], clean[0][keep]) and bits_equal(big[1][keep], clean[1][keep])
    ref = oracle.linear_logp(h2.cpu(), w.cpu(), tg.cpu(), bias=None, temperature=t2.cpu(), return_logits=True,
                             vocab_size=v)
    assert beq(big[0], ref[0]) and beq(big[1], ref[1])


def test_float64_accuracy(be, cgen):
    n, d, v = 64, 4096, 151936
    h, w, t, b = make_inputs(cgen, n, d, v, bias=True)
    tg = targets_for(cgen, n, v)
    logp, lse, _ = run(be, h, w, tg, t, b, v)
    z = (h.double() @ w.double().t() + b.double()[None]) / t.double()[:, None]
    rlse = torch.logsumexp(z, 1)
    rlogp = z.gather(1, tg[:, None]).squeeze(1) - rlse
    assert float(((lse.double() - rlse).norm() / rlse.norm())) < 1e-5
    assert float((logp.double() - rlogp).abs().max()) < 5e-3


@pytest.mark.parametrize("variant,n,d,v", [
    ("pingpong-128x192", 1000, 448, 44800), ("pingpong-128x192", 130, 64, 13440),
    ("pingpong-128x192", 77, 4096, 151936),
    ("swapab-128", 129, 4096, 151936), ("swapab-128", 300, 64, 13440), ("swapab-128", 1000, 448, 44800),
    ("swapab-128", 40, 256, 1024), ("swapab-128", 9, 128, 1088),
    ("pingpong-128x192-dyn", 1000, 448, 44800), ("pingpong-128x192-dyn", 130, 64, 13440),
    ("pingpong-128x192-dyn", 77, 4096, 151936), ("pingpong-128x192-dyn", 2100, 256, 23040),
    ("pingpong-128x192-mc2", 1000, 448, 44800), ("pingpong-128x192-mc2", 300, 64, 13440),
    ("pingpong-128x192-mc2", 77, 4096, 151936), ("pingpong-128x192-mc2", 2100, 256, 23040)])
def test_register_store_kernels_equal_the_cta_kernel(be, cgen, variant, n, d, v):
    """The kernels whose consumer warps store the logits from their registers against cta-128x256, byte for byte. The
    persistent ping-pong kernel: many 128x192 tiles a CTA (the two consumers alternate, the ring's sequence runs on
    across tiles: 7 K blocks in a 5-stage ring), more tiles than SMs with one K block, and the full-size shape. The
    swapped-operand kernel: 129 rows (a 160-row tile), two 160-row tiles, four 256-row tiles with 7 K blocks, one
    64-row tile, and 9 rows in a 32-row tile with an odd number of 64-column tiles (the last CTA's second consumer
    beyond the width). The ping-pong kernel on the dynamic schedule: the ping-pong kernel's shapes, and 17 m tiles
    with many tiles a CTA. The ping-pong kernel in clusters of two CTAs: 8 m tiles (four pairs) with 7 K blocks, 3
    and 1 m tiles (the last pair's second tile beyond the rows, its CTA storing nothing), and 17 m tiles with more
    pairs than clusters. With and without the logits, bias, mixed temperatures, a NaN and an inf row, targets at
    the slice and tile edges, ragged rows, a TP shard."""
    h, w, t, b = make_inputs(cgen, n, d, v, bias=True)
    h[n // 2, 3] = float("nan")
    h[n - 1, 0] = float("inf")
    tg = targets_for(cgen, n, v)
    edges = torch.tensor([0, 63, 64, 127, 128, 191, 192, v - 1], device="cuda")
    tg[:8] = edges
    ref = run(be, h, w, tg, t, b, v, logits=True, variant="cta-128x256")
    out = run(be, h, w, tg, t, b, v, logits=True, variant=variant)
    assert beq(out[0], ref[0]) and beq(out[1], ref[1]) and beq(out[2], ref[2])
    plain = run(be, h, w, tg, t, b, v, variant=variant)
    assert beq(plain[0], ref[0]) and beq(plain[1], ref[1])
    assert math.isnan(float(out[0][n // 2])) and math.isnan(float(out[1][n - 1]))
    start, width = 64 * 3, 64 * ((v // 64) // 2)
    shard = {}
    for name in ("cta-128x256", variant):
        be.launch = name
        st = be.shard_stats(h, w[start:start + width].contiguous(), tg, vocab_start=start, vocab_size=v,
                            bias=b[start:start + width].contiguous(), temperature=t, return_logits=True)
        no_sentinel(st["tile_max"], st["tile_sum"], st["target_logit"], st["logits"])
        shard[name] = st
    for k in ("tile_max", "tile_sum", "logits"):
        assert beq(shard[variant][k], shard["cta-128x256"][k]), k
    owned = shard["cta-128x256"]["target_owned"]
    assert beq(shard[variant]["target_logit"][owned], shard["cta-128x256"]["target_logit"][owned])
    be.launch = "auto"


@pytest.mark.parametrize("n", [32, 200, 257])
def test_swapped_operands_give_the_same_logits_on_edge_classes(be, gen, n):
    """swapab-128 multiplies with the weight as the wgmma's A operand: every edge class of the tensor-core rule
    (tests/edge_inputs.py: subnormal operands and sums, cancellation, signed zero, overflow inside K, non-finite
    inputs; K zero-padded to a multiple of 64, which adds no term), and random bit patterns over the whole bf16 range,
    in row tiles of 32, 224 and 160 rows: logits, lse and logp byte for byte equal to cta-128x256's."""
    from edge_inputs import CASES, bits_to_bf16, make_case, wide_bits
    seed = int(torch.randint(0, 10 ** 6, (1,), generator=gen))
    cases = []
    for name in CASES:
        _, h, w = make_case(name, seed, n=n, v=192)
        cases.append((name, h, w))
    rng = np.random.default_rng(seed)
    for k in (64, 128):
        cases.append((f"whole-range K={k}", bits_to_bf16(wide_bits(rng, (n, k))), bits_to_bf16(wide_bits(rng, (256, k)))))
    failures = []
    for name, h, w in cases:
        pad = -h.shape[1] % 64
        h = torch.nn.functional.pad(h.float(), (0, pad)).to(torch.bfloat16).cuda()
        w = torch.nn.functional.pad(w.float(), (0, pad)).to(torch.bfloat16).cuda()
        v = w.shape[0]
        tg = torch.from_numpy(rng.integers(0, v, n)).cuda()
        t = torch.from_numpy(rng.uniform(0.25, 4.0, n).astype(np.float32)).cuda()
        ref = run(be, h, w, tg, t, None, v, logits=True, variant="cta-128x256")
        out = run(be, h, w, tg, t, None, v, logits=True, variant="swapab-128")
        for i, what in enumerate(("logp", "lse", "logits")):
            if not beq(out[i], ref[i]):
                failures.append(f"{name} {what}")
    be.launch = "auto"
    assert not failures, failures


def test_unknown_launch_is_refused(be, cgen):
    h, w, t, _ = make_inputs(cgen, 3, 64, 128)
    be.launch = "cta-96x256"
    try:
        with pytest.raises(ValueError, match="launch must be"):
            be.linear_logp(h, w, targets_for(cgen, 3, 128), bias=None, temperature=t, return_logits=False,
                           vocab_size=128)
    finally:
        be.launch = "auto"


def test_launch_names_are_the_extensions(be, cgen):
    """The launch configurations are names on both sides: the extension's list is sm90.LAUNCHES (and this test's
    VARIANTS), and the extension itself refuses a name it does not know, naming the accepted ones."""
    from fused_logp.kernel import sm90
    ext = be._module()
    assert list(ext.launch_names()) == list(sm90.LAUNCHES) == list(VARIANTS)
    assert list(ext.dz_launch_names()) == list(sm90.DZ_LAUNCHES)
    h, w, t, _ = make_inputs(cgen, 3, 64, 128)
    nt = 2
    out = [torch.empty(3, nt, device="cuda"), torch.empty(3, nt, device="cuda"), torch.empty(3, device="cuda")]
    tg = targets_for(cgen, 3, 128)
    with pytest.raises(RuntimeError, match="launch must be one of cta-128x256, cta-64x256, "
                                           "cta-64x128, pingpong-128x192, swapab-128, pingpong-128x192-dyn, "
                                           "pingpong-128x192-mc2; got 'cta-96x256'"):
        ext.fused_stats(h, w, tg, t, None, 0, 128, out[0], out[1], out[2], None, "cta-96x256", 0)
    # the extension refuses what the ping-pong kernel does not take, as the backend does before it
    h80, w80, _, _ = make_inputs(cgen, 3, 80, 128)
    with pytest.raises(RuntimeError, match="pingpong-128x192 takes D a multiple of 64, got D = 80"):
        ext.fused_stats(h80, w80, tg, t, None, 0, 128, out[0], out[1], out[2], None, "pingpong-128x192", 0)
    out3 = [torch.empty(3, 3, device="cuda"), torch.empty(3, 3, device="cuda"), torch.empty(3, device="cuda")]
    w130 = torch.cat([w, w[:2]]).contiguous()
    with pytest.raises(RuntimeError, match="multiple of 64, got 130"):
        ext.fused_stats(h, w130, tg, t, None, 0, 130, out3[0], out3[1], out3[2], None, "pingpong-128x192", 0)
    # a message with numbers in it raises (they are formatted by num(), launch.cuh), for an output of the wrong shape
    with pytest.raises(RuntimeError, match=r"tile_max must be a contiguous CUDA float32 \[3, 2\] tensor"):
        ext.fused_stats(h, w, tg, t, None, 0, 128, out3[0], out[1], out[2], None, "cta-128x256", 0)
    with pytest.raises(RuntimeError, match=r"hooks must be in \[0, 3\]; got 4"):
        ext.fused_stats(h, w, tg, t, None, 0, 128, out[0], out[1], out[2], None, "cta-128x256", 4)


@pytest.mark.parametrize("n,d,v,pad", [(1, 4096, 151936, 64), (7, 256, 4000 + 33, 30), (300, 512, 9000, 0)])
def test_serving_head_and_merge_of_ids(be, cgen, n, d, v, pad):
    """The serving entries: logits_and_stats (one launch) gives the bytes of shard_tile_stats at T = 1 with targets
    0; merge_ids (one launch) gives, for int64 and int32 ids [N], [N, C] and strided [N, C], the bytes of the merge
    after a gather (logp_from_logits at T = 1) and of the trainer's linear_logp; a row with an id outside the
    vocabulary is NaN and counted, and the next check names targets."""
    from fused_logp import linear_logp, logp_from_logits, shard_tile_stats
    from fused_logp.kernel.op import check_input_errors, logits_and_stats, logp_of_ids
    from fused_logp.shared_contract.errors import ContractInputError

    h, w, _, b = make_inputs(cgen, n, d, v + pad, bias=True)
    for bias in (None, b):
        be.launch = "auto"
        tm, ts, z, tl = be.logits_and_stats(h, w[:v], zeros=torch.zeros(n, dtype=torch.int64, device="cuda"),
                                            ones=torch.ones(n, device="cuda"), vocab_size=v,
                                            bias=None if bias is None else bias[:v].float())
        no_sentinel(tm, ts, z, tl)
        st = logits_and_stats(h, w, vocab_size=v, bias=bias, backend="sm90")
        ref = shard_tile_stats(h, w[:v], torch.zeros(n, dtype=torch.int64, device="cuda"), vocab_start=0,
                               vocab_size=v, bias=None if bias is None else bias[:v], return_logits=True,
                               backend="sm90")
        for a, r in ((st.tile_max, ref.tile_max), (st.tile_sum, ref.tile_sum), (st.logits, ref.logits),
                     (st.target_logit, ref.target_logit), (tm, ref.tile_max), (ts, ref.tile_sum), (z, ref.logits)):
            assert beq(a, r)
        assert bool(st.target_owned.all()) and st.unit_temperature
        wide = torch.randint(0, v, (n, 2 * 5), generator=cgen, device="cuda")
        wide[0, 1] = v - 1
        for ids in (wide[:, 0], wide[:, :5].contiguous(), wide[:, ::2], wide[:, :5].to(torch.int32)):
            lp, ls = be.merge_ids(st.tile_max, st.tile_sum, st.logits, ids, vocab_size=v,
                                  bad_rows=torch.zeros(2, dtype=torch.int64, device="cuda"),
                                  mirror=torch.zeros(1, dtype=torch.int64, pin_memory=True))
            no_sentinel(lp, ls)
            got = logp_of_ids(st, ids, vocab_size=v, backend="sm90")
            two = logp_from_logits(st.logits, ids.to(torch.int64), temperature=1.0, backend="sm90")
            assert beq(lp, two.logp) and beq(got.logp, two.logp) and beq(got.lse, two.lse) and beq(ls, two.lse)
            tr = linear_logp(h, w, ids if ids.dim() == 1 else ids[:, 0].contiguous(), bias=bias, vocab_size=v,
                             backend="sm90")
            first = got.logp if ids.dim() == 1 else got.logp[:, 0]
            assert beq(first, tr.logp) and beq(got.lse, tr.lse)
    check_input_errors()
    bad = wide[:, :3].clone()
    bad[n - 1, 2] = v
    if n > 1:
        bad[0, 0] = -1
    counter = torch.tensor([5, 0], dtype=torch.int64, device="cuda")
    mirror = torch.zeros(1, dtype=torch.int64, pin_memory=True)
    lp, ls = be.merge_ids(st.tile_max, st.tile_sum, st.logits, bad, vocab_size=v, bad_rows=counter, mirror=mirror)
    nbad = 1 if n == 1 else 2
    torch.cuda.synchronize()
    assert counter.tolist() == [5 + nbad, 0] and int(mirror[0]) == 5 + nbad      # the ticket is back at 0
    rows = torch.zeros(n, dtype=torch.bool, device="cuda")
    rows[n - 1] = True
    rows[0] = True
    assert bool(torch.isnan(lp[rows]).all()) and bool(torch.isnan(ls[rows]).all())
    assert not bool(torch.isnan(lp[~rows]).any())
    got = logp_of_ids(st, bad, vocab_size=v, backend="sm90")
    assert beq(got.logp, lp) and beq(got.lse, ls)
    with pytest.raises(ContractInputError, match=f"targets .*: {nbad} row"):
        check_input_errors()
    check_input_errors()                       # reported once
    logp_of_ids(st, bad, vocab_size=v, backend="sm90", strict=False)
    torch.cuda.synchronize()                   # the mirror shows it: the next call reports it without waiting
    with pytest.raises(ContractInputError, match=f"targets .*: {nbad} row"):
        logp_of_ids(st, wide[:, :3], vocab_size=v, backend="sm90", strict=True)
    check_input_errors()
