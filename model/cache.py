"""The key/value cache of a stack while decoding (`model.generation`): per block, the keys and
values self- and cross-attention have computed so far."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor


@dataclass
class KV:
    """Keys and values an attention layer has computed so far, (B, Hkv, S, Dh) each: with
    grouped-query attention only the key/value heads are kept, n_heads / n_kv_heads times fewer."""

    k: Optional[Tensor] = None
    v: Optional[Tensor] = None

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


@dataclass
class LayerCache:
    self_attn: KV = field(default_factory=KV)
    cross_attn: KV = field(default_factory=KV)


class KVCache:
    """The cache of one stack during decoding: one `LayerCache` per block."""

    def __init__(self, n_layers: int):
        self.layers = [LayerCache() for _ in range(n_layers)]

    @property
    def length(self) -> int:
        """How many positions the self-attention cache holds."""
        k = self.layers[0].self_attn.k
        return 0 if k is None else k.shape[2]

    def reorder(self, rows: Tensor) -> None:
        """Keep (and duplicate) batch rows `rows` of the self-attention cache, for beam search.

        The cross-attention cache is left alone: beam search only moves rows among the
        beams of one source, whose encoder keys and values are identical.
        """
        for layer in self.layers:
            kv = layer.self_attn
            if kv.k is not None:
                kv.k, kv.v = kv.k.index_select(0, rows), kv.v.index_select(0, rows)
