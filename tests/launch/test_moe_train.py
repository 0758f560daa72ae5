"""A mixture of experts trained by `launch.train` on 2 ranks: the routers' auxiliary loss joins the
objective weighted as the LM loss is, so ZeRO-0 (the trainer's own bucketed reduction, which
divides by the step's tokens after reducing) and ZeRO-2 (DeepSpeed's, which averages) train the
same model; the log line carries the auxiliary loss and each MoE layer's expert load."""

import math

import pytest
from trainruns import losses, metrics, run_train

pytestmark = pytest.mark.slow

MOE = [
    "model.positions=rope",
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.bias=false",
    "model.dropout=0.0",
    "model.moe.experts=4",
    "model.moe.top_k=2",
    "model.moe.d_ff=32",
    "model.moe.z_loss_coef=0.001",
    "max_steps=8",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=0",
]


@pytest.fixture(scope="module")
def moe_runs(tiny_dataset, tmp_path_factory) -> dict:
    top = tmp_path_factory.mktemp("moe-train")
    runs = {}
    for stage in (0, 2):
        run_dir = top / f"zero{stage}"
        run_train(tiny_dataset, run_dir, *MOE, f"deepspeed.zero_stage={stage}")
        runs[stage] = run_dir
    return runs


def test_both_reductions_train_the_same_mixture_of_experts(moe_runs):
    zero0, zero2 = losses(moe_runs[0]), losses(moe_runs[2])
    assert sorted(zero0) == list(range(1, 9))
    for step in zero0:
        assert zero0[step] == pytest.approx(zero2[step], rel=1e-4), step
    assert zero0[8] < zero0[1]


def test_the_log_line_carries_the_routing(moe_runs):
    rows = [row for row in metrics(moe_runs[2]) if "train/loss" in row]
    for row in rows:
        # weight 0.01 on a balance loss of 1 (balanced) to 4 (one expert), plus the z-loss
        assert 0.01 <= row["train/aux_loss"] < 0.05, row
        for layer in (0, 1):
            assert 1.0 <= row[f"moe/load_max_mean/{layer}"] <= 2.0  # 4 experts, top 2
        assert row["moe/dropped_fraction"] == 0.0
    assert not any(math.isnan(row["train/aux_loss"]) for row in rows)
