"""Checkpoint layout, the `latest` pointer and retention.

    RUN_DIR/checkpoints/step_00000100/   a DeepSpeed checkpoint (every rank writes its part)
    RUN_DIR/checkpoints/latest           the tag of the newest complete checkpoint

The pointer moves only after every rank has finished writing (a barrier, then an atomic
rename by rank 0), so a crash during a save leaves the previous checkpoint in charge.
A checkpoint is tied to the world size that wrote it (DeepSpeed #2898): resuming with another
one is refused; `launch.export` turns any checkpoint into plain weights instead.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from pipeline.configure import UserError

POINTER = "latest"


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def latest_tag(root: str | Path) -> str | None:
    """The tag the pointer names, if the pointer and its checkpoint exist."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if (Path(root) / tag).is_dir() else None


def move_pointer(root: str | Path, tag: str) -> None:
    root = Path(root)
    partial = root / (POINTER + ".partial")
    partial.write_text(tag + "\n")
    os.replace(partial, root / POINTER)


def prune(root: str | Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one the pointer names)."""
    root = Path(root)
    current = latest_tag(root)
    tags = sorted(p.name for p in root.glob("step_*") if p.is_dir())
    if current is not None:
        tags = [t for t in tags if t <= current]
    doomed = [t for t in tags[:-keep_last] if t != current]
    for tag in doomed:
        shutil.rmtree(root / tag, ignore_errors=True)
    return doomed


def resolve_resume(resume: str, run_dir: str | Path) -> tuple[Path, str] | None:
    """(checkpoint root, tag) to resume from, or None to start fresh."""
    root = checkpoint_root(run_dir)
    if resume == "none":
        if latest_tag(root) is not None:
            raise UserError(f"{run_dir} already holds checkpoints; use resume=auto, or another run_dir")
        return None
    if resume == "auto":
        tag = latest_tag(root)
        return (root, tag) if tag else None
    path = Path(resume)
    if (path / POINTER).is_file():
        tag = latest_tag(path)
        if tag is None:
            raise UserError(f"resume: {path}/{POINTER} names a checkpoint that does not exist")
        return path, tag
    if path.is_dir() and path.name.startswith("step_"):
        return path.parent, path.name
    raise UserError(f"resume: {resume!r} is not auto, none, a checkpoints directory or a step_* checkpoint")
