"""Parity with Hugging Face: tiny random GPT2LMHeadModel, BertForMaskedLM and LlamaForCausalLM
(built from a config, nothing downloaded) give the same logits once converted into ours, and
ours give the same logits once exported to them; a Llama-style GPT with grouped key/value heads
generates the same tokens greedily with its cache as LlamaForCausalLM does with its own. Our
rotary BERT is checked against ModernBERT's own layers (see that test for why not against
ModernBertForMaskedLM as a whole)."""

import dataclasses

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
from model.hf_decoders import (  # noqa: E402
    config_from_hf_decoder,
    gpt_from_hf_decoder,
    gpt_to_hf_decoder,
    hf_decoder_config,
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
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=16,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    return perturb(transformers.GPT2LMHeadModel(cfg))


@pytest.fixture(scope="module")
def hf_bert():
    cfg = transformers.BertConfig(
        vocab_size=V,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=16,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        bos_token_id=2,
        eos_token_id=3,
    )
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
    ours = perturb(
        build_model(
            ModelConfig(
                arch="gpt",
                vocab_size=V,
                d_model=32,
                n_layers=2,
                n_heads=4,
                d_ff=48,
                max_seq_len=16,
                activation="gelu_tanh",
                dropout=0.0,
            )
        )
    )
    hf = gpt_to_hf(ours).eval()
    x = ids(2, 12, seed=1)
    with torch.no_grad():
        assert max_diff(hf(x).logits, ours(x).logits) < ATOL
    assert gpt_from_hf(hf).cfg == ours.cfg


def test_bert_into_ours(hf_bert):
    ours = bert_from_hf(hf_bert).eval()
    assert (ours.cfg.norm_position, ours.cfg.layer_norm_eps, ours.cfg.activation) == (
        "post",
        1e-12,
        "gelu",
    )
    x = ids(2, 12)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf_bert(x).logits) < ATOL
        real = mask.bool()
        assert (
            max_diff(ours(x, mask).logits[real], hf_bert(x, attention_mask=mask).logits[real])
            < ATOL
        )


def test_ours_into_bert():
    torch.manual_seed(2)
    ours = perturb(
        build_model(
            ModelConfig(
                arch="bert",
                vocab_size=V,
                d_model=32,
                n_layers=2,
                n_heads=4,
                d_ff=48,
                max_seq_len=16,
                norm_position="post",
                layer_norm_eps=1e-12,
                dropout=0.0,
            )
        )
    )
    hf = bert_to_hf(ours).eval()
    x = ids(2, 12, seed=2)
    with torch.no_grad():
        assert max_diff(hf(x).logits, ours(x).logits) < ATOL
    assert bert_from_hf(hf).cfg == ours.cfg


def test_round_trip_keeps_hf_logits(hf_bert, hf_gpt2):
    x = ids(1, 10, seed=3)
    with torch.no_grad():
        assert (
            max_diff(bert_to_hf(bert_from_hf(hf_bert)).eval()(x).logits, hf_bert(x).logits) < ATOL
        )
        assert max_diff(gpt_to_hf(gpt_from_hf(hf_gpt2)).eval()(x).logits, hf_gpt2(x).logits) < ATOL


def test_config_translation_refuses_other_conventions():
    with pytest.raises(ValueError, match="norm_position='pre'"):
        hf_gpt2_config(ModelConfig(arch="gpt", vocab_size=V, norm_position="post"))
    with pytest.raises(ValueError, match="positions='learned'"):
        hf_bert_config(
            ModelConfig(arch="bert", vocab_size=V, norm_position="post", positions="sinusoidal")
        )
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        config_from_hf_gpt2(
            transformers.GPT2Config(vocab_size=V, scale_attn_by_inverse_layer_idx=True)
        )
    with pytest.raises(ValueError, match="is_decoder"):
        config_from_hf_bert(transformers.BertConfig(vocab_size=V, is_decoder=True))
    with pytest.raises(ValueError, match="activation 'gelu_fast'"):
        config_from_hf_gpt2(
            transformers.GPT2Config(
                vocab_size=V, activation_function="gelu_fast", bos_token_id=2, eos_token_id=3
            )
        )


def test_hf_special_ids_are_kept_or_overridden():
    cfg = transformers.GPT2Config(vocab_size=V, bos_token_id=5, eos_token_id=6, pad_token_id=7)
    ours = config_from_hf_gpt2(cfg)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (5, 6, 7)
    assert config_from_hf_gpt2(cfg, eos_id=3).eos_id == 3


# --- Llama ------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 1], ids=["gqa", "mqa"])
def hf_llama(request):
    """4 query heads over 2 key/value heads (grouped-query) or 1 (multi-query), an untied head,
    rotary base 1000 (not the default), RMSNorm epsilon 1e-6."""
    cfg = transformers.LlamaConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=request.param,
        max_position_embeddings=32,
        rope_parameters={"rope_type": "default", "rope_theta": 1000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=2,
        eos_token_id=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return perturb(transformers.LlamaForCausalLM(cfg))


def test_llama_into_ours(hf_llama):
    ours = gpt_from_hf_decoder(hf_llama).eval()
    cfg = ours.cfg
    assert (cfg.positions, cfg.norm, cfg.activation, cfg.rope_theta, cfg.layer_norm_eps) == (
        "rope",
        "rmsnorm",
        "swiglu",
        1000.0,
        1e-6,
    )
    assert (cfg.n_kv_heads, cfg.bias, cfg.tie_embeddings, cfg.d_ff) == (
        hf_llama.config.num_key_value_heads,
        False,
        False,
        48,
    )
    x = ids(2, 12)
    mask = torch.ones_like(x)
    mask[1, 8:] = 0  # right padding: positions are the same arange for both
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, hf_llama(x).logits, rtol=1e-5, atol=ATOL)
        real = mask.bool()
        torch.testing.assert_close(
            ours(x, mask).logits[real],
            hf_llama(x, attention_mask=mask).logits[real],
            rtol=1e-5,
            atol=ATOL,
        )


@pytest.mark.parametrize("bias, tie", [(False, True), (True, False)])
def test_ours_into_llama(bias, tie):
    """Biases (Llama's attention_bias and mlp_bias together) and a tied head convert too."""
    torch.manual_seed(3)
    ours = perturb(
        build_model(
            ModelConfig(
                arch="gpt",
                vocab_size=V,
                d_model=32,
                n_layers=2,
                n_heads=4,
                n_kv_heads=2,
                d_ff=48,
                max_seq_len=16,
                positions="rope",
                rope_theta=500000.0,
                norm="rmsnorm",
                activation="swiglu",
                bias=bias,
                tie_embeddings=tie,
                dropout=0.0,
            )
        )
    )
    hf = gpt_to_hf_decoder(ours).eval()
    assert (
        hf.config.attention_bias == hf.config.mlp_bias == bias
        and hf.config.tie_word_embeddings == tie
    )
    x = ids(2, 12, seed=1)
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, ours(x).logits, rtol=1e-5, atol=ATOL)
    assert gpt_from_hf_decoder(hf).cfg == dataclasses.replace(ours.cfg, family="llama")


def test_llama_greedy_generation_with_the_cache_equals_token_for_token(hf_llama):
    """Our cache (rotated keys of the key/value heads only) against Hugging Face's, prompts
    left-padded to one length: Hugging Face counts positions from each row's first real token
    as we do."""
    ours = gpt_from_hf_decoder(hf_llama).eval()
    prompts = ids(3, 7, seed=4)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    prompts[1, :3] = 0
    ours_out = ours.generate(prompts, mask, max_new_tokens=12, eos_id=3)
    theirs = hf_llama.generate(prompts, attention_mask=mask, max_new_tokens=12, do_sample=False)
    assert ours_out.shape == theirs.shape and torch.equal(ours_out, theirs)
    assert len(set(map(tuple, theirs[:, 7:].tolist()))) == 3  # three different continuations


def test_llama_config_translation_refuses_other_conventions():
    with pytest.raises(ValueError, match="positions='rope'"):
        hf_decoder_config(
            ModelConfig(arch="gpt", vocab_size=V, norm="rmsnorm", activation="swiglu")
        )
    with pytest.raises(ValueError, match="norm='rmsnorm'"):
        hf_decoder_config(
            ModelConfig(arch="gpt", vocab_size=V, positions="rope", activation="swiglu")
        )
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf_decoder(transformers.LlamaConfig(vocab_size=V, hidden_act="gelu"))
    with pytest.raises(ValueError, match="rope_type='linear'"):
        config_from_hf_decoder(
            transformers.LlamaConfig(
                vocab_size=V,
                rope_parameters={"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
            )
        )
    # GPT-2 and BERT take none of the new options.
    with pytest.raises(ValueError, match="norm='layernorm'"):
        hf_gpt2_config(ModelConfig(arch="gpt", vocab_size=V, norm="rmsnorm"))
    with pytest.raises(ValueError, match="bias=True"):
        hf_bert_config(ModelConfig(arch="bert", vocab_size=V, norm_position="post", bias=False))
    with pytest.raises(ValueError, match="n_kv_heads=2"):
        hf_gpt2_config(ModelConfig(arch="gpt", vocab_size=V, n_kv_heads=2))
    with pytest.raises(ValueError, match="activation 'swiglu'"):
        hf_gpt2_config(ModelConfig(arch="gpt", vocab_size=V, activation="swiglu"))


# --- ModernBERT -----------------------------------------------------------------------------


def test_rotary_bert_against_modernbert_layers():
    """Our rotary BERT in ModernBERT's layout (pre-norm LayerNorms without biases, GeGLU, no
    biases anywhere, rotary base 160000, global attention) against the same network put
    together from ModernBERT's own modules.

    Not against ModernBertForMaskedLM as a whole: its stack normalises the token embeddings
    (`embeddings.norm`) and gives the first layer no attention norm (an Identity), where our
    pre-norm stack normalises each block's input and not the embeddings. The residual streams
    differ from the first layer on, so no key map makes one compute the other (and a flag to
    imitate it would be a branch for one reference). What can be matched is all the rest, run
    by Hugging Face's code: ModernBertEncoderLayer with `global_attn_every_n_layers=1` (every
    layer full attention, no sliding window) and each built as a later layer (index 1, which
    has its attention norm), its fused Wqkv and Wi (`Wi`'s first half activated, as our
    `mlp.fc`), ModernBertRotaryEmbedding's cos and sin, and ModernBertPredictionHead with the
    decoder tied to the embeddings; composed in our stack's order: token embedding, layers,
    final LayerNorm, head. Padding too, as ModernBERT's 4D additive mask."""
    from transformers.models.modernbert import modeling_modernbert as mb

    hf_cfg = transformers.ModernBertConfig(
        vocab_size=V,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=16,
        global_attn_every_n_layers=1,
        norm_eps=1e-5,
        norm_bias=False,
        attention_bias=False,
        mlp_bias=False,
        classifier_bias=False,
        decoder_bias=False,
        hidden_activation="gelu",
        classifier_activation="gelu",
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
        cls_token_id=2,
        sep_token_id=3,
    )
    hf_cfg._attn_implementation = "eager"
    assert hf_cfg.layer_types == ["full_attention"] * 2
    theta = hf_cfg.rope_parameters["full_attention"]["rope_theta"]
    torch.manual_seed(4)
    ours = perturb(
        build_model(
            ModelConfig(
                arch="bert",
                vocab_size=V,
                d_model=32,
                n_layers=2,
                n_heads=4,
                d_ff=48,
                max_seq_len=16,
                dropout=0.0,
                norm_position="pre",
                positions="rope",
                rope_theta=theta,
                activation="geglu",
                bias=False,
                layer_norm_eps=1e-5,
            )
        )
    )

    layers = [mb.ModernBertEncoderLayer(hf_cfg, layer_idx=1).eval() for _ in range(2)]
    head = mb.ModernBertPredictionHead(hf_cfg).eval()
    rotary = mb.ModernBertRotaryEmbedding(hf_cfg)
    with torch.no_grad():
        for layer, block in zip(layers, ours.blocks, strict=True):
            attn = block.attn
            layer.attn_norm.weight.copy_(block.attn_norm.weight)
            layer.attn.Wqkv.weight.copy_(
                torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
            )
            layer.attn.Wo.weight.copy_(attn.out_proj.weight)
            layer.mlp_norm.weight.copy_(block.mlp_norm.weight)
            layer.mlp.Wi.weight.copy_(block.mlp.fc.weight)
            layer.mlp.Wo.weight.copy_(block.mlp.proj.weight)
        head.dense.weight.copy_(ours.head.dense.weight)
        head.norm.weight.copy_(ours.head.norm.weight)

    def by_hand(x, mask):
        h = ours.embed.tok(x)  # (B, T, C)
        position_ids = torch.arange(x.shape[1])[None]
        cos_sin = rotary(h, position_ids, "full_attention")
        additive = (
            None
            if mask is None
            else torch.zeros(mask.shape).masked_fill(mask == 0, float("-inf"))[:, None, None]
        )
        for layer in layers:
            h = layer(h, attention_mask=additive, position_embeddings=cos_sin)
        h = torch.nn.functional.layer_norm(h, (32,), ours.norm.weight, None, 1e-5)
        return head(h) @ ours.embed.tok.weight.T  # (B, T, V)

    x = ids(2, 12, seed=5)
    mask = torch.ones_like(x)
    mask[1, 9:] = 0
    with torch.no_grad():
        torch.testing.assert_close(ours(x).logits, by_hand(x, None), rtol=1e-5, atol=ATOL)
        real = mask.bool()
        torch.testing.assert_close(
            ours(x, mask).logits[real], by_hand(x, mask)[real], rtol=1e-5, atol=ATOL
        )
