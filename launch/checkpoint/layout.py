"""Checkpoint layout, the `latest` pointer and retention; what a checkpoint records of itself,
and which checkpoints a resume may continue from.

    RUN_DIR/checkpoints/step_00000100/            a DeepSpeed checkpoint (every rank writes
                                                  its part)
    RUN_DIR/checkpoints/step_00000100.universal/  its universal copy, if one was made
                                                  (launch.deepspeed.universal.to_universal)
    RUN_DIR/checkpoints/latest                    the tag of the newest complete checkpoint

The pointer moves only after every rank has finished writing (a barrier, then an atomic
rename by rank 0), so a crash during a save leaves the previous checkpoint in charge.
A ZeRO checkpoint is tied to the world size that wrote it (DeepSpeed #2898); its universal
copy loads on any world size. `launch.export` turns any checkpoint into plain weights.
This module reads DeepSpeed's file names but never imports it, nor torch.distributed.

Which of the candidates is intact: `launch.checkpoint.integrity`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from omegaconf import OmegaConf

from common.configure import UserError

POINTER = "latest"
UNIVERSAL_SUFFIX = ".universal"
UNIVERSAL_INFO = "universal.json"  # written last into a universal copy: it is complete
# A ZeRO rank's optimizer partition (stages 1-3, or DeepSpeed's BF16_Optimizer; "bf16_" in bf16
# runs).
RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# The module's weights: whole below ZeRO-3 (`mp_rank_00_...`), one file per rank under ZeRO-3.
MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


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
    tags = checkpoint_tags(root)
    if current is not None:
        tags = [t for t in tags if t <= current]
    doomed = [t for t in tags[:-keep_last] if t != current]
    for tag in doomed:
        discard(root, tag)
    return doomed


def checkpoint_tags(root: str | Path) -> list[str]:
    """The step_* checkpoints under `root`, oldest first (universal copies are part of theirs)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(UNIVERSAL_SUFFIX)
    )


def discard(root: str | Path, tag: str) -> None:
    """Remove checkpoint `root/tag` with its universal copy, finished or not. Before a save into
    a tag that exists (what a save that never completed left, or a damaged checkpoint that a
    resume skipped), so that no stale file, nor a copy of the old contents, outlives it."""
    root = Path(root)
    for name in (tag, universal_tag_for(tag), f".{universal_tag_for(tag)}.partial"):
        shutil.rmtree(root / name, ignore_errors=True)


def universal_tag_for(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def is_universal(root: str | Path, tag: str) -> bool:
    """Whether `root/tag` is a universal checkpoint (DeepSpeed's `zero/` folder
    of whole tensors)."""
    return (Path(root) / tag / "zero").is_dir()


def is_zero_partitioned(checkpoint: str | Path) -> bool:
    """Whether a checkpoint's optimizer state is split over per-rank files (ZeRO 1-3, or
    DeepSpeed's BF16_Optimizer), as opposed to whole in `mp_rank_00_model_states.pt` (stage 0)."""
    return bool(_rank_files(Path(checkpoint)))


def client_info(root: str | Path, tag: str) -> dict:
    """The trainer's `client_state.json` of checkpoint `root/tag` (what its torch client state
    holds, readable without unpickling); {} if there is none or it is unreadable."""
    info = Path(root) / tag / "client_state.json"
    try:
        saved = json.loads(info.read_text()) if info.is_file() else {}
    except (OSError, json.JSONDecodeError):
        saved = {}
    return saved if isinstance(saved, dict) else {}


def saved_shape(root: str | Path, tag: str) -> dict:
    """How checkpoint `root/tag` was trained: `world_size` (see `saved_world_size`) and, from
    the trainer's `client_state.json` where it says, `global_batch_size`, `micro_batch_size` and
    `grad_accum` (absent in checkpoints written before the global batch was recorded)."""
    saved = client_info(root, tag)
    shape = {
        key: saved[key]
        for key in ("global_batch_size", "micro_batch_size", "grad_accum")
        if isinstance(saved.get(key), int)
    }
    return {"world_size": saved_world_size(root, tag), **shape}


def saved_model_config(root: str | Path, tag: str) -> dict | None:
    """The model config (a plain dict) that checkpoint `root/tag` holds weights of: from its
    `client_state.json`, else, for a checkpoint written before that recorded it, from its run's
    `config.yaml` beside the checkpoints (a job rewrites it only once it has loaded them, and
    export reads a run's model from there too); None if neither tells."""
    model = client_info(root, tag).get("model")
    if isinstance(model, dict):
        return model
    config_file = Path(root).parent / "config.yaml"
    try:
        model = (
            OmegaConf.to_container(OmegaConf.load(config_file)).get("model")
            if config_file.is_file()
            else None
        )
    except Exception:  # noqa: BLE001 - unreadable: no record, as without the file
        return None
    return model if isinstance(model, dict) else None


def saved_world_size(root: str | Path, tag: str) -> int | None:
    """The number of ranks that wrote checkpoint `root/tag`: from the trainer's
    `client_state.json`, else from DeepSpeed's per-rank files; None if neither tells
    (a stage-0 checkpoint without the json has no per-rank files, and loads on any world size)."""
    directory = Path(root) / tag
    world_size = client_info(root, tag).get("world_size")
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
    return [m for m in (RANK_FILE.match(p.name) for p in directory.iterdir()) if m]


# ----------------------------------------------------------------------------- which checkpoints a
# resume may continue from (the intact one among them: integrity.choose_resume)


def resume_candidates(resume: str, run_dir: str | Path) -> list[tuple[Path, str]]:
    """The checkpoints `resume` may continue from, newest first; [] to start fresh.
    `auto` (or a checkpoints directory): the one the pointer names and every older one, for a
    resume to fall back on when the newest is damaged (newer directories are saves that never
    completed); a step_* directory: that one alone; `none`: none, refused if the run has some."""
    root = checkpoint_root(run_dir)
    if resume == "none":
        if latest_tag(root) is not None:
            raise UserError(
                f"{run_dir} already holds checkpoints; use resume=auto, or another run_dir"
            )
        return []
    if resume != "auto":
        path = Path(resume)
        if (path / POINTER).is_file():
            root = path
        elif path.is_dir() and path.name.startswith("step_"):
            return [(path.parent, path.name)]
        else:
            raise UserError(
                f"resume: {resume!r} is not auto, none, a checkpoints "
                "directory or a step_* checkpoint"
            )
    pointer = root / POINTER
    newest = pointer.read_text().strip() if pointer.is_file() else ""
    if not newest:
        return []
    # The pointer's own tag even if its directory is gone: the verdict says so, and the older ones
    # follow.
    tags = sorted({tag for tag in checkpoint_tags(root) if tag <= newest} | {newest}, reverse=True)
    return [(root, tag) for tag in tags]
