"""Configuration of a run's checkpoints (`launch.checkpoint.save`: when they are written, how
many are kept)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted


def checkpoint_problems(checkpoint: CheckpointConfig) -> list[str]:
    """`checkpoint.*`'s problems, each message starting with its key."""
    return [] if checkpoint.keep_last >= 1 else ["checkpoint.keep_last: must be at least 1"]
