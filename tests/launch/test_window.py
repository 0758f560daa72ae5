"""The throughput window's loss: the mean of the finite step losses since the last log line,
then a fresh window (launch.train.window)."""

import math

from launch.train.step_result import StepResult
from launch.train.window import ThroughputWindow


def step(loss: float, tokens: float = 100.0) -> StepResult:
    return StepResult(
        loss=loss,
        tokens=tokens,
        flops=1e6,
        flops_llmc=math.nan,
        samples=4,
        stop=False,
        skipped="",
        spike_limit=math.inf,
    )


def test_the_window_loss_is_the_mean_of_its_finite_steps_and_starts_afresh():
    window = ThroughputWindow(grad_clip=0.0, world_size=2, peak=1e9, is_main=True)
    for loss in (3.5, math.nan, 6.0, 4.0):  # a step with no finite micro batch has no loss
        window.add(step(loss), 0.5, None)
    first = window.figures()
    assert first["train/loss_mean"] == (3.5 + 6.0 + 4.0) / 3
    assert first["perf/tokens_per_s"] == 400 / 2.0  # the NaN step's tokens and time still count
    window.add(step(math.nan), 0.5, None)
    assert math.isnan(window.figures()["train/loss_mean"])
    window.add(step(2.0), 0.5, None)
    assert window.figures()["train/loss_mean"] == 2.0
