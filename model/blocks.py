"""The one set of blocks that GPT, BERT and Seq2Seq are built from.

The design and its reasons: docs/design.md#modelblockspy.
"""

from __future__ import annotations

import math
from typing import List, NamedTuple, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from model.attention import (
    FLEX_MIN_HEAD_DIM,
    Attention,
    document_attention_mask,
    document_block_mask,
    flex_attention_available,
    padding_mask,
    self_attention_mask,
)
from model.cache import KVCache, LayerCache
from model.config import GATED_ACTIVATIONS, ModelConfig
from model.moe import MoE
from model.positions import Rotary, positions_from_mask, positions_in_documents, sinusoids


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
    # A mixture of experts' routers' auxiliary losses, weighted and summed over the MoE layers
    # (`model.moe`), when labels were given to a model that has some; not in `loss`.
    aux_loss: Optional[Tensor] = None


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


def make_attention(cfg: ModelConfig, self_attention: bool = True) -> Attention:
    """A block's attention layer; query/key norms on self-attention only (`Attention`)."""
    return Attention(
        cfg.d_model,
        cfg.n_heads,
        cfg.dropout,
        cfg.kv_heads,
        cfg.bias,
        head_dim=cfg.head_dim,
        qkv_bias=cfg.qkv_bias,
        qk_norm=cfg.qk_norm if self_attention else "none",
        eps=cfg.layer_norm_eps,
    )


def make_mlp(cfg: ModelConfig, layer: int = 0) -> nn.Module:
    """Block `layer`'s MLP: a mixture of experts where `cfg.is_moe_layer(layer)`."""
    if cfg.is_moe_layer(layer):
        shared = cfg.moe.shared_d_ff
        return MoE(
            cfg,
            make_activation(cfg.activation),
            GatedMLP(cfg.d_model, shared, cfg.activation, bias=False) if shared else None,
        )
    if cfg.activation in GATED_ACTIVATIONS:
        return GatedMLP(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias)
    return MLP(cfg.d_model, cfg.d_ff, cfg.activation, cfg.bias)


# --- layers ------------------------------------------------------------------------------


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
    """Self-attention and MLP sublayers, each a residual branch with its own norm: before the
    sublayer (pre), after the sum (post), or on the sublayer's output (post_branch, OLMo 2)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        self.norm_position = cfg.norm_position
        self.attn_norm = make_norm(cfg)
        self.attn = make_attention(cfg)
        self.mlp_norm = make_norm(cfg)
        self.mlp = make_mlp(cfg, layer)
        self.drop = nn.Dropout(cfg.dropout)

    def residual(self, x: Tensor, norm: nn.Module, sublayer) -> Tensor:
        if self.norm_position == "pre":
            return x + self.drop(sublayer(norm(x)))
        if self.norm_position == "post_branch":
            return x + self.drop(norm(sublayer(x)))
        return norm(x + self.drop(sublayer(x)))

    def residual_projections(self) -> List[nn.Linear]:
        """The layers that write into the residual stream (GPT-2 scales their init); an MoE's
        experts keep theirs."""
        mlp = self.mlp.shared_expert if isinstance(self.mlp, MoE) else self.mlp
        return [self.attn.out_proj] + ([mlp.proj] if mlp is not None else [])

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

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__(cfg, layer)
        self.cross_attn_norm = make_norm(cfg)
        self.cross_attn = make_attention(cfg, self_attention=False)

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


def moe_layers(model: nn.Module) -> list[MoE]:
    """The mixture-of-experts layers of `model`, in block order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


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
        # The stream is never renormalised between blocks (pre, post_branch): one norm at the end.
        self.pre_norm = cfg.norm_position != "post"
        self.embed = Embeddings(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        block = DecoderBlock if cross_attention else Block
        self.blocks = nn.ModuleList(block(cfg, i) for i in range(cfg.n_layers))
        self.norm = make_norm(cfg)
        # Rotary positions: one (cos, sin) table for every block's self-attention.
        self.rotary = (
            Rotary(cfg.head_size, cfg.max_seq_len, cfg.rope_theta)
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
                attention_mask, T, past + T, self.causal, x.device, self.cfg.sliding_window
            )
            self.attention_kernel = "sdpa"
        else:
            kernel = self._document_kernel(x.device)
            make_mask = (
                document_block_mask if kernel == "flex_attention" else document_attention_mask
            )
            mask = make_mask(document_ids, attention_mask, self.causal, self.cfg.sliding_window)
            is_causal = False
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
                f"document_attention={self.document_attention!r}: expected "
                "auto, sdpa or flex_attention"
            )
        head_dim = self.cfg.head_size
        if (
            self.document_attention == "flex_attention"
            and device.type == "cuda"
            and head_dim < FLEX_MIN_HEAD_DIM
        ):
            raise ValueError(
                f"document_attention=flex_attention: heads of {head_dim} dimensions; "
                f"FlexAttention's CUDA kernel takes at least {FLEX_MIN_HEAD_DIM}"
            )
        if self.document_attention != "auto":
            return self.document_attention
        dropout_active = self.training and self.cfg.dropout > 0
        fits = head_dim >= FLEX_MIN_HEAD_DIM and flex_attention_available()
        return "flex_attention" if device.type == "cuda" and not dropout_active and fits else "sdpa"
