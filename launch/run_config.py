"""The config a training job runs with: the YAML and its overrides, `init.model`'s directory (its
model config; a `model.*` override that contradicts it refused), and the precision chosen for this
machine. One route for the trainer, its dry run and the main job's dry run of each stage, so that
a dry run checks the model the job will build."""

from __future__ import annotations

from launch import init_model
from launch.config import TrainConfig
from launch.metrics import resolve_precision


def training_config(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`cfg` (loaded from the YAML with `overrides`, the command line's key=value list) as the
    job will run it."""
    return resolve_precision(init_model.resolve(cfg, overrides))
