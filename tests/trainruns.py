"""Tiny GPT and BERT runs of `launch.train` in processes of their own (2 ranks under torchrun by
default, on CPU), as the launch tests start them, and what a run leaves: its metrics rows, losses
and offline W&B records. Also the settings of the runs conftest trains once a session
(`uninterrupted_gpt`, `dropout_zero3_gpt`), which tests of several files assert on."""

import json
import os
import subprocess
import sys
from pathlib import Path

from repo import ROOT

from launch.main.plan import python_launcher

# The tests' tiny model and batch, on any config.
TINY_SHAPE = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=64",
    "data.micro_batch_size=4",
]
TINY = [
    *TINY_SHAPE,
    "data.num_workers=0",
    "optim.lr=3e-3",
    "schedule.warmup_steps=5",
    "eval_batches=0",
    "threads_per_rank=1",
    # W&B starts a service process per run (seconds each); the tests of W&B ask for it.
    "wandb.mode=disabled",
    # ZeRO-3 would keep every tensor of a model this small whole on every rank.
    "deepspeed.zero3_persistence_threshold=0",
]


# One process, no evaluation or checkpoint: the runs that check what a start refuses or allows
# (the model's shape is TINY_SHAPE's unless an init.model gives it).
ONE_PROCESS = [
    "data.micro_batch_size=4",
    "data.num_workers=0",
    "schedule.warmup_steps=1",
    "eval_every=0",
    "eval_batches=0",
    "checkpoint.every_steps=0",
    "log_every=1",
    "threads_per_rank=1",
    "wandb.mode=disabled",
]


def run_module(*args: str) -> subprocess.CompletedProcess:
    """`python -m ARGS` in the repository, one thread, W&B off; whatever its exit status."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def train_one_process(
    data: Path, run_dir: Path, *overrides: str, shape: bool = True
) -> subprocess.CompletedProcess:
    """`launch.train` on configs/tiny_gpt.yaml in one process with ONE_PROCESS (and TINY_SHAPE
    with `shape`) and `overrides`, whatever its exit status (a dry run: `--dry-run`)."""
    return run_module(
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *(TINY_SHAPE if shape else []),
        *ONE_PROCESS,
        *overrides,
    )


def train(
    config: str, data: Path, run_dir: Path, *overrides: str, nproc: int = 2
) -> subprocess.CompletedProcess:
    """`launch.train` on configs/CONFIG with TINY and `overrides`, on `nproc` ranks; it must succeed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    launcher = python_launcher(nproc)
    command = [
        *launcher,
        "-m",
        "launch.train",
        str(ROOT / "configs" / config),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def run_train(
    data: Path,
    run_dir: Path,
    *overrides: str,
    nproc: int = 2,
    env: dict | None = None,
    check: bool = True,
    inject: str = "",
) -> subprocess.CompletedProcess:
    """A tiny GPT trained by `launch.train` on `nproc` ranks; `inject`: loss faults installed
    from outside the trainer (tests/launch/inject_loss.py, INJECT_LOSS's format)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", **(env or {})}
    if inject:
        env["INJECT_LOSS"] = inject
    launcher = python_launcher(nproc)
    trainer = (
        [str(ROOT / "tests" / "launch" / "inject_loss.py")] if inject else ["-m", "launch.train"]
    )
    command = [
        *launcher,
        *trainer,
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY,
        *overrides,
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert run.returncode == 0, run.stderr[-4000:]
    return run


# ----------------------------------------------------------------------------- the runs trained once
# a session (conftest)

# test_elastic's resume chain: a short epoch, so that the chain crosses an epoch boundary: 12 steps
# of global batch 8.
ELASTIC_CHAIN = [
    "max_steps=14",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=4",
    "checkpoint.keep_last=10",
    "model.dropout=0.0",
    "data.log_sample_keys=true",
]
# The uninterrupted run of that chain (conftest's `uninterrupted_gpt`, shared with test_compile):
# also evaluated every 4 steps, for test_compile's claim that evaluation runs eagerly in a compiled
# run. Evaluation leaves training alone (no dropout, its own loader): the chain's legs, which do not
# evaluate, still match this run's losses.
UNINTERRUPTED_GPT = [*ELASTIC_CHAIN, "deepspeed.zero_stage=2", "eval_every=4"]

# The uninterrupted run of test_train's resume, shared with test_zero_paths (conftest's
# `dropout_zero3_gpt`).
DROPOUT_ZERO3 = [
    "max_steps=10",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=5",
    "deepspeed.zero_stage=3",
    "model.dropout=0.1",
]


# ----------------------------------------------------------------------------- what a run leaves


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> dict[int, float]:
    return {row["step"]: row["train/loss"] for row in metrics(run_dir) if "train/loss" in row}


def steps_of(run_dir: Path, rank: int) -> list[int]:
    """The steps that rank `rank` trained, from its sample keys (data.log_sample_keys=true)."""
    keys = run_dir / f"sample_keys.rank{rank}.jsonl"
    return (
        [json.loads(line)["step"] for line in keys.read_text().splitlines()]
        if keys.is_file()
        else []
    )


def wandb_records(run_dir: Path):
    """The records of the run's offline W&B files (wandb/offline-run-*/run-*.wandb), parsed."""
    from wandb.proto import wandb_internal_pb2

    files = sorted(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert files, "no offline W&B run file"
    records = []
    for path in files:
        for data in read_wandb_log(path):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
    return records


def read_wandb_log(path: Path) -> list[bytes]:
    """Records of a W&B transaction log (.wandb): a 7-byte header (":W&B", 0xBEE1, version),
    then LevelDB-log-style 32 KiB blocks of records: crc32 (4), length (2), type (1), data;
    type 1 is a whole record, 2/3/4 the first/middle/last piece of one."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pending, pos, block = [], b"", 7, 32768
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # block trailer padding
            pos += room
            continue
        length = int.from_bytes(data[pos + 4 : pos + 6], "little")
        kind = data[pos + 6]
        chunk = data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind == 0 and length == 0:
            continue
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            records.append(pending)
            pending = b""
    return records
