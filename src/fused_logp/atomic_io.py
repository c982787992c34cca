"""Writing a command's output files whole or not at all: each file is written to a temporary file in its folder and
renamed into place, so a failure or an interrupt leaves either the old file or none, never a part."""
from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


class OutputPathError(ValueError):
    """An output path cannot be written (the message names the argument and what is accepted)."""


def check_output_file(path, arg: str = "--out") -> Path:
    """path as a file to be written: not a folder, its folder a folder (or creatable). Creates nothing."""
    p = Path(path)
    if str(path).strip() == "":
        raise OutputPathError(f"{arg} is empty; a file path is expected")
    if p.is_dir():
        raise OutputPathError(f"{arg} {str(path)!r} is a folder; a file path is expected")
    _check_parent(p.parent, arg, path)
    return p


def check_output_dir(path, arg: str = "--out") -> Path:
    """path as a folder to write into: a folder or absent (its nearest existing parent a folder). Creates nothing."""
    p = Path(path)
    if str(path).strip() == "":
        raise OutputPathError(f"{arg} is empty; a folder path is expected")
    if p.exists() and not p.is_dir():
        raise OutputPathError(f"{arg} {str(path)!r} is a file; a folder (existing or new) is expected")
    _check_parent(p, arg, path)
    return p


def _check_parent(folder: Path, arg, path):
    q = folder.absolute()
    while not q.exists():
        q = q.parent
    if not q.is_dir():
        raise OutputPathError(f"{arg} {str(path)!r}: {str(q)!r} is a file, not a folder")
    if not os.access(q, os.W_OK | os.X_OK):
        raise OutputPathError(f"{arg} {str(path)!r}: the folder {str(q)!r} is not writable")


def atomic_write_bytes(path, data: bytes) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=str(p.parent))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_text(path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


@contextlib.contextmanager
def atomic_path(path):
    """A temporary path next to `path` for writers that take a file name (torch.save, savefig): renamed onto path
    when the block ends without an error, removed otherwise."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.stem}.", suffix=p.suffix, dir=str(p.parent))
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, p)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
