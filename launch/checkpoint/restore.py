"""Restoring a checkpoint's record: the engine's load (weights, optimizer, schedule) and the
`CheckpointState` it kept, read back by its owner; what the trainer does with it (its settings'
changes, the loader, the random streams) is `launch.train.resume.restore`."""

from __future__ import annotations

from pathlib import Path

from launch.checkpoint.state import CheckpointState
from launch.deepspeed.engine import Engine


def load_state(engine: Engine, root: Path, tag: str) -> CheckpointState:
    """Checkpoint `root/tag` into the engine, and its record."""
    return CheckpointState.from_client_state(engine.load(root, tag), where=str(Path(root) / tag))
