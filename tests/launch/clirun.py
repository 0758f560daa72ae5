"""The project's commands run as a user runs them: a command line of `launch.train` on a tiny GPT
(train_command) and a packed shard set for it (packed_data); a command in a process of its own,
in ENV (run_cli). What a refused command must answer: tests/errorlines.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from repo import ROOT
from shardtools import make_dataset, save_manifest
from trainruns import TINY

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def train_command(data: Path, run_dir: Path, *overrides: str) -> list[str]:
    """`-m launch.train` on configs/tiny_gpt.yaml with TINY and W&B off: what follows the
    interpreter or a launcher."""
    return [
        "-m",
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY,
        "wandb.mode=disabled",
        *overrides,
    ]


def packed_data(directory: Path, seq_len: int, sizes=(40, 40)) -> dict:
    """Packed shards of `sizes` samples of `seq_len` tokens, the seq_len recorded: the manifest."""
    manifest = make_dataset(directory, packed=list(sizes), seq_len=seq_len)
    manifest["datasets"]["packed"]["seq_len"] = seq_len  # as prepare records it
    save_manifest(directory, manifest)
    return manifest


def run_cli(*args: str, env: dict | None = None, timeout: int = 300) -> tuple[int, list[str]]:
    """`python ARGS` in ROOT with ENV (or `env`): its exit status and stderr lines."""
    run = subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        env=env or ENV,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return run.returncode, run.stderr.splitlines()
