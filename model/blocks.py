"""The one set of blocks that GPT, BERT and Seq2Seq are built from.

The design and its reasons: docs/design.md#modelblockspy.
"""

from __future__ import annotations

import functools
import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any, List, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model.config import GATED_ACTIVATIONS, ModelConfig


class ModelOutput(NamedTuple):
    """What a model's forward returns; each field holds one thing or is None.

    A named tuple rather than a dataclass: DeepSpeed ZeRO-3 finds the tensors in tuples to
    hook its backward-pass parameter handling onto; it cannot see into a dataclass.
    """

    # (B, T, V) at every position; given only when no labels were (a training step never needs
    # them).
    logits: Optional[Tensor] = None
    # Mean cross-entropy over the scored positions (labels != IGNORE_INDEX), when labels were given.
    loss: Optional[Tensor] = None
    # (N, V) at the N scored positions only, in the row-major order of `labels != IGNORE_INDEX`:
    # what BERT's head computes when given labels (see `model.bert`).
    scored_logits: Optional[Tensor] = None


def make_activation(name: str) -> nn.Module:
    """The nonlinearity `name` applies; for a gated activation, the one its gate applies."""
    return {
        "gelu": nn.GELU(),
        "gelu_tanh": nn.GELU(approximate="tanh"),
        "relu": nn.ReLU(),
        "swiglu": nn.SiLU(),
        "geglu": nn.GELU(),
    }[name]


def make_norm(cfg: ModelConfig) -> nn.Module:
    """A norm over d_model: LayerNorm (with a bias unless cfg.bias is false), or RMSNorm, which
    rescales by the root mean square without centring and has a weight only (Zhang & Sennrich
    2019). torch's RMSNorm computes in float32 for 16-bit inputs, as Hugging Face's Llama does."""
    if cfg.norm == "rmsnorm":
        return nn.RMSNorm(cfg.d_model, eps=cfg.layer_norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.layer_norm_eps, bias=cfg.bias)


def make_mlp(cfg: ModelConfig) -> nn.Module:
    if cfg.activation in GATED_ACTIVATIONS:
        return GatedMLP(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias)
    return MLP(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias)


# --- key/value cache -------------------------------------------------------------------


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


# --- masks and positions -------------------------------------------------------------------


def self_attention_mask(
    key_mask: Optional[Tensor], q_len: int, k_len: int, causal: bool, device: torch.device
) -> tuple[Optional[Tensor], bool]:
    """The (attn_mask, is_causal) pair for SDPA, True = may attend.

    `key_mask` (B, k_len) is 1 for real tokens, 0 for padding; the last `q_len` keys are the
    queries' own positions (the rest are cached). Returns None with is_causal=True when SDPA's
    built-in causal mask is exact, because fused kernels run fastest without an explicit mask.
    """
    if key_mask is None:
        if not causal or q_len == 1:
            return None, False
        if q_len == k_len:
            return None, True
    mask = None
    if causal:
        # Bottom-right aligned: query i sits at key position k_len - q_len + i.
        # (T, S)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
    if key_mask is not None:
        keys = key_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        mask = keys if mask is None else keys & mask  # (B, 1, T, S)
    return _never_empty(mask), False


def document_attention_mask(
    document_ids: Tensor, key_mask: Optional[Tensor], causal: bool
) -> Tensor:
    """The (B, 1, T, T) SDPA mask, True = may attend, that keeps each token within its document.

    `document_ids` (B, T) numbers the documents of each row (contiguous runs of one id);
    `key_mask` (B, T) is 1 for real tokens, 0 for padding. Causal: a token also sees no later one.
    """
    mask = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    if causal:
        T = document_ids.shape[1]
        mask = mask & torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
    if key_mask is not None:
        mask = mask & key_mask.bool()[:, None, :]
    return _never_empty(mask[:, None])  # (B, 1, T, T)


def document_block_mask(document_ids: Tensor, key_mask: Optional[Tensor], causal: bool) -> Any:
    """`document_attention_mask` as a FlexAttention BlockMask: the same rule, evaluated per
    (query, key) pair, from which FlexAttention learns which blocks of the score matrix it may skip."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids.shape
    keys = None if key_mask is None else key_mask.bool()

    def may_attend(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = document_ids[b, q] == document_ids[b, kv]
        if causal:
            allowed = allowed & (q >= kv)
        if keys is not None:
            allowed = allowed & keys[b, kv]
        return allowed

    return create_block_mask(may_attend, B, None, T, T, device=document_ids.device)


@functools.cache
def flex_attention_available() -> bool:
    """Whether this torch has FlexAttention and Triton, which its CUDA kernels are compiled with."""
    # torch >= 2.5
    has_flex = importlib.util.find_spec("torch.nn.attention.flex_attention") is not None
    return has_flex and importlib.util.find_spec("triton") is not None


_compiled_flex_attention = None
# Inductor's FlexAttention kernel refuses heads narrower than this ("embedding dimension of the
# query, key, and value must be at least 16"; seen on an H100, torch 2.11).
FLEX_MIN_HEAD_DIM = 16


def _flex_attention(q: Tensor, k: Tensor, v: Tensor, block_mask: Any) -> Tensor:
    """FlexAttention; compiled on CUDA, where only the compiled form is the fused kernel. The
    eager form (on the CPU, for tests) computes the whole score matrix: correct, not fast."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    gqa = {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}  # grouped key/value heads
    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, **gqa)
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention(q, k, v, block_mask=block_mask, **gqa)


# Keys up to which compiled bf16 training on a CPU recomputes attention in backward
# (`attention`): up to there the recomputation is faster than SDPA's CPU flash backward, beyond
# it slower (docs/results.md#where-a-training-step-goes-ours-and-theirs).
RECOMPUTE_MAX_KEYS = 128


# Whether this torch's SDPA takes grouped key/value heads itself (`enable_gqa`, torch >= 2.5).
SDPA_TAKES_GQA = "enable_gqa" in (F.scaled_dot_product_attention.__doc__ or "")


def expand_kv(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """Keys and values (B, Hkv, S, Dh) repeated to (B, H, S, Dh): query head h reads head h // (H / Hkv)."""
    groups = n_heads // k.shape[1]
    if groups == 1:
        return k, v
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


def attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], dropout_p: float, is_causal: bool
) -> Tensor:
    """q (B, H, T, Dh); k, v (B, Hkv, S, Dh), Hkv dividing H (grouped-query attention), each
    key/value head serving H / Hkv consecutive query heads.

    Grouped heads go to SDPA as they are (`enable_gqa`) where its kernel takes them: on a CPU
    (whose flash kernel takes masks too), and on CUDA to the flash kernel (16-bit, no explicit
    mask). Otherwise they are repeated to H heads first: CUDA's memory-efficient kernel, which
    takes masks and float32, has no grouped heads, and SDPA would fall back to its math path.

    torch's `scaled_dot_product_attention` runs it, except in one case: bf16 training on a CPU
    inside a compiled graph (`compile: true`), without dropout, at up to RECOMPUTE_MAX_KEYS keys. There
    SDPA's CPU flash kernel runs its backward pass at a small fraction of the bf16 GEMM rate
    (at 128 keys, 10 ms for a layer whose forward takes 0.7 ms), and `_RecomputedAttention`
    keeps the flash forward but recomputes the probabilities in backward with batched GEMMs
    (float32 for the scores and their gradient, bf16 for the three that produce q, k and v's
    gradients) and float32 element-wise work, which inductor fuses. Like the flash kernel it saves no
    (T x S) matrix; the backward holds one for each layer in turn."""
    if (
        q.device.type == "cpu"
        and q.dtype == torch.bfloat16
        and dropout_p == 0.0
        and torch.is_grad_enabled()
        and torch.compiler.is_compiling()
        and k.shape[-2] <= RECOMPUTE_MAX_KEYS
        and (q.requires_grad or k.requires_grad or v.requires_grad)
    ):
        return _RecomputedAttention.apply(q, *expand_kv(k, v, q.shape[1]), mask, is_causal)
    if k.shape[1] != q.shape[1]:
        flash = mask is None and q.dtype in (torch.float16, torch.bfloat16)
        if SDPA_TAKES_GQA and (q.device.type == "cpu" or flash):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, enable_gqa=True
            )
        k, v = expand_kv(k, v, q.shape[1])
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
    )


class _RecomputedAttention(torch.autograd.Function):
    """Softmax attention (B, H, T, Dh) with an optional boolean mask (True = may attend,
    broadcast to (B, H, T, S)) or SDPA's top-left causal mask: forward by the CPU flash kernel,
    which also returns each query's log-sum-exp; backward from the saved q, k, v, output and
    log-sum-exp (the equations of Dao et al. 2022, "FlashAttention", appendix B, unblocked)."""

    @staticmethod
    def forward(
        ctx, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], is_causal: bool
    ) -> Tensor:
        scale = q.shape[-1] ** -0.5
        additive = (
            None
            if mask is None
            else torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(
                ~mask, float("-inf")
            )
        )  # the kernel takes a mask in the query's dtype
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            # (B, H, T, Dh), (B, H, T) float32
            q,
            k,
            v,
            0.0,
            is_causal,
            attn_mask=additive,
            scale=scale,
        )
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.is_causal, ctx.scale = is_causal, scale
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, mask = ctx.saved_tensors
        # The scores and the probabilities' gradient in float32 GEMMs, as the flash kernel keeps
        # them: rounded to bf16, a score of 30 could be off by 0.06 and its probability by 6%
        # (compiled BERT trained to a loss 0.6 higher so). The three GEMMs that produce the
        # gradients take bf16 operands (p and grad_s rounded once), as FlashAttention-2's do.
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * ctx.scale  # (B, H, T, S)
        T, S = scores.shape[-2:]
        if ctx.is_causal:
            scores = scores.masked_fill(
                ~torch.ones(T, S, dtype=torch.bool, device=q.device).tril(), float("-inf")
            )
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        p = torch.exp(scores - lse.unsqueeze(-1))  # the forward's probabilities
        grad_v = torch.matmul(p.to(v.dtype).transpose(-2, -1), grad)
        grad_p = torch.matmul(grad.float(), v.float().transpose(-2, -1))
        delta = (grad.float() * out.float()).sum(dim=-1, keepdim=True)  # rowsum(p * grad_p)
        grad_s = (p * (grad_p - delta) * ctx.scale).to(q.dtype)
        return (
            torch.matmul(grad_s, k),
            torch.matmul(grad_s.transpose(-2, -1), q),
            grad_v,
            None,
            None,
        )


def padding_mask(key_mask: Optional[Tensor]) -> Optional[Tensor]:
    """A (B, 1, 1, S) SDPA mask from a (B, S) padding mask (1 = real), for cross-attention."""
    return None if key_mask is None else _never_empty(key_mask.bool()[:, None, None, :])


def _never_empty(mask: Tensor) -> Tensor:
    # A query row with no key to attend to (a left pad under a causal mask, an all-padding
    # source) makes softmax return NaN, which then spreads through the backward pass. Such a
    # row is padding itself, so letting it attend everywhere changes no real output.
    return mask | ~mask.any(dim=-1, keepdim=True)


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


# --- layers ------------------------------------------------------------------------------


class Attention(nn.Module):
    """Multi-head attention; keys and values from `x` itself or from encoder `memory`.

    With n_kv_heads < n_heads, each key/value head serves n_heads / n_kv_heads query heads
    (grouped-query attention, Ainslie et al. 2023): the k and v projections, and the decoding
    cache, shrink by that factor. Rotary positions, when given, rotate the queries and keys of
    self-attention only: a cross-attention key is a source position, whose distance from a target
    position means nothing, and the encoder has put its own positions into the memory already."""

    def __init__(
        self, d_model: int, n_heads: int, dropout: float, n_kv_heads: int = 0, bias: bool = True
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = d_model // n_heads
        self.dropout = dropout
        self.q_proj = nn.Linear(d_model, d_model, bias=bias)
        self.k_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(d_model, self.n_kv_heads * self.head_dim, bias=bias)
        self.out_proj = nn.Linear(d_model, d_model, bias=bias)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, Dh)

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        is_causal: bool = False,
        cache: Optional[KV] = None,
        rotary: Optional[tuple[Tensor, Tensor]] = None,
    ) -> Tensor:
        """`mask`: an SDPA mask (True = may attend), or a FlexAttention BlockMask (a document mask on CUDA);
        `rotary`: the (cos, sin) of the queries' positions (`Rotary`), self-attention only."""
        B, T, C = x.shape
        q = self._heads(self.q_proj(x), self.n_heads)  # (B, H, T, Dh)
        if memory is None:
            k = self._heads(self.k_proj(x), self.n_kv_heads)  # (B, Hkv, T, Dh)
            v = self._heads(self.v_proj(x), self.n_kv_heads)  # (B, Hkv, T, Dh)
            if rotary is not None:
                q, k = rotate(q, *rotary), rotate(k, *rotary)  # the cache keeps keys rotated
            if cache is not None:
                k, v = cache.append(k, v)  # (B, Hkv, past + T, Dh)
        elif cache is not None and cache.k is not None:
            k, v = cache.k, cache.v  # the memory is fixed while decoding: project it once
        else:
            k = self._heads(self.k_proj(memory), self.n_kv_heads)  # (B, Hkv, S, Dh)
            v = self._heads(self.v_proj(memory), self.n_kv_heads)  # (B, Hkv, S, Dh)
            if cache is not None:
                cache.k, cache.v = k, v
        if mask is not None and not isinstance(mask, Tensor):
            if self.training and self.dropout > 0:
                raise ValueError(
                    "FlexAttention has no attention dropout: use SDPA's mask when dropout is on"
                )
            y = _flex_attention(q, k, v, mask)  # (B, H, T, Dh)
        else:
            # (B, H, T, Dh)
            y = attention(q, k, v, mask, self.dropout if self.training else 0.0, is_causal)
        return self.out_proj(y.transpose(1, 2).reshape(B, T, C))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d_model, d_ff, bias=bias)
        self.act = make_activation(activation)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class GatedMLP(nn.Module):
    """act(x W) * (x V), projected back by `proj` (Shazeer 2020, "GLU Variants Improve
    Transformer"): SwiGLU (act = SiLU, Llama) or GeGLU (act = GELU, ModernBERT). W and V are one
    layer `fc` of 2 d_ff outputs, W's first, so that they are one GEMM and the keys stay MLP's
    (`mlp.fc`, `mlp.proj`); ModernBERT's `Wi` has this layout, Llama's gate_proj and up_proj are
    its two halves."""

    def __init__(self, d_model: int, d_ff: int, activation: str, bias: bool = True):
        super().__init__()
        self.fc = nn.Linear(d_model, 2 * d_ff, bias=bias)
        self.act = make_activation(activation)
        self.proj = nn.Linear(d_ff, d_model, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        gate, value = self.fc(x).chunk(2, dim=-1)  # (B, T, d_ff) each
        return self.proj(self.act(gate) * value)


class Block(nn.Module):
    """Self-attention and MLP sublayers, each a residual branch with its own norm."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.pre_norm = cfg.norm_position == "pre"
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.kv_heads, cfg.bias)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        if self.pre_norm:
            return x + self.drop(sublayer(norm(x)))
        return norm(x + self.drop(sublayer(x)))

    def residual_projections(self) -> List[nn.Linear]:
        """The layers that write into the residual stream (GPT-2 scales their init)."""
        return [self.attn.out_proj, self.mlp.proj]

    def forward(
        self,
        x: Tensor,
        mask: Optional[Tensor],
        is_causal: bool,
        cache: Optional[LayerCache] = None,
        rotary: Optional[tuple[Tensor, Tensor]] = None,
    ) -> Tensor:
        kv = None if cache is None else cache.self_attn
        x = self.residual(
            x,
            self.attn_norm,
            lambda h: self.attn(h, mask=mask, is_causal=is_causal, cache=kv, rotary=rotary),
        )
        return self.residual(x, self.mlp_norm, self.mlp)


class DecoderBlock(Block):
    """A Block plus cross-attention to the encoder memory, between self-attention and MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.cross_attn_norm = make_norm(cfg)
        self.cross_attn = Attention(cfg.d_model, cfg.n_heads, cfg.dropout, cfg.kv_heads, cfg.bias)

    def residual_projections(self) -> List[nn.Linear]:
        return super().residual_projections() + [self.cross_attn.out_proj]

    def forward(
        self,
        x: Tensor,
        mask: Optional[Tensor],
        is_causal: bool,
        cache: Optional[LayerCache] = None,
        rotary: Optional[tuple[Tensor, Tensor]] = None,
        memory: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
    ) -> Tensor:
        kv = None if cache is None else cache.self_attn
        x = self.residual(
            x,
            self.attn_norm,
            lambda h: self.attn(h, mask=mask, is_causal=is_causal, cache=kv, rotary=rotary),
        )
        cross_kv = None if cache is None else cache.cross_attn  # no rotary: see `Attention`
        x = self.residual(
            x,
            self.cross_attn_norm,
            lambda h: self.cross_attn(h, memory=memory, mask=memory_mask, cache=cross_kv),
        )
        return self.residual(x, self.mlp_norm, self.mlp)


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
    """x (B, H, T, Dh) rotated by its positions' angles: computed in float32, returned in x's dtype."""
    half = x.shape[-1] // 2
    x32 = x.float()
    # each pair turned by 90 degrees
    x_rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + x_rotated * sin).to(x.dtype)


class Embeddings(nn.Module):
    """Token embeddings plus learned or sinusoidal position embeddings; with rotary positions,
    which act inside self-attention (`Rotary`), token embeddings only."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.positions = cfg.positions
        if self.positions == "learned":
            self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model)
        elif self.positions == "sinusoidal":
            # Not a parameter and not saved: a sinusoidal stack has no position keys.
            self.register_buffer(
                "pos_table", sinusoids(cfg.max_seq_len, cfg.d_model), persistent=False
            )
        # Vaswani et al. scale token embeddings by sqrt(d_model), so that the fixed,
        # unit-amplitude sinusoids do not drown them, and in a Seq2Seq whose embeddings are the
        # output projection too (`share_embeddings`), whatever the positions.
        self.scale = (
            math.sqrt(cfg.d_model)
            if self.positions == "sinusoidal" or cfg.share_embeddings
            else 1.0
        )

    def forward(self, input_ids: Tensor, positions: Tensor) -> Tensor:
        tok = self.tok(input_ids) * self.scale  # (B, T, C)
        if self.positions == "rope":
            return tok
        # DeepSpeed's bf16/fp16 casts parameters, not buffers: the sinusoid table stays fp32
        # and takes the dtype of the embeddings here.
        if self.positions == "learned":
            pos = self.pos(positions)  # (B or 1, T, C)
        else:
            pos = self.pos_table[positions].to(tok.dtype)  # (B or 1, T, C)
        return tok + pos  # (B, T, C)


def init_weights(module: nn.Module, std: float) -> None:
    """GPT-2 / BERT initialisation: normal(0, std) weights, zero biases, unit norms."""
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=std)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        nn.init.ones_(module.weight)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)


def attention_kernels(model: nn.Module) -> list[str]:
    """What the stacks of `model` ran their self-attention on in their last forward."""
    return sorted(
        {
            m.attention_kernel
            for m in model.modules()
            if isinstance(m, Transformer) and m.attention_kernel
        }
    )


class Transformer(nn.Module):
    """A stack: embeddings, blocks and one norm; returns hidden states (B, T, C).

    `norm` sits where the blocks' own norms leave the stream unnormalised: after the last
    block in pre-LN (GPT-2's ln_f), after the embeddings in post-LN (BERT's embedding
    LayerNorm). Either way the key is `norm`, so a stack's keys do not depend on the choice.
    """

    def __init__(self, cfg: ModelConfig, causal: bool, cross_attention: bool = False):
        super().__init__()
        self.cfg = cfg
        self.causal = causal
        self.cross_attention = cross_attention
        self.pre_norm = cfg.norm_position == "pre"
        self.embed = Embeddings(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        block = DecoderBlock if cross_attention else Block
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        # Rotary positions: one (cos, sin) table for every block's self-attention.
        self.rotary = (
            Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
            if cfg.positions == "rope"
            else None
        )
        # The kernel of document masks: "auto" (FlexAttention where it can run, see the module
        # doc), "sdpa" or "flex_attention" (eager on the CPU: for tests). Not a parameter.
        self.document_attention = "auto"
        # What the last forward's self-attention ran: "sdpa", or "<kernel> (document mask)".
        self.attention_kernel = ""
        self.apply(lambda m: init_weights(m, cfg.init_std))
        if self.embed.scale != 1.0:
            # Lookups scaled by sqrt(d_model) start from std d_model^-0.5, as tensor2tensor and
            # fairseq initialise the paper's embeddings: a scaled lookup then has unit variance
            # and, shared, the output projection gives unit-scale logits. From init_std (0.02)
            # the lookups would start 16x larger than the rest (d_model 256) and Adam's steps
            # would move them 3x faster relative to their size.
            nn.init.normal_(self.embed.tok.weight, mean=0.0, std=cfg.d_model**-0.5)
        if self.pre_norm:
            # GPT-2: each residual branch adds variance to a stream that is never
            # renormalised, so scale their output layers by 1/sqrt(number of branches).
            projections = [p for b in self.blocks for p in b.residual_projections()]
            for proj in projections:
                nn.init.normal_(
                    proj.weight, mean=0.0, std=cfg.init_std / math.sqrt(len(projections))
                )

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        *,
        memory: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        document_ids: Optional[Tensor] = None,
    ) -> Tensor:
        """input_ids (B, T); attention_mask (B, past + T), 1 = real token, covering cached
        positions too; memory (B, S, C) and memory_mask (B, S) for cross-attention;
        document_ids (B, T), the document of each token of a packed block (contiguous runs of
        one id per row): each token attends within its document only, positions from its start."""
        if (memory is not None) != self.cross_attention:
            raise ValueError(
                "encoder memory is required by, and only by, a stack with cross-attention"
            )
        B, T = input_ids.shape
        past = 0 if cache is None else cache.length
        if past + T > self.cfg.max_seq_len:
            raise ValueError(f"{past + T} positions exceed max_seq_len={self.cfg.max_seq_len}")
        if attention_mask is not None and attention_mask.shape != (B, past + T):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected {(B, past + T)}"
            )
        if document_ids is not None:
            if cache is not None:
                raise ValueError(
                    "document_ids mark the documents of whole packed blocks; decoding takes none"
                )
            if document_ids.shape != (B, T):
                raise ValueError(
                    f"document_ids has shape {tuple(document_ids.shape)}, expected {(B, T)}"
                )

        if (
            attention_mask is not None
            and attention_mask.device.type == "cpu"
            and not torch.compiler.is_compiling()
            and bool(attention_mask.all())
        ):
            # Nothing is padded: without an explicit mask SDPA takes its fused causal path,
            # and positions are the plain arange either way. Asked of a mask on the host only,
            # where it costs no device sync; the trainer drops an all-ones mask before moving
            # a batch (`launch.tasks.Task.to_device`).
            attention_mask = None
        if document_ids is None:
            # (1 or B, T)
            positions = positions_from_mask(attention_mask, past, T, input_ids.device)
        else:
            positions = positions_in_documents(document_ids)  # (B, T)
        x = self.embed(input_ids, positions)  # (B, T, C)
        rotary = None if self.rotary is None else self.rotary(positions)  # (1 or B, 1, T, Dh) each
        if not self.pre_norm:
            x = self.norm(x)
        x = self.drop(x)
        if document_ids is None:
            mask, is_causal = self_attention_mask(
                attention_mask, T, past + T, self.causal, x.device
            )
            self.attention_kernel = "sdpa"
        else:
            kernel = self._document_kernel(x.device)
            make_mask = (
                document_block_mask if kernel == "flex_attention" else document_attention_mask
            )
            mask, is_causal = make_mask(document_ids, attention_mask, self.causal), False
            self.attention_kernel = f"{kernel} (document mask)"
        cross = (memory, padding_mask(memory_mask)) if self.cross_attention else ()
        for i, block in enumerate(self.blocks):
            layer_cache = None if cache is None else cache.layers[i]
            if self.cfg.activation_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(
                    block, x, mask, is_causal, layer_cache, rotary, *cross, use_reentrant=False
                )
            else:
                x = block(x, mask, is_causal, layer_cache, rotary, *cross)
        return self.norm(x) if self.pre_norm else x  # (B, T, C)

    def _document_kernel(self, device: torch.device) -> str:
        if self.document_attention not in ("auto", "sdpa", "flex_attention"):
            raise ValueError(
                f"document_attention={self.document_attention!r}: expected auto, sdpa or flex_attention"
            )
        head_dim = self.cfg.d_model // self.cfg.n_heads
        if (
            self.document_attention == "flex_attention"
            and device.type == "cuda"
            and head_dim < FLEX_MIN_HEAD_DIM
        ):
            raise ValueError(
                f"document_attention=flex_attention: heads of {head_dim} dimensions (d_model / n_heads); "
                f"FlexAttention's CUDA kernel takes at least {FLEX_MIN_HEAD_DIM}"
            )
        if self.document_attention != "auto":
            return self.document_attention
        dropout_active = self.training and self.cfg.dropout > 0
        fits = head_dim >= FLEX_MIN_HEAD_DIM and flex_attention_available()
        return "flex_attention" if device.type == "cuda" and not dropout_active and fits else "sdpa"
