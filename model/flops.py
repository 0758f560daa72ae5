"""Training FLOPs of GPT, BERT and Seq2Seq, for model FLOPs utilisation (MFU).

Counts matrix multiplications only, 2 FLOPs per multiply-add, and training = 3 x forward
(the backward pass costs twice the forward), as Kaplan et al. 2020 ("Scaling Laws for Neural
Language Models") and Chowdhery et al. 2022 (PaLM, appendix B) do. For GPT and BERT, per
token of a sequence of T tokens through L layers of width d:

    6 N + 12 L T d

where N = `matmul_params(cfg)`: the weights of every matmul a token goes through, that is
2 d^2 + 2 d d_kv (q and out; k and v, d_kv = n_kv_heads x d / n_heads, so d with plain
multi-head attention, less with grouped-query attention) + 2 d d_ff (MLP; 3 d d_ff for a gated
one, whose gate is a third matrix) per block, plus the output layer d V (counted whether or not
it is tied to the embeddings: it is a matmul, while the input lookup is not), plus BERT's
head dense layer d^2. Biases, norms, softmax and embedding lookups, O(d) per token, are left
out. BERT's head runs only on the masked positions a batch scores (`model.bert`), so its
d^2 + d V count for those tokens only when `training_flops` is told how many there are.
12 L T d is QK^T and AV (2 T d multiply-adds per token and layer, times 3), counted over
all T keys even under a causal mask, as PaLM does; it does not shrink with grouped-query
attention, whose every query head still meets T keys. Rotary positions, norms and the gate's
product are O(d) per token and left out.

A Seq2Seq pair of S source and T target tokens costs 6 x (encoder matmul params) x S +
12 L_enc S^2 d for the encoder; for the decoder 6 x (decoder self-attention, cross-attention
q and out, MLP, LM head) x T + 6 x 2 d d_kv x S per layer (cross-attention keys and values
of the memory) + 12 L_dec (T + S) T d (self- and cross-attention).

Other counts a reader may compare with, per token of a sequence of T tokens:
* PaLM (Chowdhery et al. 2022, appendix B): 6 N + 12 L H Q T, H Q = d, with N the
  parameters; the formula above is this one with N counted as the matmul weights.
* llm.c (Karpathy, `gpt2_estimate_mfu`): 6 N + 6 L d T with N *all* the parameters
  (embeddings, norms and biases included) and causal attention counted half, since half of
  QK^T is masked. `llmc_flops_per_token` gives it; the trainer logs MFU by both (`perf/mfu`
  and `perf/mfu_llmc`). For GPT-2 124M at T = 1024 ours is 854 MFLOP per token and llm.c's
  803 (6% less): it counts half of the attention square, we all of it (as PaLM does); the
  weights both count are within 1%. llm.c's does not cover a Seq2Seq pair, for which only
  ours is logged.
"""

from __future__ import annotations

from model.config import GATED_ACTIVATIONS, ModelConfig


def _block_params(cfg: ModelConfig) -> int:
    """A block's matmul weights: attention (`_attention_params`) and the MLP."""
    mlp_matrices = 3 if cfg.activation in GATED_ACTIVATIONS else 2
    return _attention_params(cfg) + mlp_matrices * cfg.d_model * cfg.d_ff


def _attention_params(cfg: ModelConfig) -> int:
    """q and out (d x d each), k and v (d x d_kv each)."""
    return 2 * cfg.d_model**2 + 2 * cfg.d_model * _kv_dim(cfg)


def _kv_dim(cfg: ModelConfig) -> int:
    return cfg.kv_heads * cfg.head_dim


def matmul_params(cfg: ModelConfig) -> int:
    """All weights that take part in matmuls (N of 6N for GPT and BERT); see the module doc."""
    head = cfg.d_model * cfg.vocab_size
    if cfg.arch == "gpt":
        return cfg.n_layers * _block_params(cfg) + head
    if cfg.arch == "bert":
        return cfg.n_layers * _block_params(cfg) + cfg.d_model**2 + head
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    return enc.n_layers * _block_params(enc) + dec.n_layers * (_block_params(dec) + _attention_params(dec)) + head


def training_flops(cfg: ModelConfig, seq_len: int, tgt_len: int = 0, scored: float | None = None) -> float:
    """Forward + backward FLOPs of one sequence of seq_len tokens (Seq2Seq: one pair with a
    source of seq_len and a target of tgt_len tokens); for BERT, `scored` is the number of
    masked positions the head runs on (default: all seq_len)."""
    d = cfg.d_model
    if cfg.arch in ("gpt", "bert"):
        T, L = seq_len, cfg.n_layers
        if cfg.arch == "bert" and scored is not None:
            head = d * d + d * cfg.vocab_size
            return 6 * (matmul_params(cfg) - head) * T + 6 * head * scored + 12 * L * T * T * d
        return 6 * matmul_params(cfg) * T + 12 * L * T * T * d
    S, T = seq_len, tgt_len
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    encoder = 6 * enc.n_layers * _block_params(enc) * S + 12 * enc.n_layers * S * S * d
    per_target_token = dec.n_layers * (_block_params(dec) + 2 * d * d) + d * cfg.vocab_size  # cross: q, out
    memory_kv = dec.n_layers * 2 * d * _kv_dim(dec) * S  # cross: k, v of the memory
    attention = 12 * dec.n_layers * (T + S) * T * d
    return encoder + 6 * per_target_token * T + 6 * memory_kv + attention


def flops_per_token(cfg: ModelConfig, seq_len: int, tgt_len: int = 0) -> float:
    """`training_flops` divided by the tokens of the sequence (Seq2Seq: seq_len + tgt_len)."""
    return training_flops(cfg, seq_len, tgt_len) / (seq_len + (tgt_len if cfg.arch == "seq2seq" else 0))


def llmc_flops_per_token(cfg: ModelConfig, n_parameters: int, seq_len: int) -> float:
    """llm.c's training FLOPs per token of a T-token sequence: 6 N + 6 L d T, N all parameters
    (see the module doc); NaN for Seq2Seq, which it does not cover."""
    if cfg.arch == "seq2seq":
        return float("nan")
    return 6.0 * n_parameters + 6.0 * cfg.n_layers * cfg.d_model * seq_len
