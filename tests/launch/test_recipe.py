"""The recipe of "Attention Is All You Need" as options: the inverse square-root schedule
(`schedule.decay: inverse_sqrt`) against the paper's formula, checkpoint averaging
(`launch.average`) against elementwise means of exported checkpoints, and
configs/transformer_base.yaml.

The fast tests compute by hand; the one slow test trains a tiny Seq2Seq for 6 steps under 2
ranks (a real DeepSpeed engine, ZeRO-2), checks its logged lr step by step, averages its
checkpoints and evaluates the average."""

import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from repo import ROOT

from common.configure import UserError, load_config
from launch.average import average_state_dicts
from launch.config import TrainConfig
from launch.main.plan import python_launcher
from launch.optim import build_scheduler, lr_multiplier
from launch.optim_config import ScheduleConfig
from launch.resolve import config_problems

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def paper_lr(n: int, d_model: int, warmup: int) -> float:
    """Vaswani et al. 2017, eq. 3, at (1-based) step n, written out separately from launch.optim."""
    return 1 / math.sqrt(d_model) * min(1 / math.sqrt(n), n / warmup / math.sqrt(warmup))


def test_inverse_sqrt_matches_the_paper_at_hand_picked_steps():
    cfg = ScheduleConfig(warmup_steps=4000, decay="inverse_sqrt")
    # LambdaLR's step s is the lr of the paper's step n = s + 1 (defined: n >= 1).
    for n in (1, 2000, 4000, 16000):
        assert lr_multiplier(n - 1, cfg, max_steps=100_000, d_model=512) == pytest.approx(
            paper_lr(n, 512, 4000), rel=1e-12
        )
    # The same numbers written down: the peak (512 * 4000)^-0.5 and the 1/sqrt decay after it.
    # 1.746e-7
    assert lr_multiplier(0, cfg, 100_000, 512) == pytest.approx(512**-0.5 * 4000**-1.5, rel=1e-12)
    assert lr_multiplier(3999, cfg, 100_000, 512) == pytest.approx(6.9877e-4, rel=1e-4)
    # linear rise
    assert lr_multiplier(1999, cfg, 100_000, 512) == pytest.approx(6.9877e-4 / 2, rel=1e-4)
    # 1/sqrt(4) after
    assert lr_multiplier(15999, cfg, 100_000, 512) == pytest.approx(6.9877e-4 / 2, rel=1e-4)
    # max_steps plays no part, and optim.lr scales the whole curve (a real torch scheduler).
    assert lr_multiplier(99, cfg, 10, 512) == lr_multiplier(99, cfg, 10**9, 512)
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build_scheduler(optimizer, cfg, 100_000, d_model=512)
    seen = []
    for _ in range(5):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert seen == pytest.approx([2.0 * paper_lr(n, 512, 4000) for n in range(1, 6)], rel=1e-12)


def test_inverse_sqrt_needs_a_warmup_and_a_width():
    cfg = TrainConfig(task="translation")
    cfg.model.arch = "seq2seq"
    cfg.schedule.decay, cfg.schedule.warmup_steps = "inverse_sqrt", 0
    assert any(p.startswith("schedule.warmup_steps:") for p in config_problems(cfg))
    cfg.schedule.decay = "rsqrt"
    assert any("schedule.decay: 'rsqrt'" in p for p in config_problems(cfg))
    with pytest.raises(ValueError, match="d_model"):
        lr_multiplier(0, ScheduleConfig(warmup_steps=10, decay="inverse_sqrt"), 100)


def test_transformer_base_config_is_the_papers():
    cfg = load_config(TrainConfig, ROOT / "configs" / "transformer_base.yaml")
    m = cfg.model
    assert (m.d_model, m.n_layers, m.n_decoder_layers, m.n_heads, m.d_ff) == (512, 6, 6, 8, 2048)
    assert (m.dropout, m.positions, m.norm_position, m.activation, m.label_smoothing) == (
        0.1,
        "sinusoidal",
        "post",
        "relu",
        0.1,
    )
    assert m.share_embeddings
    assert (cfg.optim.beta1, cfg.optim.beta2, cfg.optim.eps, cfg.optim.lr) == (0.9, 0.98, 1e-9, 1.0)
    assert (cfg.schedule.decay, cfg.schedule.warmup_steps) == ("inverse_sqrt", 4000)
    assert config_problems(cfg) == []


def test_average_state_dicts_is_the_elementwise_mean():
    g = torch.Generator().manual_seed(0)
    a = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    b = {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)}
    same = average_state_dicts([a, a, a], ["1", "2", "3"])
    assert all(torch.equal(same[k], a[k]) for k in a)
    mean = average_state_dicts([a, b], ["a", "b"])
    assert all(torch.allclose(mean[k], (a[k] + b[k]) / 2, atol=1e-7, rtol=0) for k in a)
    half = average_state_dicts(
        [{k: v.half() for k, v in a.items()}, {k: v.half() for k, v in b.items()}], ["a", "b"]
    )
    assert half["w"].dtype == torch.float16  # stored back in the checkpoints' dtype
    with pytest.raises(UserError, match="differ in w"):
        average_state_dicts([a, {"w": torch.zeros(4, 4), "b": b["b"]}], ["a", "b"])
    with pytest.raises(UserError, match="hold different weights"):
        average_state_dicts([a, {"w": b["w"]}], ["a", "b"])


# ----------------------------------------------------------------------------- slow: real training

WARMUP, D_MODEL, SCALE = 4, 32, 2.0
TRAIN = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.n_layers=1",
    "model.n_decoder_layers=1",
    "model.max_seq_len=64",
    "data.micro_batch_size=8",
    "data.num_workers=0",
    "max_steps=6",
    "eval_every=0",
    "eval_batches=0",
    "log_every=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=3",
    "wandb.mode=disabled",
    "threads_per_rank=1",
    "schedule.decay=inverse_sqrt",
    f"schedule.warmup_steps={WARMUP}",
    f"optim.lr={SCALE}",
    "optim.beta2=0.98",
    "optim.eps=1e-9",
]


def python_m(module: str, *args: str, nproc: int = 1) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*python_launcher(nproc), "-m", module, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )


def weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


@pytest.mark.slow
def test_trained_lr_follows_the_formula_and_checkpoints_average(tiny_dataset, tmp_path):
    from launch.average import average
    from launch.export import export

    run_dir = tmp_path / "run"
    trained = python_m(
        "launch.train",
        str(ROOT / "configs" / "tiny_translation.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *TRAIN,
        nproc=2,
    )
    assert trained.returncode == 0, trained.stderr[-4000:]
    # The lr logged after step s is the one step s + 1 will take.
    logged = {
        row["step"]: row["train/lr"]
        for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
        if "train/lr" in row
    }
    assert sorted(logged) == [1, 2, 3, 4, 5, 6]
    for step, lr in logged.items():
        assert lr == pytest.approx(SCALE * paper_lr(step + 1, D_MODEL, WARMUP), rel=1e-6), step

    root = run_dir / "checkpoints"
    assert sorted(p.name for p in root.glob("step_*")) == [
        "step_00000002",
        "step_00000004",
        "step_00000006",
    ]
    singles = {}
    for tag in ("step_00000002", "step_00000004", "step_00000006"):
        export(root / tag, tmp_path / tag)
        singles[tag] = weights(tmp_path / tag)
    meta = average(run_dir, 2, tmp_path / "avg2")
    assert [Path(p).name for p in meta["averaged"]] == ["step_00000004", "step_00000006"]
    mean = weights(tmp_path / "avg2")
    a, b = singles["step_00000004"], singles["step_00000006"]
    assert mean.keys() == a.keys()
    assert any(not torch.equal(a[k], b[k]) for k in a)  # two different checkpoints
    for key in a:
        torch.testing.assert_close(mean[key], (a[key] + b[key]) / 2, rtol=0, atol=1e-6)

    # N identical checkpoints: one checkpoint copied under three tags of a run of its own.
    same_run = tmp_path / "same"
    (same_run / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "tokenizer.model"):
        shutil.copy(run_dir / name, same_run / name)
    for tag in ("step_00000001", "step_00000002", "step_00000003"):
        shutil.copytree(root / "step_00000004", same_run / "checkpoints" / tag)
    (same_run / "checkpoints" / "latest").write_text("step_00000003\n")
    average(same_run, 3, tmp_path / "avg_same")
    same = weights(tmp_path / "avg_same")
    assert all(torch.equal(same[k], a[k]) for k in a)

    # More than the run has, and checkpoints of different tokenizers: one line, exit status 2.
    too_many = python_m(
        "launch.average", f"checkpoint={run_dir}", "last=4", f"out={tmp_path / 'avg4'}"
    )
    assert too_many.returncode == 2 and "has 3 complete checkpoint(s)" in too_many.stderr, (
        too_many.stderr[-2000:]
    )
    client = same_run / "checkpoints" / "step_00000001" / "client_state.json"
    client.write_text(json.dumps({**json.loads(client.read_text()), "tokenizer_sha256": "0" * 64}))
    mixed = python_m(
        "launch.average", f"checkpoint={same_run}", "last=3", f"out={tmp_path / 'avg_mixed'}"
    )
    assert mixed.returncode == 2 and "different tokenizers" in mixed.stderr, mixed.stderr[-2000:]
    assert not (tmp_path / "avg4").exists() and not (tmp_path / "avg_mixed").exists()

    # The average is an exported model directory like any other: evaluate reads it unchanged.
    evaluated = python_m(
        "launch.evaluate",
        f"checkpoint={tmp_path / 'avg2'}",
        "split=train",
        "limit=8",
        "beam=1",
        "max_len=16",
        f"out={tmp_path / 'eval'}",
    )
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    assert list((tmp_path / "eval").iterdir())


def test_the_loss_is_the_mean_over_the_steps_scored_tokens_however_the_batch_is_cut(
    tiny_dataset, tmp_path
):
    """The same 8 pairs per step as one micro batch of 8, or two of 4 accumulated: the loss, hence
    the update, is the mean over all their scored tokens either way (fairseq's normalisation),
    not the mean of the two micro batches' means, which weighs the tokens of the shorter one more.
    fp32, no dropout: the logged losses of 3 steps agree to float rounding."""
    losses = {}
    for micro, accum in ((8, 1), (4, 2)):
        run_dir = tmp_path / f"run-{micro}x{accum}"
        args = [
            *TRAIN,
            "max_steps=3",
            "checkpoint.every_steps=0",
            "schedule.decay=cosine",
            "schedule.warmup_steps=1",
            "optim.lr=3e-3",
            "model.dropout=0.0",
            "deepspeed.precision=fp32",
            f"data.micro_batch_size={micro}",
            f"grad_accum={accum}",
        ]
        trained = python_m(
            "launch.train",
            str(ROOT / "configs" / "tiny_translation.yaml"),
            f"data.data_dir={tiny_dataset}",
            f"run_dir={run_dir}",
            *args,
        )
        assert trained.returncode == 0, trained.stderr[-4000:]
        losses[micro] = [
            row["train/loss"]
            for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "train/loss" in row
        ]
    assert len(losses[8]) == 3
    assert losses[4] == pytest.approx(losses[8], rel=2e-5)
