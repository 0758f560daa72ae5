"""Distributed training with a real DeepSpeed engine: 2 processes under torchrun, on CPU (gloo)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo import ROOT
from trainruns import DROPOUT_ZERO3, TINY, metrics, train, wandb_records

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("config", ["tiny_gpt.yaml", "tiny_bert.yaml"])
@pytest.mark.parametrize("stage", [2, 3])
def test_loss_falls(tiny_dataset, tmp_path, config, stage):
    run_dir = tmp_path / "run"
    profiled = config == "tiny_gpt.yaml" and stage == 2  # and `profile_start`, on one of them
    run = train(
        config,
        tiny_dataset,
        run_dir,
        "max_steps=30",
        "log_every=1",
        "eval_every=30",
        f"deepspeed.zero_stage={stage}",
        "checkpoint.every_steps=0",
        *(["profile_start=10", "profile_steps=2"] if profiled else []),
    )
    if profiled:  # steps 11-12: each rank's Chrome trace, rank 0's table of where the time went
        traces = sorted(p.name for p in (run_dir / "profile").iterdir())
        assert traces == ["trace_rank0_steps11-12.json", "trace_rank1_steps11-12.json"], traces
        assert json.loads((run_dir / "profile" / traces[0]).read_text())["traceEvents"]
        table = run.stderr[run.stderr.index("profile of optimizer steps 11-12 (rank 0): wall") :]
        assert "host operators by CPU time of their own" in table and "aten::" in table, table[
            :3000
        ]
    rows = metrics(run_dir)
    losses = [r["train/loss"] for r in rows if "train/loss" in r]
    assert len(losses) == 30
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5, losses
    final = rows[-1]
    assert final["eval/loss"] < losses[0] and final["eval/perplexity"] > 1
    if config == "tiny_bert.yaml":
        assert 0 < final["eval/accuracy"] <= 1
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000030"


def test_resume_reproduces_uninterrupted_losses(tiny_dataset, tmp_path, dropout_zero3_gpt):
    # W&B (offline) in the stopped and resumed jobs, for the run id they share; the uninterrupted
    # run has it off (TINY): W&B records the losses, it does not change them.
    common = [*DROPOUT_ZERO3, "wandb.mode=offline"]
    straight = dropout_zero3_gpt
    stopped = tmp_path / "stopped"
    train("tiny_gpt.yaml", tiny_dataset, stopped, *common, "stop_after_steps=5")
    assert (stopped / "checkpoints" / "latest").read_text().strip() == "step_00000005"
    resumed = train("tiny_gpt.yaml", tiny_dataset, stopped, *common)
    assert "resumed from" in resumed.stderr
    expected = {r["step"]: r["train/loss"] for r in metrics(straight) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in metrics(stopped) if "train/loss" in r}
    print("\nstep  uninterrupted  stopped+resumed")
    for step in range(1, 11):
        print(f"{step:4d}  {expected[step]:.8f}     {got[step]:.8f}")
    assert [got[s] for s in range(6, 11)] == pytest.approx(
        [expected[s] for s in range(6, 11)], abs=1e-6, rel=0
    )
    # The resumed job continued the same W&B run.
    ids = {
        json.loads((p / "client_state.json").read_text())["wandb_run_id"]
        for p in (stopped / "checkpoints").glob("step_*")
    }
    assert len(ids) == 1


def test_a_resumed_run_drops_the_metrics_rows_it_trains_again(tmp_path):
    # A job that died at step 30 with its last checkpoint at step 20 had logged 10..30.
    from launch.train.resume import truncate_metrics

    rows = [{"step": step, "train/loss": 9.0 - step / 10} for step in (10, 20, 30)] + [
        {"step": 30, "eval/loss": 7.5}
    ]
    # ... and was killed while writing a row: a torn last line.
    (tmp_path / "metrics.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows) + '{"step": 3'
    )
    assert truncate_metrics(tmp_path, 20) == 3
    assert [
        json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()
    ] == [10, 20]
    assert truncate_metrics(tmp_path, 20) == 0 and truncate_metrics(tmp_path / "nowhere", 0) == 0
    # a fresh start
    assert truncate_metrics(tmp_path, 0) == 2 and (tmp_path / "metrics.jsonl").read_text() == ""


def test_wandb_offline_files_and_export(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    train(
        "tiny_bert.yaml",
        tiny_dataset,
        run_dir,
        "max_steps=6",
        "log_every=2",
        "eval_every=6",
        "deepspeed.zero_stage=3",
        "checkpoint.every_steps=0",
        "wandb.mode=offline",
    )
    records = wandb_records(run_dir)
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in logged] == [2, 4, 6]
    expected_losses = {r["step"]: r["train/loss"] for r in metrics(run_dir) if "train/loss" in r}
    assert {h["_step"]: h["train/loss"] for h in logged} == pytest.approx(expected_losses)
    config_items = {
        item.key: item.value_json
        for r in records
        if r.WhichOneof("record_type") == "run"
        for item in r.run.config.update
    }
    assert (
        json.loads(config_items["task"]) == "mlm"
        and json.loads(config_items["deepspeed"])["zero_stage"] == 3
    )
    summary = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "summary"
        for item in r.summary.update
        if item.key
    }
    assert len(summary["git_commit"]) == 40 and len(summary["data_manifest_sha256"]) == 64
    assert summary["parameters"] > 0

    # Exported weights reproduce the engine's evaluation loss with the plain model.
    out = tmp_path / "export"
    run = subprocess.run(
        [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    from launch.model_dir import load_model_dir
    from launch.tasks import TASKS
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    model, meta = load_model_dir(out)
    assert meta["step"] == 6 and meta["task"] == "mlm"
    task = TASKS["mlm"]
    loss_sum = count = 0.0
    with torch.no_grad():
        for rank in range(2):  # the engine evaluated with 2 ranks: the same shares, the same masks
            loader = ShardLoader(
                LoaderPlan(
                    str(tiny_dataset),
                    "mlm",
                    "valid",
                    micro_batch_size=4,
                    rank=rank,
                    world_size=2,
                    seed=0,
                )
            )
            for batch in loader:
                inputs = task.model_inputs(batch)
                output = model(**inputs)
                n = int(task.target_mask(inputs).sum())
                loss_sum += float(output.loss) * n
                count += n
    engine_eval = [r["eval/loss"] for r in metrics(run_dir) if "eval/loss" in r][-1]
    assert loss_sum / count == pytest.approx(engine_eval, abs=1e-5)


def test_same_command_under_the_deepspeed_launcher(tiny_dataset, tmp_path):
    """The deepspeed launcher appends --local_rank=N and sets the rank variables itself."""
    run_dir = tmp_path / "run"
    deepspeed = Path(sys.executable).with_name("deepspeed")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [
        str(deepspeed),
        "--num_gpus",
        "2",
        "--master_port",
        "29731",
        "--module",
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *TINY,
        "max_steps=3",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "world 2" in run.stderr
    assert [r["step"] for r in metrics(run_dir) if "train/loss" in r] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000003"


def test_a_second_job_on_one_run_dir_fails_at_once_and_a_dead_ones_lock_is_taken_over(
    tiny_dataset, tmp_path
):
    import signal
    import time

    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [
        sys.executable,
        "-m",
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *TINY,
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
    ]
    first = subprocess.Popen(
        [*command, "max_steps=100000"],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").is_file() and time.time() < deadline:
            assert first.poll() is None, "the first job ended"
            time.sleep(0.5)
        second = subprocess.run(
            [*command, "max_steps=3"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert second.returncode == 2
        (line,) = [line for line in second.stderr.splitlines() if line.startswith("error:")]
        assert f"locked by train pid {first.pid}" in line
        assert first.poll() is None  # the first job trains on
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    third = subprocess.run(
        [*command, "max_steps=3", "resume=none"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert third.returncode == 0, third.stderr[-3000:]
    assert f"taking over the stale lock of pid {first.pid}" in third.stderr
