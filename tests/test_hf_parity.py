"""Parity with Hugging Face: tiny random GPT2LMHeadModel and BertForMaskedLM (built from a
config, nothing downloaded) give the same logits once converted into ours, and ours give the
same logits once exported to them."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from model import ModelConfig, build_model  # noqa: E402
from model.hf import (  # noqa: E402
    bert_from_hf,
    bert_to_hf,
    config_from_hf_bert,
    config_from_hf_gpt2,
    gpt_from_hf,
    gpt_to_hf,
    hf_bert_config,
    hf_gpt2_config,
)

V = 64
ATOL = 1e-5


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, shape, generator=torch.Generator().manual_seed(seed))


def perturb(model: torch.nn.Module) -> torch.nn.Module:
    """Random values everywhere (LayerNorms, biases, token types), so no mapping hides behind an init of 1 or 0."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


@pytest.fixture(scope="module")
def hf_gpt2():
    cfg = transformers.GPT2Config(vocab_size=V, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                  bos_token_id=2, eos_token_id=3, pad_token_id=0, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return perturb(transformers.GPT2LMHeadModel(cfg))


@pytest.fixture(scope="module")
def hf_bert():
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=48, max_position_embeddings=16, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, bos_token_id=2, eos_token_id=3)
    torch.manual_seed(0)
    return perturb(transformers.BertForMaskedLM(cfg))


def test_gpt2_into_ours(hf_gpt2):
    ours = gpt_from_hf(hf_gpt2).eval()
    assert (ours.cfg.activation, ours.cfg.norm_position, ours.cfg.d_ff) == ("gelu_tanh", "pre", 128)
    x = ids(2, 12)
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf_gpt2(x).logits) < ATOL


def test_ours_into_gpt2():
    torch.manual_seed(1)
    ours = perturb(build_model(ModelConfig(arch="gpt", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48,
                                           max_seq_len=16, activation="gelu_tanh", dropout=0.0)))
    hf = gpt_to_hf(ours).eval()
    x = ids(2, 12, seed=1)
    with torch.no_grad():
        assert max_diff(hf(x).logits, ours(x).logits) < ATOL
    assert gpt_from_hf(hf).cfg == ours.cfg


def test_bert_into_ours(hf_bert):
    ours = bert_from_hf(hf_bert).eval()
    assert (ours.cfg.norm_position, ours.cfg.layer_norm_eps, ours.cfg.activation) == ("post", 1e-12, "gelu")
    x = ids(2, 12)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf_bert(x).logits) < ATOL
        real = mask.bool()
        assert max_diff(ours(x, mask).logits[real], hf_bert(x, attention_mask=mask).logits[real]) < ATOL


def test_ours_into_bert():
    torch.manual_seed(2)
    ours = perturb(build_model(ModelConfig(arch="bert", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=48,
                                           max_seq_len=16, norm_position="post", layer_norm_eps=1e-12, dropout=0.0)))
    hf = bert_to_hf(ours).eval()
    x = ids(2, 12, seed=2)
    with torch.no_grad():
        assert max_diff(hf(x).logits, ours(x).logits) < ATOL
    assert bert_from_hf(hf).cfg == ours.cfg


def test_round_trip_keeps_hf_logits(hf_bert, hf_gpt2):
    x = ids(1, 10, seed=3)
    with torch.no_grad():
        assert max_diff(bert_to_hf(bert_from_hf(hf_bert)).eval()(x).logits, hf_bert(x).logits) < ATOL
        assert max_diff(gpt_to_hf(gpt_from_hf(hf_gpt2)).eval()(x).logits, hf_gpt2(x).logits) < ATOL


def test_config_translation_refuses_other_conventions():
    with pytest.raises(ValueError, match="norm_position='pre'"):
        hf_gpt2_config(ModelConfig(arch="gpt", vocab_size=V, norm_position="post"))
    with pytest.raises(ValueError, match="positions='learned'"):
        hf_bert_config(ModelConfig(arch="bert", vocab_size=V, norm_position="post", positions="sinusoidal"))
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf_gpt2(transformers.GPT2Config(vocab_size=V, scale_attn_by_inverse_layer_idx=True))
    with pytest.raises(ValueError, match="is_decoder"):
        config_from_hf_bert(transformers.BertConfig(vocab_size=V, is_decoder=True))
    with pytest.raises(ValueError, match="activation 'gelu_fast'"):
        config_from_hf_gpt2(transformers.GPT2Config(vocab_size=V, activation_function="gelu_fast", bos_token_id=2, eos_token_id=3))


def test_hf_special_ids_are_kept_or_overridden():
    cfg = transformers.GPT2Config(vocab_size=V, bos_token_id=5, eos_token_id=6, pad_token_id=7)
    ours = config_from_hf_gpt2(cfg)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (5, 6, 7)
    assert config_from_hf_gpt2(cfg, eos_id=3).eos_id == 3
