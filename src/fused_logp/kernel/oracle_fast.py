"""The compiled CPU oracle (`oracle-fast`): the contract on the CPU with exactly the bytes of kernel/oracle.py.

Why C++ through torch's extension builder (kernel/cpu/oracle_cpu.cpp), and not numba or a numpy rewrite:
the GEMM rule is per-term work on bit fields: each product is aligned to its group's largest nominal exponent
and truncated, 16 of them and the accumulator's term are summed exactly, and the sum is truncated to 24 bits.
What makes it fast is explicit AVX-512 lane work over 16 output columns at a time, with the exactness argued
step by step in the source: the group's emax of two rows at once in int16 lanes, each term as one binary32
product scaled by a power of two and converted with truncation (exact where emax lies in [-90, 60]; any other
lane, a row with |h| >= 2^36 and anything non-finite go to the scalar rule), the 24-bit truncation as an int32
-> binary32 conversion rounding toward zero; the statistics with the contract's exp on 16 lanes. A JIT compiler
does not emit that from loops reliably. torch.utils.cpp_extension is already how the project builds its SM90
kernel, needs no new dependency beyond a C++ compiler and ninja, and at::parallel_for uses torch's own OpenMP
pool (torch.set_num_threads applies). The numpy oracle stays the readable reference; tests compare the two byte
for byte on every input class at test time.

Bytes do not depend on the build: the GEMM is exact on any instruction set (a portable scalar path, the rule as
written, computes the same function where AVX-512 is absent and decides the vector path's edge lanes; tests
compare both), and every float operation of the statistics is one IEEE binary32 operation: the build uses
-ffp-contract=off and no fast-math, so nothing is fused or reassociated. The contract constants are passed as
-D definitions generated from shared_contract/constants.py and read back after the build (a mismatch makes the
backend unavailable).

Batch invariance: a logit depends on its (row, column) pair only, a tile statistic on its (row, tile), the merge
on its row; how rows and columns are split over threads changes no bit.

Name and default: a separate name, `oracle-fast`, beside `oracle` (the numpy reference keeps its name, its golden
entry and its role as the readable definition). It is what `auto` selects for CPU inputs (kernel/backends.py), and
the audit's default: every contract test runs on both CPU backends (the `cpu_backend` fixture of tests/conftest.py:
the contract sentences, the GEMM rule against an exact transcription, every edge sentence and the H200's captured
bytes, the golden fingerprints, the transform program, the backward, the refusals), and tests/oracle/test_oracle_fast.py
compares the two directly on every edge class, on both of its GEMM paths.

The build is kept in the shared extension cache (kernel/extension_build.py, FUSED_LOGP_CACHE); it is compiled with
-march=native, so its name carries a digest of the CPU's feature flags (a cache shared by different CPUs never
loads a build for another instruction set). Building needs g++ and ninja: without them
`available()` says why and every entry raises; `auto` then refuses in strict mode (naming the reason) and outside
it runs the numpy oracle, logging the reason once and recording it in provenance.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import sys
import threading
from pathlib import Path

import numpy as np
import torch

from ..shared_contract import constants as C
from .backends import CORE_ENTRIES, Forward, Merged, TileStats
from .contract_header import defines
from .extension_build import build_checked

_SRC = Path(__file__).resolve().parent / "cpu" / "oracle_cpu.cpp"
_TILE = C.VOCAB_TILE
# Rows per GEMM call in linear_logp: bounds the FP32 logits held at once ([rows, V]; 64 x 151936 x 4 B = 39 MB).
ROWS_PER_CALL = 64

_lock = threading.Lock()
_ext = None
_ext_error: str | None = None


def _defines() -> list[tuple[str, int]]:
    """The contract constants compiled into the extension (kernel/csrc/contract_constants.h), in the order
    contract_constants() returns them."""
    return defines()


def _cpu_digest() -> str:
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = line
                    break
    except OSError:
        flags = os.uname().machine
    return hashlib.sha256(flags.encode()).hexdigest()[:10]


def toolchain_problem() -> str | None:
    """None when a C++ compiler and ninja are reachable, else what is missing (and how to get it)."""
    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None and shutil.which("g++") is None:
        return (f"no C++ compiler ({cxx!r} or g++) on PATH: install one (Debian/Ubuntu: apt-get install g++) "
                f"to build the compiled CPU oracle")
    if shutil.which("ninja") is None:
        return "ninja is not on PATH (it comes with this package's dependencies: pip install ninja)"
    return None


def _build():
    global _ext, _ext_error
    if _ext is not None or _ext_error is not None:     # built (or failed) already: no lock on every call
        return
    with _lock:
        if _ext is not None or _ext_error is not None:
            return
        # ninja installed into this interpreter's environment is found even when the venv is not activated
        bindir = os.path.dirname(sys.executable)
        if shutil.which("ninja") is None and os.path.exists(os.path.join(bindir, "ninja")):
            os.environ["PATH"] = bindir + os.pathsep + os.environ.get("PATH", "")
        problem = toolchain_problem()
        if problem:
            _ext_error = problem
            return
        _ext, _ext_error = build_checked(
            "the compiled CPU oracle", [v for _, v in _defines()],
            name=f"fused_logp_oracle_cpu_{_cpu_digest()}",
            sources=[str(_SRC)],
            extra_cflags=["-O3", "-march=native", "-ffp-contract=off", "-fno-fast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
        if _ext is not None:                 # the exp2 table (verified against its digest) before any statistic
            from ..shared_contract.ex2_table import table_bits
            _ext.set_ex2_table(torch.from_numpy(np.array(table_bits()).view(np.int32)))


def extension():
    """The built extension (builds on first use); raises BackendUnavailableError with the reason otherwise."""
    _build()
    if _ext is None:
        from ..shared_contract.errors import BackendUnavailableError
        raise BackendUnavailableError(_ext_error or "the compiled CPU oracle is not built")
    return _ext


def _cpu(t: torch.Tensor) -> torch.Tensor:
    if t.device.type == "cpu" and not t.requires_grad:     # already what the extension reads: no alias per call
        return t
    return t.detach().cpu()


class OracleFastBackend:
    """The contract on the CPU, compiled (kernel/cpu/oracle_cpu.cpp). Same entries and bytes as OracleBackend."""

    name = "oracle-fast"
    contract_bearing = True
    entries = CORE_ENTRIES
    multi_target = True          # stats_from_logits takes targets [N] or [N, C]

    def __init__(self):
        self.force_scalar = False          # the portable path on any machine (tests compare both paths)

    def available(self, device=None):
        _build()
        if _ext is None:
            return False, _ext_error or "not built"
        return True, f"built ({_ext.vector_isa()})"

    def describe(self) -> dict:
        isa = _ext.vector_isa() if _ext is not None else "unbuilt"
        return {"arch": "cpu", "compute_capability": "none", "toolkit": f"torch {torch.__version__} cpu",
                "build": f"c++ {isa}{' (scalar forced)' if self.force_scalar else ''}"}

    # --- pieces ------------------------------------------------------------------------------------------

    def logits(self, hidden, weight, n_real, bias=None) -> torch.Tensor:
        """Unscaled logits [N, n_real] fp32 (plus bias) under the Hopper k16 rule."""
        z = extension().hopper_logits(_cpu(hidden).contiguous(), _cpu(weight).contiguous(), int(n_real),
                                      bool(self.force_scalar))
        if bias is not None:
            z = (z + _cpu(bias)[:n_real].to(torch.float32)[None, :]).to(torch.float32)
        return z

    def _stats(self, z, temp, n_real, targets_rel):
        """(tile_max, tile_sum, target_logit, owned) of logits z [N, >= n_real] for targets relative to column 0
        ([N] or [N, C] int64): the target's z' where 0 <= target < n_real, else -inf (not owned)."""
        return tuple(extension().stats_targets(z, temp, int(n_real), targets_rel.contiguous()))

    # --- backend entries (the interface of OracleBackend) ------------------------------------------------

    def shard_stats(self, hidden, weight_shard, targets, *, vocab_start, vocab_size, bias, temperature,
                    return_logits):
        dev = hidden.device
        n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
        temp = _cpu(temperature).to(torch.float32).contiguous()
        tgt = _cpu(targets).to(torch.int64)
        if vocab_start:
            tgt = tgt - vocab_start
        if bias is None and n_real > 0:                 # one pass: logits and their statistics
            z, tmax, tsum, tlogit, owned = extension().shard_stats_fused(
                _cpu(hidden).contiguous(), _cpu(weight_shard).contiguous(), int(n_real), temp, tgt.contiguous(),
                bool(self.force_scalar))
        else:
            z = self.logits(hidden, weight_shard, n_real, bias)
            tmax, tsum, tlogit, owned = self._stats(z, temp, n_real, tgt)
        if dev.type != "cpu":
            tmax, tsum, tlogit, owned, z = (x.to(dev) for x in (tmax, tsum, tlogit, owned, z))
        return TileStats(tmax, tsum, tlogit, owned, vocab_start // _TILE, z if return_logits else None)

    def merge_stats(self, tile_max, tile_sum, target_logit):
        dev = tile_max.device
        logp, lse = extension().merge(_cpu(tile_max).to(torch.float32), _cpu(tile_sum).to(torch.float32),
                                      _cpu(target_logit).to(torch.float32))
        return Merged(logp.to(dev), lse.to(dev))

    def linear_logp(self, hidden, weight, targets, *, bias, temperature, return_logits, vocab_size):
        """Rows in chunks of ROWS_PER_CALL (bounded FP32 logits memory); every row's bytes are its own. Without a
        bias and without logits, each chunk is one call into the extension (GEMM, statistics and merge)."""
        dev = hidden.device
        n = hidden.shape[0]
        if return_logits or n == 0 or bias is not None:
            if return_logits or n <= ROWS_PER_CALL:
                st = self.shard_stats(hidden, weight, targets, vocab_start=0, vocab_size=vocab_size, bias=bias,
                                      temperature=temperature, return_logits=return_logits)
                logp, lse = self.merge_stats(st.tile_max, st.tile_sum, st.target_logit)
                return Forward(logp, lse, st.logits)
        ext = extension()
        h = _cpu(hidden).contiguous()
        w = _cpu(weight).contiguous()
        temp = _cpu(temperature).to(torch.float32).contiguous()
        tgt = _cpu(targets).to(torch.int64).contiguous()
        n_real = min(w.shape[0], vocab_size)
        if n <= ROWS_PER_CALL and bias is None:          # one call (a serving step, the embedded default)
            lp, ls = ext.linear_logp_fused(h, w, n_real, temp, tgt, bool(self.force_scalar))
            return Forward(lp, ls, None) if dev.type == "cpu" else Forward(lp.to(dev), ls.to(dev), None)
        logps, lses = [], []
        for r0 in range(0, n, ROWS_PER_CALL):
            sl = slice(r0, r0 + ROWS_PER_CALL)
            if bias is None:
                lp, ls = ext.linear_logp_fused(h[sl], w, n_real, temp[sl], tgt[sl], bool(self.force_scalar))
            else:
                st = self.shard_stats(h[sl], w, tgt[sl], vocab_start=0, vocab_size=vocab_size, bias=bias,
                                      temperature=temp[sl], return_logits=False)
                lp, ls = self.merge_stats(st.tile_max, st.tile_sum, st.target_logit)
            logps.append(lp)
            lses.append(ls)
        if len(logps) == 1:
            return Forward(logps[0].to(dev), lses[0].to(dev), None)
        return Forward(torch.cat(logps).to(dev), torch.cat(lses).to(dev), None)

    def stats_from_logits(self, logits, targets, *, temperature, vocab_size):
        dev = logits.device
        z = _cpu(logits).to(torch.float32)
        if z.stride(-1) != 1:
            z = z.contiguous()
        temp = _cpu(temperature).to(torch.float32).contiguous()
        ext = extension()
        tmax, tsum, tlogit, _ = ext.stats_targets(z, temp, int(vocab_size), _cpu(targets).to(torch.int64).contiguous())
        logp, lse = ext.merge(tmax, tsum, tlogit)
        return Merged(logp, lse) if dev.type == "cpu" else Merged(logp.to(dev), lse.to(dev))


def contract_ex2(x: np.ndarray) -> np.ndarray:
    """The compiled contract exp2 on a binary32 array (tests compare it with numpy_contract.contract_ex2)."""
    return extension().contract_ex2(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()


def contract_log(x: np.ndarray) -> np.ndarray:
    """The compiled contract log on a binary32 array (tests compare it with numpy_contract.contract_log)."""
    return extension().contract_log(torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))).numpy()
