"""The throughput window between two log lines: tokens, samples and FLOPs of the training steps
alone (evaluation and checkpoints between them would otherwise count as slow training), the
share of clipped steps, the mean of the steps' losses (a step's own loss swings with the lengths
it drew), and the figures they give (tokens/s, samples/s, MFU by both counts, and how evenly the
ranks' tokens were spread: the mean and worst of each step's max/min)."""

from __future__ import annotations

import math

from launch.train.step_result import StepResult


class ThroughputWindow:
    def __init__(self, grad_clip: float, world_size: int, peak: float, is_main: bool):
        self.grad_clip, self.world_size, self.peak, self.is_main = (
            grad_clip,
            world_size,
            peak,
            is_main,
        )
        self.reset()

    def reset(self) -> None:
        self.tokens = self.flops = self.flops_llmc = self.samples = self.seconds = 0.0
        self.clipped = self.steps = self.losses = 0
        self.loss_sum = 0.0
        self.balance_sum = self.balance_worst = 0.0

    def add(self, result: StepResult, seconds: float, grad_norm) -> None:
        """One step: its figures, its wall time, and its gradient norm, kept on the device (a
        read here would wait for the update; the window reads it at the log line)."""
        self.seconds += seconds
        self.tokens += result.tokens
        self.flops += result.flops
        self.flops_llmc += result.flops_llmc
        self.samples += result.samples
        self.steps += 1
        if math.isfinite(result.loss):  # a step with no finite micro batch has no loss
            self.loss_sum += result.loss
            self.losses += 1
        self.balance_sum += result.rank_tokens_max_min
        self.balance_worst = max(self.balance_worst, result.rank_tokens_max_min)
        if self.grad_clip:
            self.clipped = self.clipped + (grad_norm.isfinite() & (grad_norm > self.grad_clip))

    def figures(self) -> dict:
        """The window's metrics, then a fresh window."""
        elapsed = max(self.seconds, 1e-9)
        achieved = self.flops / elapsed / self.world_size  # per rank, like the peak
        achieved_llmc = self.flops_llmc / elapsed / self.world_size
        out = {
            "train/clipped_fraction": float(self.clipped) / self.steps,
            "train/loss_mean": self.loss_sum / self.losses if self.losses else float("nan"),
            "perf/tokens_per_s": self.tokens / elapsed,
            "perf/samples_per_s": self.samples / elapsed,
            "perf/mfu": achieved / self.peak if self.is_main else float("nan"),
        }
        if self.world_size > 1:  # the ranks wait for the one with the most work at each step
            out["perf/rank_tokens_max_min"] = self.balance_sum / self.steps
            out["perf/rank_tokens_max_min_worst"] = self.balance_worst
        if self.is_main and math.isfinite(achieved_llmc):  # llm.c's count has no Seq2Seq form
            out["perf/mfu_llmc"] = achieved_llmc / self.peak
        self.reset()
        return out
