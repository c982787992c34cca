"""Energy per call from the GPU's own counter (NVML's total energy consumption, millijoules), through ctypes on the
driver's libnvidia-ml (no Python package needed). At the board power limit every workload runs at the same watts,
so joules per call are the honest unit beside time."""
from __future__ import annotations

import ctypes
import time

import torch

_lib = None
_handle = None


def _init():
    global _lib, _handle
    if _lib is not None:
        return _handle is not None
    try:
        _lib = ctypes.CDLL("libnvidia-ml.so.1")
        if _lib.nvmlInit_v2() != 0:
            return False
        h = ctypes.c_void_p()
        if _lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(torch.cuda.current_device()), ctypes.byref(h)) != 0:
            return False
        _handle = h
        return True
    except OSError:
        _lib = False
        return False


def energy_mj() -> int | None:
    """The device's energy counter (mJ since the driver loaded), or None where NVML cannot be read."""
    if not _init():
        return None
    e = ctypes.c_ulonglong()
    if _lib.nvmlDeviceGetTotalEnergyConsumption(_handle, ctypes.byref(e)) != 0:
        return None
    return int(e.value)


def power_limit_w() -> float | None:
    if not _init():
        return None
    v = ctypes.c_uint()
    if _lib.nvmlDeviceGetEnforcedPowerLimit(_handle, ctypes.byref(v)) != 0:
        return None
    return v.value / 1000.0


def joules_per_call(fn, seconds: float = 0.6) -> float | None:
    """Run fn back to back for about `seconds` (after a warm-up) and divide the energy the counter saw by the
    calls. The counter updates every few ms on Hopper; 0.6 s keeps its granularity below 2%."""
    if energy_mj() is None:
        return None
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    calls = 0
    e0 = energy_mj()
    while time.perf_counter() - t0 < seconds:
        for _ in range(4):
            fn()
        calls += 4
        torch.cuda.synchronize()
    e1 = energy_mj()
    return (e1 - e0) / 1000.0 / calls
