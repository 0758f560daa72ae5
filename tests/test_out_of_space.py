"""A full or read-only file system under the commands (issue 61, defects 6 and 7): one `error:`
line naming the path and what to do, exit 2, nothing left half written.

The file systems are real: a small tmpfs fills up (ENOSPC) and a tmpfs mounted read-only refuses
every write (EROFS), as a full disk and a read-only mount do; no OSError is faked in the code
paths these tests run end to end. Mounting needs root (CI runs as root): elsewhere the mounting
tests skip, except under CI=true, where they fail. A file size limit (RLIMIT_FSIZE: EFBIG) needs
no root, and tests the atomic writes anywhere.

- prepare onto a file system that fills up while a Ray task writes the shards: the existing
  dataset at output_dir stays byte for byte, no staging directory is left;
- training whose run_dir fills up while the dataset's tokenizer is copied in: no truncated
  tokenizer.model, nor any temporary file;
- training whose W&B directory (RUN_DIR/wandb) is read-only: refused before the engine is built,
  by the dry run too, and by the tracker itself should it become so later.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from corpora import prepare_args, run_prepare
from errorlines import assert_one_error_line, assert_one_line_error
from repo import ROOT

# tests/launch's helpers (a training command line), which pytest puts on the path only for the
# files beside them
sys.path.insert(0, str(Path(__file__).resolve().parent / "launch"))
from clirun import ENV, run_cli, train_command  # noqa: E402

from common.configure import UserError  # noqa: E402
from common.hashing import file_sha256  # noqa: E402

IN_CI = os.environ.get("CI", "").lower() == "true"


def cannot_mount(reason: str) -> None:
    """Skip, or under CI=true fail: CI runs as root, where a tmpfs mounts."""
    if IN_CI:
        pytest.fail(f"CI=true but {reason}: the full and read-only file system tests need it")
    pytest.skip(f"{reason}: the full and read-only file system tests mount a tmpfs (as root)")


@pytest.fixture
def tmpfs(tmp_path):
    """`tmpfs(name, size, read_only=False)`: a tmpfs of `size` bytes mounted at tmp_path/name (made
    read-only after `fill`, a function of the mount point, has written into it); every mount is
    unmounted at the end, whatever the test did."""
    mounted: list[Path] = []

    def mount(name: str, size: int, read_only: bool = False, fill=None) -> Path:
        if os.geteuid() != 0:
            cannot_mount("not root")
        if shutil.which("mount") is None:
            cannot_mount("no mount command")
        point = tmp_path / name
        point.mkdir(parents=True, exist_ok=True)
        run = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(point)],
            capture_output=True,
            text=True,
        )
        if run.returncode != 0:
            cannot_mount(f"mount -t tmpfs failed ({run.stderr.strip() or run.returncode})")
        mounted.append(point)
        if fill is not None:
            fill(point)
        if read_only:
            subprocess.run(["mount", "-o", "remount,ro", str(point)], check=True)
        return point

    yield mount
    for point in reversed(mounted):
        # lazily where a process still holds a file there (it goes with the process)
        if subprocess.run(["umount", str(point)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(point)], check=True)


def blocks(directory: Path) -> int:
    """The bytes `directory`'s files take on a tmpfs: whole pages."""
    return sum(-(-p.stat().st_size // 4096) * 4096 for p in directory.rglob("*") if p.is_file())


def hashes(directory: Path) -> dict[str, str]:
    """{relative path: sha256} of every file under `directory`."""
    return {
        p.relative_to(directory).as_posix(): file_sha256(p)
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def leftovers(directory: Path) -> list[str]:
    """Names under `directory` that a half-done write leaves: staging directories, temporary
    files."""
    return sorted(p.name for p in directory.rglob("*") if ".partial" in p.name)


# ----------------------------------------------------------------------------- the classifier


@pytest.mark.parametrize(
    "code, kind",
    [
        (errno.ENOSPC, "space"),
        (errno.EDQUOT, "space"),
        (errno.EFBIG, "space"),
        (errno.EROFS, "access"),
        (errno.EACCES, "access"),
        (errno.ENOENT, None),
        (errno.EIO, None),
    ],
)
def test_storage_refusals_are_told_from_other_errors(code, kind):
    from common.storage import storage_refusal  # here: the end-to-end tests run without it

    assert storage_refusal(OSError(code, os.strerror(code))) == kind
    assert storage_refusal(ValueError("no")) is None


def test_the_line_names_the_file_or_the_setting_and_what_to_do(tmp_path):
    from common.storage import storage_error

    out = tmp_path / "ds"
    advice = dict(space="make room", access="write elsewhere")
    # a write to an open file names no file: the setting says where
    line = str(
        storage_error(OSError(errno.ENOSPC, "No space left on device"), "out=X", out, **advice)
    )
    assert line.startswith("out=X: No space left on device (ENOSPC): ") and "free now" in line
    assert line.endswith("; make room"), line
    # a file in a companion of the output (its staging directory) is the output's
    staged = tmp_path / "ds.partial-1-ab" / "shard.tar"
    line = str(
        storage_error(
            OSError(errno.EROFS, "Read-only file system", str(staged)), "out=X", out, **advice
        )
    )
    assert line.startswith(f"out=X: cannot write {staged}: Read-only file system (EROFS)")
    assert line.endswith("; write elsewhere"), line
    # elsewhere: the file alone, with the advice that holds anywhere
    other = tmp_path / "inputs" / "a.txt"
    line = str(
        storage_error(
            OSError(errno.EACCES, "Permission denied", str(other)), "out=X", out, **advice
        )
    )
    assert line.startswith(f"{other}: Permission denied (EACCES)") and "out=X" not in line, line
    # a copy's error names both files: the one written is the second
    copied = OSError(errno.ENOSPC, "No space left on device", str(other), None, str(out / "t"))
    line = str(storage_error(copied, "out=X", out, **advice))
    assert line.startswith(f"out=X: cannot write {out / 't'}: "), line
    assert storage_error(OSError(errno.ENOENT, "No such file"), "out=X", out, **advice) is None
    assert isinstance(storage_error(OSError(errno.EDQUOT, "Quota"), "o", out, **advice), UserError)


def test_an_atomic_write_past_the_file_size_limit_leaves_the_old_file(tmp_path):
    from common.atomic import atomic_write

    """RLIMIT_FSIZE (`ulimit -f`) makes a write past it fail with EFBIG (Python ignores SIGXFSZ):
    the file keeps its old bytes, the temporary file is gone, the error names the file."""
    target = tmp_path / "config.yaml"
    target.write_text("old: 1\n")
    script = (
        "import errno, resource, sys\n"
        "from common.atomic import atomic_write\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "try:\n"
        f"    atomic_write({str(target)!r}, 'x' * 100_000)\n"
        "except OSError as err:\n"
        "    print(errno.errorcode[err.errno], err.filename)\n"
        "    sys.exit(3)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 3, run.stdout + run.stderr
    assert run.stdout.split() == ["EFBIG", str(target)]
    assert target.read_text() == "old: 1\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    atomic_write(target, "new: 2\n")  # and without the limit, the new bytes
    assert target.read_text() == "new: 2\n"


# ----------------------------------------------------------------------------- prepare


@pytest.mark.slow
def test_prepare_onto_a_full_file_system_is_one_line_and_the_old_dataset_stays(
    tiny_corpus, tiny_dataset, tmpfs
):
    """The scratch check passes (the buckets fit), then the encode tasks fill the file system
    while they write the shards: ENOSPC inside a Ray task (and the driver's own, whichever comes
    first). One line, exit 2; the dataset that was there is byte for byte as it was, no staging
    directory left, and the local Ray stopped."""
    room = blocks(tiny_dataset) + 2**20  # the old dataset, the scan's buckets, and little more
    disk = tmpfs("disk", room, fill=lambda point: shutil.copytree(tiny_dataset, point / "ds"))
    out = disk / "ds"
    before = hashes(out)
    assert "manifest.json" in before and any(name.endswith(".tar") for name in before)
    # another seq_len: a dataset that, had it been published, would differ from the old one
    args = prepare_args(tiny_corpus, out, **{"ray.num_workers": 2, "overwrite": "true"})
    run = run_prepare([*args, "seq_len=16"], timeout=600)
    assert_one_line_error(
        run,
        f"output_dir={out}: ",
        "No space left on device (ENOSPC)",
        f"tmpfs on {disk} ran out of space",
        "free some space there, or choose an output_dir on another file system",
    )
    assert hashes(out) == before
    assert leftovers(disk) == [], leftovers(disk)
    assert sorted(p.name for p in disk.iterdir() if not p.name.endswith(".lock")) == ["ds"]


# ----------------------------------------------------------------------------- training


def tiny_train(data: Path, run_dir: Path, *overrides: str) -> list[str]:
    return train_command(data, run_dir, "model.max_seq_len=32", "max_steps=1", *overrides)


def test_a_run_dir_that_fills_while_the_tokenizer_is_copied_keeps_no_truncated_file(
    tiny_dataset, tmpfs
):
    """run_dir on a file system with room for config.yaml but not for the dataset's tokenizer.model
    (a few hundred KiB): one line naming the file, exit 2, and no tokenizer.model (whole or
    not at all), no temporary file; config.yaml, written before, is whole."""
    tokenizer = tiny_dataset / "tokenizer.model"
    assert tokenizer.stat().st_size > 160 * 1024
    run_dir = tmpfs("run", 128 * 1024)
    code, lines = run_cli(*tiny_train(tiny_dataset, run_dir))
    assert_one_error_line(
        code,
        lines,
        f"run_dir={run_dir}: cannot write {run_dir / 'tokenizer.model'}: ",
        "No space left on device (ENOSPC)",
        "choose a run_dir on another file system",
    )
    assert not (run_dir / "tokenizer.model").exists()
    assert leftovers(run_dir) == []
    assert "run_dir:" in (run_dir / "config.yaml").read_text()


@pytest.mark.slow
def test_a_requeued_run_on_a_disk_that_filled_leaves_its_files_as_they_were(tiny_dataset, tmpfs):
    """A run trained (config.yaml, tokenizer.model, metrics, a checkpoint), then its file system
    filled up but for a little (another job's files): the same command again, resuming, refuses
    in one line at the copy of the tokenizer, and every file of the run directory is byte for
    byte as it was (each replaced whole or not at all)."""
    disk = tmpfs("disk", 32 * 2**20)
    run_dir = disk / "run"
    command = tiny_train(tiny_dataset, run_dir)
    code, lines = run_cli(*command)
    assert code == 0, "\n".join(lines[-30:])
    fill(disk / "another-job.bin", leave=64 * 1024)  # room for the config, not the tokenizer
    before = hashes(run_dir)
    assert {"config.yaml", "tokenizer.model"} <= set(before), before
    code, lines = run_cli(*command)
    assert_one_error_line(
        code,
        lines,
        f"run_dir={run_dir}: cannot write {run_dir / 'tokenizer.model'}: ",
        "No space left on device (ENOSPC)",
    )
    assert hashes(run_dir) == before
    assert leftovers(disk) == []


def fill(path: Path, leave: int) -> None:
    """A file that takes all of its file system's free space but `leave` bytes."""
    free = shutil.disk_usage(path.parent).free
    with open(path, "wb") as handle:
        handle.truncate(0)
        for _ in range(max(0, free - leave) // 2**16):
            handle.write(b"\0" * 2**16)


def read_only_wandb(tmp_path: Path, tmpfs) -> tuple[Path, Path]:
    """A writable run_dir whose W&B directory (RUN_DIR/wandb) is a read-only mount."""
    run_dir = tmp_path / "run"
    wandb = tmpfs("run/wandb", 64 * 1024, read_only=True)
    return run_dir, wandb


def test_a_read_only_w_and_b_directory_stops_the_run_before_the_engine(
    tiny_dataset, tmp_path, tmpfs
):
    run_dir, wandb = read_only_wandb(tmp_path, tmpfs)
    code, lines = run_cli(*tiny_train(tiny_dataset, run_dir, "wandb.mode=offline"))
    assert_one_error_line(
        code,
        lines,
        f"W&B's directory {wandb}: Read-only file system (EROFS): tmpfs on {wandb} is mounted "
        "read-only; make it writable, choose another run_dir",
        "turn W&B off with wandb.mode=disabled",
    )
    assert not any("ZeRO" in line or "optimizer:" in line for line in lines)  # before the engine
    assert sorted(p.name for p in run_dir.iterdir()) == ["wandb"]  # nothing written
    # the dry run says the same, writing nothing
    run = subprocess.run(
        [sys.executable, *tiny_train(tiny_dataset, run_dir, "wandb.mode=offline"), "--dry-run"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stdout + run.stderr
    assert (
        f"wandb.mode: W&B's directory {wandb} cannot be written (tmpfs on {wandb} is mounted "
        "read-only)" in run.stdout
    ), run.stdout
    # W&B off: the same run_dir trains
    code, lines = run_cli(*tiny_train(tiny_dataset, run_dir, "wandb.mode=disabled"))
    assert code == 0, "\n".join(lines[-30:])


def test_the_tracker_says_a_w_and_b_directory_that_became_read_only_in_one_line(tmp_path, tmpfs):
    """Past the start's check (a directory that became read-only since, a race): W&B's own
    OSError in wandb.init is the same one line, exit 2."""
    run_dir, wandb = read_only_wandb(tmp_path, tmpfs)
    script = (
        "from common.configure import run_main\n"
        "from launch.config import WandbConfig\n"
        "from launch.tracking import Tracker\n"
        "run_main(lambda: Tracker(enabled=True, settings=WandbConfig(mode='offline'), "
        f"run_dir={str(run_dir)!r}, run_id='abcd1234', config={{}}, summary={{}}).finish())\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script],
        cwd=ROOT,
        env={**os.environ, "WANDB_SILENT": "true"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(
        run, f"W&B's directory {wandb}: cannot write {wandb}/", "Read-only file system (EROFS)"
    )
