"""benchmarks/rank_clock.py: the off-CPU share of a rank's steps that bench_translation and
bench_train print for both sides. A step that sleeps is off the CPU; the wrapper around the real
trainer counts its steps after the skipped ones and leaves the training as it was."""

import os
import subprocess
import time

from repo import ROOT
from trainruns import TINY, UNINTERRUPTED_GPT, losses

from benchmarks import rank_clock
from launch.main.plan import torchrun


def test_a_sleeping_step_is_off_the_cpu_and_the_skipped_steps_are_not_counted():
    clock = rank_clock.StepClock(skip=1)
    for _ in range(3):
        clock.begin()
        time.sleep(0.05)
        clock.end()
    figures = clock.figures()
    assert figures["steps"] == 2 and figures["wall_s"] >= 0.1
    assert figures["off_cpu"] > 0.9, figures
    spin = rank_clock.StepClock()
    spin.begin()
    end = time.thread_time() + 0.05
    while time.thread_time() < end:
        pass
    spin.end()
    assert spin.cpu >= 0.05 and 0.0 <= spin.figures()["off_cpu"] < 1.0
    assert rank_clock.shares([0.123, None]) == "r0 12% r1 -"


def test_the_clocked_trainer_trains_as_the_trainer_and_counts_its_steps(
    tiny_dataset, uninterrupted_gpt, tmp_path
):
    """rank_clock.py in place of `-m launch.train` under torchrun: one file per rank with the
    steps after the skipped ones, and the same losses as the shared 2-rank run of the plain
    trainer (conftest's uninterrupted_gpt, same overrides)."""
    clocked, out = tmp_path / "clocked", tmp_path / "clock"
    command = [
        *torchrun(2),
        str(ROOT / "benchmarks" / "rank_clock.py"),
        "--out",
        str(out),
        "--skip",
        "3",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={clocked}",
        *TINY,
        *UNINTERRUPTED_GPT,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = rank_clock.read(out)
    assert [r["rank"] for r in ranks] == [0, 1] and {r["steps"] for r in ranks} == {14 - 3}, ranks
    assert all(0 < r["cpu_s"] and 0.0 <= r["off_cpu"] < 1.0 for r in ranks), ranks
    assert losses(clocked) == losses(uninterrupted_gpt)
