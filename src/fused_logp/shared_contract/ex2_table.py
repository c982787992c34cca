"""The table of the contract's exp2 (CONTRACT.md section 6): EX2_TABLE[j] = SM90's ex2.approx.ftz.f32(-j * 2^-23).

The package ships it compressed (`ex2_sm90.bin.xz`, written and verified on an SM90 GPU by tools/ex2_table.py): the
first bit pattern, then the differences T[j] - T[j + 1] as signed bytes, xz compressed. Decompression is integer
arithmetic; the result is checked against EX2_TABLE_SHA256 before any use.
"""
from __future__ import annotations

import hashlib
import lzma
import threading
from importlib import resources

import numpy as np

from . import constants as C



class Ex2TableError(RuntimeError):
    """The shipped exp2 table is damaged or not the one this contract version names."""


_lock = threading.Lock()
_table: np.ndarray | None = None


def decode(blob: bytes) -> np.ndarray:
    """The compressed file's bytes -> the table's bit patterns, uint32 [EX2_TABLE_ENTRIES]."""
    raw = lzma.decompress(blob)
    if len(raw) != 4 + C.EX2_TABLE_ENTRIES - 1:
        raise Ex2TableError(f"the exp2 table holds {len(raw)} bytes; {4 + C.EX2_TABLE_ENTRIES - 1} expected")
    first = int(np.frombuffer(raw[:4], dtype="<u4")[0])
    d = np.frombuffer(raw[4:], dtype=np.int8).astype(np.int64)
    bits = np.empty(C.EX2_TABLE_ENTRIES, dtype=np.int64)
    bits[0] = first
    np.cumsum(d, out=bits[1:])
    bits[1:] = first - bits[1:]
    return bits.astype(np.uint32)


def digest(bits: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(bits, dtype="<u4").tobytes()).hexdigest()


def table_bits() -> np.ndarray:
    """The verified table as uint32 bit patterns (read-only; loaded once per process)."""
    global _table
    if _table is None:
        with _lock:
            if _table is None:
                blob = resources.files(__package__).joinpath(C.EX2_TABLE_FILE).read_bytes()
                bits = decode(blob)
                got = digest(bits)
                if got != C.EX2_TABLE_SHA256:
                    raise Ex2TableError(f"the exp2 table {C.EX2_TABLE_FILE} has sha256 {got}; {C.CONTRACT_VERSION} "
                                        f"requires {C.EX2_TABLE_SHA256}")
                bits.setflags(write=False)
                _table = bits
    return _table


def table_f32() -> np.ndarray:
    """The table as binary32 values."""
    return table_bits().view(np.float32)
