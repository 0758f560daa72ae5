"""Files written whole or not at all: the bytes go to a temporary name beside the file (same
directory, so the same file system), are flushed to the disk (fsync), and the temporary file is
then renamed over the file. A full disk, a read-only file system or a process killed part way
leaves the old file as it was (or none), never a truncated one, and no temporary file once the
error is raised. Imports nothing of the project, so that `configure` can use it."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import IO, Iterator

PARTIAL = ".partial"  # the temporary file: NAME.PID.partial beside NAME
# a write's errors that name no file: a full file system, a quota, a file size limit
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


def partial_name(path: str | os.PathLike) -> Path:
    """Where `atomic_file` writes `path`'s bytes before they are complete: NAME.PID.partial in
    its directory (the pid, so that two processes writing one file do not share one)."""
    path = Path(path)
    return path.with_name(f"{path.name}.{os.getpid()}{PARTIAL}")


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike, mode: str = "wb", **kwargs) -> Iterator[IO]:
    """A file object to write `path` through (`mode` "wb" or "w", `kwargs` as `open` takes
    them): on leaving the block without an error it is flushed, fsynced and renamed over
    `path`, and its directory fsynced; on an error the temporary file is removed and `path`
    is untouched. The new file's permissions are those a plain `open` would give (the umask's)."""
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_file writes a whole file: mode 'w' or 'wb', not {mode!r}")
    path = Path(path)
    partial = partial_name(path)
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, mode, **kwargs) as handle:
            yield handle
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except BaseException as err:
        with contextlib.suppress(OSError):
            partial.unlink()
        if isinstance(err, OSError) and err.filename is None and err.errno in _FULL:
            # a write to the open file names none: the file it was for, in the message
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise
    sync_directory(path.parent)


def atomic_write(path: str | os.PathLike, data: bytes | str, encoding: str = "utf-8") -> None:
    """Write `data` (text is encoded with `encoding`) to `path`, whole or not at all."""
    with atomic_file(path, "wb") as handle:
        handle.write(data.encode(encoding) if isinstance(data, str) else data)


def atomic_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy the file `source` to `target` (its bytes, as shutil.copyfile), whole or not at all."""
    with open(source, "rb") as reader, atomic_file(target, "wb") as writer:
        shutil.copyfileobj(reader, writer, 1 << 20)


def sync_directory(directory: str | os.PathLike) -> None:
    """fsync a directory, so that a rename in it survives a crash; a file system that cannot
    (some network ones refuse a directory's fsync) is left as it is."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
