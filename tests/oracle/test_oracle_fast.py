"""The compiled CPU oracle (`oracle-fast`) against the numpy oracle, byte for byte, on every input class.

The numpy oracle (kernel/oracle.py, over shared_contract/gemm_rule.py and shared_contract/numpy_contract.py) is the
reference: every comparison calls its functions at test time, so the compiled one follows its current rule. NaN
payloads are not part of the contract (same_bytes: NaN matches NaN); every other byte, signed zeros included, must
be equal.
"""
import os

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fused_logp import linear_logp, logp_from_logits, merge_shard_stats, shard_tile_stats
from fused_logp.kernel.oracle import OracleBackend
from fused_logp.kernel import oracle_fast as fast
from fused_logp.kernel.backends import get_backend
from fused_logp.shared_contract import constants as C
from fused_logp.shared_contract import gemm_rule, numpy_contract
from fused_logp.shared_contract.numpy_contract import contract_ex2, contract_log

from helpers import same_bytes

FAST = get_backend("oracle-fast")


@pytest.fixture(autouse=True, scope="module")
def _built():
    ok, why = FAST.available()
    assert ok, f"the compiled CPU oracle must build here: {why}"


@pytest.fixture(params=["vector", "scalar"])
def path(request):
    """Both GEMM paths of the extension: AVX-512 (where the CPU has it) and the portable scalar one."""
    FAST.force_scalar = request.param == "scalar"
    yield request.param
    FAST.force_scalar = False


def _bf16_from_bits(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).sub(65536 * (bits >= 32768).to(torch.int32)).to(torch.int16).view(torch.bfloat16)


def _classes(gen, n, v, d):
    """(name, hidden, weight) for each input class of CONTRACT.md section 2, edges included."""
    out = []
    out.append(("gaussian", torch.randn(n, d, generator=gen).bfloat16(), torch.randn(v, d, generator=gen).bfloat16()))
    hs = torch.pow(2.0, torch.randint(-40, 41, (n, d), generator=gen).float())
    ws = torch.pow(2.0, torch.randint(-40, 41, (v, d), generator=gen).float())
    h = (torch.randn(n, d, generator=gen) * hs).bfloat16()
    w = (torch.randn(v, d, generator=gen) * ws).bfloat16()
    h[torch.rand(n, d, generator=gen) < 0.1] = 0
    w[torch.rand(v, d, generator=gen) < 0.1] = 0
    out.append(("wide-range-with-zeros", h, w))
    # subnormal operands and sums: products near and below 2^-126, partial sums in the subnormal range
    h = (torch.randn(n, d, generator=gen) * torch.pow(2.0, torch.randint(-133, -100, (n, d), generator=gen).float())).bfloat16()
    w = (torch.randn(v, d, generator=gen) * torch.pow(2.0, torch.randint(-30, 5, (v, d), generator=gen).float())).bfloat16()
    h[:, ::7] = -h[:, ::7]
    out.append(("subnormal", h, w))
    # products whose nominal exponents all lie below -126 (the group's alignment floor decides emax)
    h = (torch.randn(n, d, generator=gen) * torch.pow(2.0, torch.randint(-67, -62, (n, d), generator=gen).float())).bfloat16()
    w = (torch.randn(v, d, generator=gen) * torch.pow(2.0, torch.randint(-67, -62, (v, d), generator=gen).float())).bfloat16()
    out.append(("tiny-products", h, w))
    # products that truncate to zero next to a large one (signed zero of the result)
    h = torch.randn(n, d, generator=gen).bfloat16()
    w = (torch.randn(v, d, generator=gen) * 1e-30).bfloat16()
    w[:, 0] = 1.0
    h[:, 0] = 0
    out.append(("truncate-to-zero", h, -w))
    # exact cancellation across groups
    h = torch.randn(n, d, generator=gen).bfloat16()
    w = torch.randn(v, d, generator=gen).bfloat16()
    if d >= 32:
        w[:, 16:32] = w[:, 0:16]
        h[:, 16:32] = -h[:, 0:16]
    out.append(("cancellation", h, w))
    # any finite bf16 bit pattern (the whole exponent range; partial sums may leave the binary32 range)
    hb = _bf16_from_bits(torch.randint(0, 65536, (n, d), generator=gen))
    wb = _bf16_from_bits(torch.randint(0, 65536, (v, d), generator=gen))
    hb[~torch.isfinite(hb)] = 1.0
    wb[~torch.isfinite(wb)] = -2.0
    out.append(("all-finite-bit-patterns", hb, wb))
    # non-finite inputs: inf, -inf, NaN, inf next to zero
    h = torch.randn(n, d, generator=gen).bfloat16()
    w = torch.randn(v, d, generator=gen).bfloat16()
    h[0, 3] = float("inf")
    if n > 1:
        h[1, 5] = float("nan")
    w[min(2, v - 1), d - 1] = float("-inf")
    w[0, 3] = 0
    out.append(("non-finite", h, w))
    return out


def _logit_mismatches(got, want):
    """Where two logits tensors differ in bytes. The contract writes a NaN logit as GEMM_NAN_BITS; where the
    contract text does not fix it (no such constant), NaN matches NaN."""
    diff = got.view(torch.int32) != want.view(torch.int32)
    if not hasattr(C, "GEMM_NAN_BITS"):
        diff &= ~(torch.isnan(want) & torch.isnan(got))
    return diff


def _near_overflow(gen, n, v, d):
    """Partial sums beyond the binary32 range, cancelled (or not) by a later group."""
    h = torch.full((n, d), 2.0 ** 60).bfloat16()
    w = torch.zeros(v, d)
    w[:, :16] = 2.0 ** 67
    w[:, 16:32] = -(2.0 ** 67)
    w[:, 32:] = torch.randn(v, d - 32, generator=gen)
    return h, w.bfloat16()


@pytest.mark.parametrize("shape", [(3, 37, 16), (5, 70, 64), (4, 130, 256)])
def test_logits_equal_numpy_oracle_on_every_class(gen, path, shape):
    n, v, d = shape
    for name, h, w in _classes(gen, n, v, d):
        want = gemm_rule.hopper_logits(h, w)
        got = FAST.logits(h, w, v)
        bad = _logit_mismatches(got, want)
        assert not bad.any(), (f"{name}: {int(bad.sum())} of {bad.numel()} logits differ; first at "
                               f"{torch.nonzero(bad)[0].tolist()}")


def test_logits_on_transient_overflow(gen, path):
    h, w = _near_overflow(gen, 2, 40, 64)
    assert not _logit_mismatches(FAST.logits(h, w, 40), gemm_rule.hopper_logits(h, w)).any()


def test_vector_and_scalar_paths_agree_on_bit_patterns(gen):
    """Two implementations of the GEMM rule inside the extension give one answer (random bit patterns)."""
    h = _bf16_from_bits(torch.randint(0, 65536, (6, 128), generator=gen))
    w = _bf16_from_bits(torch.randint(0, 65536, (53, 128), generator=gen))
    vec = FAST.logits(h, w, 53)
    FAST.force_scalar = True
    try:
        sca = FAST.logits(h, w, 53)
    finally:
        FAST.force_scalar = False
    assert not _logit_mismatches(vec, sca).any()


def _float_patterns(gen, size):
    bits = torch.randint(-(2 ** 31), 2 ** 31, (size,), generator=gen, dtype=torch.int64).to(torch.int32)
    x = bits.view(torch.float32).numpy().copy()
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, -1.0, 1e-45, -1e-45, 1.1754944e-38,
                        88.72284, 88.7228394, 88.72284 + 1e-5, -103.97208, -103.972076, -104.0, 3.4028235e38],
                       dtype=np.float32)
    with np.errstate(invalid="ignore"):
        folded = -np.abs(x[: size // 2]) % 110.0                     # many values in exp's domain
    return np.concatenate([x, special, folded])


def test_ex2_and_log_equal_the_numpy_functions(gen):
    x = _float_patterns(gen, 1 << 18)
    with np.errstate(invalid="ignore"):
        xn = np.where(x > 0, -x, x).astype(np.float32)                # the exp2's domain: x <= 0
    assert same_bytes(torch.from_numpy(fast.contract_ex2(xn)), torch.from_numpy(contract_ex2(xn)))
    assert same_bytes(torch.from_numpy(fast.contract_log(x)), torch.from_numpy(contract_log(x)))


def _logit_rows(gen, n, v):
    z = torch.randn(n, v, generator=gen) * torch.tensor([1.0, 30.0, 1e-3, 400.0, 1.0, 1.0, 1.0])[:n, None]
    if n > 4:
        z[4, 5 % v] = float("inf")
        z[5, 70 % v] = float("nan")
        z[6, :] = 0.0
        z[6, ::3] = -0.0
    return z


@pytest.mark.parametrize("v", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize("temp", [1.0, 0.3, 2.5])
def test_stats_and_merge_equal_numpy_oracle(gen, v, temp):
    z = _logit_rows(gen, 7, v)
    temps = torch.full((7,), temp)
    temps[1] = 1e-30                                   # z / T overflows to inf: that tile is NaN
    tgt = torch.randint(0, v, (7, 3), generator=gen)
    want = OracleBackend().stats_from_logits(z, tgt, temperature=temps, vocab_size=v)
    got = FAST.stats_from_logits(z, tgt, temperature=temps, vocab_size=v)
    assert same_bytes(got[0], want[0]) and same_bytes(got[1], want[1])
    tmax, tsum, _ = numpy_contract.tile_stats(z.numpy(), temps.numpy(), v)
    ftmax, ftsum = fast.extension().tile_stats(z, temps, v)
    assert same_bytes(ftsum, torch.from_numpy(tsum))
    # the sign of a zero tile maximum is not fixed by numpy's max reduction and changes no later bit
    assert same_bytes(ftmax + 0.0, torch.from_numpy(tmax) + 0.0)


def test_shard_stats_equal_numpy_oracle(gen, path):
    h = torch.randn(5, 64, generator=gen).bfloat16()
    w = torch.randn(700, 64, generator=gen).bfloat16()
    t = torch.randint(0, 640, (5,), generator=gen)
    temp = torch.tensor([0.7, 1.0, 1.3, 2.0, 0.5])
    bias = torch.randn(320, generator=gen)
    kw = dict(vocab_start=320, vocab_size=640, bias=bias, temperature=temp, return_logits=True)
    want = OracleBackend().shard_stats(h, w[320:640], t, **kw)
    got = FAST.shard_stats(h, w[320:640], t, **kw)
    for key in ("tile_sum", "target_logit", "logits"):
        assert same_bytes(got[key], want[key]), key
    assert same_bytes(got["tile_max"] + 0.0, want["tile_max"] + 0.0)
    assert torch.equal(got["target_owned"], want["target_owned"]) and got["tile_offset"] == want["tile_offset"]


def test_op_entries_equal_numpy_oracle(gen):
    """linear_logp, the TP entries and logp_from_logits: the same logp/lse/logits bytes from both backends."""
    h = torch.randn(9, 128, generator=gen).bfloat16()
    w = torch.randn(1000, 128, generator=gen).bfloat16()
    t = torch.randint(0, 1000, (9,), generator=gen)
    temps = torch.rand(9, generator=gen) + 0.3
    a = linear_logp(h, w, t, temperature=temps, return_logits=True, backend="oracle", strict=True)
    b = linear_logp(h, w, t, temperature=temps, return_logits=True, backend="oracle-fast", strict=True)
    assert same_bytes(a.logp, b.logp) and same_bytes(a.lse, b.lse) and same_bytes(a.logits, b.logits)
    assert b.provenance.backend == "oracle-fast" and b.provenance.contract_bearing
    stats = [shard_tile_stats(h, w[s:e], t, vocab_start=s, vocab_size=1000, temperature=temps, backend="oracle-fast")
             for s, e in ((0, 384), (384, 1000))]
    m = merge_shard_stats(stats, vocab_size=1000, backend="oracle-fast")
    assert same_bytes(m.logp, a.logp) and same_bytes(m.lse, a.lse)
    fl = logp_from_logits(a.logits, t, temperature=temps, backend="oracle-fast")
    assert same_bytes(fl.logp, a.logp) and same_bytes(fl.lse, a.lse)


def test_row_chunks_threads_and_batch_composition(gen):
    """More rows than one GEMM call holds, 1 or 2 threads, a row alone: the bytes of the numpy oracle."""
    n = fast.ROWS_PER_CALL + 13                 # 77 rows x 2000 x 256: large enough to be split over two threads
    h = torch.randn(n, 256, generator=gen).bfloat16()
    w = torch.randn(2000, 256, generator=gen).bfloat16()
    t = torch.randint(0, 2000, (n,), generator=gen)
    want = linear_logp(h, w, t, temperature=0.8, backend="oracle")
    threads = torch.get_num_threads()
    try:
        for k in (1, 2):
            torch.set_num_threads(k)
            got = linear_logp(h, w, t, temperature=0.8, backend="oracle-fast")
            assert same_bytes(got.logp, want.logp) and same_bytes(got.lse, want.lse), k
    finally:
        torch.set_num_threads(threads)
    for i in (0, 17, n - 1):
        one = linear_logp(h[i:i + 1], w, t[i:i + 1], temperature=0.8, backend="oracle-fast")
        assert same_bytes(one.logp, want.logp[i:i + 1]) and same_bytes(one.lse, want.lse[i:i + 1])


def test_golden_fingerprints_equal_the_stored_oracle_ones():
    from fused_logp import CONTRACT_VERSION
    from fused_logp.golden import golden_digests, load_golden
    assert golden_digests("oracle-fast") == load_golden()[CONTRACT_VERSION]["oracle/cpu/none"]


def test_strict_mode_accepts_it_and_the_constants_are_the_contract_ones():
    res = linear_logp(torch.randn(1, 16).bfloat16(), torch.randn(70, 16).bfloat16(), torch.tensor([3]),
                      backend="oracle-fast", strict=True)
    assert res.provenance.contract_bearing and res.provenance.build.startswith("c++")
    assert [int(x) for x in fast.extension().contract_constants()] == [v for _, v in fast._defines()]


# --- property: bf16 drawn over the whole exponent range, zeros, subnormals, inf and NaN --------------------

_SPECIAL_BITS = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0x3F80,
                 0xBF80, 0x0040, 0x00FF]


@st.composite
def bit_problems(draw):
    n = draw(st.integers(1, 4))
    d = 16 * draw(st.integers(1, 4))
    v = draw(st.integers(1, 150))
    seed = draw(st.integers(0, 2 ** 31 - 1))
    g = torch.Generator().manual_seed(seed)
    mode = draw(st.sampled_from(["bits", "gauss", "scaled"]))
    if mode == "bits":
        h = _bf16_from_bits(torch.randint(0, 65536, (n, d), generator=g))
        w = _bf16_from_bits(torch.randint(0, 65536, (v, d), generator=g))
        nonfinite = draw(st.booleans())
        if not nonfinite:
            h[~torch.isfinite(h)] = 0
            w[~torch.isfinite(w)] = 0
    else:
        lo, hi = (-10, 10) if mode == "gauss" else (-135, 60)
        h = (torch.randn(n, d, generator=g) * torch.pow(2.0, torch.randint(lo, hi, (n, d), generator=g).float())).bfloat16()
        w = (torch.randn(v, d, generator=g) * torch.pow(2.0, torch.randint(lo, hi, (v, d), generator=g).float())).bfloat16()
    specials = draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, d - 1), st.sampled_from(_SPECIAL_BITS)),
                             max_size=4))
    for r, c, b in specials:
        h[r, c] = _bf16_from_bits(torch.tensor([b]))[0]
    temp = draw(st.sampled_from([1.0, 0.7, 2.0]))
    t = torch.tensor(draw(st.lists(st.integers(0, v - 1), min_size=n, max_size=n)))
    return h, w, t, temp


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(bit_problems())
def test_property_fast_equals_numpy_oracle(prob):
    h, w, t, temp = prob
    a = linear_logp(h, w, t, temperature=temp, return_logits=True, backend="oracle")
    b = linear_logp(h, w, t, temperature=temp, return_logits=True, backend="oracle-fast")
    assert not _logit_mismatches(b.logits, a.logits).any()
    assert same_bytes(b.logp, a.logp) and same_bytes(b.lse, a.lse)


# --- the audit command ----------------------------------------------------------------------------------------

def _rollout(gen, n=11, d=64, v=300):
    from fused_logp.kernel.transforms import TransformProgram, program_logp_from_logits
    h = torch.randn(n, d, generator=gen).bfloat16()
    w = (torch.randn(v + 20, d, generator=gen) * 0.3).bfloat16()            # 20 padding rows
    temp = torch.rand(n, generator=gen) + 0.5
    res = linear_logp(h, w, torch.zeros(n, dtype=torch.int64), temperature=temp, vocab_size=v, return_logits=True,
                      backend="oracle")
    t = torch.argmax(res.logits, dim=1)                                     # a likely token: kept by any program
    base = linear_logp(h, w, t, temperature=temp, vocab_size=v, backend="oracle")
    logp = base.logp.clone()
    top_k = torch.zeros(n, dtype=torch.int64)
    top_p = torch.ones(n)
    for r, (k, p) in {2: (5, 1.0), 3: (0, 0.9), 7: (40, 0.8)}.items():
        top_k[r], top_p[r] = k, p
        prog = TransformProgram(temperature=float(temp[r]), top_k=k or None, top_p=p if p < 1 else None)
        lp, _, _ = program_logp_from_logits(res.logits[r:r + 1], t[r:r + 1], prog, vocab_size=v)
        logp[r] = lp[0]
    return h, w, t, temp, logp, base.lse, top_k, top_p, v


def test_audit_tensor_capture_passes_and_reports_a_flipped_bit(gen, tmp_path, capsys):
    from safetensors.torch import save_file

    from fused_logp.audit import write_capture
    from fused_logp.cli import main
    h, w, t, temp, logp, lse, top_k, top_p, v = _rollout(gen)
    save_file({"lm_head.weight": w, "model.norm.weight": torch.ones(w.shape[1]).bfloat16()}, str(tmp_path / "w.safetensors"))
    cap = tmp_path / "cap.pt"
    write_capture(cap, hidden=h, targets=t, logp=logp, temperature=temp, lse=lse, top_k=top_k, top_p=top_p, vocab_size=v)
    out = tmp_path / "rep.json"
    assert main(["audit", str(cap), "--weight", str(tmp_path / "w.safetensors"), "--rows-per-batch", "4",
                 "--out", str(out)]) == 0
    import json
    rep = json.loads(out.read_text())
    assert rep["ok"] and rep["rows"] == 11 and rep["values_checked"] == 11 and rep["program_rows"] == 3
    assert rep["rows_per_s"] > 0 and rep["provenance"]["backend"] == "oracle-fast"
    assert "rows/s" in capsys.readouterr().out
    bad = logp.clone()
    bad[6] = torch.tensor(bad[6].view(torch.int32).item() ^ 1, dtype=torch.int32).view(torch.float32)   # one ulp
    write_capture(cap, hidden=h, targets=t, logp=bad, temperature=temp, lse=lse, top_k=top_k, top_p=top_p,
                  vocab_size=v)
    assert main(["audit", str(cap), "--weight", str(tmp_path / "w.safetensors"), "--out", str(out),
                 "--no-progress"]) == 1
    rep = json.loads(out.read_text())
    assert rep["logp_mismatches"] == 1 and rep["first_mismatches"][0]["row"] == 6
    from fused_logp import weight_fingerprint
    assert rep["weight_fingerprint"] == weight_fingerprint(w[:v], vocab_size=v)
    other = rep["weight_fingerprint"][:-1] + ("1" if rep["weight_fingerprint"][-1] == "0" else "0")
    assert main(["audit", str(cap), "--weight", str(tmp_path / "w.safetensors"), "--no-progress",
                 "--expect-fingerprint", other]) == 2                                 # another lm_head: refused


def test_audit_reads_the_plugin_capture_and_skips_padding_columns(gen, tmp_path):
    import json

    from fused_logp.audit import main
    from fused_logp.kernel.transforms import TransformProgram, program_logp_from_logits
    h, w, t, temp, logp, lse, top_k, top_p, v = _rollout(gen)
    ids = torch.stack([t, torch.randint(0, v, (11,), generator=gen)], dim=1)
    z = linear_logp(h, w, t, temperature=temp, vocab_size=v, return_logits=True).logits
    lp = logp_from_logits(z, ids, temperature=temp, backend="oracle").logp
    recs = []
    for r in range(11):
        prog = None
        if top_k[r] > 0 or top_p[r] < 1:                 # the plugin's value: the program's logp, -inf outside its kept set
            prog = TransformProgram(temperature=float(temp[r]), top_k=int(top_k[r]) or None,
                                    top_p=float(top_p[r]) if top_p[r] < 1 else None)
            plp, _, kept = program_logp_from_logits(z[r:r + 1], ids[r:r + 1], prog, vocab_size=v, require_kept=False)
            lp[r] = torch.where(kept, plp, torch.full_like(plp, float("-inf")))[0]
        vals = [float(x) if torch.isfinite(x) else repr(float(x)) for x in lp[r]]
        recs.append({"kind": "sample", "req_id": f"r{r}", "hidden": h[r].view(torch.int16).tolist(),
                     "temperature": float(temp[r]), "ids": ids[r].tolist() + [0],
                     "logprobs": vals + ["-inf"], "program": None if prog is None else prog.to_dict()})
    (tmp_path / "cap.jsonl").write_text("\n".join(json.dumps(x) for x in recs) + "\n")
    torch.save({"weight": w}, tmp_path / "head.pt")
    out = tmp_path / "rep.json"
    assert main([str(tmp_path / "cap.jsonl"), "--weight", str(tmp_path / "head.pt"), "--vocab-size", str(v),
                 "--out", str(out), "--no-progress"]) == 0
    rep = json.loads(out.read_text())
    n_inf = int(torch.isneginf(lp).sum())
    assert rep["values_checked"] == 22 - n_inf and rep["values_skipped"] == 11 + n_inf
    assert rep["program_rows"] == 3
    one_ulp = torch.tensor([recs[7]["logprobs"][0]]).view(torch.int32).add(1).view(torch.float32).item()
    recs[7]["logprobs"][0] = one_ulp                                              # a program row's value, one ulp off
    (tmp_path / "cap.jsonl").write_text("\n".join(json.dumps(x) for x in recs) + "\n")
    assert main([str(tmp_path / "cap.jsonl"), "--weight", str(tmp_path / "head.pt"), "--vocab-size", str(v),
                 "--out", str(out), "--no-progress"]) == 1
    assert json.loads(out.read_text())["first_mismatches"][0]["row"] == 7


def test_audit_refuses_unusable_inputs_with_a_message(tmp_path, capsys):
    from fused_logp.audit import main
    torch.save({"hidden": torch.randn(2, 16).bfloat16(), "targets": torch.tensor([1, 2])}, tmp_path / "cap.pt")
    torch.save({"w": torch.randn(40, 16)}, tmp_path / "w.pt")                    # no logp; fp32 weight
    assert main([str(tmp_path / "cap.pt"), "--weight", str(tmp_path / "w.pt"), "--no-progress"]) == 2
    assert "'logp'" in capsys.readouterr().err
    torch.save({"hidden": torch.randn(2, 16).bfloat16(), "targets": torch.tensor([1, 2]),
                "logp": torch.zeros(2)}, tmp_path / "cap.pt")
    assert main([str(tmp_path / "cap.pt"), "--weight", str(tmp_path / "w.pt"), "--no-progress"]) == 2
    assert "bfloat16" in capsys.readouterr().err


def test_panel_decode_equals_the_scalar_decode(gen):
    """The AVX-512 weight decode (load, 16 x 16 transpose, fields) against the scalar one on any bit pattern."""
    w = _bf16_from_bits(torch.randint(0, 65536, (333, 64), generator=gen))
    assert fast.extension().panel_decode_mismatches(w) == 0


# --- the H200's bytes (tests/data/edges-h200.npz, every edge class of CONTRACT.md section 2) ----------------------

_H200 = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "edges-h200.npz")
_H200_CASES = sorted({k.split("__")[0] for k in np.load(_H200).files}) if os.path.exists(_H200) else []


@pytest.mark.parametrize("case", _H200_CASES)
def test_equals_h200_bytes(case, path):
    data = np.load(_H200)
    bf = lambda name: torch.from_numpy(data[f"{case}__{name}"].astype(np.uint16).view(np.int16)).view(torch.bfloat16)  # noqa: E731
    as_f = lambda name: torch.from_numpy(data[f"{case}__{name}"].view(np.float32))  # noqa: E731
    h, w = bf("h"), bf("w")
    t = torch.from_numpy(data[f"{case}__targets"].astype(np.int64))
    res = linear_logp(h, w, t, return_logits=True, backend="oracle-fast", strict=True)
    got = res.logits.contiguous().view(torch.int32).numpy().view(np.uint32)
    bad = np.flatnonzero(got != data[f"{case}__kernel"])
    assert bad.size == 0, f"{case}: {bad.size} logits differ from the H200's"
    assert same_bytes(res.lse, as_f("lse")) and same_bytes(res.logp, as_f("logp"))
    res_t = linear_logp(h, w, t, temperature=torch.from_numpy(data[f"{case}__temps"]), backend="oracle-fast", strict=True)
    assert same_bytes(res_t.lse, as_f("lse_t")) and same_bytes(res_t.logp, as_f("logp_t"))


def _edge_case_names():
    from edge_inputs import CASES
    return sorted(CASES)


@pytest.mark.parametrize("case", _edge_case_names())
def test_equals_numpy_oracle_on_fresh_edge_inputs(case, path):
    """Every edge-class generator of tests/edge_inputs.py with a fresh seed: logits, lse and logp bytes."""
    import secrets

    from edge_inputs import make_case
    seed = secrets.randbits(31)
    _, h, w = make_case(case, seed, n=13, v=100)
    t = torch.randint(0, 100, (13,))
    temps = torch.rand(13) + 0.4
    a = linear_logp(h, w, t, temperature=temps, return_logits=True, backend="oracle")
    b = linear_logp(h, w, t, temperature=temps, return_logits=True, backend="oracle-fast")
    bad = _logit_mismatches(b.logits, a.logits)
    assert not bad.any(), f"{case} seed {seed}: {int(bad.sum())} logits differ"
    assert same_bytes(b.logp, a.logp) and same_bytes(b.lse, a.lse), f"{case} seed {seed}"
    # without logits and without a bias: one extension call, the statistics taken inside the GEMM's threads
    c = linear_logp(h, w, t, temperature=temps, backend="oracle-fast")
    assert same_bytes(c.logp, a.logp) and same_bytes(c.lse, a.lse), f"{case} seed {seed} (fused call)"


def test_rule_points_equal_h200(path):
    """The hand-built points of section 2 (tests/edge_inputs.py RULE_POINTS): the bits the H200 gave
    (tests/data/rule-points-h200.json), on both GEMM paths."""
    import json

    from edge_inputs import RULE_POINTS, point_operands
    with open(os.path.join(os.path.dirname(_H200), "rule-points-h200.json")) as f:
        h200 = json.load(f)["h200_bits"]
    k = 16 * max(-(-max(len(hv), len(wv)) // 16) for hv, wv in RULE_POINTS.values())
    for name, (hv, wv) in sorted(RULE_POINTS.items()):
        h, w = point_operands(hv, wv, k)
        one = FAST.logits(h, w, 1)
        assert (one.view(torch.int32).item() & 0xFFFFFFFF) == int(h200[name], 16), name


def test_vector_tile_statistics_equal_the_scalar_definition(gen):
    """The AVX-512 tile statistics (exp, max, tree) against the scalar ones, tile by tile, on ordinary logits,
    signed zeros at the maximum, ragged tiles, non-finite values and values at exp's range limits."""
    ext = fast.extension()
    z = torch.randn(6, 1000, generator=gen) * 30
    z[1, :64] = 0.0
    z[1, 5] = -0.0
    z[2, :64] = -0.0
    z[2, 70] = float("inf")
    z[3, 200] = float("nan")
    z[4, 300:340] = -200.0
    z[5, ::7] = float("-inf")
    temps = torch.tensor([0.7, 1.0, 2.0, 0.3, 1.0, 1e-3])
    for n_real in (1000, 999, 64, 1):
        assert ext.tile_stats_mismatches(z, temps, n_real) == 0, n_real
