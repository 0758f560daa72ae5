"""Attention: SDPA masks (padding, causal, documents), the kernels (SDPA, FlexAttention for
document masks on CUDA, a recomputed-softmax path for compiled bf16 on a CPU) and the
multi-head attention layer with grouped key/value heads (the design:
docs/design.md#modelblockspy)."""

from __future__ import annotations

import functools
import importlib.util
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KV
from model.positions import rotate


def self_attention_mask(
    key_mask: Optional[Tensor],
    q_len: int,
    k_len: int,
    causal: bool,
    device: torch.device,
    window: int = 0,
) -> tuple[Optional[Tensor], bool]:
    """The (attn_mask, is_causal) pair for SDPA, True = may attend.

    `key_mask` (B, k_len) is 1 for real tokens, 0 for padding; the last `q_len` keys are the
    queries' own positions (the rest are cached). `window` > 0 (causal only): a query sees its
    own key and the window - 1 before it, no earlier one. Returns None with is_causal=True when
    SDPA's built-in causal mask is exact, because fused kernels run fastest without an explicit
    mask.
    """
    windowed = causal and 0 < window < k_len
    if key_mask is None and not windowed:
        if not causal or q_len == 1:
            return None, False
        if q_len == k_len:
            return None, True
    mask = None
    if causal:
        # Bottom-right aligned: query i sits at key position k_len - q_len + i.
        # (T, S)
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril(k_len - q_len)
        if windowed:
            mask = mask.triu(k_len - q_len - window + 1)
    if key_mask is not None:
        keys = key_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        mask = keys if mask is None else keys & mask  # (B, 1, T, S)
    return _never_empty(mask), False


def document_attention_mask(
    document_ids: Tensor, key_mask: Optional[Tensor], causal: bool, window: int = 0
) -> Tensor:
    """The (B, 1, T, T) SDPA mask, True = may attend, that keeps each token within its document.

    `document_ids` (B, T) numbers the documents of each row (contiguous runs of one id);
    `key_mask` (B, T) is 1 for real tokens, 0 for padding. Causal: a token also sees no later one,
    and with `window` > 0 none more than window - 1 before it.
    """
    mask = document_ids[:, :, None] == document_ids[:, None, :]  # (B, T, T)
    if causal:
        T = document_ids.shape[1]
        lower = torch.ones(T, T, dtype=torch.bool, device=document_ids.device).tril()
        if 0 < window < T:
            lower = lower.triu(1 - window)
        mask = mask & lower
    if key_mask is not None:
        mask = mask & key_mask.bool()[:, None, :]
    return _never_empty(mask[:, None])  # (B, 1, T, T)


def document_block_mask(
    document_ids: Tensor, key_mask: Optional[Tensor], causal: bool, window: int = 0
) -> Any:
    """`document_attention_mask` as a FlexAttention BlockMask: the same rule, evaluated per
    (query, key) pair, from which FlexAttention learns which blocks of the score
    matrix it may skip."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = document_ids.shape
    keys = None if key_mask is None else key_mask.bool()

    def may_attend(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
        allowed = document_ids[b, q] == document_ids[b, kv]
        if causal:
            allowed = allowed & (q >= kv)
            if window > 0:
                allowed = allowed & (q - kv < window)
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
    """Keys and values (B, Hkv, S, Dh) repeated to (B, H, S, Dh): query head h reads
    head h // (H / Hkv)."""
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
    inside a compiled graph (`compile: true`), without dropout, at up to RECOMPUTE_MAX_KEYS keys.
    There SDPA's CPU flash kernel runs its backward pass at a small fraction of the bf16 GEMM rate
    (at 128 keys, 10 ms for a layer whose forward takes 0.7 ms), and `_RecomputedAttention` keeps
    the flash forward but recomputes the probabilities in backward with batched GEMMs (float32 for
    the scores and their gradient, bf16 for the three that produce q, k and v's gradients) and
    float32 element-wise work, which inductor fuses. Like the flash kernel it saves no (T x S)
    matrix; the backward holds one for each layer in turn."""
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


class Attention(nn.Module):
    """Multi-head attention; keys and values from `x` itself or from encoder `memory`.

    With n_kv_heads < n_heads, each key/value head serves n_heads / n_kv_heads query heads
    (grouped-query attention, Ainslie et al. 2023): the k and v projections, and the decoding
    cache, shrink by that factor. Rotary positions, when given, rotate the queries and keys of
    self-attention only: a cross-attention key is a source position, whose distance from a target
    position means nothing, and the encoder has put its own positions into the memory already.

    `head_dim` (0: d_model / n_heads) sets each head's width apart from d_model, as Qwen3 and
    Mistral do; `qkv_bias` gives q, k and v biases where `bias` gives none (Qwen2.5); `qk_norm`
    RMS-normalises queries and keys before their rotation, per head ("head", Qwen3) or over a
    projection's whole output ("projection", OLMo 2), against logits that grow without bound."""

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        dropout: float,
        n_kv_heads: int = 0,
        bias: bool = True,
        *,
        head_dim: int = 0,
        qkv_bias: bool = False,
        qk_norm: str = "none",
        eps: float = 1e-6,
    ):
        super().__init__()
        self.n_heads = n_heads
        self.n_kv_heads = n_kv_heads or n_heads
        self.head_dim = head_dim or d_model // n_heads
        self.dropout = dropout
        width, kv_width = n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d_model, width, bias=bias or qkv_bias)
        self.k_proj = nn.Linear(d_model, kv_width, bias=bias or qkv_bias)
        self.v_proj = nn.Linear(d_model, kv_width, bias=bias or qkv_bias)
        self.out_proj = nn.Linear(width, d_model, bias=bias)
        self.qk_norm = qk_norm
        if qk_norm != "none":
            sizes = (self.head_dim,) * 2 if qk_norm == "head" else (width, kv_width)
            self.q_norm = nn.RMSNorm(sizes[0], eps=eps)
            self.k_norm = nn.RMSNorm(sizes[1], eps=eps)

    def _heads(self, x: Tensor, n: int) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, n, self.head_dim).transpose(1, 2)  # (B, n, T, Dh)

    def _normed_heads(self, x: Tensor, proj: nn.Linear, norm: str, n: int) -> Tensor:
        """x projected into n heads (B, n, T, Dh), with the query/key norm `norm` ("q_norm",
        "k_norm") over the whole projection or over each head, as `qk_norm` says."""
        y = proj(x)  # (B, T, n * Dh)
        if self.qk_norm == "projection":
            y = getattr(self, norm)(y)
        y = self._heads(y, n)
        return getattr(self, norm)(y) if self.qk_norm == "head" else y

    def forward(
        self,
        x: Tensor,
        memory: Optional[Tensor] = None,
        mask: Optional[Tensor] = None,
        is_causal: bool = False,
        cache: Optional[KV] = None,
        rotary: Optional[tuple[Tensor, Tensor]] = None,
    ) -> Tensor:
        """`mask`: an SDPA mask (True = may attend), or a FlexAttention BlockMask (a document
        mask on CUDA); `rotary`: the (cos, sin) of the queries' positions (`Rotary`),
        self-attention only."""
        B, T, _ = x.shape
        q = self._normed_heads(x, self.q_proj, "q_norm", self.n_heads)  # (B, H, T, Dh)
        if memory is None:
            k = self._normed_heads(x, self.k_proj, "k_norm", self.n_kv_heads)  # (B, Hkv, T, Dh)
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
        return self.out_proj(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, C)
