"""Warm-start sources made in the test: small BERT- and GPT-shaped configs over one vocabulary of
V ids, and `pretrained`, a model built from one with its weights moved off their initial values,
as a warm start's `Pretrained` source (its tokenizer's hash SHA unless told)."""

import torch

from model import ModelConfig, Pretrained, build_model

V = 40
SHA = "a" * 64


def bert_config(**overrides) -> ModelConfig:
    base = dict(
        arch="bert",
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=16,
        dropout=0.0,
        norm_position="post",
        layer_norm_eps=1e-12,
        activation="gelu",
    )
    return ModelConfig(**{**base, **overrides})


def gpt_config(**overrides) -> ModelConfig:
    base = dict(
        arch="gpt",
        vocab_size=V,
        d_model=32,
        n_layers=3,
        n_heads=2,
        d_ff=48,
        max_seq_len=24,
        dropout=0.0,
        norm_position="pre",
        activation="gelu_tanh",
    )
    return ModelConfig(**{**base, **overrides})


def pretrained(cfg: ModelConfig, seed: int, sha: str = SHA) -> Pretrained:
    torch.manual_seed(seed)
    model = build_model(cfg)
    with torch.no_grad():  # move LayerNorms and biases off their initial values, so copies show
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return Pretrained(model.state_dict(), cfg, sha)
