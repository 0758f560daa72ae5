"""Positions: ids counted from each row's first real token or each document's first token, the
sinusoidal table, and rotary embeddings (the design: docs/design.md#modelblockspy)."""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor, nn


def positions_from_mask(
    key_mask: Optional[Tensor], past: int, length: int, device: torch.device
) -> Tensor:
    """Position ids of the last `length` tokens, counted from each row's first real token.

    Counting from the first real token makes a left-padded prompt see the same positions as
    the unpadded one, as Hugging Face does for batched generation.
    """
    if key_mask is None:
        return torch.arange(past, past + length, device=device)[None]  # (1, T)
    return (key_mask.long().cumsum(dim=-1) - 1).clamp(min=0)[:, -length:]  # (B, T)


def positions_in_documents(document_ids: Tensor) -> Tensor:
    """Position ids (B, T) counted from each document's first token: 0 wherever the id changes."""
    T = document_ids.shape[1]
    t = torch.arange(T, device=document_ids.device)  # (T,)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    # (B, T): where each token's document starts
    first = torch.where(starts, t, 0).cummax(dim=1).values
    return t - first  # (B, T)


def sinusoids(length: int, d_model: int) -> Tensor:
    """The (length, d_model) sinusoidal position table of Vaswani et al. 2017, section 3.5."""
    position = torch.arange(length, dtype=torch.float32)[:, None]  # (L, 1)
    frequency = torch.exp(
        torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model)
    )
    table = torch.zeros(length, d_model)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)
    return table


class Rotary(nn.Module):
    """Rotary position embeddings (Su et al. 2021, "RoFormer"): the (cos, sin) that rotate a
    self-attention query or key (`rotate`) by its position.

    The pair of a head's dimensions (i, i + Dh/2) turns by position * theta^(-2i/Dh), so the
    score of a query at position m and a key at n depends on m - n only. Dimensions are paired
    across the two halves ("rotate half", as GPT-NeoX and Hugging Face's Llama do; RoFormer and
    Meta's Llama pair neighbours), so Hugging Face weights convert without permuting q and k.
    The table covers max_seq_len positions in float32, whatever the training dtype (DeepSpeed
    casts parameters, not buffers); it is not saved: a rotary stack has no position keys."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float):
        super().__init__()
        # (Dh/2,)
        inverse_frequency = 1.0 / (
            theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        )
        # (L, Dh/2)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inverse_frequency)
        # (L, Dh): each pair's angle on both its dimensions
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions (1 or B, T) -> cos, sin (1 or B, 1, T, Dh), to broadcast over heads."""
        return self.cos[positions][:, None], self.sin[positions][:, None]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, H, T, Dh) rotated by its positions' angles: computed in float32,
    returned in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    # each pair turned by 90 degrees
    x_rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + x_rotated * sin).to(x.dtype)
