"""Sizes in bytes for messages, the free space of a file system and its name: one formatter
and one free-space reading for every module that reports either (checkpoint saves, prepare's
scratch and memory checks, the dry run's figures). And the one line for a write the storage
refused (`storage_error`, `storage_errors`): a full file system, a quota, a file size limit, a
read-only mount or a directory this user may not write become a `UserError` naming the path
and what to do, exit 2, wherever they are raised (prepare's driver and its Ray tasks, training's
set-up of run_dir, W&B's directory)."""

from __future__ import annotations

import contextlib
import errno
import getpass
import os
import re
import shutil
from pathlib import Path
from typing import Iterator, Sequence

from common.configure import UserError

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


def file_system(path: str | Path) -> str:
    """The file system that holds `path`, for a message: "TYPE on MOUNT_POINT" (the mount point
    alone where /proc/self/mounts does not say)."""
    mount = existing_ancestor(path).resolve()
    while not os.path.ismount(mount) and mount != mount.parent:
        mount = mount.parent
    kind = None
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mounts").read_text().splitlines():
            fields = line.split()
            # The last mount on a directory is the one seen; octal escapes (\040) stand for spaces
            # and the like.
            if len(fields) > 2 and re.sub(
                r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), fields[1]
            ) == str(mount):
                kind = fields[2]
    return f"{kind} on {mount}" if kind else str(mount)


# The errors of a write the storage refused, by what the user does about them: make room (a full
# file system, a quota, a file larger than the file system or `ulimit -f` allows), or write
# elsewhere (a read-only mount, a directory this user may not write).
OUT_OF_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
NOT_WRITABLE = frozenset({errno.EROFS, errno.EACCES})


def storage_refusal(err: BaseException) -> str | None:
    """`"space"` for an OSError of a full file system (ENOSPC, EDQUOT, EFBIG), `"access"` for one
    of a read-only or forbidden one (EROFS, EACCES), None for anything else."""
    if not isinstance(err, OSError):
        return None
    if err.errno in OUT_OF_SPACE:
        return "space"
    if err.errno in NOT_WRITABLE:
        return "access"
    return None


def _within(path: Path, roots: Sequence[Path]) -> bool:
    """Whether `path` is one of `roots`, in one, or in a companion beside one: a root's name
    with a suffix (NAME.partial-TOKEN, NAME.lock: its staging directory, its lock file)."""
    for form in {path.absolute(), path.resolve()}:
        for root in roots:
            for base in {root.absolute(), root.resolve()}:
                try:
                    top = form.relative_to(base.parent).parts[0]
                except (ValueError, IndexError):
                    continue
                if top == base.name or top.startswith(base.name + "."):
                    return True
    return False


def _same_file_system(path: Path, other: Path) -> bool:
    try:
        return existing_ancestor(path).stat().st_dev == existing_ancestor(other).stat().st_dev
    except OSError:
        return False


def _why(err: OSError, path: Path) -> str:
    """What the storage said, and what of the file system there explains it."""
    said = f"{err.strerror or os.strerror(err.errno)} ({errno.errorcode.get(err.errno, err.errno)})"
    where = file_system(path)
    if err.errno == errno.ENOSPC:
        with contextlib.suppress(OSError):
            usage = shutil.disk_usage(existing_ancestor(path))
            return (
                f"{said}: {where} ran out of space ({byte_size(usage.free)} of "
                f"{byte_size(usage.total)} free now)"
            )
        return f"{said}: {where} ran out of space"
    if err.errno == errno.EDQUOT:
        return f"{said}: this user's quota on {where} is used up"
    if err.errno == errno.EFBIG:
        return f"{said}: a file larger than {where} or this process's limit (ulimit -f) allows"
    if err.errno == errno.EROFS:
        return f"{said}: {where} is mounted read-only"
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid {os.getuid()}"
    return f"{said}, for {user}"


def storage_error(
    err: BaseException,
    what: str,
    where: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    space: str,
    access: str,
) -> UserError | None:
    """The one line for an OSError that says the storage refused a write (`storage_refusal`), as
    a UserError; None for any other error, which stays a bug's traceback.

    `what` names the setting the user chooses the place by ("output_dir=/data/ds"), and is the
    place named when the error names no file (a write to an open file: ENOSPC); `where` is the
    directory (or directories) the command writes in, with their companions beside them
    (NAME.partial-TOKEN, NAME.lock); `space` and `access` say what to do about a full file
    system and an unwritable one ("free some space there or choose an output_dir on another
    file system"). A file outside `where` is named alone, with the advice that holds anywhere:
    make room on its file system (when it is another one), or check its permissions."""
    kind = storage_refusal(err)
    if kind is None:
        return None
    roots = [Path(where)] if isinstance(where, (str, os.PathLike)) else [Path(p) for p in where]
    roots = [root.absolute() for root in roots]
    # the second of a two-path call (a copy's, a rename's) is the one written
    named = getattr(err, "filename2", None) or getattr(err, "filename", None)
    path = Path(os.fsdecode(named)).absolute() if named else roots[0]
    ours = not named or _within(path, roots)
    if kind == "space":
        ours = ours or _same_file_system(path, roots[0])
    if ours:
        advice = space if kind == "space" else access
        writing = f"cannot write {path}: " if named and path != roots[0] else ""
        return UserError(f"{what}: {writing}{_why(err, path)}; {advice}")
    advice = "make room there" if kind == "space" else "check its permissions and its mount"
    return UserError(f"{path}: {_why(err, path)}; {advice}")


@contextlib.contextmanager
def storage_errors(
    what: str,
    where: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    space: str,
    access: str,
) -> Iterator[None]:
    """An OSError of refused storage raised in the block becomes `storage_error`'s UserError
    (the OSError its cause); any other error passes unchanged."""
    try:
        yield
    except OSError as err:
        refused = storage_error(err, what, where, space=space, access=access)
        if refused is None:
            raise
        raise refused from err
