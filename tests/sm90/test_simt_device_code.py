"""The SM90 kernels' device code, run on the CPU (tests/sm90/simt): the forward statistics epilogue of every launch
configuration, the backward's dz epilogue of both dz configurations and the row merge, compiled from kernel/csrc with
g++ under a SIMT emulation of one thread block, against the numpy oracle (the dz: its formula in binary32) byte for
byte.

What this covers that no CPU test did before: the accumulator register layout of each consumer tile (which
thread's register holds which logit), the tree levels mapped onto lanes and xor-shuffles, the warp votes (T = 1,
rows beyond N, the target search), the non-finite tiles, the bias, ragged vocabularies, TP shards, the ping-pong
kernel's 64-column slices and its logits stores from registers, and the merge's chunks. What it does not cover:
the GEMM (wgmma), TMA, mbarriers, named barriers and the schedule (tests/sm90/test_pingpong_protocol.py models the
ping-pong kernel's waits; the GPU tests run everything). The two PTX instructions without a C++ spelling are
replaced by their exact models (simt.h): ex2.approx.ftz.f32 by the shipped table (checked here against the numpy
contract_ex2) and max.NaN.f32."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import helpers
import numpy as np
import pytest
import torch

from fused_logp.shared_contract import ex2_table
from fused_logp.shared_contract.numpy_contract import contract_ex2, row_lse, tile_stats

HERE = Path(__file__).resolve().parent / "simt"
CSRC = Path(__file__).resolve().parents[2] / "src" / "fused_logp" / "kernel" / "csrc"
CONFIGS = {"cta-128x256": 0, "cta-64x256": 1, "cta-64x128": 2, "pingpong-128x192": 3, "swapab-128": 5}
# the configurations whose consumer warps store the logits from their registers (and take widths in multiples of 64)
REGISTER_LOGITS = ("pingpong-128x192", "swapab-128")
POISON = np.float32(1234.5)
_P = ctypes.c_void_p


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    cxx = shutil.which("g++")
    if cxx is None:
        pytest.skip("no g++ on this machine: the SIMT harness is built with it")
    out = tmp_path_factory.mktemp("simt") / "harness.so"
    cmd = [cxx, "-std=c++17", "-O2", "-ffp-contract=off", "-fno-fast-math", "-fPIC", "-shared", "-I", str(HERE),
           "-I", str(CSRC), str(HERE / "harness.cpp"), "-o", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    h = ctypes.CDLL(str(out))
    h.simt_forward_stats.argtypes = [ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_longlong] + [_P] * 7
    h.simt_forward_stats.restype = ctypes.c_int
    h.simt_row_lse.argtypes = [ctypes.c_int, _P, _P, ctypes.c_int, ctypes.c_int, _P]
    h.simt_row_lse.restype = ctypes.c_int
    h.simt_logits_stats.argtypes = [_P, ctypes.c_longlong, _P, _P, ctypes.c_int, ctypes.c_int, _P, _P, _P]
    h.simt_backward_dz.argtypes = [ctypes.c_int, _P, ctypes.c_int, ctypes.c_int, ctypes.c_longlong] + [_P] * 7 + \
        [ctypes.c_longlong, ctypes.c_longlong]
    h.simt_backward_dz.restype = ctypes.c_int
    h.simt_ex2.argtypes = [ctypes.c_float]
    h.simt_ex2.restype = ctypes.c_float
    table = np.ascontiguousarray(ex2_table.table_bits())
    h.simt_set_ex2_table(table.ctypes.data_as(_P))
    h.table = table      # kept alive with the library
    return h


def ptr(a):
    return None if a is None else a.ctypes.data_as(_P)


def same_bytes(a, b) -> bool:
    """helpers.same_bytes on float32 arrays: byte equality, NaN matching NaN whatever its payload."""
    return helpers.same_bytes(torch.from_numpy(np.asarray(a, np.float32)), torch.from_numpy(np.asarray(b, np.float32)))


def logits(rng, n, v):
    z = (rng.standard_normal((n, v)) * 4).astype(np.float32)
    z[rng.integers(0, n, 3), rng.integers(0, v, 3)] = rng.choice([np.inf, -np.inf, np.nan], 3)
    z[n // 2, : min(v, 64)] = -np.inf            # a tile all -inf
    z[-1, rng.integers(0, v)] = 88.0              # a large logit
    return z


def run_stats(lib, config, z, temperature, targets, *, vocab_start=0, bias=None, want_logits=False):
    n, v = z.shape
    nt = -(-v // 64)
    tmax = np.full((n, nt), POISON, np.float32)
    tsum = tmax.copy()
    tlogit = np.full(n, POISON, np.float32)
    out = np.full((n, v), POISON, np.float32) if want_logits else None
    rc = lib.simt_forward_stats(CONFIGS[config], ptr(z), n, v, vocab_start, ptr(targets), ptr(temperature),
                                ptr(bias), ptr(tmax), ptr(tsum), ptr(tlogit), ptr(out))
    assert rc == 0
    return tmax, tsum, tlogit, out


def expected_stats(z, temperature, targets, vocab_start=0, bias=None):
    zb = z if bias is None else (z + bias[None, :]).astype(np.float32)
    tmax, tsum, zs = tile_stats(zb, temperature, z.shape[1])
    local = targets - vocab_start
    owned = (local >= 0) & (local < z.shape[1])
    tl = np.where(owned, zs[np.arange(z.shape[0]), np.clip(local, 0, z.shape[1] - 1)], POISON).astype(np.float32)
    return tmax, tsum, tl, zb


def temperatures(rng, n, kind):
    if kind == "one":
        return np.ones(n, np.float32)
    t = rng.uniform(0.25, 1.6, n).astype(np.float32)
    t[::5] = 1.0                                  # some rows at T = 1 inside warps that are not all at 1
    return t


# (rows, vocabulary width): rows beyond a warp's first eight (70), one row, a ragged vocabulary (653, 300), a
# width of whole 64-column tiles that is not whole 192- or 256-column tiles (704, 320)
SHAPES = [(70, 704), (1, 320), (130, 653), (17, 300), (64, 128)]


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("n,v", SHAPES)
@pytest.mark.parametrize("tkind", ["one", "mixed"])
def test_forward_statistics_equal_the_oracle(lib, config, n, v, tkind):
    if config in REGISTER_LOGITS and v % 64:
        pytest.skip(f"{config} takes vocabulary widths that are multiples of 64 (the backend refuses others)")
    rng = np.random.default_rng([n, v, len(config), len(tkind)])
    z = logits(rng, n, v)
    temp = temperatures(rng, n, tkind)
    targets = rng.integers(0, v, n).astype(np.int64)
    targets[0] = v - 1                            # the last real column
    if n > 2:
        targets[1] = 63                           # a tile's last lane
    got = run_stats(lib, config, z, temp, targets)
    want = expected_stats(z, temp, targets)
    for name, g, w in zip(("tile_max", "tile_sum", "target_logit"), got, want):
        assert same_bytes(g, w), f"{config} {name} differs at N={n}, V={v}, T {tkind}"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_tp_shard_with_bias(lib, config):
    """A shard starting at vocabulary id 1280 (a tile boundary), targets inside and outside it, a bias."""
    rng = np.random.default_rng(len(config))
    n, v, start = 40, 576, 1280
    z = logits(rng, n, v)
    temp = temperatures(rng, n, "mixed")
    bias = rng.standard_normal(v).astype(np.float32)
    targets = rng.integers(0, 4096, n).astype(np.int64)
    targets[:10] = start + rng.integers(0, v, 10)
    got = run_stats(lib, config, z, temp, targets, vocab_start=start, bias=bias)
    want = expected_stats(z, temp, targets, vocab_start=start, bias=bias)
    for name, g, w in zip(("tile_max", "tile_sum", "target_logit"), got, want):
        assert same_bytes(g, w), f"{config} {name}"


@pytest.mark.parametrize("config", list(CONFIGS))
def test_a_layout_error_is_caught(lib, config):
    """The negative control: accumulators placed with each thread's two rows exchanged give other statistics, so the
    comparisons above can fail."""
    rng = np.random.default_rng(7)
    n, v = 70, 704
    z = logits(rng, n, v)
    temp = temperatures(rng, n, "mixed")
    targets = rng.integers(0, v, n).astype(np.int64)
    lib.simt_set_mislaid(1)
    try:
        got = run_stats(lib, config, z, temp, targets)
    finally:
        lib.simt_set_mislaid(0)
    want = expected_stats(z, temp, targets)
    assert not same_bytes(got[0], want[0]) and not same_bytes(got[2], want[2])


@pytest.mark.parametrize("config", REGISTER_LOGITS)
@pytest.mark.parametrize("n,v,bias", [(70, 704, False), (200, 384, True), (1, 192, True), (130, 448, True)])
def test_logits_from_registers(lib, config, n, v, bias):
    """pingpong-128x192 and swapab-128 store the logits (plus the bias) from their accumulator registers, slice by
    slice: every element once, exactly the logits; the statistics of the same call unchanged."""
    rng = np.random.default_rng([n, v])
    z = logits(rng, n, v)
    temp = temperatures(rng, n, "mixed")
    b = rng.standard_normal(v).astype(np.float32) if bias else None
    targets = rng.integers(0, v, n).astype(np.int64)
    tmax, tsum, tl, out = run_stats(lib, config, z, temp, targets, bias=b, want_logits=True)
    etmax, etsum, etl, zb = expected_stats(z, temp, targets, bias=b)
    assert same_bytes(out, zb)
    assert same_bytes(tmax, etmax) and same_bytes(tsum, etsum) and same_bytes(tl, etl)


@pytest.mark.parametrize("n,v", [(33, 64), (96, 192), (200, 384), (256, 128), (257, 320), (600, 256)])
def test_swapped_operand_row_tiles(lib, n, v):
    """swapab-128 takes the batch in row tiles of 32-256 rows (rounded up to 32): one tile of 64, 96, 224 and 256 rows,
    two tiles of 160 rows (257) and three of 224 (600); the tree's levels 5 and 6 across its warps, the targets' list,
    a ragged last row tile, with the logits and bias, against the oracle."""
    rng = np.random.default_rng([n, v, 5])
    z = logits(rng, n, v)
    temp = temperatures(rng, n, "mixed")
    b = rng.standard_normal(v).astype(np.float32)
    targets = rng.integers(0, v, n).astype(np.int64)
    targets[: min(n, 40)] = rng.integers(0, min(v, 128), min(n, 40))    # many targets in the first CTA's rows
    tmax, tsum, tl, out = run_stats(lib, "swapab-128", z, temp, targets, bias=b, want_logits=True)
    etmax, etsum, etl, zb = expected_stats(z, temp, targets, bias=b)
    assert same_bytes(out, zb)
    for name, g, w in zip(("tile_max", "tile_sum", "target_logit"), (tmax, tsum, tl), (etmax, etsum, etl)):
        assert same_bytes(g, w), name


DZ_CONFIGS = {"cta-128x256": 0, "pingpong-128x192": 1}   # the dz epilogues of sm90.DZ_LAUNCHES (-dyn: the same)
BF16_POISON = np.uint16(0x7FC1)
LOG2E = np.float32(1.4426950408889634)


def dz_inputs(rng, n, v, off, bias):
    """Logits, the row inputs of the dz (lse above every scaled logit of the row, so that every exp2 argument is
    negative, as with a row's real lse), targets inside, at both edges of and outside the chunk [off, off + v)."""
    z = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    b = rng.standard_normal(v).astype(np.float32) if bias else None
    temp = temperatures(rng, n, "mixed")
    zb = z if b is None else (z + b[None, :]).astype(np.float32)
    lse = (np.maximum(zb.max(axis=1), 0) / temp + 0.5 + rng.uniform(0, 2, n)).astype(np.float32)
    coef = rng.standard_normal(n).astype(np.float32)
    gl = rng.standard_normal(n).astype(np.float32)
    t = off + rng.integers(-3, v + 3, n)
    t[: min(n, 4)] = np.array([off, off + v - 1, off - 1, off + v])[: min(n, 4)]
    return z, b, temp, lse, coef, gl, t.astype(np.int64)


def expected_dz(z, b, temp, lse, coef, gl, targets, off, width):
    """dz (dz_epilogue.cuh dz_pair) in numpy binary32 operations, on the columns [0, width) the store writes (beyond
    the chunk's v columns the accumulator is +0 and no bias is added): x = z a - b with a = rcp(T) log2(e),
    b = lse log2(e); dz = rcp(T) coef ex2(x) (+ rcp(T) g_logp on the target column), rounded to bf16, ties to even."""
    n, v = z.shape
    zz = np.zeros((n, width), np.float32)
    zz[:, :v] = z if b is None else z + b[None, :]
    rt = (np.float32(1) / temp).astype(np.float32)
    a, bb = rt * LOG2E, lse * LOG2E
    cs, gt = coef * rt, gl * rt
    d = cs[:, None] * contract_ex2(zz * a[:, None] - bb[:, None])
    col = targets - off
    own = np.nonzero((col >= 0) & (col < width))[0]
    d[own, col[own]] += gt[own]
    bits = d.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def run_dz(lib, config, z, b, temp, lse, coef, gl, targets, off, width):
    n, v = z.shape
    out = np.full((n, width + 8), BF16_POISON, np.uint16)
    rc = lib.simt_backward_dz(DZ_CONFIGS[config], ptr(z), n, v, off, ptr(targets), ptr(temp), ptr(b), ptr(lse),
                              ptr(coef), ptr(gl), out.ctypes.data_as(_P), width + 8, width)
    assert rc == 0
    return out


@pytest.mark.parametrize("config", list(DZ_CONFIGS))
@pytest.mark.parametrize("n,v,bias", [(70, 704, False), (1, 320, True), (130, 653, True), (17, 300, False),
                                      (200, 385, True), (129, 192, False), (64, 64, True)])
def test_backward_dz_equals_the_formula(lib, config, n, v, bias):
    """The dz epilogues (the CTA kernel's whole warpgroup tile, the ping-pong kernel's 64-column slices through one
    buffer) on accumulators in the wgmma layout, through their shared-memory staging in the 128-byte swizzle and the
    TMA store's box and clip (simt.h's model of both): every element of [N, width) (width = v rounded up to 8, the
    scratch columns included) equals the formula in binary32, bf16 bit for bit, and nothing beyond width is written.
    Widths that are not whole 64-, 192- or 256-column tiles, rows that are not whole 64- or 128-row tiles, bias or
    none, targets inside, at the edges of and outside the chunk."""
    rng = np.random.default_rng([n, v, len(config), int(bias)])
    off = 5000
    z, b, temp, lse, coef, gl, t = dz_inputs(rng, n, v, off, bias)
    width = -(-v // 8) * 8
    out = run_dz(lib, config, z, b, temp, lse, coef, gl, t, off, width)
    want = expected_dz(z, b, temp, lse, coef, gl, t, off, width)
    diff = np.argwhere(out[:, :width] != want)
    assert diff.size == 0, f"{config}: {len(diff)} elements differ, first at {diff[0].tolist()}"
    assert (out[:, width:] == BF16_POISON).all(), f"{config} wrote beyond the store's width"


@pytest.mark.parametrize("config", list(DZ_CONFIGS))
def test_a_dz_layout_error_is_caught(lib, config):
    """The negative control of the dz: accumulators placed with each thread's two rows exchanged give other bytes."""
    rng = np.random.default_rng(17)
    n, v, off = 70, 704, 0
    z, b, temp, lse, coef, gl, t = dz_inputs(rng, n, v, off, True)
    lib.simt_set_mislaid(1)
    try:
        out = run_dz(lib, config, z, b, temp, lse, coef, gl, t, off, v)
    finally:
        lib.simt_set_mislaid(0)
    assert (out[:, :v] != expected_dz(z, b, temp, lse, coef, gl, t, off, v)).any()


@pytest.mark.parametrize("threads", [64, 256])
@pytest.mark.parametrize("n,v", [(4, 151936), (5, 700), (2, 64), (3, 64 * 896 + 64), (3, 64 * 256 * 3)])
def test_row_merge_equals_the_oracle(lib, threads, n, v):
    """block_row_lse (merge_kernel with either block size, merge_ids_kernel): the max, then the terms by chunks into
    two shared buffers while thread 0 chains the chunk before; rows of one tile, of less than a chunk, of a chunk and
    one tile more (256 threads: 897 tiles), of exactly three chunks (64 threads: 768 tiles) and of Qwen's 2374."""
    rng = np.random.default_rng([n, v, threads])
    z = (rng.standard_normal((n, v)) * 3).astype(np.float32)
    z[1, 9] = np.nan
    tmax, tsum, _ = tile_stats(z, np.full(n, 0.7, np.float32), v)
    lse = np.full(n, POISON, np.float32)
    assert lib.simt_row_lse(threads, ptr(tmax), ptr(tsum), n, tmax.shape[1], ptr(lse)) == 0
    assert same_bytes(lse, row_lse(tmax, tsum))


@pytest.mark.parametrize("n,v,pad", [(9, 700, 12), (3, 64, 0), (5, 151936, 64), (33, 1000, 0)])
def test_statistics_from_logits_equal_the_oracle(lib, n, v, pad):
    """warp_logits_tile_stats (logits_stats_kernel: vLLM's gathered TP rows): the statistics and the target's scaled
    logit of FP32 logits rows with a row stride beyond the vocabulary (pad), a ragged last tile, non-finite lanes."""
    rng = np.random.default_rng([n, v, pad])
    z = logits(rng, n, v + pad)
    temp = temperatures(rng, n, "mixed")
    targets = rng.integers(0, v, n).astype(np.int64)
    targets[0] = v - 1
    nt = -(-v // 64)
    tmax = np.full((n, nt), POISON, np.float32)
    tsum = tmax.copy()
    tl = np.full(n, POISON, np.float32)
    lib.simt_logits_stats(ptr(z), v + pad, ptr(targets), ptr(temp), n, v, ptr(tmax), ptr(tsum), ptr(tl))
    want = expected_stats(np.ascontiguousarray(z[:, :v]), temp, targets)
    for name, g, w in zip(("tile_max", "tile_sum", "target_logit"), (tmax, tsum, tl), want):
        assert same_bytes(g, w), name


def test_ex2_model_equals_the_contract_exp2(lib):
    """simt.h's model of ex2.approx.ftz.f32 (what the emulated device code calls) equals the numpy contract_ex2 on
    special values, the edges of the scale and the flush, and 200,000 random arguments <= 0."""
    rng = np.random.default_rng(5)
    special = np.array([0.0, -0.0, -1e-45, -2.0 ** -23, -1.0, -1.5, -126.0, -126.5, -149.0, -149.99, -150.0,
                        -159.99, -160.0, -1e30, -np.inf, np.nan, 1e-8], np.float32)
    x = np.concatenate([special, -rng.exponential(20.0, 200_000).astype(np.float32),
                        -rng.uniform(0, 1, 1000).astype(np.float32)])
    got = np.array([lib.simt_ex2(float(a)) for a in x], np.float32)
    assert same_bytes(got, contract_ex2(x))
