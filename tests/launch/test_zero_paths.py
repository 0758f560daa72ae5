"""DeepSpeed paths beside the default: bf16 gradient accumulation in fp32 (ZeRO 1-3) and
activation checkpointing under ZeRO-3, 2 ranks under torchrun on CPU. Offload: test_offload.py."""

import json
import math
import os
import sys

import pytest
from trainruns import DROPOUT_ZERO3, metrics, train

from common.configure import UserError
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.config import DeepSpeedConfig
from launch.optim_config import OptimConfig


def _config(stage: int, precision: str, config_file: str = "") -> dict:
    from launch.deepspeed.config import deepspeed_config

    cfg = TrainConfig(
        grad_accum=4,
        deepspeed=DeepSpeedConfig(zero_stage=stage, precision=precision, config_file=config_file),
    )
    return deepspeed_config(cfg, BatchPlan(2, 4, 2))


def test_bf16_gradients_accumulate_in_fp32_under_zero_and_stage_0_is_autocast(tmp_path):
    for stage in (1, 2, 3):
        config = _config(stage, "bf16")
        assert (
            config["data_types"] == {"grad_accum_dtype": "fp32"}
            and config["communication_data_type"] == "fp32"
        )
        # fp32 anyway
        assert not {"data_types", "communication_data_type"} & set(_config(stage, "fp32"))
    # DeepSpeed has no fp32 accumulation for bf16 without ZeRO (NotImplementedError at
    # initialize): there bf16 is torch's autocast over fp32 weights, not DeepSpeed's bf16.
    stage0 = _config(0, "bf16")
    assert not {"data_types", "communication_data_type", "bf16"} & set(stage0)
    # launch.optim.AdamW clips there; DeepSpeed clips under ZeRO (and fp16 at stage 0)
    assert stage0["gradient_clipping"] == _config(0, "fp32")["gradient_clipping"] == 0
    assert _config(1, "bf16")["gradient_clipping"] == OptimConfig().grad_clip > 0
    assert stage0["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"}
    user = tmp_path / "ds.json"
    user.write_text(
        json.dumps({"data_types": {"grad_accum_dtype": "bf16"}, "communication_data_type": "bf16"})
    )
    config = _config(2, "bf16", str(user))  # the user's choices are kept
    assert (
        config["data_types"] == {"grad_accum_dtype": "bf16"}
        and config["communication_data_type"] == "bf16"
    )
    # autocast's gradients are fp32 already; DeepSpeed's own bf16 at stage 0 cannot have them
    user.write_text(json.dumps({"data_types": {"grad_accum_dtype": "fp32"}}))
    assert _config(0, "bf16", str(user))["torch_autocast"]["enabled"]
    user.write_text(
        json.dumps({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    )
    with pytest.raises(UserError) as refused:
        _config(0, "bf16", str(user))
    assert "\n" not in str(refused.value) and "data_types.grad_accum_dtype=fp32" in str(
        refused.value
    )
    # the user's JSON turns ZeRO off
    user.write_text(json.dumps({"zero_optimization": {"stage": 0}}))
    assert not {"data_types", "communication_data_type"} & set(_config(2, "bf16", str(user)))


@pytest.mark.slow
def test_bf16_with_grad_accum_trains_under_zero_1_and_its_checkpoint_reads(tiny_dataset, tmp_path):
    """ZeRO-1 with bf16 and fp32 accumulation is DeepSpeed's BF16_Optimizer (fp32 gradient buffers).
    Its checkpoint, which DeepSpeed's zero_to_fp32 refuses, gives export and evaluation the fp32
    master weights (`launch.deepspeed.safe_load.consolidated_state_dict`): each rounds to the bf16
    weight the checkpoint holds, and they are not the bf16 weights themselves."""
    run_dir = tmp_path / "run"
    run = train(
        "tiny_gpt.yaml",
        tiny_dataset,
        run_dir,
        "max_steps=10",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "grad_accum=2",
        "deepspeed.zero_stage=1",
        "deepspeed.precision=bf16",
    )
    assert (
        "optimizer: AdamW (fused kernel) in DeepSpeed's BF16_Optimizer; gradients accumulated in float32, reduced in float32"
        in run.stderr
    )
    losses = [r["train/loss"] for r in metrics(run_dir) if "train/loss" in r]
    print("\nbf16 ZeRO-1 grad_accum=2 losses:", [round(x, 4) for x in losses])
    assert len(losses) == 10 and losses[-1] < 0.9 * losses[0], losses

    import torch

    from launch.deepspeed.safe_load import consolidated_state_dict

    masters = consolidated_state_dict(run_dir / "checkpoints", "step_00000010")
    saved = torch.load(
        run_dir / "checkpoints" / "step_00000010" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )["module"]
    assert set(saved) <= set(masters) and all(saved[name].dtype == torch.bfloat16 for name in saved)
    assert all(torch.equal(masters[name].bfloat16(), saved[name]) for name in saved)
    assert any(not torch.equal(masters[name], saved[name].float()) for name in saved)


@pytest.mark.slow
def test_bf16_without_zero_is_autocast_over_fp32_weights_reduced_by_the_trainer(
    tiny_dataset, tmp_path
):
    """ZeRO-0 in bf16: fp32 weights and gradients, the forward's matmuls in bf16 (its losses are
    not fp32's, and close to them), the gradients accumulated in fp32 over grad_accum=2 and
    reduced by the trainer during the backward (launch.train.reduce)."""
    import torch

    runs = {}
    for precision in ("bf16", "fp32"):
        run_dir = tmp_path / precision
        runs[precision] = train(
            "tiny_gpt.yaml",
            tiny_dataset,
            run_dir,
            "max_steps=6",
            "log_every=1",
            "eval_every=0",
            "checkpoint.every_steps=0",
            "grad_accum=2",
            "deepspeed.zero_stage=0",
            f"deepspeed.precision={precision}",
        )
    stderr = runs["bf16"].stderr
    assert (
        "optimizer: AdamW (fused kernel); gradients accumulated in float32, reduced in float32; "
        "forward under torch's autocast to bfloat16, weights in float32" in stderr
    )
    assert "gradients all-reduced during the backward" in stderr
    assert "autocast" not in runs["fp32"].stderr
    bf16, fp32 = (
        [r["train/loss"] for r in metrics(tmp_path / p) if "train/loss" in r] for p in runs
    )
    assert len(bf16) == 6 and bf16 != fp32
    assert max(abs(a - b) for a, b in zip(bf16, fp32)) < 0.05, (bf16, fp32)
    # the norm before clipping, which the optimizer measures (DeepSpeed's clipping is off here)
    for p in runs:
        norms = [r["train/grad_norm"] for r in metrics(tmp_path / p) if "train/loss" in r]
        assert all(math.isfinite(n) and n > 0 for n in norms), (p, norms)
    saved = torch.load(
        tmp_path / "bf16" / "checkpoints" / "step_00000006" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )["module"]
    assert all(tensor.dtype == torch.float32 for tensor in saved.values())


PROBE = '''
"""Counts each call of a function that torch.utils.checkpoint runs: in the forward, and again
in the backward (the recomputation), by rank, in files under $AC_PROBE_DIR."""
import os

if os.environ.get("AC_PROBE_DIR"):
    import torch
    import torch.utils.checkpoint as _checkpointing

    _original = _checkpointing.checkpoint

    def checkpoint(function, *args, **kwargs):
        def counted(*a, **k):
            phase = "forward" if torch._C._current_graph_task_id() == -1 else "recompute"
            with open(os.path.join(os.environ["AC_PROBE_DIR"], f"{phase}.rank{os.environ.get('RANK', '0')}"), "a") as fh:
                fh.write(".")
            return function(*a, **k)
        return _original(counted, *args, **kwargs)

    _checkpointing.checkpoint = checkpoint
'''


@pytest.mark.slow
def test_activation_checkpointing_under_zero_3_reproduces_the_losses(
    tiny_dataset, tmp_path, monkeypatch, dropout_zero3_gpt
):
    """model.activation_checkpointing (torch.utils.checkpoint, non-reentrant) recomputes each block
    in the backward, where ZeRO-3 must gather the block's parameters again: the losses (and so
    the updates) equal a run without it (the session's, shared with test_train's resume). Dropout
    on: the recomputation replays its RNG."""
    plain = dropout_zero3_gpt  # 10 steps, ZeRO-3, dropout 0.1
    probe = tmp_path / "probe"
    (probe / "counts").mkdir(parents=True)
    (probe / "sitecustomize.py").write_text(PROBE)
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    )
    monkeypatch.setenv("AC_PROBE_DIR", str(probe / "counts"))
    checkpointed = tmp_path / "checkpointed"
    # No engine checkpoints in this run: saving them is no part of the claim (and changes no loss).
    train(
        "tiny_gpt.yaml",
        tiny_dataset,
        checkpointed,
        *DROPOUT_ZERO3,
        "checkpoint.every_steps=0",
        "model.activation_checkpointing=true",
    )
    # Each rank checkpointed both blocks at each of the 10 steps, and recomputed each in its
    # backward.
    counts = {path.name: len(path.read_text()) for path in (probe / "counts").iterdir()}
    assert counts == {
        f"{phase}.rank{rank}": 2 * 10 for phase in ("forward", "recompute") for rank in (0, 1)
    }, counts
    expected = {r["step"]: r["train/loss"] for r in metrics(plain) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in metrics(checkpointed) if "train/loss" in r}
    print(
        "\nstep  plain        checkpointed",
        *(f"{s:4d}  {expected[s]:.8f}  {got[s]:.8f}" for s in sorted(expected)),
        sep="\n",
        file=sys.stderr,
    )
    assert sorted(got) == list(range(1, 11))
    assert [got[s] for s in sorted(got)] == pytest.approx(
        [expected[s] for s in sorted(got)], abs=1e-6, rel=0
    )
