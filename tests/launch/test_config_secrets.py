"""Issue #45, item 10: `${oc.env:NAME}` is refused in every entry point's config, in one line,
before anything is written; so a token set in the environment never reaches config.yaml, a
checkpoint's client state, W&B's run files or an export's provenance.json. Why refused rather
than stored unresolved: docs/design.md#a-config-does-not-read-the-environment."""

import os
import subprocess
import sys

import pytest
from clirun import packed_data, train_command
from repo import ROOT

SECRET = "hunter2-token-0123456789"
ENV = {
    **os.environ,
    "OMP_NUM_THREADS": "1",
    "WANDB_MODE": "disabled",
    "PRETRAIN_TEST_SECRET": SECRET,
}


def files_holding(directory, text: str) -> list:
    return [
        path
        for path in directory.rglob("*")
        if path.is_file() and text.encode() in path.read_bytes()
    ]


@pytest.mark.parametrize("where", ["file", "command line"])
def test_a_training_config_reading_the_environment_is_refused_before_anything_is_written(
    tmp_path, where
):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    packed_data(data, seq_len=32)
    config = tmp_path / "train.yaml"
    config.write_text(
        (ROOT / "configs" / "tiny_gpt.yaml").read_text()
        + ("wandb:\n  entity: ${oc.env:PRETRAIN_TEST_SECRET}\n" if where == "file" else "")
    )
    command = train_command(data, run_dir, "model.max_seq_len=32", "max_steps=1")
    command[2] = str(config)
    if where == "command line":
        command.append("wandb.entity=${oc.env:PRETRAIN_TEST_SECRET}")
    run = subprocess.run(
        [sys.executable, *command], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "wandb.entity: ${oc.env:...} is refused" in errors[0], run.stderr
    assert SECRET not in run.stderr + run.stdout
    assert not run_dir.exists() and files_holding(tmp_path, SECRET) == []


@pytest.mark.parametrize(
    "module, args",
    [
        ("pipeline.prepare", ["{root}/configs/prepare_gettext_en_de.yaml", "output_dir={out}"]),
        ("launch.export", ["checkpoint={out}", "out={out}"]),
        ("launch.main", ["{root}/configs/main.yaml", "out_dir={out}", "--dry-run"]),
    ],
    ids=["prepare", "export", "main"],
)
def test_every_entry_point_refuses_it_in_one_line(tmp_path, module, args):
    out = tmp_path / "out-${oc.env:PRETRAIN_TEST_SECRET}"
    argv = [arg.format(root=ROOT, out=out) for arg in args]
    run = subprocess.run(
        [sys.executable, "-m", module, *argv],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "${oc.env:...} is refused" in errors[0], run.stderr
    assert SECRET not in run.stderr + run.stdout and list(tmp_path.iterdir()) == []
