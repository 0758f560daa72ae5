"""Training FLOPs of GPT, BERT and Seq2Seq, for model FLOPs utilisation (MFU).

The design and its reasons: docs/design.md#modelflopspy.
"""

from __future__ import annotations

from model.config import GATED_ACTIVATIONS, ModelConfig


def _block_params(cfg: ModelConfig, layer: int = 0) -> int:
    """A block's matmul weights a token goes through: attention (`_attention_params`) and the
    MLP; in a mixture of experts the router, its top_k experts and the shared expert."""
    if cfg.is_moe_layer(layer):
        moe = cfg.moe
        experts = moe.top_k * 3 * cfg.d_model * cfg.expert_d_ff
        return _attention_params(cfg) + cfg.d_model * (moe.experts + 3 * moe.shared_d_ff) + experts
    mlp_matrices = 3 if cfg.activation in GATED_ACTIVATIONS else 2
    return _attention_params(cfg) + mlp_matrices * cfg.d_model * cfg.d_ff


def inactive_params(cfg: ModelConfig) -> int:
    """The experts' weights a token does not go through: experts - top_k of every MoE layer."""
    moe_layers = sum(cfg.is_moe_layer(i) for i in range(cfg.n_layers))
    return moe_layers * (cfg.moe.experts - cfg.moe.top_k) * 3 * cfg.d_model * cfg.expert_d_ff


def _attention_params(cfg: ModelConfig) -> int:
    """q and out (d x d_q each, d_q = n_heads x head dims, d unless head_dim is set), k and v
    (d x d_kv each)."""
    return 2 * cfg.d_model * cfg.attention_width + 2 * cfg.d_model * _kv_dim(cfg)


def _kv_dim(cfg: ModelConfig) -> int:
    return cfg.kv_heads * cfg.head_size


def matmul_params(cfg: ModelConfig) -> int:
    """All weights that take part in matmuls (N of 6N for GPT and BERT); see
    docs/design.md#modelflopspy."""
    head = cfg.d_model * cfg.vocab_size
    if cfg.arch == "gpt":
        return sum(_block_params(cfg, i) for i in range(cfg.n_layers)) + head
    if cfg.arch == "bert":
        return cfg.n_layers * _block_params(cfg) + cfg.d_model**2 + head
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    return (
        enc.n_layers * _block_params(enc)
        + dec.n_layers * (_block_params(dec) + _attention_params(dec))
        + head
    )


def training_flops(
    cfg: ModelConfig, seq_len: int, tgt_len: int = 0, scored: float | None = None
) -> float:
    """Forward + backward FLOPs of one sequence of seq_len tokens (Seq2Seq: one pair with a
    source of seq_len and a target of tgt_len tokens); for BERT, `scored` is the number of
    masked positions the head runs on (default: all seq_len)."""
    d = cfg.d_model
    if cfg.arch in ("gpt", "bert"):
        T, L = seq_len, cfg.n_layers
        if cfg.arch == "bert" and scored is not None:
            head = d * d + d * cfg.vocab_size
            return (
                6 * (matmul_params(cfg) - head) * T
                + 6 * head * scored
                + 12 * L * T * T * cfg.attention_width
            )
        d_q = cfg.attention_width  # the scores and their weighted sum run at this width
        return 6 * matmul_params(cfg) * T + 12 * L * T * T * d_q
    S, T = seq_len, tgt_len
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    encoder = (
        6 * enc.n_layers * _block_params(enc) * S + 12 * enc.n_layers * S * S * enc.attention_width
    )
    # cross: q, out
    per_target_token = (
        dec.n_layers * (_block_params(dec) + 2 * d * dec.attention_width) + d * dec.vocab_size
    )
    memory_kv = dec.n_layers * 2 * d * _kv_dim(dec) * S  # cross: k, v of the memory
    attention = 12 * dec.n_layers * (T + S) * T * dec.attention_width
    return encoder + 6 * per_target_token * T + 6 * memory_kv + attention


def flops_per_token(cfg: ModelConfig, seq_len: int, tgt_len: int = 0) -> float:
    """`training_flops` divided by the tokens of the sequence (Seq2Seq: seq_len + tgt_len)."""
    return training_flops(cfg, seq_len, tgt_len) / (
        seq_len + (tgt_len if cfg.arch == "seq2seq" else 0)
    )


def llmc_flops_per_token(cfg: ModelConfig, n_parameters: int, seq_len: int) -> float:
    """llm.c's training FLOPs per token of a T-token sequence: 6 N + 6 L d T, N all parameters
    (docs/design.md#modelflopspy), but for a mixture of experts the experts a token does not go
    through; NaN for Seq2Seq, which it does not cover."""
    if cfg.arch == "seq2seq":
        return float("nan")
    active = n_parameters - inactive_params(cfg)
    return 6.0 * active + 6.0 * cfg.n_layers * cfg.d_model * seq_len
