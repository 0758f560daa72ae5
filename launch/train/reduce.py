"""The gradient reduction of ZeRO-0 on more than one rank, done by the trainer instead of
DeepSpeed: in buckets all-reduced while the backward is still running, as DDP does (Li et al.
2020, "PyTorch Distributed", 3.2.3), with the step's figures in the last bucket.

DeepSpeed's engine all-reduces ZeRO-0's gradients after the backward has ended (its
`allreduce_gradients`), so a rank waits out the whole reduction, and the loop needed a reduction
of its own before the last backward for the step's figures (the loss normaliser, the guard's
inputs). Here the trainable parameters are cut into buckets of about `bucket_mb`, in the reverse
of their registration order (roughly the order in which the backward finishes their gradients);
on the step's last micro batch a post-accumulate hook counts each gradient in, and a bucket whose
gradients are all in starts its asynchronous all-reduce at once, while the backward goes on with
the layers below. The bucket of the first parameters (the embeddings, finished last) waits for
`finish`, which adds the step's figures to it: one collective more than the gradients need is
none at all. `finish` then waits for every bucket, and writes back each gradient times the
step's scale, which it computes from the reduced figures (the mean over the step's scored
tokens; NaN for a step the guard skips, which `launch.optim.AdamW` then drops on every rank).

Used by `launch.train.step.train_step` when `setup` finds it applies (`applies`): ZeRO-0's
gradients are fp32 (in bf16 too, which at stage 0 is torch's autocast over fp32 weights,
`launch.deepspeed.config`); under ZeRO 1-3 DeepSpeed reduces into its own partitions, and fp16
(GPU only) keeps DeepSpeed's loss scaling and reduction.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

BUCKET_MB = 4.0  # small enough that the first bucket starts early in a 10 M-parameter model


def applies(zero_stage: int, precision: str, world_size: int, offload: bool) -> bool:
    """ZeRO-0 with fp32 gradients (fp32, or bf16 as autocast over fp32 weights), on more than
    one rank, the optimizer on the device."""
    return zero_stage == 0 and precision in ("fp32", "bf16") and world_size > 1 and not offload


class BucketedReduction:
    def __init__(self, model: nn.Module, bucket_mb: float = BUCKET_MB):
        params, seen = [], set()
        for param in model.parameters():
            if param.requires_grad and id(param) not in seen:
                seen.add(id(param))
                params.append(param)
        limit = max(1, int(bucket_mb * 2**20) // 4)
        self.buckets: list[list[nn.Parameter]] = [[]]
        for param in reversed(params):
            if self.buckets[-1] and sum(p.numel() for p in self.buckets[-1]) >= limit:
                self.buckets.append([])
            self.buckets[-1].append(param)
        self.bucket_of = {id(p): i for i, bucket in enumerate(self.buckets) for p in bucket}
        self.flat: list[torch.Tensor | None] = [None] * len(self.buckets)
        self.handles: list = [None] * len(self.buckets)
        self.pending: list[int] = []
        self.armed = False
        for param in params:
            param.register_post_accumulate_grad_hook(self._gradient_in)

    def arm(self) -> None:
        """The next backward is the step's last: its gradients are the step's and go out."""
        self.pending = [len(bucket) for bucket in self.buckets]
        self.handles = [None] * len(self.buckets)
        self.armed = True

    def _gradient_in(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        index = self.bucket_of[id(param)]
        self.pending[index] -= 1
        # the last bucket goes out in `finish`, with the figures
        if self.pending[index] == 0 and index < len(self.buckets) - 1:
            self._start(index)

    def _start(self, index: int, extra: torch.Tensor | None = None) -> None:
        bucket = self.buckets[index]
        parts = [
            (p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).float()
            for p in bucket
        ]
        if extra is not None:
            parts.append(extra.to(parts[0].device, torch.float32))
        self.flat[index] = torch.cat(parts)
        self.handles[index] = dist.all_reduce(self.flat[index], async_op=True)

    def finish(
        self, figures: torch.Tensor, scale_of: Callable[[torch.Tensor], torch.Tensor]
    ) -> torch.Tensor:
        """After the step's last backward: the figures summed over the ranks (float64 in, float32
        on the wire: counts up to 2**24 exactly), and every gradient the ranks' sum times
        `scale_of(summed figures)`."""
        self.armed = False
        last = len(self.buckets) - 1
        for index in range(last):  # a parameter this step did not use never reported in
            if self.handles[index] is None:
                self._start(index)
        self._start(last, figures)
        for handle in self.handles:
            handle.wait()
        width = figures.numel()
        summed = self.flat[last][-width:].to(figures.dtype)
        scale = scale_of(summed).to(torch.float32)
        for index, bucket in enumerate(self.buckets):
            flat = self.flat[index]
            offset = 0
            for param in bucket:
                n = param.numel()
                reduced = flat[offset : offset + n].view_as(param).mul_(scale)
                if param.grad is None:
                    param.grad = reduced.to(param.dtype)
                else:
                    param.grad.copy_(reduced)
                offset += n
            self.flat[index] = None
        return summed
