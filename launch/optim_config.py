"""Configuration of the optimizer and its learning-rate schedule (`launch.optim` builds both from
it), with the checks of each that the types cannot express. No torch here: the schemas load for
`--help` and the configuration reference."""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("cosine", "linear", "constant", "inverse_sqrt")  # schedule.decay
# optim.implementation (launch.optim.adamw_kernels)
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")


@dataclass
class OptimConfig:
    # peak learning rate, reached after schedule.warmup_steps; with schedule.decay inverse_sqrt
    # a scale on the paper's schedule (1.0 = Vaswani et al.: peak (d_model * warmup_steps)^-0.5)
    lr: float = 3e-4
    weight_decay: float = 0.1  # never on norms, biases or embeddings
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    grad_clip: float = 1.0  # 0 disables clipping
    # torch AdamW's kernel: auto (the fused one, on a GPU and on a CPU) | fused | foreach | for_loop
    implementation: str = "auto"


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100  # linear warmup to optim.lr over this many optimizer steps
    # cosine | linear | constant | inverse_sqrt: optim.lr * d_model^-0.5 * min(n^-0.5, n *
    # warmup_steps^-1.5)
    # at optimizer step n = 1, 2, ... (Vaswani et al. 2017; linear rise, then 1/sqrt decay)
    decay: str = "cosine"
    min_lr_ratio: float = 0.1  # the final lr as a fraction of optim.lr (cosine and linear)


def optim_problems(optim: OptimConfig) -> list[str]:
    """`optim.*`'s problems, each message starting with its key. AdamW's ranges are ones torch
    checks only as the optimizer is built (after the process group is up, in a traceback); NaN
    fails every comparison, so each is refused here too."""
    checks = [
        (
            optim.implementation in ADAMW_IMPLEMENTATIONS,
            f"optim.implementation: {optim.implementation!r} is not one of "
            f"{', '.join(ADAMW_IMPLEMENTATIONS)}",
        ),
        (
            math.isfinite(optim.lr) and optim.lr >= 0,
            f"optim.lr: {optim.lr} must be a finite number, 0 or more",
        ),
        (
            math.isfinite(optim.weight_decay) and optim.weight_decay >= 0,
            f"optim.weight_decay: {optim.weight_decay} must be a finite number, 0 or more",
        ),
        (0 <= optim.beta1 < 1, f"optim.beta1: {optim.beta1} must be in [0, 1)"),
        (0 <= optim.beta2 < 1, f"optim.beta2: {optim.beta2} must be in [0, 1)"),
        (
            math.isfinite(optim.eps) and optim.eps >= 0,
            f"optim.eps: {optim.eps} must be a finite number, 0 or more",
        ),
        (
            math.isfinite(optim.grad_clip) and optim.grad_clip >= 0,
            f"optim.grad_clip: {optim.grad_clip} must be 0 (off) or a positive finite number",
        ),
    ]
    return [message for ok, message in checks if not ok]


def schedule_problems(schedule: ScheduleConfig) -> list[str]:
    """`schedule.*`'s problems, each message starting with its key."""
    checks = [
        (
            schedule.warmup_steps >= 0,
            f"schedule.warmup_steps: {schedule.warmup_steps} must be 0 or more",
        ),
        (
            math.isfinite(schedule.min_lr_ratio) and schedule.min_lr_ratio >= 0,
            f"schedule.min_lr_ratio: {schedule.min_lr_ratio} must be a finite number, 0 or more",
        ),
        (
            schedule.decay in DECAYS,
            f"schedule.decay: {schedule.decay!r} is not one of {', '.join(DECAYS)}",
        ),
        (
            schedule.decay != "inverse_sqrt" or schedule.warmup_steps > 0,
            "schedule.warmup_steps: inverse_sqrt needs a positive warmup "
            "(the formula divides by it)",
        ),
    ]
    return [message for ok, message in checks if not ok]
