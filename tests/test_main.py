"""The main job (`launch.main`): every stage end to end on tiny data, skipping on a re-run, and a failed stage."""

import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.slow


def main_job(config, *overrides):
    return subprocess.run([sys.executable, "-m", "launch.main", str(config), *overrides], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200, env={**__import__("os").environ, "WANDB_MODE": "offline"})


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
    assert f"pretraining text: {tiny_dataset}'s packed training tokens by source: default " in first.stderr
    assert "no extra monolingual text (optional: make manpages" in first.stderr
    report = tmp_path / "out" / "report"
    summary = (report / "summary.md").read_text()
    assert "| random/random | 4 |" in summary and "| bert/gpt | 4 |" in summary
    assert "| gpt | 4 |" in summary and "| bert | 6 |" in summary  # BERT's own budget
    assert summary.split("| bert/gpt |")[1].splitlines()[0] in first.stdout  # the table is printed too
    for plot in ("pretrain_loss.png", "finetune_loss.png"):
        png = (report / plot).read_bytes()
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000, plot
        assert f"]({plot})" in summary
    assert "warm start: copied" in (tmp_path / "out" / "logs" / "finetune-bert-gpt.log").read_text()

    again = main_job(config)
    assert again.returncode == 0
    for stage in ("pretrain gpt", "pretrain bert", "export gpt", "fine-tune bert-gpt", "evaluate finetune-bert-gpt valid"):
        assert f"{stage}: skipped" in again.stderr
    summary = (report / "summary.md").read_text()  # the same table; this invocation's wall time

    # A stage that fails stops the run with its error; what earlier stages wrote stays.
    broken = tmp_path / "broken.yaml"
    broken.write_text((ROOT / "configs" / "tiny_translation.yaml").read_text() + "no_such_key: 1\n")
    failed = main_job(config, f"translation_config={broken}", "starts=[gpt/bert]")
    assert failed.returncode == 1
    assert "stage fine-tune gpt-bert failed" in failed.stderr and "no_such_key" in failed.stderr
    assert (tmp_path / "out" / "export-gpt" / "model.safetensors").is_file()
    assert (report / "summary.md").read_text() == summary


def test_bad_start_is_refused(tmp_path):
    config = tmp_path / "main.yaml"
    config.write_text("starts: [bert/t5]\n")
    run = main_job(config)
    assert run.returncode == 2 and "starts" in run.stderr and "bert/t5" in run.stderr
    config.write_text("bert_pretrain_steps: -1\n")
    run = main_job(config)
    assert run.returncode == 2 and "bert_pretrain_steps=-1" in run.stderr and "must be positive" in run.stderr
