"""CONTRACT.md section 2 at the edges, on the CPU.

Each check runs on both CPU backends (tests/cpu_backends.py): the numpy oracle and the compiled one.

- The oracle equals bytes captured on an H200 (tests/data/edges-h200.npz, bench/probe_edges.py; the SM90 kernel
  and cuBLAS gave the same logits there) in every edge class: logits bit for bit, lse and logp at T = 1 and at
  per-row temperatures.
- One test per edge sentence of section 2, on hand-built inputs whose bytes are worked out in the test.
- A property test: over bf16 inputs drawn across the whole exponent range (zeros, subnormals, +-inf, NaN),
  the oracle equals an independent exact-rational transcription of the rule (tests/gemm_reference.py).
"""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import gemm_reference as ref
from cpu_backends import configured, hopper_logits
from edge_inputs import point_operands
from helpers import same_bytes

from fused_logp import linear_logp
from fused_logp.shared_contract import constants as C

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "edges-h200.npz")
_data = np.load(DATA)
CAPTURED = sorted({k.split("__")[0] for k in _data.files})
on_cpu_backends = pytest.mark.usefixtures("cpu_backend")


def _bf16(bits) -> torch.Tensor:
    return torch.from_numpy(np.asarray(bits, dtype=np.uint16).view(np.int16)).view(torch.bfloat16)


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.contiguous().view(torch.int32).numpy().view(np.uint32)


def _class_of(case):
    from edge_inputs import CASES
    return CASES[case][0]


# ---------------------------------------------------------------------------------------------------------
# the oracle against the H200's bytes
# ---------------------------------------------------------------------------------------------------------

def test_captured_bytes_cover_every_edge_class():
    classes = {_class_of(c) for c in CAPTURED}
    assert classes >= {"subnormal_operands", "subnormal_sums", "cancellation", "signed_zero", "overflow",
                       "transient_overflow", "infinite_c", "nonfinite_inputs", "whole_range", "ordinary"}
    assert os.path.getsize(DATA) < 1 << 20


@pytest.mark.parametrize("case", CAPTURED)
def test_oracle_equals_h200_bytes(case, cpu_backend):
    h, w = _bf16(_data[case + "__h"]), _bf16(_data[case + "__w"])
    t = torch.from_numpy(_data[case + "__targets"].astype(np.int64))
    temps = torch.from_numpy(_data[case + "__temps"])
    res = linear_logp(h, w, t, return_logits=True, backend=cpu_backend, strict=True)
    got = _bits(res.logits)
    want = _data[case + "__kernel"]
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{case} ({_class_of(case)}): {bad.size} logits differ from the H200; first "
                           f"{np.unravel_index(bad[0], got.shape)}: {cpu_backend} {got.flat[bad[0]]:#010x}, "
                           f"H200 {want.flat[bad[0]]:#010x}")
    as_t = lambda name: torch.from_numpy(_data[case + "__" + name].view(np.float32))  # noqa: E731
    assert same_bytes(res.lse, as_t("lse")) and same_bytes(res.logp, as_t("logp"))
    res_t = linear_logp(h, w, t, temperature=temps, backend=cpu_backend, strict=True)
    assert same_bytes(res_t.lse, as_t("lse_t")) and same_bytes(res_t.logp, as_t("logp_t"))


def test_reference_equals_h200_bytes_on_a_sample():
    """The independent transcription itself reproduces the H200 (a few rows and columns of every case)."""
    for case in CAPTURED:
        h, w = _data[case + "__h"][:2], _data[case + "__w"][:24]
        got = np.array(ref.logits_bits(h.tolist(), w.tolist()), dtype=np.uint32)
        assert (got == _data[case + "__kernel"][:2, :24]).all(), case


# ---------------------------------------------------------------------------------------------------------
# one test per edge sentence of section 2 (hand-built inputs; expected bytes worked out here)
# ---------------------------------------------------------------------------------------------------------

def _logit(h_vals, w_vals) -> int:
    """Oracle and reference on one dot product given as float lists (exact in bf16); both must agree."""
    hb, wb = point_operands(h_vals, w_vals)                 # asserts the inputs are exact in bf16
    got = int(_bits(hopper_logits(hb, wb))[0, 0])
    want = ref.dot_bits(_bits16(hb)[0].tolist(), _bits16(wb)[0].tolist())
    assert got == want, f"{configured()} {got:#010x} != reference {want:#010x}"
    return got


def _bits16(x):
    return x.contiguous().view(torch.int16).numpy().view(np.uint16)


@on_cpu_backends
def test_zero_accumulator_takes_no_part_in_emax():
    """16 products of 1.5 * 2^-152: with c = +0 at exponent -126 each would truncate to 0 on the 2^-151 grid;
    the hardware keeps them (emax = -133, grid 2^-158) and the sum is 3 * 2^-149."""
    assert _logit([1.5 * 2.0 ** -76] * 16, [2.0 ** -76] * 16) == 0x00000003


@on_cpu_backends
def test_emax_is_floored_at_minus_133():
    """-2^-149 plus 15 products of 1.5 * 2^-159: on the 2^-158 grid (floor -133) each small product truncates
    to zero, leaving -2^-149; a finer grid would keep 22.5 * 2^-159 and truncate the sum to +0."""
    assert C.ALIGN_EXP_FLOOR == -133
    assert _logit([-(2.0 ** -75)] + [1.5 * 2.0 ** -80] * 15, [2.0 ** -74] + [2.0 ** -79] * 15) == 0x80000001


@on_cpu_backends
def test_subnormal_accumulator_has_exponent_minus_126():
    """Group 0 leaves c = 3 * 2^-149 (subnormal); in group 1 emax = -126 (c's nominal exponent), so the 16
    products of 1.5 * 2^-152 (0.75 units of 2^-151 each) truncate to zero and c stays 3 * 2^-149."""
    h = [1.5 * 2.0 ** -76] * 16 + [1.5 * 2.0 ** -76] * 16
    w = [2.0 ** -76] * 16 + [2.0 ** -76] * 16
    assert _logit(h, w) == 0x00000003


@on_cpu_backends
def test_result_truncated_to_zero_is_plus_zero():
    assert _logit([-(2.0 ** -76)], [2.0 ** -76]) == 0x00000000            # -2^-152: below the subnormal grid
    assert _logit([-(2.0 ** -75)], [2.0 ** -75]) == 0x00000000            # -2^-150: a nonzero sum, truncated
    assert _logit([-0.0] * 16, [1.0] * 16) == 0x00000000                   # all products -0
    assert _logit([1.5, -1.5], [3.0, 3.0]) == 0x00000000                   # exact cancellation
    assert _logit([-(2.0 ** -75)], [2.0 ** -74]) == 0x80000001            # -2^-149 itself stays


@on_cpu_backends
def test_overflow_inside_a_group_is_an_infinity_and_below_2_128_stays_finite():
    big = (2 - 2.0 ** -7) * 2.0 ** 127                                     # the largest bf16: 2^128 - 2^120
    assert _logit([big], [1.0]) == 0x7F7F0000
    assert _logit([big, 2.0 ** 119], [1.0, 1.0]) == 0x7F7F8000             # 2^128 - 2^119
    assert _logit([big, 2.0 ** 119], [1.0, -1.0]) == 0x7F7E8000
    assert _logit([big, 2.0 ** 119], [1.0, 1.0 + 2.0 ** -7]) == 0x7F7F8100
    assert _logit([big, 2.0 ** 119, 1.5 * 2.0 ** 103], [1.0] * 3) == 0x7F7F8000    # truncated, not rounded up
    # 2^128 - 2^102: above the largest binary32, below 2^128: truncation keeps it finite (0x7F7FFFFF)
    assert _logit([big, (2 - 2.0 ** -7) * 2.0 ** 119, (2 - 2.0 ** -7) * 2.0 ** 111, 1.5 * 2.0 ** 103],
                  [1.0] * 4) == 0x7F7FFFFF
    assert _logit([big, 2.0 ** 120], [1.0, 1.0]) == 0x7F800000             # exactly 2^128
    assert _logit([-big, -(2.0 ** 121)], [1.0, 1.0]) == 0xFF800000


@on_cpu_backends
def test_accumulator_is_binary32_between_groups():
    """A group-0 sum beyond binary32 is +inf for every later group, even when group 1 cancels it exactly."""
    h = [2.0 ** 64] * 16 + [-(2.0 ** 64)] * 16
    w = [2.0 ** 64] * 32
    assert _logit(h, w) == 0x7F800000


@on_cpu_backends
def test_infinite_accumulator_ignores_later_finite_overflow_of_the_other_sign():
    h = [float("inf")] + [0.0] * 15 + [-(2.0 ** 64)] * 16
    w = [1.0] * 16 + [2.0 ** 64] * 16
    assert _logit(h, w) == 0x7F800000


@on_cpu_backends
def test_special_values_give_nan_bits():
    nan = C.GEMM_NAN_BITS
    assert nan == 0x7FFFFFFF
    assert _logit([float("inf")], [0.0]) == nan                            # inf * 0
    assert _logit([float("inf"), float("inf")], [1.0, -1.0]) == nan        # +inf and -inf in one group
    assert _logit([float("nan")], [1.0]) == nan
    assert _logit([float("inf")] + [0.0] * 15 + [float("-inf")], [1.0] * 17) == nan   # inf c, -inf product
    assert _logit([2.0 ** 64] * 16 + [float("-inf")], [2.0 ** 64] * 17) == nan        # overflowed c, -inf
    assert _logit([float("inf"), 2.0 ** 127], [1.0, -4.0]) == 0x7F800000   # inf beats a finite overflow


@on_cpu_backends
def test_zero_product_takes_no_part_in_emax():
    """A product with a zero factor never sets emax: 0 * 2^100 (nominal exponent -26) next to 15 products of
    1.5 * 2^-53 leaves them exact (22.5 * 2^-53); 0 * 1 (nominal -126) next to products of 1.5 * 2^-152 leaves
    emax at the floor -133 (sum 22.5 * 2^-152 -> 2 * 2^-149)."""
    assert _logit([0.0] + [1.5 * 2.0 ** -53] * 15, [2.0 ** 100] + [1.0] * 15) == 0x27340000
    assert _logit([-0.0] + [1.5 * 2.0 ** -53] * 15, [-(2.0 ** 100)] + [1.0] * 15) == 0x27340000
    assert _logit([0.0] + [1.5 * 2.0 ** -76] * 15, [1.0] + [2.0 ** -76] * 15) == 0x00000002


@on_cpu_backends
def test_rule_points_equal_h200():
    """Every hand-built point (tests/edge_inputs.py RULE_POINTS, one per sentence of section 2) gives the bits
    the H200 gave (tests/data/rule-points-h200.json)."""
    import json

    from edge_inputs import RULE_POINTS

    with open(os.path.join(os.path.dirname(DATA), "rule-points-h200.json")) as f:
        h200 = json.load(f)["h200_bits"]
    assert set(h200) == set(RULE_POINTS)
    for name, (hv, wv) in RULE_POINTS.items():
        assert _logit(hv, wv) == int(h200[name], 16), name


@on_cpu_backends
def test_ordinary_rule_unchanged():
    """Away from the edges the rule is the plain one: truncation of aligned terms at 25 fractional bits."""
    assert _logit([1.0, 2.0 ** -25 * 1.5], [1.0, 1.0]) == 0x3F800000       # 1 + 1.5 * 2^-25 -> 1
    assert _logit([1.0, 2.0 ** -23], [1.0, 1.0]) == 0x3F800001


# ---------------------------------------------------------------------------------------------------------
# property: oracle == independent reference over the whole bf16 range
# ---------------------------------------------------------------------------------------------------------

SPECIAL_BITS = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x00FF, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80,
                0x7FC0, 0xFFC1, 0x3F80, 0xBF80, 0x0040, 0x1A00]


@st.composite
def bf16_problem(draw):
    n = draw(st.integers(1, 2))
    v = draw(st.integers(1, 3))
    k = 16 * draw(st.integers(1, 3))
    # a shared scale makes sums of comparable terms likely; -80..-55 puts the sums near the subnormal grid
    centre = draw(st.one_of(st.integers(-133, 127), st.integers(-80, -55)))
    window = st.builds(lambda s, e, f: (s << 15) | (min(max(e + 127, 0), 254) << 7) | f,
                       st.integers(0, 1), st.integers(centre - 6, centre + 6), st.integers(0, 127))
    tiny = st.builds(lambda s, f: (s << 15) | f, st.integers(0, 1), st.integers(0, 127))   # subnormals, +-0
    if draw(st.booleans()):                          # the whole range: special values, any bit pattern
        element = st.one_of(st.sampled_from(SPECIAL_BITS), st.integers(0, 0xFFFF), window, tiny)
    else:                                            # finite values near one scale (sums near the grid)
        element = st.one_of(window, window, window, tiny)
    h = draw(st.lists(st.lists(element, min_size=k, max_size=k), min_size=n, max_size=n))
    w = draw(st.lists(st.lists(element, min_size=k, max_size=k), min_size=v, max_size=v))
    # zeros of hidden against large weights at the same k: a zero product whose nominal exponent would lead
    for j in draw(st.lists(st.integers(0, k - 1), max_size=3)):
        e = draw(st.integers(max(-126, centre), 127))
        for row in h:
            row[j] = draw(st.sampled_from([0x0000, 0x8000]))
        for row in w:
            row[j] = (draw(st.integers(0, 1)) << 15) | ((e + 127) << 7) | draw(st.integers(0, 127))
    return h, w


@on_cpu_backends
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(bf16_problem())
def test_oracle_equals_reference_over_the_whole_range(prob):
    h, w = prob
    got = _bits(hopper_logits(_bf16(h), _bf16(w)))
    want = np.array(ref.logits_bits(h, w), dtype=np.uint32)
    assert (got == want).all(), [(hex(int(a)), hex(int(b))) for a, b in zip(got.ravel(), want.ravel())]
