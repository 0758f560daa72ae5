"""Checkpoint layout, the `latest` pointer and retention.

    RUN_DIR/checkpoints/step_00000100/            a DeepSpeed checkpoint (every rank writes its part)
    RUN_DIR/checkpoints/step_00000100.universal/  its universal copy, if one was made (launch.engine.to_universal)
    RUN_DIR/checkpoints/latest                    the tag of the newest complete checkpoint

The pointer moves only after every rank has finished writing (a barrier, then an atomic
rename by rank 0), so a crash during a save leaves the previous checkpoint in charge.
A ZeRO checkpoint is tied to the world size that wrote it (DeepSpeed #2898); its universal
copy loads on any world size. `launch.export` turns any checkpoint into plain weights.
This module reads DeepSpeed's file names but never imports it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from pipeline.configure import UserError

POINTER = "latest"
UNIVERSAL_SUFFIX = ".universal"
UNIVERSAL_INFO = "universal.json"  # written last into a universal copy: it is complete
# A ZeRO rank's optimizer partition (stages 1-3, or DeepSpeed's BF16_Optimizer; "bf16_" in bf16 runs).
_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")


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
    """Delete all but the newest `keep_last` complete checkpoints (never the one the pointer
    names), each with its universal copy; copies count as part of their checkpoint."""
    root = Path(root)
    current = latest_tag(root)
    tags = sorted(p.name for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(UNIVERSAL_SUFFIX))
    if current is not None:
        tags = [t for t in tags if t <= current]
    doomed = [t for t in tags[:-keep_last] if t != current]
    for tag in doomed:
        shutil.rmtree(root / tag, ignore_errors=True)
        shutil.rmtree(root / universal_tag_for(tag), ignore_errors=True)
        shutil.rmtree(root / f".{universal_tag_for(tag)}.partial", ignore_errors=True)
    return doomed


def universal_tag_for(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def is_universal(root: str | Path, tag: str) -> bool:
    """Whether `root/tag` is a universal checkpoint (DeepSpeed's `zero/` folder of whole tensors)."""
    return (Path(root) / tag / "zero").is_dir()


def is_zero_partitioned(checkpoint: str | Path) -> bool:
    """Whether a checkpoint's optimizer state is split over per-rank files (ZeRO 1-3, or
    DeepSpeed's BF16_Optimizer), as opposed to whole in `mp_rank_00_model_states.pt` (stage 0)."""
    return bool(_rank_files(Path(checkpoint)))


def saved_world_size(root: str | Path, tag: str) -> int | None:
    """The number of ranks that wrote checkpoint `root/tag`: from the trainer's
    `client_state.json`, else from DeepSpeed's per-rank files; None if neither tells
    (a stage-0 checkpoint without the json has no per-rank files, and loads on any world size)."""
    directory = Path(root) / tag
    info = directory / "client_state.json"
    if info.is_file():
        try:
            world_size = json.loads(info.read_text()).get("world_size")
        except (json.JSONDecodeError, AttributeError):
            world_size = None
        if isinstance(world_size, int):
            return world_size
    ranks = _rank_files(directory)
    if not ranks:
        return None
    data_parallel = {int(m.group(1)) for m in ranks}
    model_parallel = {int(m.group(2)) for m in ranks}
    return len(data_parallel) * len(model_parallel)


def _rank_files(directory: Path) -> list[re.Match]:
    if not directory.is_dir():
        return []
    return [m for m in (_RANK_FILE.match(p.name) for p in directory.iterdir()) if m]


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
