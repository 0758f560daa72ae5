"""Guarded steps: a step whose loss is not finite on some rank, or spikes above the recent
losses, is skipped on every rank (`launch.train.step.train_step` takes the decision on the
device); here the record of each skip and the verdict when too many come in a row."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from common.configure import UserError
from launch.train.step_result import StepResult

if TYPE_CHECKING:
    from launch.train.state import Run


@dataclass
class GuardConfig:
    """Guarded steps: a step is skipped on every rank when its loss is not finite on
    any rank, or spikes."""

    # End the job (with a checkpoint of the last good weights) after more skipped steps in a row
    # than this.
    max_consecutive_skips: int = 5
    # Skip a step whose loss exceeds the mean of the last spike_window steps by this many standard
    # deviations; 0: off.
    spike_factor: float = 0.0
    spike_warmup_steps: int = 100  # applied steps before the spike test starts
    # applied steps whose losses give the running mean and standard deviation
    spike_window: int = 100


def guard_problems(guard: GuardConfig) -> list[str]:
    """`guard.*`'s problems, each message starting with its key."""
    checks = [
        (guard.max_consecutive_skips >= 0, "guard.max_consecutive_skips: must be 0 or more"),
        (guard.spike_factor >= 0, "guard.spike_factor: must be 0 (off) or positive"),
        (guard.spike_window >= 2, "guard.spike_window: must be at least 2"),
    ]
    return [message for ok, message in checks if not ok]


@dataclass
class Guard:
    """Guarded steps: a step whose loss is not finite on some rank, or (with `guard.spike_factor`)
    spikes above the recent losses, is skipped on every rank; see `train_step`."""

    max_consecutive_skips: int
    spike_factor: float
    spike_warmup_steps: int
    spike_window: int
    skipped: int = 0
    consecutive: int = 0
    fp16_overflows: int = 0  # steps DeepSpeed's fp16 loss scaler dropped (not the guard's)
    history: list = field(default_factory=list)  # the last `spike_window` applied steps' losses

    def spike_limit(self) -> float:
        """The loss above which a step counts as a spike (inf while off or warming up)."""
        if not self.spike_factor or len(self.history) < max(2, self.spike_warmup_steps):
            return math.inf
        mean = sum(self.history) / len(self.history)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / (len(self.history) - 1))
        return mean + self.spike_factor * std

    def record(self, loss: float, skipped: bool) -> None:
        if skipped:
            self.skipped += 1
            self.consecutive += 1
            return
        self.consecutive = 0
        self.history = (self.history + [loss])[-self.spike_window :]

    def state_dict(self) -> dict:
        return {
            "skipped": self.skipped,
            "consecutive": self.consecutive,
            "history": list(self.history),
            "fp16_overflows": self.fp16_overflows,
        }

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive = (
            int(state.get("skipped", 0)),
            int(state.get("consecutive", 0)),
        )
        self.fp16_overflows = int(state.get("fp16_overflows", 0))
        self.history = [float(x) for x in state.get("history", [])][-self.spike_window :]


FP16_OVERFLOW = "fp16 overflow"

# a rank's non-finite losses, as skipped_batches.jsonl names them
NON_FINITE_KINDS = ("nan", "inf", "-inf")


def step_sample_keys(run: Run, result: StepResult) -> list[str]:
    """This rank's samples of one step ("SHARD_PATH#MEMBER"), named from its batches' handles."""
    return [key for served in result.served for key in run.data.train.sample_keys(served)]


def guard_step(run: Run, result: StepResult) -> tuple[dict, str | None]:
    """Count and log a skipped step (RUN_DIR/skipped_batches.jsonl, with the global batch's
    sample keys, and W&B); end the job when fillers stand in for more than
    `data.max_bad_fraction` of an epoch's batches. Returns the metrics to log for the step, and
    the verdict: None, or after more than `guard.max_consecutive_skips` skips in a row why the
    job ends, which the loop does with a checkpoint of the last good state."""
    metrics, verdict = {}, None
    overflow = result.skipped == FP16_OVERFLOW
    if overflow:
        run.guard.fp16_overflows += 1
        metrics["train/fp16_overflow_steps"] = run.guard.fp16_overflows
    else:
        run.guard.record(result.loss, bool(result.skipped))
    if result.skipped and not overflow:
        # One gather, on a skipped step only: each rank's sample keys and its non-finite losses.
        from launch import distributed as dist  # torch: not with the schema

        gathered = dist.all_gather_object((step_sample_keys(run, result), result.non_finite_here))
        keys = [key for rank_keys, _ in gathered for key in rank_keys]
        if run.denv.is_main:
            cause, said = skip_cause(result, [non_finite for _, non_finite in gathered])
            row = {
                "step": run.step,
                "reason": result.skipped,
                **cause,
                "consecutive": run.guard.consecutive,
                "sample_keys": keys,
            }
            with open(Path(run.cfg.run_dir) / "skipped_batches.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(
                f"step {run.step}: skipped on every rank ({said}); "
                f"{run.guard.skipped} skipped so far",
                file=sys.stderr,
            )
        metrics = {"guard/skipped_steps": run.guard.skipped, "guard/skip_reason": result.skipped}
        if run.guard.consecutive > run.guard.max_consecutive_skips:
            verdict = (
                f"{run.guard.consecutive} steps in a row skipped ({result.skipped}) at step "
                f"{run.step}, more than "
                f"guard.max_consecutive_skips={run.guard.max_consecutive_skips}; the last good "
                f"weights are checkpointed (see {Path(run.cfg.run_dir) / 'skipped_batches.jsonl'})"
            )
            return metrics, verdict
    if result.filler_fraction > run.cfg.data.max_bad_fraction:
        raise UserError(
            f"{result.filler_fraction:.1%} of this epoch's batches are fillers for unreadable "
            f"data, more than data.max_bad_fraction={run.cfg.data.max_bad_fraction:g}; see the "
            f"skipped shards in the log (data.data_dir={run.cfg.data.data_dir})"
        )
    return metrics, verdict


def skip_cause(result: StepResult, non_finite_by_rank: list[dict]) -> tuple[dict, str]:
    """What made a step skipped, as fields of its skipped_batches.jsonl row and in words. A
    non-finite loss: each rank's micro batches whose loss was nan, inf or -inf, and apart from
    them `finite_loss`, the loss per scored token of the micro batches that were finite, all ranks
    (null if none was): the step itself has no finite loss. A spike: the loss and the limit it
    passed (`Guard.spike_limit`). Otherwise (DeepSpeed found a non-finite
    gradient norm): the loss."""
    reason, loss = result.skipped, result.loss
    if reason == "non-finite loss":
        found = [
            {"rank": rank, "loss": kind, "micro_batches": count}
            for rank, counts in enumerate(non_finite_by_rank)
            for kind, count in counts.items()
            if count
        ]
        by_kind = {
            kind: [entry["rank"] for entry in found if entry["loss"] == kind]
            for kind in NON_FINITE_KINDS
        }
        said = ", ".join(f"{kind} on {_ranks(ranks)}" for kind, ranks in by_kind.items() if ranks)
        return {
            "non_finite": found,
            "finite_loss": loss if math.isfinite(loss) else None,
        }, f"{reason}: {said}"
    if reason == "loss spike":
        return (
            {"loss": loss, "limit": result.spike_limit},
            f"{reason}: loss {loss:.4g} above the limit {result.spike_limit:.4g}",
        )
    return {"loss": loss}, f"{reason}, loss {loss:.4g}"


def _ranks(ranks: list[int], shown: int = 8) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"ranks {', '.join(map(str, ranks[:shown]))}{more}"
