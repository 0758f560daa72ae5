"""An exclusive lock on a directory for the life of a job, so that two jobs never write one
output (two prepares of one dataset, two trainers in one run directory).

The design and its reasons: docs/design.md#commonlockpy.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Iterator, Optional

from common.configure import UserError

LOCK_FILE = ".lock"  # inside the locked directory, unless the caller names another file
_ATTEMPTS = 20  # re-opens when a releasing holder deletes the file under us
_HOLDER_WAIT_S = 1.0  # how long to wait for a new holder to finish writing its name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Holder:
    """Who holds (or held) a lock, as written in its lock file."""

    host: str
    pid: int
    since: str  # ISO 8601 local time with its UTC offset
    what: str  # the kind of job: "prepare", "train", ...

    def describe(self) -> str:
        return f"{self.what} pid {self.pid} on host {self.host} since {self.since}"


@dataclass(frozen=True)
class DirLock:
    """A held lock: what `dir_lock` yields."""

    directory: Path
    lock_file: Path
    holder: Holder  # this process
    took_over: Optional[Holder]  # the dead holder of a stale lock, if there was one
    locked: bool  # False only where the file system refuses flock (a warning said so)


@contextlib.contextmanager
def dir_lock(
    directory: str | os.PathLike, what: str = "job", *, lock_file: str | os.PathLike | None = None
) -> Iterator[DirLock]:
    """Hold an exclusive lock on `directory` for the duration of the `with` block.

    `lock_file` defaults to `directory/.lock` (the directory is created if missing); pass a
    path outside the directory when the directory itself is created, renamed or deleted
    while locked. Raises `UserError` naming the directory and the holder when it is held.
    """
    directory = Path(directory)
    path = Path(lock_file) if lock_file is not None else directory / LOCK_FILE
    me = Holder(
        host=socket.gethostname(),
        pid=os.getpid(),
        what=what,
        since=datetime.now().astimezone().isoformat(timespec="seconds"),
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(
            f"cannot lock {directory}: cannot create {path.parent}: {err.strerror}"
        ) from err
    fd, stale_bytes = _acquire(directory, path, me)
    previous = _parse_holder(stale_bytes)
    if fd is None:
        yield DirLock(directory, path, me, None, locked=False)
        return
    try:
        if previous is not None:
            state = (
                "no longer running"
                if previous.host == me.host
                else (
                    f"its lock is free; if it still runs on {previous.host}, this file system does "
                    "not honour locks across hosts"
                )
            )
            logger.warning(
                "%s: taking over the stale lock of pid %d on host %s (%s since %s; %s)",
                directory,
                previous.pid,
                previous.host,
                previous.what,
                previous.since,
                state,
            )
        yield DirLock(directory, path, me, previous, locked=True)
    finally:
        _release(fd, path)


def _acquire(directory: Path, path: Path, me: Holder) -> tuple[Optional[int], bytes]:
    """Take the flock; returns the descriptor and what a stale holder left in the file."""
    for _ in range(_ATTEMPTS):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            raise UserError(f"cannot lock {directory}: cannot open {path}: {err.strerror}") from err
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _wait_for_holder(fd)
            os.close(fd)
            who = (
                holder.describe() if holder else "another process (it has not written its name yet)"
            )
            raise UserError(
                f"{directory} is locked by {who} (lock file {path}); wait for it to end or stop it"
            ) from None
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                logger.warning(
                    "%s: not locked: the file system refuses flock on %s (%s); nothing stops a "
                    "second job from using it at the same time",
                    directory,
                    path,
                    err.strerror,
                )
                return None, b""
            raise UserError(f"cannot lock {directory}: flock on {path}: {err.strerror}") from err
        # A holder deletes the file as it releases; if that happened between our open and our
        # flock, we hold a file nobody else will open. Start again on the current one.
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        mine = os.fstat(fd)
        if current is None or (current.st_ino, current.st_dev) != (mine.st_ino, mine.st_dev):
            os.close(fd)
            continue
        stale_bytes = os.pread(fd, 4096, 0).strip()
        if stale_bytes and _parse_holder(stale_bytes) is None:
            # Not a lock record of ours (which is written in one call): someone's file of that
            # name, not ours to truncate or delete.
            os.close(fd)
            raise UserError(
                f"cannot lock {directory}: {path} exists and is not a lock file of ours (it names "
                "no holder); move it away, or delete it if no file of yours has that name"
            )
        record = (
            json.dumps({"host": me.host, "pid": me.pid, "since": me.since, "what": me.what}) + "\n"
        )
        os.ftruncate(fd, 0)
        os.pwrite(fd, record.encode(), 0)
        _HELD.add(fd)
        return fd, stale_bytes
    raise UserError(
        f"cannot lock {directory}: {path} was replaced {_ATTEMPTS} times while taking it"
    )


# The descriptors of the locks this process holds: a forked child closes them (see the module
# docstring); only these, since a descriptor number is reused once its lock is released.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD:
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def _release(fd: int, path: Path) -> None:
    # Delete while still holding the lock (see the inode check in `_acquire`), then close,
    # which drops the flock. A file someone else has replaced meanwhile is not ours to delete.
    try:
        if os.path.samestat(os.stat(path), os.fstat(fd)):
            os.unlink(path)
    except OSError:
        pass
    _HELD.discard(fd)
    os.close(fd)


def _wait_for_holder(fd: int) -> Optional[Holder]:
    """The holder's name; a holder that has just taken the lock may not have written it yet."""
    deadline = time.monotonic() + _HOLDER_WAIT_S
    while True:
        holder = _parse_holder(os.pread(fd, 4096, 0))
        if holder is not None or time.monotonic() > deadline:
            return holder
        time.sleep(0.02)


def _parse_holder(data: bytes) -> Optional[Holder]:
    try:
        record = json.loads(data.decode("utf-8"))
        return Holder(
            host=str(record["host"]),
            pid=int(record["pid"]),
            since=str(record["since"]),
            what=str(record["what"]),
        )
    except (ValueError, KeyError, TypeError):
        return None
