"""Continued pretraining as its tests run it (test_hf_layouts, test_decoder_families): the small
run's overrides, an entry point in its own process, `launch.export` in this one, and the first
batch a run trained on."""

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT

RUN = [
    "data.micro_batch_size=4",
    "data.num_workers=0",
    "schedule.warmup_steps=2",
    "eval_every=0",
    "eval_batches=0",
    "wandb.mode=disabled",
    "threads_per_rank=1",
    "checkpoint.every_steps=0",
    "log_every=1",
    "model.dropout=0.0",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def command(module: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def train_from(directory: Path, config: str, data_dir: Path, run_dir: Path, *args: str):
    """`launch.train CONFIG` on DATA_DIR from `init.model=DIRECTORY` with RUN's settings."""
    return command(
        "launch.train",
        str(ROOT / "configs" / config),
        f"data.data_dir={data_dir}",
        f"run_dir={run_dir}",
        f"init.model={directory}",
        *args,
        *RUN,
    )


def export_here(*argv: str) -> tuple[int, str]:
    """`python -m launch.export ARGV` run in this process, as its `__main__` runs it (`run_main`):
    the exit status and stderr, without a Python, torch and transformers start per export (6.5 s
    of the 6.7 s an export took in its own process on the 2-core EPYC). The `-m` wiring itself is
    test_cli's."""
    from common.configure import run_main
    from launch.export import main

    stderr = io.StringIO()
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(stderr),
        pytest.raises(SystemExit) as exited,
    ):
        run_main(lambda: main(list(argv)))
    return exited.value.code, stderr.getvalue()


def first_batch(run_dir: Path, task: str) -> dict:
    """The model inputs of the run's first training batch, read again as its loader read them."""
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.tasks import TASKS
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    cfg = load_config(TrainConfig, run_dir / "config.yaml")
    loader = ShardLoader(LoaderPlan.from_config(cfg.data, task, "train", rank=0, world_size=1))
    return TASKS[task].model_inputs(next(iter(loader)))


def lm_eval_metrics(checkpoint: Path, data_dir: Path, out: Path) -> dict:
    """`launch.lm_eval` on an export (ours or Hugging Face's) over 20 documents: its metrics."""
    import json

    run = command(
        "launch.lm_eval",
        f"checkpoint={checkpoint}",
        f"data_dir={data_dir}",
        "limit=20",
        f"out={out}",
        "wandb.mode=disabled",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text())["metrics"]
