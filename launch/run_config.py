"""The config a training job runs with: the YAML and its overrides, `init.model`'s directory (its
model config; a `model.*` override that contradicts it refused), and the precision chosen for this
machine (`choose_precision`, the one place that decides it). One route for the trainer, its dry run
and the main job's dry run of each stage, so that a dry run checks the model the job will build."""

from __future__ import annotations

import dataclasses
import os
import sys

import torch

from launch import init_model, metrics
from launch.config import TrainConfig


def training_config(cfg: TrainConfig, overrides: list[str]) -> TrainConfig:
    """`cfg` (loaded from the YAML with `overrides`, the command line's key=value list) as the
    job will run it."""
    return with_precision_chosen(init_model.with_directory_model(cfg, overrides))


def choose_precision() -> tuple[str, str]:
    """What `deepspeed.precision: auto` is on this machine, and why: bf16 on a GPU that computes
    it, fp32 on one that does not; on a CPU, bf16 where its measured bf16 GEMMs are at least as
    fast as its fp32 ones (AMX: several times faster), else fp32 (AVX2 alone: ~100x slower)."""
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        if torch.cuda.is_bf16_supported():
            return "bf16", f"{name} computes bf16"
        return "fp32", f"{name} has no bf16"
    bf16, _ = metrics.cpu_gemm_peak(torch.bfloat16)
    fp32, _ = metrics.cpu_gemm_peak(torch.float32)
    return (
        "bf16" if bf16 >= fp32 else "fp32",
        f"this CPU's GEMMs, measured: bf16 {bf16 / 1e9:.1f}, fp32 {fp32 / 1e9:.1f} GFLOP/s",
    )


def with_precision_chosen(cfg, quiet: bool = False):
    """The training config with `deepspeed.precision: auto` replaced by this machine's choice
    (`choose_precision`), said once on stderr (by rank 0); any other value is kept."""
    if cfg.deepspeed.precision != "auto":
        return cfg
    precision, why = choose_precision()
    if not quiet and os.environ.get("RANK", "0") == "0":
        print(f"deepspeed.precision: auto -> {precision} ({why})", file=sys.stderr, flush=True)
    return dataclasses.replace(
        cfg, deepspeed=dataclasses.replace(cfg.deepspeed, precision=precision)
    )
