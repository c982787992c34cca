"""CPU CI for the SM90 kernel: the header's contract constants equal shared_contract/constants.py, and the CUDA
sources compile for sm_90a (device code only, `ptxas -v`) with no register spills. Skips where nvcc is absent."""
from __future__ import annotations

import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fused_logp.shared_contract import constants as C

CSRC = Path(__file__).resolve().parents[2] / "src" / "fused_logp" / "kernel" / "csrc"
HEADER = CSRC / "contract_math.cuh"


def test_generated_constants_header_is_current():
    """kernel/csrc/contract_constants.h, included by the CUDA build and the compiled CPU oracle, is what
    kernel/contract_header.py renders from shared_contract/constants.py."""
    from fused_logp.kernel import contract_header
    assert contract_header.HEADER.read_text() == contract_header.render(), \
        "run: python -m fused_logp.kernel.contract_header --write"
    text = contract_header.HEADER.read_text()
    assert f'"{C.CONTRACT_VERSION}"' in text and f"0x{C.EXP_LOG2E:08X}u" in text


def test_generated_wgmma_header_is_current():
    """kernel/csrc/wgmma.cuh, the wgmma wrappers (one per accumulator width) that ptx.cuh includes, is what
    kernel/wgmma_header.py renders; no other file issues wgmma.mma_async."""
    from fused_logp.kernel import wgmma_header
    assert wgmma_header.HEADER.read_text() == wgmma_header.render(), \
        "run: python -m fused_logp.kernel.wgmma_header --write"
    assert '#include "wgmma.cuh"' in (CSRC / "ptx.cuh").read_text()
    sites = {f.name: f.read_text().count("wgmma.mma_async") for f in CSRC.glob("*.cu*")}
    assert {k: v for k, v in sites.items() if v} == {"wgmma.cuh": len(wgmma_header.WIDTHS)}, sites


def test_both_compiled_implementations_take_the_constants_from_the_header():
    cuh = HEADER.read_text()
    assert '#include "contract_constants.h"' in cuh
    for name in ("EXP_LOG2E", "LOG_LN2_HI", "LOG_LN2_LO", "LOG_SQRT2_BITS", "VOCAB_TILE", "K_GROUP"):
        assert re.search(rf"constexpr\s+(?:uint32_t|int)\s+{name}\s*=\s*FL_", cuh), name
    assert not re.search(r"constexpr\s+uint32_t\s+\w+\s*=\s*0x", cuh), "a literal bit pattern in contract_math.cuh"
    cpp = (CSRC.parent / "cpu" / "oracle_cpu.cpp").read_text()
    assert '#include "../csrc/contract_constants.h"' in cpp
    for src in ((CSRC / "sm90_forward.cu").read_text(), cpp):
        assert re.search(r"contract_constants\(\) \{ return \{FL_CONTRACT_CONSTANTS_LIST\}; \}", src)


def test_sm90_module_constant_order_matches_extension_source():
    """kernel/sm90.py checks the built extension's constants in the order contract_constants() returns them."""
    from fused_logp.kernel import contract_header
    from fused_logp.kernel.sm90 import expected_constants
    assert expected_constants() == [v for _, v in contract_header.defines()]


def test_no_fast_math_or_libm_in_kernel_sources():
    for f in CSRC.glob("*.cu*"):
        text = f.read_text()
        for bad in ("__expf", "__logf", "expf(", "logf(", "use_fast_math", "fmaf"):
            assert bad not in text, f"{f.name} uses {bad}"
    # The hardware exp2 appears twice: the contract's exp2 (contract_math.cuh, whose exact model the CPU oracles
    # reproduce) and the backward's logit-gradient epilogue (not contract-bearing), reached only from the dz kernels:
    # fused_cta_kernel's DZ branch and pingpong_dz_kernel.
    hits = {f.name: f.read_text().count("\"ex2.approx.ftz.f32") for f in CSRC.glob("*.cu*")}
    assert {k: v for k, v in hits.items() if v} == {"contract_math.cuh": 1, "dz_epilogue.cuh": 1}, hits
    dz = (CSRC / "dz_epilogue.cuh").read_text()
    assert dz.count("ex2_approx(") == 3          # the definition and the two lanes of dz_pair
    assert dz.count("dz_pair(") == 3             # the definition, wg_dz_epilogue's and half_dz_epilogue's calls
    kernels = (CSRC / "cta_kernel.cuh").read_text()
    pingpong = (CSRC / "pingpong_dz_kernel.cuh").read_text()
    assert kernels.count("wg_dz_epilogue<") == 1 and pingpong.count("half_dz_epilogue<") == 2
    for f in CSRC.glob("*.cu*"):
        if f.name not in ("dz_epilogue.cuh", "cta_kernel.cuh", "pingpong_dz_kernel.cuh"):
            text = f.read_text()
            assert not any(w in text for w in ("wg_dz_epilogue", "half_dz_epilogue", "dz_pair", "ex2_approx")), f.name
    assert not any(w in pingpong for w in ("wg_dz_epilogue<", "ex2_approx(", "dz_pair("))
    assert not any(w in kernels for w in ("half_dz_epilogue<", "ex2_approx(", "dz_pair("))
    branch, call = kernels.index("if constexpr (DZ) {"), kernels.index("wg_dz_epilogue<")
    assert 0 < call - branch < 1000 and "}" not in kernels[branch + len("if constexpr (DZ) {"):call]
    dz_kernel = pingpong.index("pingpong_dz_kernel(")
    assert pingpong.index("half_dz_epilogue<") > dz_kernel and "__global__" not in pingpong[dz_kernel:]
    from fused_logp.kernel import sm90
    assert "--use_fast_math" not in sm90.CUDA_FLAGS and not any("ftz" in f for f in sm90.CUDA_FLAGS)
    assert "-gencode=arch=compute_90a,code=sm_90a" in sm90.CUDA_FLAGS


def test_statistics_use_the_contract_exp2_only():
    """Every exp of the forward statistics, the statistics from logits and the row merge is contract_ex2 of a
    non-positive product."""
    epi = (CSRC / "stats_epilogue.cuh").read_text()
    from_logits = (CSRC / "logits_stats.cuh").read_text()
    merge = (CSRC / "row_merge.cuh").read_text()
    assert epi.count("contract::contract_ex2(__fmul_rn(__fsub_rn(z, M[P]), c[h]))") == 1
    assert epi.count("contract_ex2(") == 1
    assert merge.count("contract::contract_ex2(__fmul_rn(__fsub_rn(a[j], m), log2e))") == 1
    assert from_logits.count("contract::contract_ex2(__fmul_rn(__fsub_rn(z") == 2


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
    k = (CSRC / "cta_kernel.cuh").read_text()
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


def test_pingpong_order_barriers_pair_each_signal_with_one_wait():
    """The persistent ping-pong kernel orders its consumers' mainloops with two named barriers of its own (ids above
    every barrier of the CTA kernel), each a wait of one consumer warpgroup (`bar.sync`, 256 threads) and a signal of
    the other (`bar.arrive`): a consumer waits before every mainloop but its first, and signals once every mainloop
    that has a successor unit (unit_at(i + 1): the static stride, or the dynamic schedule's next slot; a unit is
    CLUSTER m tiles of one vocabulary tile) has issued its last wgmma (the timing hook late_order_signal: once they
    complete), so that each signal meets exactly one wait; a tile beyond the rows (CLUSTER = 2) waits in its turn and
    signals after releasing its stages. Its other barriers: the initialisation's `__syncthreads` (one CTA) or cluster
    barrier (CLUSTER = 2), which the cluster kernel's threads meet again before they exit."""
    ptx = (CSRC / "ptx.cuh").read_text()
    assert re.search(r"void named_bar_arrive\(int id\) \{\s*asm volatile\(\"bar\.arrive %0, %1;\"", ptx)
    k = (CSRC / "pingpong_kernel.cuh").read_text()
    assert "constexpr int kOrderBar = 5;" in k
    assert "constexpr int kStagedBar = 4;" in (CSRC / "fused_params.cuh").read_text()    # the CTA kernel's highest
    # one wait, one signal
    assert sorted(re.findall(r"named_bar_\w+<[^>]*>\(kOrderBar[^;]*;", k)) == [
        "named_bar_arrive<256>(kOrderBar + (1 - c));", "named_bar_sync<256>(kOrderBar + c);"]
    assert "if (i > 0) named_bar_sync<256>(kOrderBar + c);" in k
    assert "if (unit_at(i + 1) < unit_count<CLUSTER>(p)) named_bar_arrive<256>(kOrderBar + (1 - c));" in k
    # the signal (one site, signal_next): once a tile beyond the rows has released its stages, and for a computed
    # tile before or after the wait for the mainloop's wgmmas
    body = k[k.index("for (int i = c;; i += 2) {"):]
    assert body.index("if (i > 0) named_bar_sync<256>(kOrderBar + c);") < body.index("if (m0 >= p.n_rows) {")
    beyond = body[body.index("if (m0 >= p.n_rows) {"):body.index("continue;")]
    assert beyond.index("release_stage<CLUSTER>(&empty[s]);") < beyond.index("signal_next(i);")
    assert re.findall(r"if \(!?p\.late_order_signal\) signal_next\(i\);", body) == [
        "if (!p.late_order_signal) signal_next(i);", "if (p.late_order_signal) signal_next(i);"]
    assert body.index("if (!p.late_order_signal) signal_next(i);") < body.index("wgmma_wait<0>();") \
        < body.index("if (p.late_order_signal) signal_next(i);")
    assert k.count("signal_next(i);") == 3
    assert k.count("__syncthreads()") == 1 and "asm" not in k      # the barriers' initialisation; no other barrier
    # the cluster barrier: after the initialisation, and at the producer's and the consumers' ends
    assert k.count("cluster_sync();") == 3 and k.count("if constexpr (CLUSTER > 1) cluster_sync();") == 2


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
        # device code only (-cubin): nvcc's front end still parses and checks the whole translation unit, host code
        # included, and ptxas reports every kernel; the host compiler's pass over the torch headers (half the time
        # on two cores) is left to the build on the GPU machine
        cmd = [nvcc, "-cubin", str(CSRC / src), "-o", str(tmp / (src + ".cubin")), *sm90.CUDA_FLAGS,
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
    """The D % 64 == 0 instantiations (FULL_K, the first bool template argument of every CTA kernel: Lb1; the
    ping-pong kernels, forward and dz, which take only such D) issue wgmma straight-line: ptxas must not serialise
    them."""
    for src, (rc, text) in ptxas_reports.items():
        for line in text.splitlines():
            if any(code in line for code in ("C7508", "C7510", "C7515", "C7519", "C7520")):
                assert "pingpong" not in line, f"{src}: {line}"
                first_bool = re.search(r"Lb([01])E", line)
                assert first_bool is None or first_bool.group(1) == "0", f"{src}: {line}"


def _top_level_args(text: str, start: int) -> tuple[list[str], int]:
    """The comma-separated arguments of the call whose '(' is at text[start], and the index after its ')'."""
    depth, args, cur, i, quote = 0, [], [], start, False
    while True:
        ch = text[i]
        if quote:
            cur.append(ch)
            if ch == "\\":
                cur.append(text[i + 1])
                i += 1
            elif ch == '"':
                quote = False
        elif ch == '"':
            quote = True
            cur.append(ch)
        elif ch in "([{":
            depth += 1
            if depth > 1:
                cur.append(ch)
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args, i + 1
            cur.append(ch)
        elif ch == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
        i += 1


def test_error_messages_format_numbers_with_num():
    """Every TORCH_CHECK message of the extension is string literals, strings, and numbers through num()
    (launch.cuh): on the H200 machine a message that streamed an int through std::ostream crashed the process."""
    strings = {"who", "cols_name", "name", "names", "launch"}
    bad = []
    for f in sorted(CSRC.glob("*.cu*")):
        text = f.read_text()
        for m in re.finditer(r"\bTORCH_CHECK\(", text):
            args, _ = _top_level_args(text, m.end() - 1)
            for a in args[1:]:
                literal = re.fullmatch(r'("(?:[^"\\]|\\.)*"\s*)+', a)
                if not (literal or a.startswith("num(") or a in strings):
                    bad.append(f"{f.name}: {a}")
    assert not bad, bad
