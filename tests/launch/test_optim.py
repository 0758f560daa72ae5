"""`optim.implementation`, torch AdamW's kernel: what each value asks torch for, the config's
refusals, and the fused kernel against torch's CPU default (the for-loop) on DeepSpeed's ZeRO
partitions: one step from the same state gives the same master weights and moments to float32
rounding, under ZeRO 0-3, fp32 and bf16, 2 ranks (tests/launch/adamw_worker.py)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch.config import TrainConfig
from launch.deepspeed.config import DeepSpeedConfig
from launch.optim import adamw_kernels, build_optimizer
from launch.optim_config import OptimConfig
from launch.resolve import config_problems
from model import ModelConfig, build_model

ROOT = Path(__file__).resolve().parents[2]
COMBOS = ["0-fp32", "1-bf16", "2-fp32", "2-bf16", "3-bf16"]


def test_each_implementation_is_what_torch_is_asked_for():
    assert adamw_kernels() == adamw_kernels("auto") == {"fused": True}  # on a GPU and on a CPU
    assert adamw_kernels("fused") == {"fused": True, "foreach": False}
    assert adamw_kernels("foreach") == {"fused": False, "foreach": True}
    assert adamw_kernels("for_loop") == {"fused": False, "foreach": False}
    with pytest.raises(ValueError, match="optim.implementation"):
        adamw_kernels("apex")
    model = build_model(
        ModelConfig(arch="gpt", vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    )
    for implementation, fused, foreach in (
        ("auto", True, None),
        ("for_loop", False, False),
        ("foreach", False, True),
    ):
        optimizer = build_optimizer(model, OptimConfig(implementation=implementation))
        assert [(g["fused"], g["foreach"]) for g in optimizer.param_groups] == [
            (fused, foreach)
        ] * 2


def test_the_zero_0_optimizer_clips_as_torch_does_and_keeps_the_norm_before_clipping():
    """ZeRO-0's AdamW (skip_non_finite) clips the gradients itself at optim.grad_clip, as torch's
    clip_grad_norm_ before torch's AdamW would, and leaves the norm before clipping where
    DeepSpeed's engine reads it; under the limit the gradients are left as they are; a
    non-finite gradient drops the step."""
    torch.manual_seed(0)
    config = ModelConfig(
        arch="gpt", vocab_size=32, d_model=16, n_layers=1, n_heads=2, max_seq_len=8, dropout=0.0
    )
    ids = torch.randint(0, 32, (2, 8))
    for limit in (0.05, 1e6):
        ours, theirs = build_model(config), build_model(config)
        theirs.load_state_dict(ours.state_dict())
        optim = OptimConfig(grad_clip=limit, implementation="for_loop")
        mine = build_optimizer(ours, optim, skip_non_finite=True)
        reference = build_optimizer(theirs, optim)
        for model in (ours, theirs):
            model(ids, labels=ids).loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(theirs.parameters(), limit)
        mine.step()
        reference.step()
        assert float(mine._global_grad_norm) == pytest.approx(float(norm), rel=1e-6)
        for a, b in zip(ours.parameters(), theirs.parameters()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    before = [p.detach().clone() for p in ours.parameters()]
    next(ours.parameters()).grad.fill_(float("nan"))
    mine.step()
    assert mine.overflow and all(torch.equal(a, b) for a, b in zip(before, ours.parameters()))


def test_the_config_refuses_an_unknown_kernel_and_one_beside_offload():
    problems = config_problems(TrainConfig(optim=OptimConfig(implementation="apex")))
    assert problems == ["optim.implementation: 'apex' is not one of auto, fused, foreach, for_loop"]
    offload = TrainConfig(
        optim=OptimConfig(implementation="fused"), deepspeed=DeepSpeedConfig(offload_optimizer=True)
    )
    assert any(
        p.startswith("optim.implementation: with deepspeed.offload_optimizer")
        for p in config_problems(offload)
    )


@pytest.mark.slow
def test_fused_and_for_loop_take_the_same_step_on_zero_partitions(tmp_path):
    """The kernels are not bit-equal (the fused one orders its float32 operations otherwise) but
    agree to a few ulps of the largest value; a kernel that mishandled DeepSpeed's flat partitions
    (an offset, a stride, the weight-decay group) would differ by the order of the update, lr = 1e-2."""
    worker = ROOT / "tests" / "launch" / "adamw_worker.py"
    job = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(worker),
            str(tmp_path),
            ",".join(COMBOS),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        timeout=600,
    )
    assert job.returncode == 0, job.stderr[-4000:]
    ulp = torch.finfo(torch.float32).eps
    for combo in COMBOS:
        result = json.loads((tmp_path / f"{combo}.json").read_text())
        assert "AdamW (fused kernel)" in result["described"]["fused"], result["described"]
        assert "fused kernel" not in result["described"]["for_loop"]
        # the same weights before the step
        assert result["losses"]["fused"] == result["losses"]["for_loop"]
        for key in ("weights", "exp_avg", "exp_avg_sq"):
            diff, scale = result[key]["diff"], result[key]["scale"]
            assert scale > 0 and diff <= 4 * ulp * scale, (combo, key, diff, scale)
        # the check can fail
        assert result["update"] > 100 * 4 * ulp * result["weights"]["scale"], result
