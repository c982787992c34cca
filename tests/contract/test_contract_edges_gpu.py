"""On the H200: the SM90 kernel at the edges of the tensor-core rule, and invalid per-row values on the device.

- Every edge class of tests/edge_inputs.py (subnormal operands and sums, cancellation, signed zero, overflow
  inside K and transient overflow, an infinite accumulator, non-finite inputs, the whole exponent range): the
  kernel's logits, lse and logp equal the oracle's bytes, and its logits equal cuBLAS's bf16 GEMM with FP32
  output (CONTRACT.md section 2).
- An invalid temperature or target in a device tensor (CONTRACT.md section 0.1) never ends the process or
  poisons the CUDA context: each case runs in a child process (this file run as a script), which must exit 0.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from fused_logp import linear_logp

pytestmark = pytest.mark.gpu

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))          # tests/: the helpers and tests/data


def _same(a, b, exact=False):
    """Byte equality; logits exactly (a NaN logit is 0x7FFFFFFF), lse/logp NaN for NaN (payload not fixed)."""
    from helpers import bits_equal, same_bytes
    a, b = a.detach().cpu(), b.detach().cpu()
    return bits_equal(a, b) if exact else same_bytes(a, b)


def _cublas(h, w):
    """cuBLAS's FP32-output GEMM of h [M, K] and w [N, K]. Tiny problems are tiled up to at least 64 x 256 first
    (every output depends on its own row and column only): below that cuBLAS may pick a kernel without tensor
    cores, whose bits follow plain FP32 FMAs, not section 2 (the probe's shapes, bench/probe_edges.py)."""
    m, n = h.shape[0], w.shape[0]
    hp = h.repeat(-(-64 // m), 1) if m < 64 else h
    wp = w.repeat(-(-256 // n), 1) if n < 256 else w
    return torch.mm(hp, wp.t(), out_dtype=torch.float32)[:m, :n]


@pytest.mark.parametrize("seed", [0, 1])
def test_kernel_equals_oracle_and_cublas_on_edge_classes(seed, gen):
    from edge_inputs import CASES, make_case

    seed = seed * 1000 + int(torch.randint(0, 999, (1,), generator=gen))
    failures = []
    for name in CASES:
        cls, h, w = make_case(name, seed, n=32, v=192)
        t = torch.randint(0, w.shape[0], (h.shape[0],), generator=gen)
        temp = torch.empty(h.shape[0]).uniform_(0.25, 4.0, generator=gen)
        want = linear_logp(h, w, t, temperature=temp, return_logits=True, backend="oracle", strict=True)
        hc, wc = h.cuda(), w.cuda()
        got = linear_logp(hc, wc, t.cuda(), temperature=temp.cuda(), return_logits=True, backend="sm90",
                          strict=True)
        for what in ("logits", "lse", "logp"):
            if not _same(getattr(got, what), getattr(want, what), exact=what == "logits"):
                failures.append(f"{name} ({cls}) {what}: kernel != oracle (seed {seed})")
        if not _same(got.logits, _cublas(hc, wc), exact=True):
            failures.append(f"{name} ({cls}) logits: kernel != cuBLAS (seed {seed})")
    assert not failures, "\n".join(failures)


def test_kernel_equals_oracle_on_whole_range_draws(gen):
    """Random bf16 bit patterns over the whole exponent range, with zeros, subnormals, +-inf and NaN."""
    from edge_inputs import bits_to_bf16, wide_bits

    rng = np.random.default_rng(int(torch.randint(0, 2 ** 31, (1,), generator=gen)))
    for k in (16, 32, 128):
        h = bits_to_bf16(wide_bits(rng, (24, k)))
        w = bits_to_bf16(wide_bits(rng, (200, k)))
        t = torch.from_numpy(rng.integers(0, 200, size=24))
        want = linear_logp(h, w, t, return_logits=True, backend="oracle", strict=True)
        got = linear_logp(h.cuda(), w.cuda(), t.cuda(), return_logits=True, backend="sm90", strict=True)
        for what in ("logits", "lse", "logp"):
            assert _same(getattr(got, what), getattr(want, what), exact=what == "logits"), f"K={k} {what}"
        assert _same(got.logits, _cublas(h.cuda(), w.cuda()), exact=True), f"K={k} cuBLAS"


@pytest.mark.parametrize("zero", [0.0, -0.0])
@pytest.mark.parametrize("regime", ["large", "subnormal"])
def test_zero_product_takes_no_part_in_emax(zero, regime):
    """CONTRACT.md section 2, step 3: a product with a zero factor never sets emax.
    large: 0 * +-2^100 (nominal -26) next to 15 products of 1.5 * 2^-53: the sum stays exact, 22.5 * 2^-53.
    subnormal: 0 * +-1 (nominal -126) next to 15 products of 1.5 * 2^-152: emax stays at the floor -133 and the
    sum is 22.5 * 2^-152 -> 2 * 2^-149. (Taking part, either zero would truncate the small products to +0.)"""
    small, big, want_value = ((1.5 * 2.0 ** -53, 2.0 ** 100, 22.5 * 2.0 ** -53) if regime == "large"
                              else (1.5 * 2.0 ** -76, 1.0, 2 * 2.0 ** -149))
    h = torch.zeros(2, 16)
    w = torch.ones(3, 16)
    if regime == "subnormal":
        w[:, 1:] = 2.0 ** -76
    h[:, 0] = zero
    h[:, 1:] = small
    w[:, 0] = big
    w[1, 0] = -big
    w[2, 0] = 2.0 ** -100
    h, w = h.bfloat16(), w.bfloat16()
    want = linear_logp(h, w, torch.tensor([0, 1]), return_logits=True, backend="oracle", strict=True).logits
    assert (want == want_value).all()
    got = linear_logp(h.cuda(), w.cuda(), torch.tensor([0, 1]).cuda(), return_logits=True, backend="sm90").logits
    assert _same(got, want, exact=True), (got.cpu().view(torch.int32), want.view(torch.int32))
    assert _same(_cublas(h.cuda(), w.cuda()), want, exact=True)


def test_kernel_equals_oracle_on_property_draws():
    """The draws of the CPU property test (tests/contract/test_contract_edges.py: the whole bf16 range, values near one
    scale, zeros against large weights): the kernel's logits equal the oracle's bit for bit."""
    from hypothesis import HealthCheck, given, settings

    from test_contract_edges import _bf16, bf16_problem

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(bf16_problem())
    def check(prob):
        h, w = _bf16(prob[0]), _bf16(prob[1])
        t = torch.zeros(h.shape[0], dtype=torch.int64)
        want = linear_logp(h, w, t, return_logits=True, backend="oracle")
        got = linear_logp(h.cuda(), w.cuda(), t.cuda(), return_logits=True, backend="sm90")
        assert _same(got.logits, want.logits, exact=True)
        assert _same(got.lse, want.lse) and _same(got.logp, want.logp)

    check()


def test_kernel_on_the_rule_points():
    """The hand-built points (one per sentence of CONTRACT.md section 2) give the kernel the H200 bits that cuBLAS
    gave (tests/data/rule-points-h200.json) and the oracle gives."""
    from edge_inputs import RULE_POINTS, point_operands

    with open(os.path.join(TESTS, "data", "rule-points-h200.json")) as f:
        h200 = json.load(f)["h200_bits"]
    bad = []
    for name, (hv, wv) in RULE_POINTS.items():
        h, w = point_operands(hv, wv)
        k = h.shape[1]
        h, w = h.expand(4, k).contiguous(), w.expand(64, k).contiguous()
        t = torch.zeros(4, dtype=torch.int64)
        got = linear_logp(h.cuda(), w.cuda(), t.cuda(), return_logits=True, backend="sm90").logits.cpu()
        orc = linear_logp(h, w, t, return_logits=True, backend="oracle").logits
        want = int(h200[name], 16)
        if not ((got.view(torch.int32) & 0xFFFFFFFF) == want).all() or not bits_equal_(got, orc):
            bad.append(f"{name}: kernel {int(got.view(torch.int32)[0, 0]) & 0xFFFFFFFF:#010x}, H200 {want:#010x}")
    assert not bad, "\n".join(bad)


def bits_equal_(a, b):
    from helpers import bits_equal
    return bits_equal(a, b)


def test_host_temperature_with_device_inputs_is_refused_at_the_call():
    """CONTRACT.md section 0.1: a value already on the host is checked there, before any launch."""
    from fused_logp.shared_contract.errors import ContractInputError

    h = torch.randn(3, 32).bfloat16().cuda()
    w = torch.randn(100, 32).bfloat16().cuda()
    with pytest.raises(ContractInputError, match=r"temperature must be finite and > 0"):
        linear_logp(h, w, torch.tensor([1, 2, 3]).cuda(), temperature=torch.tensor([1.0, 0.0, 1.0]),
                    backend="sm90")


# ---------------------------------------------------------------------------------------------------------
# invalid per-row values on the device: child processes
# ---------------------------------------------------------------------------------------------------------

BAD_ROW_CASES = ["temperature", "targets", "both_strict", "logits_entry", "shard_stats", "backward"]


@pytest.mark.parametrize("case", BAD_ROW_CASES)
def test_bad_row_values_never_end_the_process(case):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "..", "src"), TESTS]))
    proc = subprocess.run([sys.executable, "-P", os.path.abspath(__file__), case], capture_output=True, text=True,
                          timeout=300, env=env)
    tail = (proc.stdout + proc.stderr)[-4000:]
    assert proc.returncode == 0, f"child exited with {proc.returncode}:\n{tail}"
    assert "CHILD-OK" in proc.stdout, tail


def _child(case):
    from fused_logp import linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats
    from fused_logp.kernel.op import check_input_errors
    from fused_logp.shared_contract.errors import ContractInputError
    from helpers import bits_equal

    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(7)
    n, d, v = 12, 64, 300
    h = torch.randn(n, d, generator=g).bfloat16().to(dev)
    w = torch.randn(v, d, generator=g).bfloat16().to(dev)
    t = torch.randint(0, v, (n,), generator=g).to(dev)
    temp = (torch.rand(n, generator=g) + 0.5).to(dev)
    bad_rows = [1, 4, 5, 9]
    good = torch.ones(n, dtype=torch.bool)
    good[bad_rows] = False
    good_d = good.to(dev)
    report = {}

    def expect_error(word):
        try:
            check_input_errors()
        except ContractInputError as exc:
            assert word in str(exc), str(exc)
            report[f"error_{word}"] = str(exc)
        else:
            raise AssertionError(f"check_input_errors raised nothing for {word}")
        check_input_errors()                                   # cleared: nothing more to report

    def check_rows(res, ref):
        assert torch.isnan(res.logp[~good_d]).all() and torch.isnan(res.lse[~good_d]).all()
        assert bits_equal(res.logp[good_d], ref.logp[good_d]) and bits_equal(res.lse[good_d], ref.lse[good_d])

    ref = linear_logp(h, w, t, temperature=temp, backend="sm90", return_logits=True)
    tb = temp.clone()
    tb[torch.tensor(bad_rows)] = torch.tensor([0.0, -1.0, float("nan"), float("inf")], device=dev)
    tt = t.clone()
    tt[torch.tensor(bad_rows)] = torch.tensor([-1, v, v + 1000, 2 ** 40], device=dev)
    if case == "temperature":
        res = linear_logp(h, w, t, temperature=tb, backend="sm90", return_logits=True)
        check_rows(res, ref)
        assert bits_equal(res.logits, ref.logits)
        expect_error("temperature")
    if case == "targets":
        res = linear_logp(h, w, tt, temperature=temp, backend="sm90", return_logits=True)
        check_rows(res, ref)
        assert bits_equal(res.logits, ref.logits)
        expect_error("targets")
    if case == "both_strict":
        res = linear_logp(h, w, tt, temperature=tb, backend="sm90", strict=False)
        check_rows(res, ref)
        # strict mode raises at its next call once the device has finished the call that saw the bad rows
        torch.cuda.synchronize()
        try:
            linear_logp(h, w, t, temperature=temp, backend="sm90", strict=True)
        except ContractInputError as exc:
            assert "targets" in str(exc) and "temperature" in str(exc), str(exc)
            report["strict_error"] = str(exc)
        else:
            raise AssertionError("strict mode did not raise for the earlier invalid rows")
        check_input_errors()
    if case == "logits_entry":
        z = ref.logits
        tt = t.clone()
        tt[1] = -5
        tb = temp.clone()
        tb[4] = 0.0
        res = logp_from_logits(z, tt, temperature=tb, backend="sm90")
        expect_error("targets")
        assert "temperature" in report["error_targets"]
        base = logp_from_logits(z, t, temperature=temp, backend="sm90")
        rows = torch.tensor([1, 4], device=dev)
        assert torch.isnan(res.logp[rows]).all() and torch.isnan(res.lse[rows]).all()
        keep = torch.ones(n, dtype=torch.bool, device=dev)
        keep[rows] = False
        assert bits_equal(res.logp[keep], base.logp[keep]) and bits_equal(res.lse[keep], base.lse[keep])
        cols = torch.stack([t, t.flip(0)], dim=1)
        cols[9, 1] = v
        res2 = logp_from_logits(z, cols, temperature=temp, backend="sm90")
        assert torch.isnan(res2.logp[9]).all() and torch.isnan(res2.lse[9])
        expect_error("targets")
    if case == "shard_stats":
        tt = t.clone()
        tt[5] = v + 3
        a = shard_tile_stats(h, w[:128], tt, vocab_start=0, vocab_size=v, temperature=temp, backend="sm90")
        b = shard_tile_stats(h, w[128:], tt, vocab_start=128, vocab_size=v, temperature=temp, backend="sm90")
        res = merge_shard_stats([a, b], vocab_size=v, backend="sm90")
        assert torch.isnan(res.logp[5]) and torch.isnan(res.lse[5])
        keep = torch.ones(n, dtype=torch.bool, device=dev)
        keep[5] = False
        assert bits_equal(res.logp[keep], ref.logp[keep]) and bits_equal(res.lse[keep], ref.lse[keep])
        expect_error("targets")
    if case == "backward":
        hh = h.clone().requires_grad_(True)
        tt = t.clone()
        tt[4] = -1
        res = linear_logp(hh, w, tt, temperature=temp, backend="sm90")
        assert torch.isnan(res.logp[4]) and torch.isfinite(res.logp[good_d]).all()
        res.logp[good_d].sum().backward()
        assert torch.isfinite(hh.grad).all()
        expect_error("targets")
    # the CUDA context is still usable
    again = linear_logp(h, w, t, temperature=temp, backend="sm90", return_logits=True)
    torch.cuda.synchronize()
    assert bits_equal(again.logp, ref.logp) and bits_equal(again.logits, ref.logits)
    x = torch.ones(64, 64, device=dev) @ torch.ones(64, 64, device=dev)
    assert float(x[0, 0]) == 64.0
    print("CHILD-OK " + json.dumps(report))


if __name__ == "__main__":
    sys.path.insert(0, TESTS)
    _child(sys.argv[1])
