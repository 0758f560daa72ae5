"""Training FLOPs: the formula against a hand count on a tiny config, and against torch's
FLOP counter on a real forward and backward of each model."""

import dataclasses

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from model import ModelConfig, build_model, flops_per_token, matmul_params, training_flops


def test_gpt_hand_count():
    cfg = ModelConfig(
        arch="gpt", vocab_size=10, d_model=4, n_layers=1, n_heads=2, d_ff=8, max_seq_len=8
    )
    # Matmul weights a token passes through: q, k, v, out 4 * 4*4 = 64; MLP 4*8 + 8*4 = 64;
    # LM head 4*10 = 40.
    assert matmul_params(cfg) == 64 + 64 + 40
    # Forward, per sequence of T=3: 2 FLOPs per weight per token = 2*168*3 = 1008; attention
    # QK^T and AV: 2 * (2*T*T*d) = 2 * 72 = 144. Training = 3 x forward = 3 * 1152.
    assert training_flops(cfg, seq_len=3) == 3 * (1008 + 144) == 3456
    # Per token: 6N + 12 L T d = 6*168 + 12*1*3*4.
    assert flops_per_token(cfg, seq_len=3) == 6 * 168 + 12 * 1 * 3 * 4 == 1152


def test_bert_and_seq2seq_hand_count():
    bert = ModelConfig(
        arch="bert", vocab_size=10, d_model=4, n_layers=1, n_heads=2, d_ff=8, max_seq_len=8
    )
    assert matmul_params(bert) == 168 + 16  # the MLM head's dense layer
    s2s = ModelConfig(
        arch="seq2seq",
        vocab_size=10,
        d_model=4,
        n_layers=1,
        n_decoder_layers=1,
        n_heads=2,
        d_ff=8,
        max_seq_len=8,
    )
    encoder = 6 * 128 * 5 + 12 * 1 * 5 * 5 * 4  # S=5: blocks only, no head
    decoder_tokens = 6 * (128 + 2 * 16 + 40) * 3  # T=3: block, cross-attention q and out, LM head
    memory_kv = 6 * 2 * 16 * 5  # cross-attention keys and values of the 5 memory positions
    attention = 12 * 1 * (3 + 5) * 3 * 4  # self (T keys) and cross (S keys) attention of T queries
    assert (
        training_flops(s2s, seq_len=5, tgt_len=3)
        == encoder + decoder_tokens + memory_kv + attention
    )
    assert flops_per_token(s2s, 5, 3) == training_flops(s2s, 5, 3) / 8


@pytest.mark.parametrize("arch", ["gpt", "bert", "seq2seq"])
def test_formula_equals_torch_flop_counter(arch):
    cfg = ModelConfig(
        arch=arch,
        vocab_size=50,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_ff=24,
        max_seq_len=16,
        dropout=0.0,
        n_decoder_layers=3 if arch == "seq2seq" else 0,
    )
    model = build_model(cfg)
    src = torch.randint(5, 50, (1, 7))
    tgt = torch.randint(5, 50, (1, 5))
    counter = FlopCounterMode(display=False)
    # The math backend runs attention as counted matmuls (the fused CPU kernel is not counted).
    labels = src.clone()
    if arch == "bert":
        labels[0, [1, 4, 5]] = -100  # the MLM head runs on the 4 scored positions only
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = model(src, None, tgt, labels=tgt) if arch == "seq2seq" else model(src, labels=labels)
        out.loss.backward()
    assert counter.get_total_flops() == training_flops(
        cfg, 7, 5, scored=4 if arch == "bert" else None
    )


def test_llama_shape_hand_count():
    """Grouped-query attention shrinks k and v to d x d_kv; a gated MLP has three d x d_ff matrices;
    the untied LM head counts as the tied one did (a matmul either way); attention's T^2 term stays."""
    cfg = ModelConfig(
        arch="gpt",
        vocab_size=10,
        d_model=8,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=6,
        max_seq_len=8,
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        tie_embeddings=False,
    )
    # q, out 2 * 8*8 = 128; k, v 2 * 8*4 = 64 (2 heads of 2); MLP 3 * 8*6 = 144; LM head 8*10 = 80.
    assert matmul_params(cfg) == 128 + 64 + 144 + 80
    assert flops_per_token(cfg, seq_len=3) == 6 * 416 + 12 * 1 * 3 * 8
    s2s = ModelConfig(
        arch="seq2seq",
        vocab_size=10,
        d_model=8,
        n_layers=1,
        n_heads=4,
        n_kv_heads=2,
        d_ff=6,
        max_seq_len=8,
        activation="swiglu",
    )
    encoder = 6 * (192 + 144) * 5 + 12 * 1 * 5 * 5 * 8  # S=5
    # T=3: block, cross-attention q and out, LM head
    decoder_tokens = 6 * (192 + 144 + 128 + 80) * 3
    memory_kv = 6 * 64 * 5  # cross-attention k and v (2 kv heads) of the 5 memory positions
    attention = 12 * 1 * (3 + 5) * 3 * 8
    assert (
        training_flops(s2s, seq_len=5, tgt_len=3)
        == encoder + decoder_tokens + memory_kv + attention
    )


@pytest.mark.parametrize("head_dim", [0, 8])
@pytest.mark.parametrize("arch", ["gpt", "bert", "seq2seq"])
def test_formula_equals_torch_flop_counter_in_the_llama_shape(arch, head_dim):
    """Rotary positions, RMSNorm, SwiGLU, 2 key/value heads of 4 (SDPA's math path counts the
    grouped heads' attention as the full one), no biases, untied output layer; with head_dim 8,
    Qwen3's heads wider than d_model / n_heads (queries 32 wide against d_model 16)."""
    cfg = ModelConfig(
        head_dim=head_dim,
        arch=arch,
        vocab_size=50,
        d_model=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        d_ff=24,
        max_seq_len=16,
        dropout=0.0,
        n_decoder_layers=3 if arch == "seq2seq" else 0,
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        tie_embeddings=arch != "seq2seq",
    )
    model = build_model(cfg)
    src = torch.randint(5, 50, (1, 7))
    tgt = torch.randint(5, 50, (1, 5))
    counter = FlopCounterMode(display=False)
    labels = src.clone()
    if arch == "bert":
        labels[0, [1, 4, 5]] = -100
    with counter, sdpa_kernel(SDPBackend.MATH):
        out = model(src, None, tgt, labels=tgt) if arch == "seq2seq" else model(src, labels=labels)
        out.loss.backward()
    assert counter.get_total_flops() == training_flops(
        cfg, 7, 5, scored=4 if arch == "bert" else None
    )


def test_llmc_count_takes_every_parameter_of_an_untied_head():
    from model import llmc_flops_per_token

    tied = ModelConfig(arch="gpt", vocab_size=100, d_model=16, n_layers=1, n_heads=2, max_seq_len=8)
    untied = dataclasses.replace(tied, tie_embeddings=False)
    n = [sum(p.numel() for p in build_model(c).parameters()) for c in (tied, untied)]
    assert n[1] - n[0] == 100 * 16
    assert (
        llmc_flops_per_token(untied, n[1], 8) - llmc_flops_per_token(tied, n[0], 8) == 6 * 100 * 16
    )
    assert flops_per_token(untied, 8) == flops_per_token(tied, 8)  # ours: the same matmuls


def test_formula_equals_torch_flop_counter_for_a_mixture_of_experts():
    """Every second layer MoE (4 experts, top 2, a shared expert): a token goes through the
    router, its two experts and the shared one, dense layers through their MLP; llm.c's count
    leaves the two experts it skips out of N."""
    from model import llmc_flops_per_token
    from model.config import MoEConfig

    cfg = ModelConfig(
        arch="gpt", vocab_size=50, d_model=16, n_layers=2, n_heads=4, d_ff=24, max_seq_len=16,
        dropout=0.0, positions="rope", norm="rmsnorm", activation="swiglu", bias=False,
        moe=MoEConfig(experts=4, top_k=2, every=2, d_ff=12, shared_d_ff=8),
    )  # fmt: skip
    model = build_model(cfg)
    src = torch.randint(5, 50, (2, 7))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        model(src, labels=src).loss.backward()
    assert counter.get_total_flops() == 2 * training_flops(cfg, 7)
    n = sum(p.numel() for p in model.parameters())
    skipped = 2 * 3 * 16 * 12  # two experts of (3 matrices of 16 x 12) in the one MoE layer
    assert llmc_flops_per_token(cfg, n, 7) == 6.0 * (n - skipped) + 6.0 * 2 * 16 * 7
