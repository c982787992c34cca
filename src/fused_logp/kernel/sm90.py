"""The SM90 backend: the fused wgmma + TMA kernel of the contract (kernel/csrc), built on first use.

The extension is compiled with torch.utils.cpp_extension.load for `-gencode=arch=compute_90a,code=sm_90a`
into the node's extension cache (kernel/extension_build.py; `fused-logp build` fills it ahead of time, a process
finding it current loads it and compiles nothing). If it cannot be built, or its
compiled contract constants differ from shared_contract/constants.py, `available()` says why and every
entry raises: there is no fallback here.
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import torch

from ..shared_contract import constants as C
from .backends import CORE_ENTRIES, SERVING_ENTRIES, Forward, HeadStats, Merged, TileStats
from .contract_header import defines
from .extension_build import build_checked
from .sm90_aux import SM90Aux, SM90TestHooks

_CSRC = Path(__file__).resolve().parent / "csrc"
_SOURCES = ("sm90_bindings.cu", "sm90_forward.cu", "sm90_cta_128x256.cu", "sm90_cta_64x256.cu",
            "sm90_cta_64x128.cu", "sm90_pingpong_128x192.cu", "sm90_pingpong_128x192_mc2.cu", "sm90_swapab_128.cu",
            "sm90_backward.cu", "sm90_transforms.cu", "sm90_fingerprint.cu")
CUDA_FLAGS = ("-gencode=arch=compute_90a,code=sm_90a", "-O3", "-lineinfo")
_TILE = C.VOCAB_TILE

# Launch configurations of the forward kernel (free axes: schedule and tile; none changes a bit), by the name the
# extension takes (kernel/csrc/sm90_forward.cu launch_names(); a test checks that the two lists agree). "auto" is one
# of them, chosen by row count. With return_logits, the producer warpgroup of a cta-* configuration stores the logits
# while the consumer warps compute the statistics; in pingpong-128x192 (and pingpong-128x192-dyn, the same kernel on
# the dynamic schedule, and pingpong-128x192-mc2, in clusters of two CTAs) the consumer warps store them after each
# slice's statistics, in swapab-128 after each tile's statistics (docs/design/sm90-kernel.md).
LAUNCHES = ("cta-128x256", "cta-64x256", "cta-64x128", "pingpong-128x192", "swapab-128", "pingpong-128x192-dyn",
            "pingpong-128x192-mc2")

# Configurations that are built but not (yet) kept: a call naming one is refused unless FUSED_LOGP_CANDIDATE_LAUNCHES=1
# (the Makefile's GPU targets set it; SM90Backend.allow_candidates); "auto" never picks one. pingpong-128x192-dyn, the
# ping-pong kernel on the dynamic schedule (each CTA claims its next tile from a counter, so that the tiles in flight
# stay a window of the raster): on the H100 ahead of the static schedule from 3072 rows and of cta-128x256 at 4096,
# behind the static schedule at 2048 and cta-128x256 at 6144-16384; on the H200 at most 0.5% ahead of auto's choice at
# 2048-8192 rows and 2.5% behind it at 2048 (docs/design/sm90-kernel.md).
# pingpong-128x192-mc2, the ping-pong kernel in clusters of two CTAs along M, each weight tile loaded half by each CTA
# and multicast into both (pingpong_kernel.cuh, CLUSTER = 2; QuACK's schedule), for N >= 2048: on the H100 with the
# early order signal level with pingpong-128x192 at 2048 rows and behind it at 4096; not yet run on an H200.
CANDIDATE_LAUNCHES: frozenset = frozenset({"pingpong-128x192-dyn", "pingpong-128x192-mc2"})

# Configurations that take D and the vocabulary (shard) width in multiples of 64 only (the persistent ping-pong
# kernel on either schedule and the swapped-operand kernel); other calls naming one are refused before the launch (and
# by the extension).
_MULTIPLE_OF_64 = frozenset({"pingpong-128x192", "swapab-128", "pingpong-128x192-dyn", "pingpong-128x192-mc2"})


def _takes_shape(name: str, d: int, width: int) -> bool:
    """Whether configuration `name` takes D = d and a vocabulary (shard) width `width`."""
    return name not in _MULTIPLE_OF_64 or (d % 64 == 0 and width % 64 == 0)


# The odd 64-row tile counts up to SMALL_ODD_MAX rows (129-192, 257-320), where the 128-row tiles leave half of the
# last tile empty: swapab-128 (the batch rounded up to 32 rows, swap_kernel.cuh) ahead of every other configuration
# on the H100 at 129, 160, 192, 288 and 320 rows, at T = 1, T = 0.7 and with the logits (0.98x the GEMM at 129 rows
# against cta-64x256's 1.45x); cta-64x256 where swapab-128 does not take the shape (D or the width not a multiple of
# 64), as measured on the H200 before (ahead of the 128-row configurations there).
SMALL_ODD_MAX = 320

# H200 A/B (docs/design/sm90-kernel.md, "The persistent ping-pong kernel"): pingpong-128x192 ahead of both CTA
# configurations at 128, 256, 512, 1024, 2048 and 4096 rows, with and without the logits; behind cta-64x256 at 1, 16
# and 64 rows and at 129-136 (SMALL_ODD_MAX), behind cta-128x256 at 8192. 65-127 rows (one 128-row tile, as at 128)
# and 4097-8191 are not measured.
PINGPONG_ROWS = (65, 4096)


# Launch configurations of the backward's dz kernel (backward_dz; the extension's dz_launch_names(), a test checks
# that the two lists agree): cta-128x256, the CTA kernel with the dz after its mainloop (cta_kernel.cuh), and
# pingpong-128x192, the persistent ping-pong kernel with one consumer's dz beside the other's mainloop
# (pingpong_kernel.cuh pingpong_dz_kernel; D a multiple of 64). The same bytes: the same accumulators and the same
# element-wise arithmetic. "auto" (dz_auto_launch) is one of them.
# pingpong-128x192-dyn: the same on the dynamic schedule (each CTA claims its next tile from a counter).
DZ_LAUNCHES = ("cta-128x256", "pingpong-128x192", "pingpong-128x192-dyn")
# dz configurations that have not yet passed `make test-gpu` on an H200 (refused as CANDIDATE_LAUNCHES are).
DZ_CANDIDATE_LAUNCHES: frozenset = frozenset({"pingpong-128x192", "pingpong-128x192-dyn"})


def dz_auto_launch(d: int) -> str:
    """The dz configuration "auto" runs for D = d: the CTA kernel (the ping-pong one is a candidate)."""
    return "cta-128x256"


def auto_launch(n_rows: int, d: int, width: int) -> str:
    """The configuration "auto" runs for a call of n_rows rows, D = d and a vocabulary (shard) width `width`
    (figures in docs/design/sm90-kernel.md): 64x256 CTAs for n_rows <= 64; for an odd number of 64-row tiles up to
    SMALL_ODD_MAX rows (the 128-row tiles would leave half of their last tile empty) the swapped-operand kernel where D
    and the width are multiples of 64, else 64x256 CTAs; else the persistent ping-pong kernel for PINGPONG_ROWS rows
    where D and the width are multiples of 64; 128x256 CTAs otherwise. Every configuration computes the same bytes;
    this picks only the speed."""
    tiles64 = -(-n_rows // 64)
    if n_rows <= 64:
        return "cta-64x256"
    if n_rows <= SMALL_ODD_MAX and tiles64 % 2 == 1:
        return "swapab-128" if _takes_shape("swapab-128", d, width) else "cta-64x256"
    if PINGPONG_ROWS[0] <= n_rows <= PINGPONG_ROWS[1] and _takes_shape("pingpong-128x192", d, width):
        return "pingpong-128x192"
    return "cta-128x256"


_lock = threading.Lock()
_available: dict = {}          # torch.device -> SM90Backend.available answer, once settled
_ext = None
_ext_error: str | None = None


def expected_constants() -> list[int]:
    """The constants compiled into the extension (kernel/csrc/contract_constants.h), in its order, from
    shared_contract/constants.py."""
    return [v for _, v in defines()]


_ex2_checks: dict = {}         # device index -> (ok, the check's one-line record)


def ex2_check(device) -> tuple[bool, str]:
    """The exp2 self-test of `device`, once per process (CONTRACT.md section 6): its ex2.approx.ftz.f32 against the
    shipped table's model over every binary32 x <= 0 and every x in [+0, 2^-23). -> (ok, record)."""
    dev = torch.device(device)
    idx = dev.index if dev.index is not None else torch.cuda.current_device()
    hit = _ex2_checks.get(idx)
    if hit is not None:
        return hit
    import numpy as np
    from ..shared_contract.ex2_table import table_bits
    name = torch.cuda.get_device_name(idx)
    table = torch.from_numpy(np.array(table_bits()).view(np.int32)).to(f"cuda:{idx}")
    counts = [int(v) for v in _ext.ex2_selftest(table).cpu()]
    checked, differ = counts[0], counts[1]
    if differ == 0:
        out = (True, f"ex2_selftest on {name} (cuda:{idx}): {checked} arguments, 0 differ from {C.EX2_ID}")
    else:
        out = (False, f"{name} (cuda:{idx}) computes ex2.approx.ftz.f32 differently from {C.EX2_ID}: {differ} of "
                      f"{checked} arguments differ (first: x bits 0x{counts[2] & 0xFFFFFFFF:08X} gave 0x"
                      f"{counts[3] & 0xFFFFFFFF:08X}); this GPU cannot compute {C.CONTRACT_VERSION} bytes")
    _ex2_checks[idx] = out
    return out


def _build():
    global _ext, _ext_error
    with _lock:
        if _ext is not None or _ext_error is not None:
            return
        _ext, _ext_error = build_checked("the sm90 extension", expected_constants(), **build_arguments())


def build_arguments() -> dict:
    """The extension's build (torch.utils.cpp_extension.load's arguments; extension_build keys its cache on them)."""
    return dict(name="fused_logp_sm90", sources=[str(_CSRC / s) for s in _SOURCES], extra_include_paths=[str(_CSRC)],
                extra_cuda_cflags=list(CUDA_FLAGS) + (["-Xptxas=-v"] if os.environ.get("FUSED_LOGP_PTXAS_V") else []),
                extra_cflags=["-O3"])


def build_extension():
    """Build (or load from the cache) and check the extension without a GPU: -> (ok, reason)."""
    _build()
    return _ext is not None, _ext_error or "sm90 extension ready"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SM90Backend:
    """The contract on Hopper (compute capability 9.0): one fused GEMM + tile-statistics kernel and a row merge."""

    name = "sm90"
    contract_bearing = True
    entries = CORE_ENTRIES | frozenset(SERVING_ENTRIES)
    multi_target = False

    def __init__(self):
        # Launch configuration, a free axis (a name of LAUNCHES); tests set it to prove that it changes no bit.
        self.launch = "auto"
        # The backward's dz kernel, a free axis too (a name of DZ_LAUNCHES).
        self.dz_launch = "auto"
        # Whether a call may name a configuration of CANDIDATE_LAUNCHES or DZ_CANDIDATE_LAUNCHES.
        self.allow_candidates = os.environ.get("FUSED_LOGP_CANDIDATE_LAUNCHES") == "1"
        # Benchmarks only: run the mainloop without the statistics (the outputs are then meaningless); signal the
        # ping-pong kernels' order barrier once a mainloop's wgmmas complete instead of once they are issued.
        self.mainloop_only = False
        self.late_order_signal = False
        # Tests set an int32 NaN pattern: outputs are filled with it before each launch (unwritten ones show).
        self.poison: int | None = None
        # The auxiliary kernels and the test hooks (kernel/sm90_aux.py), over this backend's extension and buffers.
        self.aux = SM90Aux(self)
        self.hooks = SM90TestHooks(self)

    def _empty(self, *shape, device):
        out = torch.empty(*shape, dtype=torch.float32, device=device)
        if self.poison is not None:
            out.view(torch.int32).fill_(self.poison)
        return out

    def available(self, device=None) -> tuple[bool, str]:
        """Whether this backend serves tensors on `device` (default: the current CUDA device). A device's answer
        is found once per process (its capability and the build do not change), then read from a table."""
        key = device if isinstance(device, torch.device) else None
        hit = _available.get(key) if key is not None else None
        if hit is not None:
            return hit
        out = self._available(device)
        if key is not None and (out[0] or _ext_error is not None or key.type != "cuda"):
            _available[key] = out
        return out

    def _available(self, device) -> tuple[bool, str]:
        if not torch.cuda.is_available():
            return False, "CUDA is not available"
        device = torch.device("cuda") if device is None else torch.device(device)
        if device.type != "cuda":
            return False, f"inputs are on {device.type}, not CUDA"
        cap = torch.cuda.get_device_capability(device)
        if cap != (9, 0):
            return False, (f"needs compute capability 9.0 (sm_90a); {device} has {cap[0]}.{cap[1]} "
                           f"({torch.cuda.get_device_name(device)})")
        _build()
        if _ext is None:
            return False, _ext_error or "the sm90 extension is not built"
        ok, record = ex2_check(device)
        if not ok:
            return False, record
        return True, f"sm90 extension built for sm_90a ({torch.cuda.get_device_name(device)}); {record}"

    def describe(self) -> dict:
        cap = torch.cuda.get_device_capability() if torch.cuda.is_available() else None
        return {"arch": "sm_90a", "compute_capability": f"{cap[0]}.{cap[1]}" if cap else "none",
                "toolkit": f"torch {torch.__version__} cuda {torch.version.cuda}",
                "build": "torch.utils.cpp_extension " + " ".join(CUDA_FLAGS),
                "launch": self.launch,
                "ex2_check": next(iter(r for _, r in _ex2_checks.values()), "not run")}

    def _module(self):
        if _ext is not None:                 # built and checked once (available() said yes before any entry ran)
            return _ext
        ok, why = self.available()
        if not ok:
            raise RuntimeError(f"sm90 backend unavailable: {why}")
        return _ext

    def _launch_name(self, n_rows: int, d: int, n_real: int) -> str:
        name = auto_launch(n_rows, d, n_real) if self.launch == "auto" else self.launch
        if name not in LAUNCHES:
            raise ValueError(f"launch must be 'auto' or one of {list(LAUNCHES)}, got {self.launch!r}")
        if name in CANDIDATE_LAUNCHES and not self.allow_candidates:
            raise ValueError(f"launch {name!r} has not passed the GPU test suite yet; set "
                             "FUSED_LOGP_CANDIDATE_LAUNCHES=1 to run it, or use 'auto'")
        if not _takes_shape(name, d, n_real):
            others = [c for c in LAUNCHES if c not in _MULTIPLE_OF_64]
            raise ValueError(f"launch {name!r} takes D and the vocabulary width in multiples of 64, got D = {d} and "
                             f"width {n_real}; use 'auto' or one of {others}")
        return name

    def _dz_launch_name(self, d: int) -> str:
        name = dz_auto_launch(d) if self.dz_launch == "auto" else self.dz_launch
        if name not in DZ_LAUNCHES:
            raise ValueError(f"dz_launch must be 'auto' or one of {list(DZ_LAUNCHES)}, got {self.dz_launch!r}")
        if name in DZ_CANDIDATE_LAUNCHES and not self.allow_candidates:
            raise ValueError(f"dz_launch {name!r} has not passed the GPU test suite yet; set "
                             "FUSED_LOGP_CANDIDATE_LAUNCHES=1 to run it, or use 'auto'")
        if name != "cta-128x256" and d % 64:
            raise ValueError(f"dz_launch {name!r} takes D a multiple of 64, got D = {d}; use 'auto' or "
                             "'cta-128x256'")
        return name

    # -- entries ----------------------------------------------------------------------------------------------
    def _stats(self, hidden, weight, targets, temperature, bias, vocab_start, n_real, return_logits,
               target_logit):
        n = hidden.shape[0]
        launch = self._launch_name(n, hidden.shape[1], n_real)
        ext = self._module()
        nt = _cdiv(n_real, _TILE)
        tile_max = self._empty(n, nt, device=hidden.device)
        tile_sum = self._empty(n, nt, device=hidden.device)
        logits = self._empty(n, n_real, device=hidden.device) if return_logits else None
        ext.fused_stats(hidden, weight, targets.contiguous(), temperature.contiguous(), bias, vocab_start, n_real,
                        tile_max, tile_sum, target_logit, logits, launch,
                        int(self.mainloop_only) | 2 * int(self.late_order_signal))
        return tile_max, tile_sum, logits

    def linear_logp(self, hidden, weight, targets, *, bias, temperature, return_logits, vocab_size):
        n = hidden.shape[0]
        dev = hidden.device
        target_logit = self._empty(n, device=dev)   # every row's target is owned here
        tile_max, tile_sum, logits = self._stats(hidden, weight, targets, temperature, bias, 0, vocab_size,
                                                 return_logits, target_logit)
        logp, lse = self.merge_stats(tile_max, tile_sum, target_logit)
        return Forward(logp, lse, logits)

    def shard_stats(self, hidden, weight_shard, targets, *, vocab_start, vocab_size, bias, temperature,
                    return_logits):
        if vocab_start % _TILE != 0:
            raise ValueError(f"vocab_start must be a multiple of VOCAB_TILE={_TILE} (global tiles), "
                             f"got {vocab_start}")
        n = hidden.shape[0]
        dev = hidden.device
        n_real = max(0, min(weight_shard.shape[0], vocab_size - vocab_start))
        owned = (targets >= vocab_start) & (targets < vocab_start + n_real)
        target_logit = torch.full((n,), float("-inf"), dtype=torch.float32, device=dev)
        if n_real == 0:
            empty = torch.empty(n, 0, dtype=torch.float32, device=dev)
            return TileStats(empty, empty.clone(), target_logit, owned, vocab_start // _TILE,
                             torch.empty(n, 0, dtype=torch.float32, device=dev) if return_logits else None)
        tile_max, tile_sum, logits = self._stats(hidden, weight_shard, targets, temperature, bias, vocab_start,
                                                 n_real, return_logits, target_logit)
        return TileStats(tile_max, tile_sum, target_logit, owned, vocab_start // _TILE, logits)

    def logits_and_stats(self, hidden, weight, *, zeros, ones, vocab_size, bias):
        """A serving head: FP32 logits [N, vocab_size] and the T = 1 tile statistics of every row, one launch, its
        outputs allocated by the extension (no Python per output). zeros [N] int64 are the target ids (their slots go
        to a scratch row, which is returned), ones [N] FP32 the temperatures."""
        tile_max, tile_sum, logits, scratch = self._module().logits_and_stats(
            hidden, weight, zeros, ones, bias, vocab_size,
            self._launch_name(hidden.shape[0], hidden.shape[1], vocab_size), self.poison)
        return HeadStats(tile_max, tile_sum, logits, scratch)

    def merge_ids(self, tile_max, tile_sum, logits, ids, *, vocab_size, bad_rows, mirror):
        """logp of ids [N] or [N, C] (int32/int64) and lse [N] from a T = 1 call's statistics and logits over the
        whole real vocabulary: the row merge with z'_id = z[id], in one launch (outputs allocated by the extension).
        A row with an id outside [0, vocab_size) gets NaN logp and lse and adds 1 to bad_rows[0] (CUDA int64 [2]:
        the running count and a block ticket kept at 0); the launch stores the running count into mirror (pinned
        host int64 [1])."""
        ids = ids if ids.dim() == 1 or ids.stride(-1) == 1 else ids.contiguous()
        logp, lse = self._module().merge_ids(tile_max, tile_sum, logits, ids, int(vocab_size), bad_rows, mirror,
                                             self.poison)
        return Merged(logp, lse)

    def merge_stats(self, tile_max, tile_sum, target_logit):
        ext = self._module()
        n = tile_max.shape[0]
        logp = self._empty(n, device=tile_max.device)
        lse = self._empty(n, device=tile_max.device)
        ext.merge_stats(tile_max.contiguous(), tile_sum.contiguous(), target_logit.contiguous(), logp, lse)
        return Merged(logp, lse)

    def stats_from_logits(self, logits, targets, *, temperature, vocab_size):
        return self.merge_stats(*self.aux.tile_stats_from_logits(logits, targets, temperature, vocab_size))

    # -- the auxiliary kernels and the test hooks under the backend's name (kernel/transforms.py, tests, bench/) --
    tile_stats_from_logits = property(lambda self: self.aux.tile_stats_from_logits)
    topp_crossing = property(lambda self: self.aux.topp_crossing)
    backward_dz = property(lambda self: self.aux.backward_dz)
    fingerprint_rows = property(lambda self: self.aux.fingerprint_rows)
    device_ex2log = property(lambda self: self.hooks.device_ex2log)
