"""Configuration schema of the three networks (GPT, BERT, Seq2Seq) and its validation.

`ModelConfig` is an OmegaConf structured config (plain str/int/float/bool fields, nested
dataclasses, Optional), embedded as `model:` in the trainer's YAML. One config describes one
stack of blocks; a Seq2Seq has two stacks, and its `encoder` / `decoder` sub-configs override
the shared fields per stack, so that an encoder taken from a post-LN BERT and a decoder taken
from a pre-LN GPT (Rothe et al. 2020) fit one config. `for_stack` resolves them into the
flat config each stack is built from.

This module itself imports only the standard library (the `model` package around it loads torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

ARCHS = ("gpt", "bert", "seq2seq")
# The gated ones (Shazeer 2020, "GLU Variants Improve Transformer"): act(x W) * (x V), then W2.
GATED_ACTIVATIONS = ("swiglu", "geglu")
ACTIVATIONS = ("gelu", "gelu_tanh", "relu") + GATED_ACTIVATIONS
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("pre", "post", "post_branch")
# Query/key norms: none, RMSNorm over each head's dims (Qwen3), or over each projection's whole
# output, all heads at once (OLMo 2).
QK_NORMS = ("none", "head", "projection")
POSITIONS = ("learned", "sinusoidal", "rope")
STACKS = ("encoder", "decoder")
# The Hugging Face decoder families a GPT exports as (`model.hf_decoders`); "": the one its
# options call for.
FAMILIES = ("", "llama", "qwen2", "qwen3", "mistral", "olmo2", "olmoe", "qwen3_moe", "mixtral")
# How a router scores the experts: a softmax over them (Mixtral, OLMoE, Qwen3-MoE) or a sigmoid
# each (DeepSeek-V3).
ROUTER_SCORES = ("softmax", "sigmoid")
# A gated MLP's default width is rounded up to a multiple of this (Llama's `multiple_of`).
GATED_D_FF_MULTIPLE = 256


def default_d_ff(d_model: int, activation: str) -> int:
    """The MLP width that d_ff=0 stands for: 4 * d_model; for a gated activation 2/3 of that,
    rounded up to a multiple of 256, as Llama sizes it (Touvron et al. 2023), so that its three
    matrices hold about the weights of the two ungated ones (d_model 4096: 11008)."""
    if activation in GATED_ACTIVATIONS:
        return -(-(8 * d_model // 3) // GATED_D_FF_MULTIPLE) * GATED_D_FF_MULTIPLE
    return 4 * d_model


@dataclass
class MoEConfig:
    """A mixture of experts in place of the MLP (arch=gpt, a gated activation): a router sends
    each token to top_k of `experts` gated MLPs and sums their outputs weighted by its scores
    (`model.moe`)."""

    experts: int = 0  # gated MLPs per MoE layer; 0: a dense MLP in every layer
    top_k: int = 2  # experts each token goes to
    # layers i with (i + 1) % every == 0 are MoE, the others dense (Qwen3-MoE's
    # decoder_sparse_step); 1: every layer
    every: int = 1
    d_ff: int = 0  # each expert's hidden width; 0: model.d_ff
    score: str = "softmax"  # softmax | sigmoid: the router's scores of the experts
    # the top_k scores rescaled to sum to 1 (Mixtral, Qwen3-MoE); false: as scored (OLMoE)
    normalize_top_k: bool = True
    # a shared expert of this width that every token also goes through (DeepSeek); 0: none
    shared_d_ff: int = 0
    # 0: dropless (every token reaches its top_k experts). Otherwise an expert takes at most
    # ceil(capacity_factor x tokens x top_k / experts) of a micro batch's tokens, first choices
    # first; a token past that is dropped by that expert (its residual stream passes it on).
    capacity_factor: float = 0.0
    # weight of the load-balancing loss (Switch Transformer: experts x sum over experts of the
    # fraction of tokens sent there x the mean router probability there), added to the loss
    aux_loss_coef: float = 0.01
    # weight of the router z-loss (ST-MoE: the mean squared logsumexp of the router's logits)
    z_loss_coef: float = 0.0


@dataclass
class StackConfig:
    """Per-stack overrides of a Seq2Seq's encoder or decoder; None keeps the shared value."""

    n_heads: Optional[int] = None  # None: the shared n_heads
    d_ff: Optional[int] = None  # None: the shared d_ff
    activation: Optional[str] = None  # None: the shared activation
    norm_position: Optional[str] = None  # None: the shared norm_position
    positions: Optional[str] = None  # None: the shared positions
    layer_norm_eps: Optional[float] = None  # None: the shared layer_norm_eps
    n_kv_heads: Optional[int] = None  # None: the shared n_kv_heads
    norm: Optional[str] = None  # None: the shared norm
    rope_theta: Optional[float] = None  # None: the shared rope_theta
    # A stack's own vocabulary and special ids, for a translation whose sides have tokenizers of
    # their own (a BERT encoder's WordPiece, a GPT-2 decoder's BPE); set from the dataset's
    # tokenizers by the trainer. None: the shared ones.
    vocab_size: Optional[int] = None
    pad_id: Optional[int] = None
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    mask_id: Optional[int] = None


# The fields that change how a network trains, not the network its weights define. Every other
# field decides the parameters' names and shapes or what they compute, so a resumed run may
# change these alone (`launch.train` refuses the others before loading).
TRAINING_ONLY_FIELDS = ("dropout", "label_smoothing", "activation_checkpointing", "init_std")


@dataclass
class ModelConfig:
    arch: str = "gpt"  # gpt | bert | seq2seq
    vocab_size: int = 8000  # must match the tokenizer; 0: launch.train takes it from the dataset
    d_model: int = 512  # width of the residual stream
    n_layers: int = 6  # seq2seq: encoder layers
    n_decoder_layers: int = 0  # seq2seq only; 0 = n_layers
    n_heads: int = 8  # attention heads; must divide d_model
    # Key/value heads, each shared by n_heads / n_kv_heads query heads (grouped-query attention,
    # Ainslie et al. 2023); 0 = n_heads (multi-head attention). Must divide n_heads.
    n_kv_heads: int = 0
    # Dimensions of each attention head; 0 = d_model / n_heads. Qwen3 and Mistral set it apart:
    # queries are then n_heads * head_dim wide, whatever d_model.
    head_dim: int = 0
    # MLP width; 0 = 4 * d_model, or for swiglu/geglu 2/3 of that rounded up to a multiple of 256
    # (Llama's rule; filled in when the config is made)
    d_ff: int = 0
    max_seq_len: int = 512  # positions the model has (and the longest input it takes)
    dropout: float = 0.1  # embeddings, attention probabilities and residual branches
    # gelu | gelu_tanh (GPT-2's gelu_new) | relu | swiglu | geglu: the last two gated, silu(x W) *
    # (x V)
    # and gelu(x W) * (x V) (Shazeer 2020), as in Llama and ModernBERT
    activation: str = "gelu"
    # pre: x + f(norm(x)) with a final norm after the last block (GPT-2);
    # post: norm(x + f(x)) with a norm after the embeddings instead (BERT, Vaswani et al.);
    # post_branch: x + norm(f(x)), the norm on each branch's output, a final norm as pre's (OLMo 2).
    # pre and post_branch stacks also get GPT-2's 1/sqrt(number of residual branches) scaling of the
    # residual projections at init: post-LN renormalises every branch, so BERT has none.
    norm_position: str = "pre"
    # layernorm | rmsnorm (Zhang & Sennrich 2019, as in Llama): every norm of the model
    norm: str = "layernorm"
    # learned | sinusoidal (added to the token embeddings) | rope (rotary: queries and keys of
    # self-attention rotated by their position, Su et al. 2021)
    positions: str = "learned"
    rope_theta: float = 10000.0  # rope only: the base of the rotary frequencies
    layer_norm_eps: float = 1e-5  # the norms' epsilon (LayerNorm or RMSNorm)
    # biases in the linear layers and LayerNorms; false: none anywhere (Llama, ModernBERT)
    bias: bool = True
    # biases on the query, key and value projections even where bias is false (Qwen2.5)
    qkv_bias: bool = False
    # none | head (RMSNorm over each head's queries and keys, Qwen3) | projection (over the
    # whole query and key projections, OLMo 2); before rotary positions, eps layer_norm_eps
    qk_norm: str = "none"
    # Causal self-attention sees the last sliding_window keys only, its own included (Mistral);
    # 0: all of them. Applies with document masks and in generation with the cache alike.
    sliding_window: int = 0
    # The Hugging Face class a format=hf export writes: llama | qwen2 | qwen3 | mistral | olmo2,
    # set by init.model from such a directory; "": the one the options call for. Computes nothing.
    family: str = ""
    moe: MoEConfig = field(default_factory=MoEConfig)  # arch=gpt only
    # recompute each block in the backward pass to save memory
    activation_checkpointing: bool = False
    label_smoothing: float = 0.1  # seq2seq only
    # seq2seq only: the source embedding, target embedding and output projection are one
    # matrix over the shared vocabulary, and token embeddings are scaled by sqrt(d_model)
    # (Vaswani et al. 2017, section 3.4; with learned positions too).
    share_embeddings: bool = False
    # The output layer (GPT's and the decoder's LM head, BERT's MLM decoder) is the token
    # embedding matrix (Press & Wolf 2017); false: a matrix of its own (Llama 2's untied head).
    tie_embeddings: bool = True
    init_std: float = 0.02  # std of the normal initialisation of the weights
    # The special ids of the dataset's tokenizer, set from it by the trainer (the defaults are
    # those of the project's SentencePiece layout): padding (masked out wherever it is read), a
    # decoder's first token, the end of a text, and MLM's mask (-1: the tokenizer has none).
    pad_id: int = 0
    bos_id: int = 2
    eos_id: int = 3
    mask_id: int = 4
    encoder: StackConfig = field(default_factory=StackConfig)  # seq2seq only
    decoder: StackConfig = field(default_factory=StackConfig)  # seq2seq only

    def __post_init__(self):
        # One name, one meaning: after construction d_ff is the MLP's width, never the 0 shorthand.
        if self.d_ff == 0:
            self.d_ff = default_d_ff(self.d_model, self.activation)
            # A Seq2Seq stack with an activation of its own gets its own width by the same rule.
            for stack in (self.encoder, self.decoder):
                if (
                    isinstance(stack, StackConfig)
                    and stack.d_ff is None
                    and stack.activation is not None
                ):
                    stack.d_ff = default_d_ff(self.d_model, stack.activation)

    @property
    def kv_heads(self) -> int:
        """The number of key/value heads: n_kv_heads, or n_heads where that is 0."""
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        """Each attention head's dimensions: head_dim, or d_model / n_heads where that is 0."""
        return self.head_dim or self.d_model // self.n_heads

    @property
    def attention_width(self) -> int:
        """The query projection's outputs (and the output projection's inputs): n_heads heads."""
        return self.n_heads * self.head_size

    def is_moe_layer(self, layer: int) -> bool:
        """Whether block `layer` (from 0) has a mixture of experts in place of its MLP."""
        return self.moe.experts > 0 and (layer + 1) % self.moe.every == 0

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden width: moe.d_ff, or d_ff where that is 0."""
        return self.moe.d_ff or self.d_ff

    def for_stack(self, stack: str) -> "ModelConfig":
        """The flat config of a Seq2Seq's `encoder` or `decoder` stack, overrides applied
        (arch stays "seq2seq"; the stack's own overrides are cleared)."""
        if stack not in STACKS:
            raise ValueError(f"stack must be one of {STACKS}, got {stack!r}")
        overrides = {
            k: v for k, v in dataclasses.asdict(getattr(self, stack)).items() if v is not None
        }
        if stack == "decoder":
            overrides["n_layers"] = self.n_decoder_layers or self.n_layers
        return dataclasses.replace(
            self, **overrides, n_decoder_layers=0, encoder=StackConfig(), decoder=StackConfig()
        )

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first bad field; returns self for chaining."""
        _check(self.arch in ARCHS, f"arch={self.arch!r}: expected one of {ARCHS}")
        for name in ("vocab_size", "d_model", "n_layers", "max_seq_len"):
            _check(getattr(self, name) > 0, f"{name}={getattr(self, name)}: must be positive")
        _check(
            self.n_decoder_layers >= 0, f"n_decoder_layers={self.n_decoder_layers}: must be >= 0"
        )
        _check(0.0 <= self.dropout < 1.0, f"dropout={self.dropout}: must be in [0, 1)")
        _check(
            0.0 <= self.label_smoothing < 1.0,
            f"label_smoothing={self.label_smoothing}: must be in [0, 1)",
        )
        _check(self.init_std > 0, f"init_std={self.init_std}: must be positive")
        _check_ids(self, "")
        _check(
            self.tie_embeddings or not self.share_embeddings,
            "share_embeddings=True makes the output layer the shared embedding: "
            "it needs tie_embeddings=True",
        )
        if self.arch == "seq2seq":
            for stack in STACKS:
                _check_stack(self.for_stack(stack), self, stack)
                _check_ids(self.for_stack(stack), stack)
            vocabs = {self.for_stack(stack).vocab_size for stack in STACKS}
            _check(
                not self.share_embeddings or len(vocabs) == 1,
                "share_embeddings=True needs one vocabulary; encoder and "
                f"decoder have {sorted(vocabs)}",
            )
        else:
            _check(
                not self.share_embeddings,
                "share_embeddings=True: only arch=seq2seq has two embeddings to share",
            )
            _check(
                self.n_decoder_layers == 0,
                f"n_decoder_layers={self.n_decoder_layers}: only arch=seq2seq has a decoder",
            )
            for stack in STACKS:
                for name, value in dataclasses.asdict(getattr(self, stack)).items():
                    _check(
                        value is None,
                        f"{stack}.{name}={value!r}: per-stack overrides only apply to arch=seq2seq",
                    )
            _check_stack(self, self, "")
        return self


def _check_stack(cfg: ModelConfig, parent: ModelConfig, stack: str) -> None:
    """Check one stack's resolved fields; a message names `stack.field` when it was overridden."""

    def named(name: str) -> str:
        overridden = stack and getattr(getattr(parent, stack), name) is not None
        return (
            f"{stack}.{name}={getattr(cfg, name)!r}"
            if overridden
            else f"{name}={getattr(cfg, name)!r}"
        )

    _check(cfg.n_heads > 0, f"{named('n_heads')}: must be positive")
    _check(cfg.head_dim >= 0, f"head_dim={cfg.head_dim}: must be >= 0 (0 = d_model / n_heads)")
    _check(
        cfg.head_dim > 0 or cfg.d_model % cfg.n_heads == 0,
        f"d_model={cfg.d_model} is not divisible by {named('n_heads')}",
    )
    _check(
        cfg.d_ff > 0, f"{named('d_ff')}: must be positive (0 in a config file means 4 * d_model)"
    )
    _check(cfg.activation in ACTIVATIONS, f"{named('activation')}: expected one of {ACTIVATIONS}")
    _check(
        cfg.norm_position in NORM_POSITIONS,
        f"{named('norm_position')}: expected one of {NORM_POSITIONS}",
    )
    _check(cfg.positions in POSITIONS, f"{named('positions')}: expected one of {POSITIONS}")
    _check(cfg.n_kv_heads >= 0, f"{named('n_kv_heads')}: must be >= 0 (0 = n_heads)")
    _check(
        cfg.n_heads % cfg.kv_heads == 0, f"{named('n_kv_heads')} does not divide {named('n_heads')}"
    )
    _check(cfg.norm in NORMS, f"{named('norm')}: expected one of {NORMS}")
    _check(cfg.layer_norm_eps > 0, f"{named('layer_norm_eps')}: must be positive")
    _check(cfg.qk_norm in QK_NORMS, f"qk_norm={cfg.qk_norm!r}: expected one of {QK_NORMS}")
    _check(cfg.sliding_window >= 0, f"sliding_window={cfg.sliding_window}: must be >= 0")
    _check(
        cfg.sliding_window == 0 or cfg.arch == "gpt",
        f"sliding_window={cfg.sliding_window}: only a causal arch=gpt model has one",
    )
    _check(cfg.family in FAMILIES, f"family={cfg.family!r}: expected one of {FAMILIES[1:]} or ''")
    _check(
        cfg.family == "" or cfg.arch == "gpt",
        f"family={cfg.family!r}: only arch=gpt models are of a decoder family",
    )
    _check(
        cfg.norm_position != "post_branch" or cfg.arch == "gpt",
        "norm_position='post_branch': only arch=gpt takes it",
    )
    _check_moe(cfg)
    if cfg.positions == "sinusoidal":
        _check(
            cfg.d_model % 2 == 0,
            f"d_model={cfg.d_model}: sinusoidal positions need an even d_model",
        )
    if cfg.positions == "rope":
        _check(
            cfg.head_size % 2 == 0,
            f"d_model={cfg.d_model} / {named('n_heads')}: heads of {cfg.head_size} "
            "dimensions; rotary positions turn pairs of them, so the number must be even",
        )
        _check(cfg.rope_theta > 0, f"{named('rope_theta')}: must be positive")


def _check_ids(cfg: ModelConfig, stack: str) -> None:
    """The vocabulary size and special ids of the model, or of one Seq2Seq stack (`stack`)."""
    prefix = f"{stack}." if stack else ""
    _check(cfg.vocab_size > 0, f"{prefix}vocab_size={cfg.vocab_size}: must be positive")
    for name in ("pad_id", "bos_id", "eos_id", "mask_id"):
        value = getattr(cfg, name)
        _check(
            0 <= value < cfg.vocab_size or (name == "mask_id" and value == -1),
            f"{prefix}{name}={value}: outside the vocabulary [0, {cfg.vocab_size})",
        )


def _check_moe(cfg: ModelConfig) -> None:
    moe = cfg.moe
    _check(moe.experts >= 0, f"moe.experts={moe.experts}: must be >= 0 (0 = dense)")
    if not moe.experts:
        return
    _check(cfg.arch == "gpt", f"moe.experts={moe.experts}: only arch=gpt has MoE layers")
    _check(
        cfg.activation in GATED_ACTIVATIONS,
        f"moe.experts={moe.experts}: experts are gated MLPs; activation={cfg.activation!r} is not "
        f"one of {GATED_ACTIVATIONS}",
    )
    _check(
        1 <= moe.top_k <= moe.experts,
        f"moe.top_k={moe.top_k}: must be between 1 and moe.experts={moe.experts}",
    )
    _check(moe.every >= 1, f"moe.every={moe.every}: must be >= 1")
    _check(moe.d_ff >= 0, f"moe.d_ff={moe.d_ff}: must be >= 0 (0 = d_ff)")
    _check(moe.shared_d_ff >= 0, f"moe.shared_d_ff={moe.shared_d_ff}: must be >= 0 (0 = none)")
    _check(moe.score in ROUTER_SCORES, f"moe.score={moe.score!r}: expected one of {ROUTER_SCORES}")
    _check(
        moe.capacity_factor >= 0,
        f"moe.capacity_factor={moe.capacity_factor}: must be >= 0 (0 = dropless)",
    )
    for name in ("aux_loss_coef", "z_loss_coef"):
        _check(getattr(moe, name) >= 0, f"moe.{name}={getattr(moe, name)}: must be >= 0")


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"model config: {message}")
