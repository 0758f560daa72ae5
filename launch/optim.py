"""AdamW parameter groups and the learning-rate schedule (warmup, then cosine, linear or
constant; or the inverse square root of "Attention Is All You Need", Vaswani et al. 2017, 5.3).

Weight decay applies to the weight matrices of linear layers only: never to norms, biases or
embeddings (as in GPT-2/BERT practice and Loshchilov and Hutter 2019). A tied embedding that
doubles as the output layer is one parameter and counts as an embedding.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from launch.optim_config import ADAMW_IMPLEMENTATIONS, OptimConfig, ScheduleConfig


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (no_decay if param.ndim < 2 or id(param) in embeddings else decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


class AdamW(torch.optim.AdamW):
    """torch's AdamW that clips the gradients to `max_grad_norm` (0: not clipped) and drops a
    step whose gradients are not all finite, saying so in `overflow`, the attribute DeepSpeed's
    engine reads to skip the schedule's step too; the norm before clipping is left in
    `_global_grad_norm`, where the engine looks for it (the trainer logs it).

    DeepSpeed's ZeRO 1-3, bf16 and fp16 optimizers clip and drop such steps themselves; under
    ZeRO-0 in fp32 (bf16 as autocast too) the engine calls this optimizer directly, with
    gradients already averaged over the ranks, so every rank takes the same decision
    (`launch.train.step.train_step`'s guard relies on it). DeepSpeed's own clipping there
    (`deepspeed_config` turns it off) computes the norm one tensor at a time and all-reduces it,
    a collective the step does not need: the gradients are the same on every rank."""

    overflow = False

    def __init__(self, *args, max_grad_norm: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.max_grad_norm = max_grad_norm
        self._global_grad_norm = None

    @torch.no_grad()
    def step(self, closure=None):
        grads = [
            p.grad for group in self.param_groups for p in group["params"] if p.grad is not None
        ]
        if not grads:
            return super().step(closure)
        norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)).float())
        self._global_grad_norm = norm
        self.overflow = not bool(norm.isfinite())
        if self.overflow:
            return None
        if self.max_grad_norm > 0:  # DeepSpeed's rule: scaled only when over the limit
            torch._foreach_mul_(grads, (self.max_grad_norm / (norm + 1e-6)).clamp(max=1.0))
        return super().step(closure)


def build_optimizer(
    model: nn.Module, cfg: OptimConfig, *, skip_non_finite: bool = False, cpu_offload: bool = False
) -> torch.optim.Optimizer:
    """AdamW over `parameter_groups`; the clipping, step-dropping `AdamW` above with
    `skip_non_finite` (ZeRO-0, where DeepSpeed has no check of its own; under ZeRO it would only
    add a pass over the gradients, and DeepSpeed would warn about an optimizer it has not
    tested), clipping at `cfg.grad_clip`.

    `cpu_offload` (ZeRO-Offload of the optimizer, `deepspeed.offload_optimizer`: the fp32 master
    weights and moments live in CPU memory): DeepSpeed's vectorised CPU Adam in AdamW mode
    (`launch.deepspeed.engine.cpu_adam`), over the same groups; torch's AdamW if its op cannot be
    built. ZeRO-Offload drops non-finite steps itself."""
    groups = parameter_groups(model, cfg.weight_decay)
    betas = (cfg.beta1, cfg.beta2)
    if cpu_offload:
        # DeepSpeed is imported by launch/deepspeed/ alone
        from launch.deepspeed.engine import cpu_adam

        return cpu_adam(groups, lr=cfg.lr, betas=betas, eps=cfg.eps)
    kernels = adamw_kernels(cfg.implementation)
    if skip_non_finite:
        return AdamW(
            groups, lr=cfg.lr, betas=betas, eps=cfg.eps, max_grad_norm=cfg.grad_clip, **kernels
        )
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=betas, eps=cfg.eps, **kernels)


def adamw_kernels(implementation: str = "auto") -> dict:
    """torch AdamW's keyword arguments for `optim.implementation`. `auto`: the fused kernel, one
    pass over parameters, gradients and both moments. On a GPU torch's default is the `foreach`
    kernels, about eight passes (the parameters are still on the CPU here, DeepSpeed moves them,
    and torch checks the device at the first step; docs/gpu.md#figures); on a CPU it is a loop of
    one tensor at a time, 4.6x the fused kernel's time, with the same steps to float32 rounding
    (docs/results.md#adamws-kernels-on-a-cpu)."""
    if implementation not in ADAMW_IMPLEMENTATIONS:
        raise ValueError(
            f"optim.implementation: {implementation!r} is not one of "
            f"{', '.join(ADAMW_IMPLEMENTATIONS)}"
        )
    if implementation == "auto":
        return {"fused": True}
    return {"fused": implementation == "fused", "foreach": implementation == "foreach"}


def lr_multiplier(step: int, cfg: ScheduleConfig, max_steps: int, d_model: int = 0) -> float:
    """The factor on `optim.lr` after `step` optimizer steps, i.e. for optimizer step `step + 1`.

    `inverse_sqrt`: d_model^-0.5 * min(n^-0.5, n * warmup^-1.5) at the paper's step number
    n = step + 1, which is never 0 (the formula is undefined there), so the first update
    already has a positive lr, as under the linear warmup of the other schedules. `optim.lr`
    is then a plain scale, 1.0 being the paper's (its peak, at n = warmup, is
    optim.lr * (d_model * warmup)^-0.5: 7.0e-4 for d_model 512, warmup 4000)."""
    if cfg.decay == "inverse_sqrt":
        if d_model <= 0 or cfg.warmup_steps <= 0:
            raise ValueError(
                "schedule.decay inverse_sqrt needs d_model and schedule.warmup_steps > 0"
            )
        n = step + 1
        return d_model**-0.5 * min(n**-0.5, n * cfg.warmup_steps**-1.5)
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, max_steps - cfg.warmup_steps))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if cfg.decay == "cosine" else 1 - progress
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * shape


def build_scheduler(
    optimizer: torch.optim.Optimizer, cfg: ScheduleConfig, max_steps: int, d_model: int = 0
):
    """`d_model` (the model's width) is read by `inverse_sqrt` alone."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, cfg, max_steps, d_model)
    )
