"""A resumed run trains with what its config.yaml records (`launch.train.changes`): a changed
`optim.lr` (and AdamW's other hyperparameters) and a changed schedule are applied from the
resumed step, each said in one line; what a resume cannot apply is refused in one line with the
overrides that resume as saved; a resume onto another dataset with the same tokenizer is refused
naming `data.allow_data_change=true`, which carries the weights, optimizer and step over onto
the new data, read from its first sample (docs/training.md#changing-settings-on-a-resume).

One tiny GPT of 4 steps (of a schedule of 8) is trained once for the module, on one rank, and
each test resumes a copy of it."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from clirun import ENV, packed_data, run_cli, train_command
from errorlines import assert_one_error_line
from repo import ROOT
from shardtools import make_dataset, save_manifest

from common.configure import load_config
from launch.config import TrainConfig
from launch.optim import lr_multiplier

# warmup 2 of 8 steps, then cosine: the rate moves every step, so a wrong peak shows at every one
BASE = [
    "model.max_seq_len=32",
    "max_steps=8",
    "schedule.warmup_steps=2",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=0",
    "data.log_sample_keys=true",
]
STEP = 4  # the base run's checkpoint
TAG = f"step_{STEP:08d}"
WORKER = ROOT / "tests" / "launch" / "resume_worker.py"


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[Path, Path]:
    """(its data, the run directory): 4 steps of configs/tiny_gpt.yaml at optim.lr 3e-3
    (TINY's), checkpointed at step 4."""
    top = tmp_path_factory.mktemp("resume_changes")
    data, run_dir = top / "data", top / "run"
    packed_data(data, seq_len=32)
    code, lines = run_cli(*train_command(data, run_dir, *BASE, f"stop_after_steps={STEP}"))
    assert code == 0, "\n".join(lines[-30:])
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == TAG
    return data, run_dir


def copy_of(base: tuple[Path, Path], tmp_path: Path) -> Path:
    run_dir = tmp_path / "run"
    shutil.copytree(base[1], run_dir)
    return run_dir


def checkpoint_sha256(run_dir: Path) -> dict[str, str]:
    tag = run_dir / "checkpoints" / TAG
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(tag.iterdir())
        if path.is_file()
    }


def recorded(run_dir: Path) -> TrainConfig:
    return load_config(TrainConfig, run_dir / "config.yaml")


def rate(cfg: TrainConfig, step: int) -> float:
    """The rate `cfg` gives the step after `step`: what metrics.jsonl logs at `step`."""
    return cfg.optim.lr * lr_multiplier(step, cfg.schedule, cfg.max_steps, cfg.model.d_model)


def logged_rates(run_dir: Path) -> dict[int, float]:
    rows = (json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines())
    return {row["step"]: row["train/lr"] for row in rows if "train/lr" in row}


def resume(data: Path, run_dir: Path, *overrides: str) -> tuple[int, list[str]]:
    return run_cli(*train_command(data, run_dir, *BASE, *overrides))


def test_a_changed_learning_rate_trains_as_config_yaml_records_it(base, tmp_path):
    run_dir = copy_of(base, tmp_path)
    before = checkpoint_sha256(run_dir)
    old = recorded(run_dir)
    code, lines = resume(base[0], run_dir, "optim.lr=1e-3")
    assert code == 0, "\n".join(lines[-30:])
    cfg = recorded(run_dir)
    assert cfg.optim.lr == 1e-3
    trained = logged_rates(run_dir)
    assert sorted(trained) == list(range(1, 9))
    for step in range(STEP + 1, 9):  # what trained after the resume: config.yaml's schedule
        assert trained[step] == pytest.approx(rate(cfg, step), rel=1e-12), step
        assert trained[step] != pytest.approx(rate(old, step), rel=1e-3), step
    assert f"resume: optim.lr 0.003 -> 0.001 applied from step {STEP}" in lines
    step_5 = rate(old, STEP) / 3
    assert (
        f"resume: learning rate of step {STEP + 1} {rate(old, STEP):.4g} -> {step_5:.4g} "
        f"(optim.lr 0.001 x the schedule's factor at step {STEP})"
    ) in lines
    # the resumed checkpoint as it was; the new one records the rate it trained with
    assert checkpoint_sha256(run_dir) == before
    client = json.loads(
        (run_dir / "checkpoints" / "step_00000008" / "client_state.json").read_text()
    )
    assert client["config"]["optim"]["lr"] == 1e-3


def engine_as_set_up(data: Path, run_dir: Path, *overrides: str) -> tuple[dict, str]:
    """What the engine's optimizer would step with next once `launch.train` has set the run up
    (tests/launch/resume_worker.py; nothing trains), and the set-up's stderr."""
    run = subprocess.run(
        [sys.executable, str(WORKER), *train_command(data, run_dir, *BASE, *overrides)[2:]],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("OPTIMIZER ")]
    return json.loads(line.removeprefix("OPTIMIZER ")), run.stderr


def test_the_first_step_after_the_resume_takes_the_changed_optimizer_settings(base, tmp_path):
    """metrics.jsonl logs each step's rate for the step after it: the first resumed step's own is
    read from the engine as the job sets it up, with AdamW's other hyperparameters, each group's."""
    run_dir = copy_of(base, tmp_path)
    overrides = ["optim.lr=1e-3", "optim.beta2=0.99", "optim.weight_decay=0.01", "optim.eps=1e-6"]
    engine, stderr = engine_as_set_up(base[0], run_dir, *overrides)
    cfg = recorded(run_dir)
    assert engine["step"] == STEP
    assert engine["lr"] == pytest.approx(rate(cfg, STEP), rel=1e-12)
    groups = engine["groups"]
    assert [group["lr"] for group in groups] == [engine["lr"]] * 2
    assert [group["betas"] for group in groups] == [[0.9, 0.99]] * 2
    assert [group["eps"] for group in groups] == [1e-6] * 2
    assert [group["weight_decay"] for group in groups] == [0.01, 0.0]  # the no-decay group: 0
    for key, old, new in [
        ("optim.lr", "0.003", "0.001"),
        ("optim.beta2", "0.95", "0.99"),
        ("optim.weight_decay", "0.1", "0.01"),
        ("optim.eps", "1e-08", "1e-06"),
    ]:
        assert f"resume: {key} {old} -> {new} applied from step {STEP}" in stderr, key


def test_a_changed_schedule_trains_as_config_yaml_records_it(base, tmp_path):
    """A longer warmup (step 4 back inside it), linear decay and a longer run: the rate after the
    resume is the new schedule's at each step, from the first."""
    run_dir = copy_of(base, tmp_path)
    changes = ["schedule.warmup_steps=6", "schedule.decay=linear", "max_steps=10"]
    engine, _ = engine_as_set_up(base[0], run_dir, *changes)  # the first step's rate
    cfg = recorded(run_dir)
    assert (cfg.schedule.warmup_steps, cfg.schedule.decay, cfg.max_steps) == (6, "linear", 10)
    assert engine["lr"] == pytest.approx(rate(cfg, STEP), rel=1e-12)
    code, lines = resume(base[0], run_dir, *changes)  # the steps after it
    assert code == 0, "\n".join(lines[-30:])
    trained = logged_rates(run_dir)
    assert sorted(trained) == list(range(1, 11))
    for step in range(STEP + 1, 11):
        assert trained[step] == pytest.approx(rate(cfg, step), rel=1e-12), step
    for line in [
        f"resume: max_steps 8 -> 10 applied from step {STEP}",
        f"resume: schedule.warmup_steps 2 -> 6 applied from step {STEP}",
        f"resume: schedule.decay cosine -> linear applied from step {STEP}",
    ]:
        assert line in lines, line
    assert any(f"learning rate of step {STEP + 1}" in line for line in lines)


@pytest.mark.parametrize(
    "override, fragments",
    [
        ("seed=5", ["seed 1234 there, 5 here", "resume it with seed=1234"]),
        (
            "deepspeed.precision=bf16",
            ["deepspeed.precision fp32 there, bf16 here", "deepspeed.precision=fp32"],
        ),
    ],
    ids=["seed", "precision"],
)
def test_a_change_a_resume_cannot_apply_is_refused_in_one_line(base, tmp_path, override, fragments):
    """Before the checkpoint loads (from its client_state.json): no engine built, the checkpoint
    and config.yaml as they were."""
    run_dir = copy_of(base, tmp_path)
    before, config = checkpoint_sha256(run_dir), (run_dir / "config.yaml").read_bytes()
    code, lines = resume(base[0], run_dir, override)
    assert_one_error_line(
        code,
        lines,
        f"checkpoint {run_dir / 'checkpoints' / TAG} cannot be resumed with this job's settings",
        *fragments,
        "init.model=DIR run_dir=NEW",
    )
    assert not any(line.startswith("optimizer: ") for line in lines)
    assert checkpoint_sha256(run_dir) == before
    assert (run_dir / "config.yaml").read_bytes() == config


def test_another_dataset_is_refused_with_the_way_forward_which_works(base, tmp_path):
    """Another dataset with the same tokenizer: refused, naming the data the checkpoint read and
    data.allow_data_change=true; with it, the weights, optimizer and step carry over and the new
    data is read from its first sample, as a fresh run on it reads it."""
    data, run_dir = base[0], copy_of(base, tmp_path)
    other = tmp_path / "other"
    manifest = make_dataset(other, packed=[48, 40], seq_len=32, seed=7)
    manifest["datasets"]["packed"]["seq_len"] = 32
    save_manifest(other, manifest)
    assert (other / "tokenizer.model").read_bytes() == (data / "tokenizer.model").read_bytes()
    before, config = checkpoint_sha256(run_dir), (run_dir / "config.yaml").read_bytes()

    code, lines = resume(other, run_dir)
    assert_one_error_line(
        code,
        lines,
        "shards_sha256: saved",
        f"resume on the data it read (data.data_dir={data})",
        "pass data.allow_data_change=true",
    )
    assert checkpoint_sha256(run_dir) == before
    assert (run_dir / "config.yaml").read_bytes() == config

    code, lines = resume(other, run_dir, "data.allow_data_change=true")
    assert code == 0, "\n".join(lines[-30:])
    assert f"resume: data.data_dir {data} -> {other} applied from step {STEP}" in lines
    assert any(
        line.startswith("resume: data.allow_data_change=true: the train data differs")
        and "read from its first sample" in line
        for line in lines
    )
    cfg = recorded(run_dir)
    assert cfg.data.data_dir == str(other) and cfg.data.allow_data_change
    # steps 5-8 read the new data from its start: its first four steps' samples
    fresh = tmp_path / "fresh"
    code, lines = run_cli(*train_command(other, fresh, *BASE, "max_steps=4"))
    assert code == 0, "\n".join(lines[-30:])
    assert sample_keys(run_dir)[STEP + 1 :] == sample_keys(fresh)[1:]
    assert checkpoint_sha256(run_dir) == before


def sample_keys(run_dir: Path) -> list:
    """Each step's sample keys (data.log_sample_keys), in step order; index 0 unused."""
    rows = [
        json.loads(line) for line in (run_dir / "sample_keys.rank0.jsonl").read_text().splitlines()
    ]
    by_step = {row["step"]: row["keys"] for row in rows}
    return [None] + [by_step[step] for step in range(1, max(by_step) + 1)]


def test_each_changed_key_is_applied_or_refused():
    """The classes on their own (no run): every key of the config that differs is in
    `differences`, and each is either refused, with its values, or applied, with a line."""
    from dataclasses import replace

    from common.configure import config_to_dict
    from launch.train.changes import applied_lines, differences, leaves, refusal

    cfg = TrainConfig()
    saved = config_to_dict(cfg)
    checkpoint = Path("/runs/x/checkpoints") / TAG

    def changed(**sections) -> TrainConfig:
        out = cfg
        for section, values in sections.items():
            if isinstance(values, dict):
                out = replace(out, **{section: replace(getattr(out, section), **values)})
            else:
                out = replace(out, **{section: values})
        return out

    assert differences(saved, cfg) == [] and refusal(checkpoint, saved, cfg) is None
    assert differences(None, changed(seed=5)) == []  # a checkpoint that recorded no config
    applied = changed(
        optim={"lr": 1e-4, "beta2": 0.99},
        schedule={"warmup_steps": 7},
        data={"mixture": {"a": 1.0}},
        deepspeed={"zero_stage": 1},
        model={"dropout": 0.0},
        resume="none",  # the key that chose the checkpoint: not compared
    )
    assert refusal(checkpoint, saved, applied) is None
    assert applied_lines(saved, applied, 4) == [
        "resume: model.dropout 0.1 -> 0.0 applied from step 4",
        "resume: data.mixture {} -> {'a': 1.0} applied from step 4",
        "resume: optim.lr 0.0003 -> 0.0001 applied from step 4",
        "resume: optim.beta2 0.95 -> 0.99 applied from step 4",
        "resume: schedule.warmup_steps 100 -> 7 applied from step 4",
        "resume: deepspeed.zero_stage 2 -> 1 applied from step 4",
    ]
    refused = changed(
        seed=5, model={"init_std": 0.05}, deepspeed={"zero_stage": 0}, init={"model": "exp"}
    )
    line = refusal(checkpoint, saved, refused)
    for fragment in [
        "seed 1234 there, 5 here",
        "model.init_std 0.02 there, 0.05 here",
        'init.model "" there, exp here',
        "deepspeed.zero_stage 2 there, 0 here",
        'resume it with seed=1234 model.init_std=0.02 deepspeed.zero_stage=2 init.model=""',
        f"python -m launch.export checkpoint={checkpoint} out=DIR",
    ]:
        assert fragment in line, fragment
    assert "\n" not in line
    # every key of the schema is compared (but `resume`), data.mixture as one value
    keys = set(leaves(saved))
    assert "data.mixture" in keys and "resume" in keys and "optim.lr" in keys
