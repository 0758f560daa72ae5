"""Replacing an output directory without touching what is not ours: the one way prepare, export
and average put their output in place (issue 61).

A command builds its output in a staging directory beside it, `NAME.partial-TOKEN` (TOKEN: the
process id and a random suffix, so that no run ever takes a name another run or a user holds),
marked as ours by a `.staging.json` inside it. Only when it is complete is it swapped in: the old
output is renamed to `NAME.replaced-TOKEN` (marked too) and removed after the swap. A name is
deleted only when this run made it or it carries our marker for this output; a backup such as
`NAME.old` is never touched. Before anything is written, `check_replaceable` refuses an output
that is a file, a directory holding anything the command did not write (whatever `overwrite`
says), or one that holds the run's own inputs (`check_inputs_outside`). A symbolic link named as
the output is followed (`real_output`): the link is the user's, the directory it names is the
output. Run under the output's lock (`common.lock`), `clear_leftovers` removes what a run killed
outright left (and puts back an output that such a run had moved aside but not yet replaced).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable

from common.configure import UserError

MARKER = ".staging.json"  # inside a staging or replaced directory: whose it is
STAGING, REPLACED = "partial", "replaced"


def real_output(output: str | os.PathLike, key: str) -> Path:
    """`output`, or the directory a symbolic link of that name points to (the link stays the
    user's); a link that points nowhere is refused in one line."""
    output = Path(output)
    if not output.is_symlink():
        return output
    target = output.resolve()
    if not target.exists():
        raise UserError(
            f"{key}: {output} is a symbolic link to {target}, which does not exist; create that "
            "directory or give another path"
        )
    return target


def check_inputs_outside(
    output: Path, key: str, inputs: Iterable[tuple[str, str | os.PathLike]]
) -> None:
    """UserError, one line, when `output` (the value of `key`) is one of the run's inputs or
    holds one: replacing it would delete what the run reads. `inputs`: (key, local path)."""
    target = output.resolve()
    for input_key, path in inputs:
        where = Path(path).resolve()
        if where == target or target in where.parents:
            raise UserError(
                f"{key}: {output} holds {path}, an input of this run ({input_key}); replacing it "
                f"would delete it: choose another {key}, outside the inputs"
            )


def check_replaceable(
    output: Path,
    key: str,
    what: str,
    foreign: Callable[[Path], list[str]],
    overwrite: bool | None,
) -> None:
    """UserError, one line, unless `output` may be replaced: it does not exist, is an empty
    directory, or is an earlier output of this command (`foreign`, what in it the command did not
    write, is empty), the last only with `overwrite` where the command asks for it (`overwrite`
    None: an own output is replaced without it). A file, or a directory holding anything else, is
    refused whatever `overwrite` says: a command deletes only what it wrote."""
    if not (output.exists() or output.is_symlink()):
        return
    if not output.is_dir():
        raise UserError(
            f"{key}: {output} is a file, not a directory {what} writes; choose another {key}"
        )
    if not any(output.iterdir()):
        return
    strangers = foreign(output)
    if not strangers:
        if overwrite is False:
            raise UserError(
                f"{key}: {output} is already the output of an earlier {what}; pass "
                "overwrite=true to replace it"
            )
        return
    shown = ", ".join(strangers[:3]) + (", ..." if len(strangers) > 3 else "")
    raise UserError(
        f"{key}: {output} holds what {what} did not write ({shown}); {what} replaces only its own "
        "earlier output or an empty directory"
        + (", whatever overwrite says" if overwrite is not None else "")
        + f": choose another {key}, or move those away yourself"
    )


def new_staging(output: Path, what: str) -> Path:
    """A fresh staging directory beside `output`, unique to this run and marked as ours."""
    token = f"{os.getpid()}-{secrets.token_hex(4)}"
    staging = output.with_name(f"{output.name}.{STAGING}-{token}")
    staging.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()  # never an existing one: the name is this run's
    _mark(staging, what, output, STAGING)
    return staging


def adopt(staging: Path, output: Path, what: str) -> Path:
    """Take over an earlier run's staging directory (a resume): marked as this run's."""
    _mark(staging, what, output, STAGING)
    return staging


def publish(staging: Path, output: Path, what: str) -> None:
    """Swap the finished `staging` into place as `output`. The old output is moved aside under a
    name of this run's and removed only once the new one is in place; if the swap fails, the old
    output is put back."""
    token = staging.name.rpartition(f".{STAGING}-")[2]
    replaced = output.with_name(f"{output.name}.{REPLACED}-{token}")
    moved = False
    if output.exists():
        output.rename(replaced)
        moved = True
        _mark(replaced, what, output, REPLACED)
    try:
        staging.rename(output)
    except BaseException:
        if moved and not output.exists():
            (replaced / MARKER).unlink(missing_ok=True)
            replaced.rename(output)
        raise
    (output / MARKER).unlink(missing_ok=True)  # kept to the end: until then, a leftover is ours
    if moved:
        shutil.rmtree(replaced)


def discard(staging: Path) -> None:
    """Remove this run's staging directory (a failure, an interrupt)."""
    shutil.rmtree(staging, ignore_errors=True)


def staging_dirs(output: Path, role: str = STAGING) -> list[Path]:
    """The directories beside `output` that carry our marker for it in `role` (an earlier run's
    staging directories, or the outputs it moved aside)."""
    found = []
    for path in sorted(output.parent.glob(f"{_glob_escape(output.name)}.{role}-*")):
        record = _marker(path)
        if record and record.get("output") == output.name and record.get("role") == role:
            found.append(path)
    return found


def clear_leftovers(
    output: Path, log: Callable[[str], None] = lambda msg: None, spare: Path | None = None
) -> list[Path]:
    """Under the output's lock: remove the staging and replaced directories that earlier runs
    killed outright (kill -9, a lost node) left beside `output`, each one only if it carries our
    marker for this output; an output such a run had moved aside and not yet replaced is put
    back first. `spare`: a staging directory this run goes on from (a prepare's resume), kept.
    Returns what was removed."""
    mine = [
        (role, path)
        for role in (STAGING, REPLACED)
        for path in staging_dirs(output, role)
        if path != spare
    ]
    if not (output.exists() or output.is_symlink()):
        aside = [path for role, path in mine if role == REPLACED]
        if aside:
            newest = max(aside, key=lambda path: path.stat().st_mtime)
            (newest / MARKER).unlink(missing_ok=True)
            newest.rename(output)
            log(f"put back {output}, which an interrupted run had moved to {newest.name}")
            mine = [(role, path) for role, path in mine if path != newest]
    record = _marker(output)  # a run killed right after its swap
    if record and record.get("output") == output.name and record.get("role") == STAGING:
        (output / MARKER).unlink()
    removed = []
    for _, path in mine:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
        log(f"removed {path}, left by an interrupted run")
    return removed


def _mark(directory: Path, what: str, output: Path, role: str) -> None:
    record = {
        "what": what,
        "output": output.name,
        "role": role,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "since": datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    (directory / MARKER).write_text(json.dumps(record) + "\n")


def _marker(directory: Path) -> dict | None:
    try:
        record = json.loads((directory / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def _glob_escape(name: str) -> str:
    return "".join(f"[{c}]" if c in "*?[" else c for c in name)
