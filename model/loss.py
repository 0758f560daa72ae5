"""The losses of the three models, and the ignore index of their labels.

Labels are aligned with the positions that predict them (`launch.tasks` makes them); a label
of IGNORE_INDEX scores nothing. `cross_entropy` is the plain loss over given logits (BERT's
head, which only runs on the scored positions); `linear_cross_entropy` is the language-model
head's loss without its (tokens x vocabulary) logits (GPT and the Seq2Seq decoder).

A causal LM's loss needs logits for every position, but only to reduce them to one number:
materialising (B*T, V) float logits, their log-softmax and the gradient of both costs more
memory traffic than the projection itself on a CPU, and most of the activation memory of a
small model on a GPU. `linear_cross_entropy` projects `chunk` rows at a time, turns each
chunk's log-softmax into its gradient in place (softmax minus the smoothed one-hot target) and
multiplies that straight back into the gradients of the hidden states and the weight, so the
backward pass only scales what the forward pass left. The same idea as Liger Kernel's fused
linear cross-entropy and Wijmans et al. 2024, "Cut Your Losses in Large-Vocabulary Language
Models", written in plain torch.

`LMHead` is the `nn.Linear` onto the vocabulary that uses it when given targets; it stays a
module (and `lm_head.weight` its key) so that ZeRO-3 gathers its weight around the call.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # the label torch's cross_entropy ignores by default
CHUNK_ELEMENTS = 1 << 22  # float logits per chunk: 16 MiB, about what stays in a CPU's cache hierarchy


def cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of logits (..., V) over labels (...) that are not IGNORE_INDEX; 0 (not NaN) when there are none."""
    total = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),  # a bf16 log-softmax over the vocabulary loses precision
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def _chunk_rows(vocab_size: int) -> int:
    return max(64, CHUNK_ELEMENTS // vocab_size)


def _chunk_loss(logp: Tensor, targets: Tensor, keep: Tensor, label_smoothing: float) -> Tensor:
    """Summed loss of the kept rows of float log-probabilities (c, V)."""
    nll = -logp.gather(1, targets[:, None]).squeeze(1)  # (c,)
    if label_smoothing:
        # The target distribution (1 - e) one-hot + e / V, as in F.cross_entropy.
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp.mean(dim=-1)
    return (nll * keep).sum()


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, label_smoothing: float) -> Tensor:
        # h (N, C), weight (V, C), bias (V,) or None, targets (N,) with IGNORE_INDEX ignored.
        acc = torch.promote_types(h.dtype, torch.float32)  # float32, or float64 for float64 inputs
        valid = targets != IGNORE_INDEX  # (N,)
        count = valid.sum().clamp(min=1)
        safe = targets.clamp(min=0)
        grad_h = torch.empty_like(h)
        grad_w = torch.zeros_like(weight, dtype=acc)
        grad_b = None if bias is None else torch.zeros_like(bias, dtype=acc)
        total = h.new_zeros((), dtype=acc)
        rows = _chunk_rows(weight.shape[0])
        for start in range(0, h.shape[0], rows):
            hc, tc, kc = h[start : start + rows], safe[start : start + rows], valid[start : start + rows]
            logp = F.log_softmax(F.linear(hc, weight, bias).to(acc), dim=-1)  # (c, V), one fused kernel
            total += _chunk_loss(logp, tc, kc, label_smoothing)
            # d loss / d logits = softmax - (1 - e) one-hot - e / V, for each kept row, / count.
            grad = logp.exp_()  # (c, V), in place
            grad[torch.arange(len(tc), device=grad.device), tc] -= 1.0 - label_smoothing
            if label_smoothing:
                grad -= label_smoothing / grad.shape[1]
            # The row weights (0 for ignored rows) go onto the (c, C) factors, not the (c, V) one.
            scale = (kc / count).to(acc)[:, None]  # (c, 1)
            grad_w += grad.t() @ (hc.to(acc) * scale)  # (V, C); out of place, which FLOP counters see
            if grad_b is not None:
                grad_b += grad.t() @ scale.squeeze(1)
            grad_h[start : start + rows] = (grad.to(h.dtype) @ weight) * scale.to(h.dtype)  # (c, C)
        ctx.save_for_backward(grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype))
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w, grad_b = ctx.saved_tensors
        return grad_h * grad_loss, grad_w * grad_loss, None if grad_b is None else grad_b * grad_loss, None, None


def linear_cross_entropy(
    h: Tensor, weight: Tensor, bias: Optional[Tensor], targets: Tensor, label_smoothing: float = 0.0
) -> Tensor:
    """Mean cross-entropy of `F.linear(h, weight, bias)` against `targets` over the rows whose
    target is not IGNORE_INDEX (0 when there are none), as `cross_entropy` gives for the same logits. h (..., C), targets (...)."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # (N, C), (N,)
    if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
        return _LinearCrossEntropy.apply(h, weight, bias, targets, label_smoothing)
    acc = torch.promote_types(h.dtype, torch.float32)
    valid = targets != IGNORE_INDEX
    safe = targets.clamp(min=0)
    total = h.new_zeros((), dtype=acc)
    rows = _chunk_rows(weight.shape[0])
    for start in range(0, h.shape[0], rows):
        logp = F.log_softmax(F.linear(h[start : start + rows], weight, bias).to(acc), dim=-1)
        total += _chunk_loss(logp, safe[start : start + rows], valid[start : start + rows], label_smoothing)
    return total / valid.sum().clamp(min=1)


class LMHead(nn.Linear):
    """The projection onto the vocabulary: logits without targets, the loss with them."""

    def forward(self, h: Tensor, targets: Optional[Tensor] = None, label_smoothing: float = 0.0) -> Tensor:
        if targets is None:
            return super().forward(h)  # (..., V)
        return linear_cross_entropy(h, self.weight, self.bias, targets, label_smoothing)
