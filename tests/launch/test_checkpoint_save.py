"""Saving a checkpoint across ranks (issue #28, items 5 and 10): a file system that fills during a
save ends every rank with one line naming it, the previous checkpoint still the latest; each rank
hashes the files it wrote, and integrity.json is what a serial hash of the directory would be.

Real processes and real files: 2-rank runs of launch.train under torchrun (CPU, gloo) into a
small tmpfs where one can be mounted (root on Linux; skipped elsewhere), and, without a mount, a
rank whose write fails with ENOSPC part way through, as a full disk's does: this file run as
launch.train with `torch.save` wrapped (`FILL_AT=RANK:STEP`). One-process engines (`sizes`,
`fill`) check the save's size estimate against the files DeepSpeed writes, and what a write
into a full tmpfs raises.

    FILL_AT=1:4 python -m torch.distributed.run --nproc_per_node 2 tests/launch/test_checkpoint_save.py CONFIG [key=value ...]
    python tests/launch/test_checkpoint_save.py sizes OUT
    python tests/launch/test_checkpoint_save.py fill DIR OUT
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # conftest, shardtools
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402
import torch  # noqa: E402

from launch import checkpoint as ckpt  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
STEP_2, STEP_4 = ckpt.tag_for(2), ckpt.tag_for(4)
COMBOS = [(stage, precision) for stage in (0, 1, 2, 3) for precision in ("fp32", "bf16")]


# ----------------------------------------------------------------------------- helpers


def train(
    data: Path,
    run_dir: Path,
    *overrides: str,
    script: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
    """2 ranks of launch.train (or of `script`, which runs it) under torchrun; not checked."""
    from trainruns import TINY

    entry = [str(script)] if script else ["-m", "launch.train"]
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        *entry,
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY,
        "wandb.mode=disabled",
        "eval_every=0",
        "log_every=1",
        "dist_timeout_s=60",
        *overrides,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def error_line(result: subprocess.CompletedProcess) -> str:
    """The one `error:` line that every rank printed (the same on each), and no rank's traceback."""
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert result.returncode != 0 and len(errors) == 2 and len(set(errors)) == 1, result.stderr[
        -5000:
    ]
    assert "[rank" not in result.stderr and "Connection closed" not in result.stderr, result.stderr[
        -5000:
    ]
    return errors[0]


def losses(run_dir: Path) -> dict[int, float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


def parameters(data: Path) -> int:
    """The parameters of the tests' tiny GPT on `data` (trainruns.TINY), as the trainer counts them."""
    from dataclasses import replace

    from trainruns import TINY

    from common.configure import load_config
    from launch.config import TrainConfig
    from model import build_model
    from pipeline.format import read_manifest

    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", TINY)
    vocab = int(read_manifest(data)["tokenizer"]["vocab_size"])
    return sum(p.numel() for p in build_model(replace(cfg.model, vocab_size=vocab)).parameters())


@contextlib.contextmanager
def tmpfs(directory: Path, size: int):
    """A tmpfs of `size` bytes on `directory`, unmounted after; the test is skipped where none can be mounted."""
    directory.mkdir(parents=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], capture_output=True)


# ----------------------------------------------------------------------------- a full file system


@pytest.mark.slow
def test_a_save_that_a_full_tmpfs_cannot_hold_is_refused_in_one_line_and_the_resume_is_exact(
    tiny_dataset, tmp_path
):
    # ZeRO-2 in fp32 writes 16 bytes a parameter (weights 4, fp32 master weights 4, Adam moments 8):
    # room for the tokenizer, the first checkpoint and the run's small files, not for a second one.
    need = 16 * parameters(tiny_dataset)
    size = (tiny_dataset / "tokenizer.model").stat().st_size + need * 3 // 2 + 128 * 1024
    with tmpfs(tmp_path / "full", size) as full:
        run_dir = full / "run"
        failed = train(
            tiny_dataset,
            run_dir,
            "max_steps=4",
            "checkpoint.every_steps=2",
            "checkpoint.keep_last=5",
        )
        line = error_line(failed)
        root = ckpt.checkpoint_root(run_dir)
        assert line.startswith(
            f"error: checkpoint {STEP_4} not saved: the file system of {root} (tmpfs on {full}) "
            f"has "
        ), line
        assert (
            "free and the save needs about" in line
            and f"{root / ckpt.POINTER} still names {STEP_2}" in line
        ), line
        assert ckpt.latest_tag(root) == STEP_2 and ckpt.verify(root / STEP_2) is None
        assert not (root / STEP_4).exists()
        logged = losses(run_dir)  # steps 3 and 4 were trained and logged before the save
        roomy = tmp_path / "roomy"
        shutil.copytree(run_dir, roomy)
    resumed = train(
        tiny_dataset, roomy, "max_steps=4", "checkpoint.every_steps=2", "checkpoint.keep_last=5"
    )
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert f"resumed from {ckpt.checkpoint_root(roomy) / STEP_2} at step 2" in resumed.stderr
    again = losses(roomy)
    assert sorted(again) == [1, 2, 3, 4]
    assert [again[3], again[4]] == pytest.approx([logged[3], logged[4]], abs=1e-6, rel=0)


@pytest.mark.slow
def test_a_write_failing_with_enospc_on_one_rank_ends_every_rank_in_one_line(
    tiny_dataset, tmp_path
):
    run_dir = tmp_path / "run"
    failed = train(
        tiny_dataset,
        run_dir,
        "max_steps=4",
        "checkpoint.every_steps=2",
        script=Path(__file__),
        env={"FILL_AT": "1:4"},
    )
    line = error_line(failed)
    root = ckpt.checkpoint_root(run_dir)
    assert line.startswith(f"error: checkpoint {STEP_4} not saved: the file system of {root} ("), (
        line
    )
    assert (
        ") is full: rank 1 writing zero_pp_rank_1_mp_rank_00_optim_states.pt: No space left on device; the "
        "save needs about "
    ) in line, line
    assert (
        f"the partial {STEP_4} is removed and {root / ckpt.POINTER} still names {STEP_2}" in line
    ), line
    assert ckpt.latest_tag(root) == STEP_2 and ckpt.verify(root / STEP_2) is None
    assert not (root / STEP_4).exists()


@pytest.mark.slow
def test_a_write_into_a_full_tmpfs_raises_enospc_naming_the_file(tmp_path):
    with tmpfs(tmp_path / "full", 256 * 1024) as full:
        result = run_script("fill", full, tmp_path)
        assert result.returncode == 0, result.stderr[-4000:]
        raised = json.loads((tmp_path / "fill.json").read_text())
    assert raised["type"] == "OSError" and raised["errno"] == errno.ENOSPC, raised
    assert Path(raised["filename"]).parent == full / "step_1" and raised["filename"].endswith(
        "_states.pt"
    ), raised


@pytest.mark.slow
def test_the_size_estimate_is_the_checkpoint_files_less_their_pickling(tmp_path):
    result = run_script("sizes", tmp_path)
    assert result.returncode == 0, result.stderr[-4000:]
    for combo, (estimate, written) in json.loads((tmp_path / "sizes.json").read_text()).items():
        assert 0.9 * written <= estimate <= written, (combo, estimate, written)


# ----------------------------------------------------------------------------- hashing shared by
# the ranks


def test_each_rank_hashes_the_files_it_wrote_and_the_rest_is_balanced_by_size():
    sizes = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": 1000 + rank for rank in range(4)}
    sizes |= {"mp_rank_00_model_states.pt": 900, "client_state.json": 10}
    assert ckpt.hashing_shares(sizes, 4) == [
        # the least loaded, 1000
        ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],
        ["client_state.json", "zero_pp_rank_1_mp_rank_00_optim_states.pt"],  # then 1001
        ["zero_pp_rank_2_mp_rank_00_optim_states.pt"],
        ["zero_pp_rank_3_mp_rank_00_optim_states.pt"],
    ]
    # On fewer ranks (a resume elsewhere) the files of ranks that are not there are balanced with
    # the rest.
    shares = ckpt.hashing_shares(sizes, 2)
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert (
        "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shares[1]
        and abs(sum(sizes[n] for n in shares[0]) - sum(sizes[n] for n in shares[1])) < 1000
    )
    assert ckpt.hashing_shares(sizes, 1) == [sorted(sizes)]


@pytest.mark.slow
def test_two_ranks_each_hash_their_own_files_and_integrity_json_is_the_serial_hash(
    tiny_dataset, tmp_path
):
    run_dir = tmp_path / "run"
    saved = train(tiny_dataset, run_dir, "max_steps=1", "deepspeed.zero_stage=3")
    assert saved.returncode == 0, saved.stderr[-4000:]
    tag_dir = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(1)
    record = json.loads((tag_dir / ckpt.INTEGRITY).read_text())["files"]
    serial = tmp_path / "serial"
    shutil.copytree(tag_dir, serial)
    (serial / ckpt.INTEGRITY).unlink()
    ckpt.write_integrity(serial)  # one process hashing every file
    expected = json.loads((serial / ckpt.INTEGRITY).read_text())["files"]
    assert {name: (e["size"], e["sha256"]) for name, e in record.items()} == {
        name: (e["size"], e["sha256"]) for name, e in expected.items()
    }
    # ZeRO-3: each rank writes an optimizer partition and a model-states file, named by its rank.
    for rank in (0, 1):
        own = [name for name in record if name.startswith(f"zero_pp_rank_{rank}_")]
        assert len(own) == 2 and all(record[name]["hashed_by"] == rank for name in own), record
    # The shares are those a resume on 2 ranks verifies: one rule, `hashing_shares`, for both.
    shares = ckpt.hashing_shares({name: entry["size"] for name, entry in record.items()}, 2)
    assert {name: entry["hashed_by"] for name, entry in record.items()} == {
        name: rank for rank, share in enumerate(shares) for name in share
    }
    assert [ckpt.files_for_rank(tag_dir, rank, 2) for rank in (0, 1)] == shares


# ----------------------------------------------------------------------------- as a script


def run_script(*args) -> subprocess.CompletedProcess:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
    }
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run(
        [sys.executable, __file__, *map(str, args)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def tiny_engine(stage: int, precision: str):
    """A one-process DeepSpeed engine of a small GPT, after one step (its Adam moments exist)."""
    from launch.config import BatchPlan, TrainConfig
    from launch.deepspeed.config import DeepSpeedConfig, deepspeed_config
    from launch.deepspeed.engine import Engine
    from launch.optim import build_optimizer, build_scheduler
    from launch.optim_config import OptimConfig, ScheduleConfig
    from model import ModelConfig, build_model
    from pipeline.load.config import LoaderConfig

    model_cfg = ModelConfig(
        arch="gpt", vocab_size=256, d_model=64, n_layers=2, n_heads=2, max_seq_len=16, dropout=0.0
    )
    cfg = TrainConfig(
        max_steps=10,
        model=model_cfg,
        data=LoaderConfig(micro_batch_size=2),
        optim=OptimConfig(lr=1e-2),
        schedule=ScheduleConfig(warmup_steps=1),
        deepspeed=DeepSpeedConfig(
            zero_stage=stage, precision=precision, zero3_persistence_threshold=0
        ),
    )
    torch.manual_seed(0)
    model = build_model(model_cfg)
    n_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim, skip_non_finite=stage == 0)
    engine = Engine(
        model,
        optimizer,
        build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
        deepspeed_config(cfg, BatchPlan(2, 1, 1)),
    )
    tokens = torch.randint(
        0,
        model_cfg.vocab_size,
        (2, model_cfg.max_seq_len + 1),
        generator=torch.Generator().manual_seed(1),
    )
    output = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    engine.backward(output.loss)
    engine.step()
    return engine, n_parameters


def sizes(out: Path) -> None:
    """OUT/sizes.json: {stage-precision: [the save's estimate, the bytes DeepSpeed wrote]}."""
    from launch.checkpoint.space import checkpoint_size

    found = {}
    for stage, precision in COMBOS:
        engine, n_parameters = tiny_engine(stage, precision)
        engine.save(out, f"{stage}-{precision}", {})
        written = sum(p.stat().st_size for p in (out / f"{stage}-{precision}").iterdir())
        found[f"{stage}-{precision}"] = [
            checkpoint_size(n_parameters, stage, precision)[0],
            written,
        ]
    (out / "sizes.json").write_text(json.dumps(found))


def fill(directory: Path, out: Path) -> None:
    """OUT/fill.json: what a save into DIRECTORY, too small for it, raised."""
    engine, _ = tiny_engine(2, "fp32")
    try:
        engine.save(directory, "step_1", {})
        raised = {"type": None}
    except Exception as err:  # noqa: BLE001 - what it is, is the finding
        raised = {
            "type": type(err).__name__,
            "errno": getattr(err, "errno", None),
            "filename": getattr(err, "filename", None),
            "message": str(err),
        }
    (out / "fill.json").write_text(json.dumps(raised))


class Filling:
    """A file on a disk with `room` bytes free: the write that passes it writes what fits, then
    fails with ENOSPC, as a full file system's does."""

    def __init__(self, file, room: int):
        self.file, self.room, self.written = file, room, 0

    def write(self, data) -> int:
        data = memoryview(data).cast("B")
        if self.written + len(data) > self.room:
            self.file.write(data[: self.room - self.written])
            self.written = self.room
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.written += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()


def fill_at(rank: int, step: int) -> None:
    """Rank `rank`'s write of its optimizer partition at `step` fails after 64 KiB: `torch.save`,
    which DeepSpeed calls for every file of a checkpoint, wrapped."""
    real_save = torch.save

    def save(obj, f, *args, **kwargs):
        name = str(f) if isinstance(f, (str, os.PathLike)) else str(getattr(f, "name", ""))
        path = Path(name)
        if (
            path.parent.name != ckpt.tag_for(step)
            or not path.name.startswith(f"zero_pp_rank_{rank}_")
            or not path.name.endswith("optim_states.pt")
        ):
            return real_save(obj, f, *args, **kwargs)
        with (
            open(path, "wb")
            if isinstance(f, (str, os.PathLike))
            else contextlib.nullcontext(f) as file
        ):
            return real_save(obj, Filling(file, 64 * 1024), *args, **kwargs)

    torch.save = save


if __name__ == "__main__":
    from launch import distributed, launcher

    if os.environ.get("FILL_AT"):  # a rank of launch.train, as `python -m launch.train` runs it
        fill_at(*map(int, os.environ["FILL_AT"].split(":")))
        from launch.train.cli import main

        launcher.die_with_parent()
        distributed.run_rank(main)
    torch.set_num_threads(1)

    def one_process():
        distributed.init_process_group(distributed.read_env(), timeout_s=120)
        {
            "sizes": lambda: sizes(Path(sys.argv[2])),
            "fill": lambda: fill(Path(sys.argv[2]), Path(sys.argv[3])),
        }[sys.argv[1]]()

    distributed.run_rank(one_process)
