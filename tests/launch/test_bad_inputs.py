"""Bad inputs that ended in a traceback where one line belongs (issue #45, items 7-9): an
optimizer setting torch refuses only once the process group is up, a damaged or pickled weights
file given to the tools that read exported models, token ids outside the vocabulary in an
evaluation split."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
from conftest import ROOT
from test_reliability import ENV, assert_one_error_line, packed_data, run_cli, train_command

from launch.config import TrainConfig, config_problems

# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("lr", float("nan"), "optim.lr: nan must be a finite number, 0 or more"),
        ("lr", -1.0, "optim.lr: -1.0 must be"),
        ("lr", float("inf"), "optim.lr: inf must be"),
        ("beta1", 1.0, "optim.beta1: 1.0 must be in [0, 1)"),
        ("beta2", float("nan"), "optim.beta2: nan must be in [0, 1)"),
        ("eps", -1e-8, "optim.eps: -1e-08 must be"),
        ("weight_decay", float("nan"), "optim.weight_decay: nan must be"),
        ("grad_clip", float("inf"), "optim.grad_clip: inf must be 0 (off) or"),
    ],
)
def test_optimizer_settings_torch_refuses_are_config_problems(key, value, expected):
    cfg = TrainConfig()
    cfg.model.vocab_size = 100
    assert config_problems(cfg) == []
    cfg.optim = dataclasses.replace(cfg.optim, **{key: value})
    assert config_problems(cfg) == [expected] or expected in config_problems(cfg)[0]


@pytest.mark.parametrize("lr", ["nan", "-1"])
def test_a_bad_learning_rate_stops_the_trainer_in_one_line_leaving_nothing(tmp_path, lr):
    data, run_dir = tmp_path / "data", tmp_path / "runs" / "gpt"
    packed_data(data, seq_len=32)
    args = train_command(data, run_dir, "model.max_seq_len=32", "max_steps=1", f"optim.lr={lr}")
    code, lines = run_cli(*args)
    assert_one_error_line(code, lines, f"optim.lr: {float(lr)} must be a finite number")
    assert not (tmp_path / "runs").exists()  # no empty run directory left
    # and the dry run, which said "ready", names it
    dry = subprocess.run(
        [sys.executable, *args, "--dry-run"], cwd=ROOT, env=ENV, capture_output=True, text=True
    )
    assert dry.returncode == 2 and f"optim.lr: {float(lr)} must be" in dry.stdout, dry.stdout
    assert not (tmp_path / "runs").exists()
