"""CPU CI for the SM90 kernel: the header's contract constants equal shared_contract/constants.py, and the CUDA
sources compile for sm_90a (compile only, `ptxas -v`) with no register spills. Skips where nvcc is absent."""
from __future__ import annotations

import concurrent.futures
import os
import re
import secrets
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fused_logp.shared_contract import constants as C

CSRC = Path(__file__).resolve().parents[1] / "src" / "fused_logp" / "kernel" / "csrc"
HEADER = CSRC / "contract_math.cuh"


def _header_constants() -> dict[str, int]:
    text = HEADER.read_text()
    out = {}
    for name, val in re.findall(r"constexpr\s+(?:uint32_t|int)\s+(\w+)\s*=\s*(0x[0-9A-Fa-f]+|\d+)u?\s*;", text):
        out[name] = int(val, 0)
    return out


def test_header_constants_equal_python_constants():
    h = _header_constants()
    want = {
        "EXP_LOG2E": C.EXP_LOG2E, "EXP_SHIFTER": C.EXP_SHIFTER, "EXP_LN2_HI": C.EXP_LN2_HI,
        "EXP_LN2_LO": C.EXP_LN2_LO, "EXP_X_MAX": C.EXP_X_MAX, "EXP_X_MIN": C.EXP_X_MIN,
        "LOG_SQRT_HALF_BITS": C.LOG_SQRT_HALF_BITS, "LOG_LN2_HI": C.LOG_LN2_HI, "LOG_LN2_LO": C.LOG_LN2_LO,
        "VOCAB_TILE": C.VOCAB_TILE, "K_GROUP": C.K_GROUP,
    }
    for i, v in enumerate(C.EXP_POLY):
        want[f"EXP_POLY_C{i + 2}"] = v
    for i, v in enumerate(C.LOG_POLY):
        want[f"LOG_POLY_{i}"] = v
    for k, v in want.items():
        assert k in h, f"{k} missing from {HEADER.name}"
        assert h[k] == v, f"{k}: header {h[k]:#x} != constants.py {v:#x}"
    assert "shared_contract/constants.py" in HEADER.read_text()


def test_sm90_module_constant_order_matches_extension_source():
    """kernel/sm90.py checks the built extension's constants in the order contract_constants() returns them."""
    from fused_logp.kernel.sm90 import expected_constants
    src = (CSRC / "sm90_forward.cu").read_text()
    body = re.search(r"contract_constants\(\) \{.*?return \{(.*?)\};", src, re.S).group(1)
    names = [s.strip() for s in body.split(",")]
    h = _header_constants()
    assert [h[n] for n in names] == expected_constants()


# The fused multiply-adds the kernels may use, each giving the bits of the separately rounded form it replaces:
# exp_reduce's exact-product step and the statistics epilogue's division from a row's reciprocal.
FMA_USES = {"contract_math.cuh": 1, "stats_epilogue.cuh": 4}


def test_no_fast_math_or_libm_in_kernel_sources():
    for f in CSRC.glob("*.cu*"):
        text = f.read_text()
        for bad in ("__expf", "__logf", "expf(", "logf(", "use_fast_math"):
            assert bad not in text, f"{f.name} uses {bad}"
        assert text.count("fmaf") == text.count("__fmaf_rn(") == FMA_USES.get(f.name, 0), f.name
    exp = (CSRC / "contract_math.cuh").read_text()
    assert "const float hi = __fmaf_rn(-k, bits(EXP_LN2_HI), xc);" in exp
    div = (CSRC / "stats_epilogue.cuh").read_text()
    body = re.search(r"float div_rn_rowrcp\(float z, float T, float y\) \{(.*?)\n\}", div, re.S).group(1)
    assert body.count("__fmaf_rn(") == 4
    # The backward's logit-gradient epilogue (not contract-bearing) is the one user of the hardware ex2.approx:
    # defined once, called once, and only under the DZ kernels' compile-time branch.
    hits = {f.name: f.read_text().count("\"ex2.approx") for f in CSRC.glob("*.cu*")}
    assert {k: v for k, v in hits.items() if v} == {"dz_epilogue.cuh": 1}, hits
    dz = (CSRC / "dz_epilogue.cuh").read_text()
    assert dz.count("ex2_approx(") == 3          # the definition and the two lanes of wg_dz_epilogue
    kernels = (CSRC / "fused_kernels.cuh").read_text()
    assert kernels.count("wg_dz_epilogue<") == 1
    for f in CSRC.glob("*.cu*"):
        if f.name not in ("dz_epilogue.cuh", "fused_kernels.cuh"):
            assert "wg_dz_epilogue" not in f.read_text() and "ex2_approx" not in f.read_text(), f.name
    branch, call = kernels.index("if constexpr (DZ) {"), kernels.index("wg_dz_epilogue<")
    assert 0 < call - branch < 1000 and "}" not in kernels[branch + len("if constexpr (DZ) {"):call]
    from fused_logp.kernel import sm90
    assert "--use_fast_math" not in sm90.CUDA_FLAGS
    assert "-gencode=arch=compute_90a,code=sm_90a" in sm90.CUDA_FLAGS


def test_named_barriers_of_two_paths_are_the_non_aligned_form():
    """`bar.sync` is PTX's `barrier.sync.aligned`: every participant must execute that same instruction. A barrier that
    the producer warpgroup and the consumer warpgroups reach at different instructions (fused_cta_kernel's staging
    barriers) is the non-aligned `barrier.sync` (named_bar_sync_split) and counts the whole CTA; the consumers-only
    barrier 1 of the backward (named_bar_sync, one instruction) lies in its DZ branch. No other barrier asm."""
    ptx = (CSRC / "ptx.cuh").read_text()
    assert re.search(r"void named_bar_sync\(\) \{\s*asm volatile\(\"bar\.sync %0, %1;\"", ptx)
    assert re.search(r"void named_bar_sync_split\(\) \{\s*asm volatile\(\"barrier\.sync %0, %1;\"", ptx)
    asm_sites = {f.name: len(re.findall(r"\"(?:bar|barrier)\.sync", f.read_text())) for f in CSRC.glob("*.cu*")}
    assert {k: v for k, v in asm_sites.items() if v} == {"ptx.cuh": 3}, asm_sites
    k = (CSRC / "fused_kernels.cuh").read_text()
    body = k[k.index("fused_cta_kernel("):]
    start = body.index("if (wg == 0) {")
    end = body.index("\n    return;\n  }", start)
    producer, consumers = body[start:end], body[end:]
    call = re.compile(r"named_bar_sync(_split)?<([^,]+), ([^>]+)>\(\)")
    prod = call.findall(producer)
    assert prod and all(split and count == "kThreads" for split, _, count in prod), prod
    ids = {i for _, i, _ in prod}
    dz_start = consumers.index("if constexpr (DZ) {")
    dz_end = consumers.index("\n    return;\n  }", dz_start)
    for m in call.finditer(consumers):
        split, bar_id, count = m.groups()
        if dz_start < m.start() < dz_end:
            assert not split and count == "128 * kConsumers", m.group(0)    # the consumers alone, one instruction
        else:
            assert bar_id in ids and split and count == "kThreads", m.group(0)
    assert {i for _, i, _ in call.findall(consumers[:dz_start] + consumers[dz_end:])} == ids


def _nvcc():
    return shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)


@pytest.fixture(scope="module")
def ptxas_reports(tmp_path_factory):
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found: the sm_90a compile check needs the CUDA toolkit")
    torch_utils = pytest.importorskip("torch.utils.cpp_extension")
    tmp = tmp_path_factory.mktemp("sm90")
    shim = tmp / "shim"
    incs = list(torch_utils.include_paths())
    # CPU wheels of torch carry the c10/cuda headers but not the CMake-generated one they include.
    if not any((Path(p) / "c10/cuda/impl/cuda_cmake_macros.h").exists() for p in incs):
        (shim / "c10/cuda/impl").mkdir(parents=True)
        (shim / "c10/cuda/impl/cuda_cmake_macros.h").write_text("#pragma once\n")
        incs = [str(shim)] + incs
    for extra in ("/usr/local/cuda/include",):
        if Path(extra).exists():
            incs.append(extra)
    incs.append(sysconfig.get_paths()["include"])
    from fused_logp.kernel import sm90
    def compile_one(src):
        cmd = [nvcc, "-c", str(CSRC / src), "-o", str(tmp / (src + ".o")), *sm90.CUDA_FLAGS,
               "-std=c++17", "-Xptxas", "-v", "-DTORCH_EXTENSION_NAME=sm90_ext", "-I", str(CSRC)]
        for p in incs:
            cmd += ["-I", p]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1800)
        return src, (r.returncode, r.stdout)

    # at most 4 compilers at once: each wgmma translation unit takes ~1-2 GB of memory
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        return dict(pool.map(compile_one, sm90._SOURCES))


def test_sm90a_compiles_without_spills(ptxas_reports):
    for src, (rc, text) in ptxas_reports.items():
        assert rc == 0, f"{src} failed to compile for sm_90a:\n{text[-4000:]}"
        spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
        source = (CSRC / src).read_text()
        if "__global__" not in source and '#include "launch.cuh"' not in source:
            continue                                    # host code only (the Python bindings): nothing for ptxas
        assert spills, f"{src}: no ptxas report"
        for st, ld in spills:
            assert int(st) == 0 and int(ld) == 0, f"{src}: register spills\n{text[-4000:]}"
        frames = re.findall(r"(\d+) bytes stack frame", text)
        assert all(int(f) == 0 for f in frames), f"{src}: local-memory stack frame\n{text[-4000:]}"


def test_full_k_mainloop_has_no_injected_wgmma_waits(ptxas_reports):
    """The D % 64 == 0 instantiations (FULL_K, the first bool template argument of every kernel: Lb1) issue
    wgmma straight-line: ptxas must not serialise them."""
    for src, (rc, text) in ptxas_reports.items():
        for line in text.splitlines():
            if any(code in line for code in ("C7508", "C7510", "C7515", "C7519", "C7520")):
                first_bool = re.search(r"Lb([01])E", line)
                assert first_bool is None or first_bool.group(1) == "0", f"{src}: {line}"


def test_fused_exp_reduction_product_is_exact():
    """exp_reduce<true> (contract_math.cuh) computes xc - k LN2_HI as one fused multiply-add: the bits of the
    contract's separate multiply and subtract wherever k LN2_HI is exact in binary32, which holds for every k the
    clamped argument [EXP_X_MIN, EXP_X_MAX] gives (k = round(xc LOG2E) in [-150, 128]) and beyond."""
    import numpy as np
    hi = np.array([C.EXP_LN2_HI], dtype=np.uint32).view(np.float32)[0]
    xs = np.array([C.EXP_X_MIN, C.EXP_X_MAX], dtype=np.uint32).view(np.float32)
    log2e = np.array([C.EXP_LOG2E], dtype=np.uint32).view(np.float32)[0]
    kmin, kmax = (int(np.rint(np.float32(x) * log2e)) for x in xs)
    assert kmin >= -151 and kmax <= 129
    k = np.arange(-256, 257, dtype=np.float32)
    assert np.array_equal((k * hi).astype(np.float64), k.astype(np.float64) * np.float64(hi))


def test_row_reciprocal_division_sampled_on_the_cpu(tmp_path):
    """tools/check_row_division.cpp: the epilogue's five operations on y = RN(1 / T) equal the IEEE quotient
    on 10^7 random (z, T) pairs of the guarded domain and its ends (the exhaustive run over z for 590 T values is
    `make check-division`; bench/results/ holds its output)."""
    cxx = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if cxx is None:
        pytest.skip("no C++ compiler")
    src = Path(__file__).resolve().parents[1] / "tools" / "check_row_division.cpp"
    exe = tmp_path / "check_row_division"
    subprocess.run([cxx, "-O2", "-std=c++17", "-ffp-contract=off", "-pthread", str(src), "-o", str(exe)], check=True)
    r = subprocess.run([str(exe), "sample", "10000000", str(secrets.randbits(32) | 1)], stdout=subprocess.PIPE,
                       text=True, timeout=600)
    assert r.returncode == 0 and " 0 mismatches" in r.stdout, r.stdout


def test_row_division_guard_is_the_checked_domain():
    """The epilogue's division guard (stats_epilogue.cuh) lies inside the domain tools/check_row_division.cpp checks:
    T in [2^-20, 2^20] and 2^-100 <= |z| <= 2^100 there, exponent fields [107, 147] and [27, 227] in the tool."""
    epi = (CSRC / "stats_epilogue.cuh").read_text()
    g = dict(re.findall(r"(kRowRcp[TZ]M(?:in|ax)) = 0x1p(-?\d+)f", epi))
    assert {k: int(v) for k, v in g.items()} == {"kRowRcpTMin": -20, "kRowRcpTMax": 20, "kRowRcpZMin": -100,
                                                  "kRowRcpZMax": 100}
    tool = (Path(__file__).resolve().parents[1] / "tools" / "check_row_division.cpp").read_text()
    t = dict(re.findall(r"(k[TZ]Exp(?:Lo|Hi)) = 127 ([+-] \d+)", tool))
    t = {k: 127 + int(v.replace(" ", "")) for k, v in t.items()}
    assert t["kTExpLo"] <= 127 + int(g["kRowRcpTMin"]) and 127 + int(g["kRowRcpTMax"]) <= t["kTExpHi"]
    assert t["kZExpLo"] <= 127 + int(g["kRowRcpZMin"]) and 127 + int(g["kRowRcpZMax"]) <= t["kZExpHi"]
