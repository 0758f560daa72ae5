"""The main job (`launch.main`): every stage end to end on tiny data, skipping on a re-run, a failed stage,
and a signal to it ending the stage it runs."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from repo import ROOT

pytestmark = pytest.mark.slow


def main_job(config, *overrides):
    # W&B off: its service process would start with each training stage (seconds each), and W&B
    # is not what these tests check (tests/launch/test_tracking.py and test_train.py do).
    return subprocess.run(
        [sys.executable, "-m", "launch.main", str(config), *overrides],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1200,
        env={**os.environ, "WANDB_MODE": "disabled", "PROGRESS_EVERY_S": "1"},
    )


def test_main_job_runs_skips_and_stops_on_failure(tiny_dataset, tmp_path):
    config = tmp_path / "main.yaml"
    config.write_text(
        f"out_dir: {tmp_path / 'out'}\ndata_dir: {tiny_dataset}\nnproc: 1\npretrain_steps: 4\nbert_pretrain_steps: 6\n"
        "finetune_steps: 4\n"
        "starts: [random/random, bert/gpt]\neval_splits: [valid]\nbeam: 2\n"
    )
    first = main_job(config)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "prepare: skipped" in first.stderr  # the dataset exists and validates
    # It says what the pretraining reads, and that extra monolingual text is optional and absent.
    assert (
        f"pretraining text: {tiny_dataset}'s packed training tokens by source: default "
        in first.stderr
    )
    assert "no extra monolingual text (optional: make manpages" in first.stderr
    # Each running stage's line every PROGRESS_EVERY_S seconds, and an overall ETA from the stages
    # run.
    assert (
        "[main] 9 stages: prepare, pretrain gpt, export gpt, pretrain bert, export bert, fine-tune random-random, "
        "evaluate finetune-random-random valid, fine-tune bert-gpt, evaluate finetune-bert-gpt valid"
    ) in first.stderr
    running = [
        line for line in first.stderr.splitlines() if line.startswith("[main] pretrain bert (")
    ]
    assert running and all(
        re.search(
            r"; 3/9 stages done, overall ETA >= \d\d:\d\d \(fine-tune, evaluate "
            r"not yet timed\)$",
            line,
        )
        for line in running
    ), running
    assert re.search(
        r"^\[main\] evaluate finetune-bert-gpt valid: done in \d+ s; 9/9 stages done, overall ETA 00:00$",
        first.stderr,
        re.MULTILINE,
    )
    report = tmp_path / "out" / "report"
    summary = (report / "summary.md").read_text()
    assert "| random/random | 4 |" in summary and "| bert/gpt | 4 |" in summary
    assert "| gpt | 4 |" in summary and "| bert | 6 |" in summary  # BERT's own budget
    # the table is printed too
    assert summary.split("| bert/gpt |")[1].splitlines()[0] in first.stdout
    for plot in ("pretrain_loss.png", "finetune_loss.png"):
        png = (report / plot).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, plot
        assert f"]({plot})" in summary
    assert "warm start: copied" in (tmp_path / "out" / "logs" / "finetune-bert-gpt.log").read_text()

    again = main_job(config)
    assert again.returncode == 0
    for stage in (
        "pretrain gpt",
        "pretrain bert",
        "export gpt",
        "fine-tune bert-gpt",
        "evaluate finetune-bert-gpt valid",
    ):
        assert f"{stage}: skipped" in again.stderr
    summary = (report / "summary.md").read_text()  # the same table; this invocation's wall time

    # A stage whose config would fail is refused before any stage runs (the chain's preflight,
    # what --dry-run reports), in one line naming it; nothing is run or rewritten.
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "configs" / "tiny_translation.yaml").read_text() + "no_such_key: 1\n")
    refused = main_job(config, f"translation_config={broken}", "starts=[gpt/bert]")
    assert refused.returncode == 2, refused.stderr[-3000:]
    # DeepSpeed's
    (line,) = [
        line for line in refused.stderr.splitlines() if "Setting accelerator to CPU" not in line
    ]
    assert (
        line.startswith("error: fine-tune (gpt/bert): ")
        and "no_such_key" in line
        and "--dry-run" in line
    ), line
    # A stage that fails while it runs (here: a damaged export, which no preflight reads) stops
    # the run with its error; what earlier stages wrote stays.
    weights = tmp_path / "out" / "export-gpt" / "model.safetensors"
    weights.write_bytes(b"damaged")
    failed = main_job(config, "starts=[random/gpt]")
    assert failed.returncode == 1, failed.stderr[-3000:]
    assert "stage fine-tune random-gpt failed" in failed.stderr, failed.stderr[-2000:]
    assert "logs/finetune-random-gpt.log" in failed.stderr
    assert (
        weights.read_bytes() == b"damaged"
        and (tmp_path / "out" / "export-bert" / "model.safetensors").is_file()
    )
    assert (report / "summary.md").read_text() == summary


def test_bad_start_is_refused(tmp_path):
    config = tmp_path / "main.yaml"
    config.write_text("starts: [bert/t5]\n")
    run = main_job(config)
    assert run.returncode == 2 and "starts" in run.stderr and "bert/t5" in run.stderr
    config.write_text("bert_pretrain_steps: -1\n")
    run = main_job(config)
    assert (
        run.returncode == 2
        and "bert_pretrain_steps=-1" in run.stderr
        and "must be positive" in run.stderr
    )


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["SIGTERM", "SIGINT", "SIGHUP"]
)
def test_a_signal_to_the_main_job_ends_its_training_stage_with_it(tiny_dataset, tmp_path, signum):
    """Issue #28, item 9. SIGTERM or SIGINT to `launch.main` while a training stage runs under
    torchrun (which has no parent-death handling of its own): the stage is stopped with it, its
    ranks checkpoint the step they reached, and no process of the stage is left a few seconds
    later; the main job says so in one line and exits 128 + the signal's number. Issue #45: SIGHUP
    too (it was passed on to torchrun, whose ranks died of it unsaved); and a second main job on
    the same out_dir, started meanwhile, is refused in one line naming the first, leaving its
    config and its stage's log as they were (it ran the same stage and wiped the log)."""
    from processes import alive, command_of, descendants, kill_all, wait_for

    out = tmp_path / "out"
    config = tmp_path / "main.yaml"
    config.write_text(
        f"out_dir: {out}\ndata_dir: {tiny_dataset}\nnproc: 2\npretrain_steps: 100000\n"
        "starts: [random/gpt]\n"
    )
    job = subprocess.Popen(
        [sys.executable, "-m", "launch.main", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "WANDB_MODE": "disabled"},
    )
    stage: list[int] = []
    try:
        wait_for(
            lambda: job.poll() is not None or (out / "pretrain-gpt" / "metrics.jsonl").is_file(),
            600,
            "the GPT pretraining to train",
        )
        assert job.poll() is None, job.communicate()
        stage = descendants(job.pid)  # torchrun, its ranks and their DataLoader workers
        assert sum("launch.train" in command_of(pid) for pid in stage) >= 3, [
            command_of(pid) for pid in stage
        ]
        log, saved = out / "logs" / "pretrain-gpt.log", (out / "config.yaml").read_bytes()
        logged = log.read_bytes()
        second = subprocess.run(
            [sys.executable, "-m", "launch.main", str(config)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "WANDB_MODE": "disabled"},
        )
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr.splitlines()[-1].startswith(
            f"error: {out} is locked by main pid {job.pid} on host "
        ), second.stderr[-3000:]
        assert log.read_bytes().startswith(logged) and (out / "config.yaml").read_bytes() == saved
        job.send_signal(signum)
        signalled = time.monotonic()
        try:
            _, stderr = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"launch.main still runs 60 s after {signum.name}") from None
        wait_for(
            lambda: not any(alive(pid) for pid in stage), 5, "every process of the stage to end"
        )
        print(
            f"\n{signum.name}: main and its stage gone {time.monotonic() - signalled:.1f} s after the signal"
        )
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        kill_all(stage)
    assert job.returncode == 128 + signum, stderr[-3000:]
    said = [
        line for line in stderr.splitlines() if line.startswith(f"[main] stopped by {signum.name}")
    ]
    assert len(said) == 1 and "pretrain gpt" in said[0], stderr[-3000:]
    run_dir = out / "pretrain-gpt"
    step = json.loads((run_dir / "preempted.json").read_text())["step"]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{step:08d}"


def test_a_stage_override_of_the_zero_stage_replaces_the_jobs_own():
    """configs/main.yaml pretrains at the job's ZeRO-1 and fine-tunes at stage 0 by
    translation_overrides: each run's command line names its stage once."""
    from common.configure import load_config
    from launch.config import MainConfig
    from launch.main.plan import finetune_overrides, pretrain_overrides

    cfg = load_config(MainConfig, ROOT / "configs" / "main.yaml", [])
    stages = [
        [o for o in overrides if o.startswith("deepspeed.zero_stage=")]
        for overrides in (
            pretrain_overrides(cfg, "gpt", Path("gpt")),
            finetune_overrides(cfg, Path("ft"), {}),
        )
    ]
    assert stages == [["deepspeed.zero_stage=1"], ["deepspeed.zero_stage=0"]]
