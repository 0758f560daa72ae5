"""Universal checkpoints: ZeRO state written by 2 ranks resumes on 1 (DeepSpeed #2898).

A 2-rank torchrun job trains a tiny GPT for a few steps under ZeRO stages 0 to 3, in fp32 and
bf16, and saves (tests/launch/universal_worker.py); `launch.deepspeed.universal.to_universal` converts each
checkpoint here, in the pytest process, without a process group; a 1-rank job loads it and takes
one more step on the same global batch (2 micro batches accumulated instead of 2 ranks x 1).
The fp32 weights, both Adam moments (gathered whole, by parameter name), the step counts and the
next step's loss and state must equal the 2-rank job's.
"""

import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from repo import ROOT

from common.configure import UserError
from launch import checkpoint as ckpt
from launch.config import BatchPlan, TrainConfig
from launch.main.plan import torchrun

# Every stage in both precisions; stage 0 is never converted. ZeRO-3 runs last (see the worker).
COMBOS = ["0-fp32", "1-fp32", "2-fp32", "0-bf16", "1-bf16", "2-bf16", "3-fp32", "3-bf16"]
TAG = "step_00000003"  # the worker saves after 3 steps
TOLERANCE = 1e-6  # absolute, on every tensor element and on the loss; measured: 0 (bit-identical)


# ----------------------------------------------------------------------------- contracts


def test_only_the_deepspeed_room_imports_deepspeed():
    importers = []
    for package in ("common", "launch", "pipeline", "model", "benchmarks"):
        for path in (ROOT / package).rglob("*.py"):  # the rooms inside each package too
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                if any(name.split(".")[0] == "deepspeed" for name in names):
                    importers.append(str(path.relative_to(ROOT)))
    assert importers and all(path.startswith("launch/deepspeed/") for path in importers), sorted(
        set(importers)
    )
    # The checkpoint layout reads DeepSpeed's file names without importing it.
    code = (
        "import sys, launch.checkpoint; assert 'deepspeed' not in sys.modules, 'deepspeed imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_saved_world_size(tmp_path):
    tag = tmp_path / TAG
    tag.mkdir()
    # stage 0 without the trainer's json: unknown
    assert ckpt.saved_world_size(tmp_path, TAG) is None
    for rank in range(4):  # ZeRO's per-rank files; bf16 runs prefix them
        (tag / f"bf16_zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").touch()
        (tag / f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt").touch()
    assert ckpt.saved_world_size(tmp_path, TAG) == 4
    (tag / "client_state.json").write_text(json.dumps({"step": 3, "world_size": 8}))
    assert ckpt.saved_world_size(tmp_path, TAG) == 8  # the trainer's record comes first
    assert ckpt.saved_world_size(tmp_path, "step_99999999") is None


def test_prune_takes_universal_copies_with_their_checkpoint(tmp_path):
    for step in (10, 20, 30):
        (tmp_path / ckpt.tag_for(step) / "zero").mkdir(parents=True)
        (tmp_path / ckpt.universal_tag_for(ckpt.tag_for(step)) / "zero").mkdir(parents=True)
    (tmp_path / f".{ckpt.universal_tag_for(ckpt.tag_for(10))}.partial").mkdir()
    ckpt.move_pointer(tmp_path, ckpt.tag_for(30))
    # Copies do not count as checkpoints: two real ones are kept, each with its copy.
    assert ckpt.prune(tmp_path, keep_last=2) == [ckpt.tag_for(10)]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "latest",
        "step_00000020",
        "step_00000020.universal",
        "step_00000030",
        "step_00000030.universal",
    ]


def test_deepspeed_config_sets_load_universal_only_when_asked(tmp_path):
    from launch.deepspeed.config import deepspeed_config

    cfg, plan = TrainConfig(), BatchPlan(8, 1, 2)
    assert "checkpoint" not in deepspeed_config(cfg, plan)
    assert deepspeed_config(cfg, plan, load_universal=True)["checkpoint"] == {
        "load_universal": True
    }
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"checkpoint": {"load_universal": True}}))
    cfg.deepspeed.config_file = str(user)
    with pytest.raises(UserError, match="checkpoint.load_universal"):
        deepspeed_config(cfg, plan)


def test_to_universal_passes_stage_0_through_and_reports_a_failure_in_one_line(tmp_path):
    from launch.deepspeed.universal import to_universal

    with pytest.raises(UserError, match="not found"):
        to_universal(tmp_path, TAG)
    stage0 = tmp_path / TAG
    stage0.mkdir()
    torch.save({"module": {}}, stage0 / "mp_rank_00_model_states.pt")
    # whole optimizer state: nothing to convert
    assert to_universal(tmp_path, TAG) == (tmp_path, TAG)

    broken_root = tmp_path / "broken"
    broken = broken_root / TAG
    broken.mkdir(parents=True)
    for rank in range(2):
        (broken / f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt").write_bytes(
            b"not a torch file"
        )
    with pytest.raises(UserError) as failure:
        to_universal(broken_root, TAG)
    message = str(failure.value)
    assert (
        "\n" not in message
        and str(broken) in message
        and "conversion to a universal checkpoint failed" in message
    )
    assert not (broken_root / ckpt.universal_tag_for(TAG)).exists()  # no half copy in place
    assert sorted(p.name for p in broken.iterdir()) == [
        f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(2)
    ]


# ----------------------------------------------------------------------------- 2 ranks -> 1


def _files(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """Save with 2 ranks, convert here, load with 1: OUT/COMBO/ holds both jobs' states."""
    from launch.deepspeed.universal import to_universal

    out = tmp_path_factory.mktemp("universal")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    worker = str(ROOT / "tests" / "launch" / "universal_worker.py")
    started = time.monotonic()
    save = subprocess.run(
        [
            *torchrun(2),
            worker,
            "save",
            str(out),
            ",".join(COMBOS),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert save.returncode == 0, save.stderr[-4000:]
    saved_s = time.monotonic() - started

    started = time.monotonic()
    layout = {}
    for combo in COMBOS:
        root = out / combo / "checkpoints"
        before = _files(root / TAG)
        load_from = to_universal(root, TAG)
        layout[combo] = {
            "load_from": load_from,
            "again": to_universal(root, TAG),
            "original_before": before,
            "original_after": _files(root / TAG),
            "entries": sorted(p.name for p in root.iterdir()),
        }
        (out / combo / "load_from.json").write_text(json.dumps([str(load_from[0]), load_from[1]]))
    converted_s = time.monotonic() - started

    started = time.monotonic()
    single = {
        k: v
        for k, v in env.items()
        if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK") and not k.startswith("SLURM_")
    }
    load = subprocess.run(
        [sys.executable, worker, "load", str(out), ",".join(COMBOS)],
        cwd=ROOT,
        env=single,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert load.returncode == 0, load.stderr[-4000:]
    print(
        f"\n2-rank save {saved_s:.1f} s, conversions {converted_s:.1f} s, 1-rank load {time.monotonic() - started:.1f} s"
    )
    return out, layout


def _max_difference(expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor]) -> float:
    assert sorted(got) == sorted(expected)
    return max(float((expected[name] - got[name]).abs().max()) for name in expected)


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS)
def test_state_and_next_step_survive_a_change_of_world_size(jobs, combo):
    out, _ = jobs
    saved, after = torch.load(out / combo / "saved.pt"), torch.load(out / combo / "next.pt")
    resumed = torch.load(out / combo / "resumed.pt", weights_only=False)
    resumed_after = torch.load(out / combo / "resumed_next.pt")
    # every parameter has moments
    assert len(saved["exp_avg"]) == len(saved["exp_avg_sq"]) == len(saved["weights"]) > 0
    assert resumed["client"]["step"] == 3 and resumed["client"]["world_size"] == 2

    rows = []
    for label, expected, got in (
        ("loaded", saved, resumed),
        ("after one more step", after, resumed_after),
    ):
        differences = {
            key: _max_difference(expected[key], got[key])
            for key in ("weights", "exp_avg", "exp_avg_sq")
        }
        rows.append(
            f"{combo} {label}: "
            + ", ".join(f"max |{key} diff| {value:.1e}" for key, value in differences.items())
        )
        assert max(differences.values()) <= TOLERANCE, rows[-1]
        assert (got["global_steps"], got["adam_steps"], got["lr"]) == (
            expected["global_steps"],
            expected["adam_steps"],
            expected["lr"],
        )
    assert resumed_after["global_steps"] == 4
    rows.append(
        f"{combo} next loss: 2 ranks {after['loss']:.8f}, 1 rank {resumed_after['loss']:.8f}"
    )
    print("\n" + "\n".join(rows))
    assert resumed_after["loss"] == pytest.approx(after["loss"], abs=TOLERANCE, rel=0)


@pytest.mark.slow
@pytest.mark.parametrize("combo", COMBOS)
def test_conversion_writes_a_complete_copy_beside_the_original(jobs, combo, tmp_path):
    out, layout = jobs
    info = layout[combo]
    root = out / combo / "checkpoints"
    assert info["original_after"] == info["original_before"]  # untouched
    assert info["again"] == info["load_from"]  # reused, not converted again
    if combo.startswith("0-"):  # the whole optimizer state is in mp_rank_00_model_states.pt
        assert info["load_from"] == (root, TAG) and not ckpt.is_zero_partitioned(root / TAG)
        assert TAG + ckpt.UNIVERSAL_SUFFIX not in info["entries"]
        return
    universal = ckpt.universal_tag_for(TAG)
    assert info["load_from"] == (root, universal) and ckpt.is_universal(root, universal)
    # Nothing else beside it: no hidden build directory, no `latest_universal` pointer.
    assert [e for e in info["entries"] if e not in ("zero_to_fp32.py", "zero_to_torch.py")] == [
        TAG,
        universal,
    ]
    copy = root / universal
    assert json.loads((copy / ckpt.UNIVERSAL_INFO).read_text())["source"] == TAG
    # DeepSpeed's output, kept off the console
    assert "*** Done!" in (copy / "conversion.log").read_text()
    # The per-rank files name the world size when the trainer's record is missing.
    bare = tmp_path / TAG
    shutil.copytree(root / TAG, bare, ignore=shutil.ignore_patterns("client_state.json"))
    assert ckpt.saved_world_size(tmp_path, TAG) == 2 == ckpt.saved_world_size(root, TAG)
