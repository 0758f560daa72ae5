"""What `launch.export` may write to (issue #45, items 1 and 4; issue #61, items 1 and 2): `out`
is replaced only when it is an earlier export of ours or empty; never when it holds anything else
(a file, another model, a user's notes: `overwrite` is retired) or is the run directory being read,
inside it or above it; the names an export uses beside `out` are its run's own (a user's
OUT.old or OUT.partial survives); a second export into one `out` is refused while the first
writes it; a failure leaves neither its staging directory nor OUT.lock; and a tokenizer.model that
is not the one the checkpoint recorded is refused before anything is written.

The checkpoints are conftest's `made_checkpoints` (a tiny GPT, ZeRO-2, two checkpoints); most
exports run in this process, as its `__main__` runs them (test_checkpoint_integrity.run_export),
the lock's in processes of their own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from errorlines import assert_one_line_error
from madecheckpoints import run_copy
from repo import ROOT

from common.configure import run_main
from launch.export import is_export


def export(checkpoint: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    """`launch.export` in this process, its exit status and stderr (run_export, with more keys)."""
    import contextlib
    import io

    from launch.export import main

    argv = [f"checkpoint={checkpoint}", f"out={out}", *extra]
    stdout, stderr = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
        pytest.raises(SystemExit) as exited,
    ):
        run_main(lambda: main(argv))
    return subprocess.CompletedProcess(
        argv, exited.value.code, stdout.getvalue(), stderr.getvalue()
    )


def snapshot(directory: Path) -> dict:
    """Every path under `directory` with its bytes (None for a directory)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


@pytest.fixture
def run_dir(made_checkpoints, tmp_path) -> Path:
    return run_copy(made_checkpoints, 2, tmp_path)


def another_model(out: Path) -> None:
    """A directory of someone else's model, with a file of the user's in it."""
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    (out / "model.safetensors").write_bytes(b"their weights")
    (out / "notes.txt").write_text("my notes on this model\n")


CASES = {
    "another model's directory": (
        lambda run, tmp: tmp / "theirs",
        lambda out, run: another_model(out),
        "holds what an export did not write (config.json, model.safetensors, notes.txt)",
    ),
    "an export with a user's file in it": (
        lambda run, tmp: tmp / "exp",
        lambda out, run: (
            export(run, out),
            (out / "thesis.tex").write_text("my thesis\n"),
        ),
        "holds what an export did not write (thesis.tex)",
    ),
    "a file": (
        lambda run, tmp: tmp / "model.bin",
        lambda out, run: out.write_text("a file"),
        "is a file, not a directory an export writes",
    ),
    "the run directory": (lambda run, tmp: run, None, "is the run directory"),
    "its checkpoints": (lambda run, tmp: run / "checkpoints", None, "is inside the run directory"),
    "a directory above it": (lambda run, tmp: tmp, None, "holds the run directory"),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_an_out_export_must_not_replace_is_refused_in_one_line_and_left_as_it_was(
    run_dir, tmp_path, case
):
    where, make, expected = CASES[case]
    out = where(run_dir, tmp_path)
    if make:
        make(out, run_dir)
    before = snapshot(tmp_path)
    assert_one_line_error(export(run_dir, out), f"out: {out} ", expected)
    assert snapshot(tmp_path) == before  # nothing deleted, nothing left (staging, OUT.lock)
    # overwrite=true replaced the first three, a user's files with them; it is no longer a key
    assert_one_line_error(export(run_dir, out, "overwrite=true"), "overwrite: no longer a key")
    assert snapshot(tmp_path) == before


def test_a_users_backup_beside_out_survives_an_export_replacing_the_earlier_one(run_dir, tmp_path):
    """Item 2: OUT.old (a user's `cp -r exp exp.old`, with a KEEP.txt) was deleted by the swap,
    and OUT.partial (a name of the user's too) by the export's start."""
    out = tmp_path / "exp"
    assert export(run_dir, out).returncode == 0
    shutil.copytree(out, tmp_path / "exp.old")
    (tmp_path / "exp.old" / "KEEP.txt").write_text("keep me\n")
    (tmp_path / "exp.partial").mkdir()
    (tmp_path / "exp.partial" / "draft.txt").write_text("a draft\n")
    beside = {name: snapshot(tmp_path / name) for name in ("exp.old", "exp.partial", run_dir.name)}
    done = export(run_dir, out)
    assert done.returncode == 0 and is_export(out), done.stderr[-3000:]
    assert {name: snapshot(tmp_path / name) for name in beside} == beside
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp", "exp.old", "exp.partial", "stage2"]


def test_an_earlier_export_is_replaced_and_a_failed_one_leaves_it_intact(run_dir, tmp_path):
    out = tmp_path / "export"
    out.mkdir()  # an empty directory is taken
    for _ in range(2):  # and an export of ours is replaced without overwrite
        done = export(run_dir, out)
        assert done.returncode == 0, done.stderr[-3000:]
    before = snapshot(tmp_path)
    # format=hf fails inside, writing its tokenizer (the run's is a stand-in, no SentencePiece
    # model): it left OUT.partial.
    pytest.importorskip("transformers")
    failed = export(run_dir, out, "format=hf")
    assert_one_line_error(failed, "not a SentencePiece model")
    assert snapshot(tmp_path) == before


HOLDER = """
import sys, time
from pathlib import Path
from common.lock import dir_lock
from common.outputs import new_staging
out = Path(sys.argv[1])
with dir_lock(out, what="export", lock_file=out.with_name(out.name + ".lock")):
    staging = new_staging(out, "export")
    (staging / "model.safetensors").write_bytes(b"being written")
    print(staging, flush=True)
    time.sleep(600)
"""


def test_a_second_export_into_an_out_being_written_is_refused_naming_the_first(run_dir, tmp_path):
    """Two exports into one out crashed each other (FileNotFoundError on out.partial/config.json)
    or the last silently won. The first here holds OUT.lock as an export does, writing OUT.partial."""
    out = tmp_path / "export"
    first = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    try:
        staging = Path(first.stdout.readline().strip())
        assert staging.parent == tmp_path and staging.name.startswith("export.partial-")
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={out}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert_one_line_error(second, f"{out} is locked by export pid {first.pid}")
        assert time.monotonic() - started < 60
        # the first one's work untouched
        assert (staging / "model.safetensors").read_bytes() == b"being written"
        assert not out.exists()
    finally:
        first.kill()
        first.wait()
    # what the killed export left, marked as its own, the next one clears
    done = export(run_dir, out)
    assert done.returncode == 0 and is_export(out), done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["export", "stage2"]


@pytest.mark.parametrize("fmt", ["ours", "hf"])
def test_a_tokenizer_other_than_the_checkpoints_is_refused_before_anything_is_written(
    run_dir, tmp_path, fmt
):
    """Item 4: the run's tokenizer.model truncated; `ours` shipped it under its new sha256, `hf`
    refused it but left OUT.partial."""
    tokenizer = run_dir / "tokenizer.model"
    tokenizer.write_bytes(tokenizer.read_bytes()[:10])
    out = tmp_path / "export"
    before = snapshot(tmp_path)
    assert_one_line_error(
        export(run_dir, out, f"format={fmt}"),
        f"{tokenizer} (sha256 ",
        "is not the tokenizer checkpoint",
        "damaged or replaced",
    )
    assert snapshot(tmp_path) == before
