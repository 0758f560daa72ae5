"""Sizes in bytes for messages, and the free space of a file system: one formatter and one
free-space reading for every module that reports either (checkpoint saves, prepare's scratch
and memory checks, the dry run's figures)."""

from __future__ import annotations

import shutil
from pathlib import Path

_UNITS = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def byte_size(n: float) -> str:
    """`n` bytes for a person: "1.50 GiB", "12.3 MiB", "4.0 KiB", "512 bytes" (two decimals from
    GiB up, where a tenth is still many megabytes)."""
    for unit, scale in _UNITS:
        if n >= scale:
            return f"{n / scale:,.2f} {unit}" if scale >= 2**30 else f"{n / scale:,.1f} {unit}"
    return f"{int(n):,} bytes"


def existing_ancestor(path: str | Path) -> Path:
    """`path` made absolute, or its nearest ancestor that exists: the directory whose file system
    a file not yet written will be on."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_space(path: str | Path) -> int:
    """Bytes an unprivileged user may still write on the file system that holds `path` (or
    would hold it: its nearest existing ancestor's)."""
    return shutil.disk_usage(existing_ancestor(path)).free
