"""The run directories of conftest's `made_checkpoints` (test_checkpoint_integrity's `make`: a tiny
GPT under ZeRO-0 and ZeRO-2, two checkpoints each, without integrity.json): their checkpoint tags,
and a copy of one that a test may change."""

import shutil
from pathlib import Path

from launch import checkpoint as ckpt

TAGS = [ckpt.tag_for(1), ckpt.tag_for(2)]  # two checkpoints per run; the pointer names the second


def run_copy(made: Path, stage: int, tmp_path: Path, *, integrity: bool = True) -> Path:
    """A copy of a made run directory; with integrity.json in each checkpoint, as the trainer writes it."""
    run_dir = tmp_path / f"stage{stage}"
    shutil.copytree(made / f"stage{stage}", run_dir)
    if integrity:
        for tag in TAGS:
            ckpt.write_integrity(ckpt.checkpoint_root(run_dir) / tag)
    return run_dir
