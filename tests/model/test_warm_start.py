"""Warm starting a Seq2Seq from GPT and BERT (Rothe et al. 2020): every tensor accounted
for, copied tensors exactly the pretrained ones, the stacks computing what the pretrained
models computed, and clear refusals of anything that does not fit."""

import dataclasses

import pytest
import torch
from warm_start_sources import SHA, V, bert_config, gpt_config, pretrained

from model import (
    GPT,
    ModelConfig,
    Pretrained,
    StackConfig,
    WarmStartError,
    build_model,
    seq2seq_config,
)
from model.blocks import Transformer
from model.warm_start import warm_start


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def bert():
    return pretrained(bert_config(), seed=1)


@pytest.fixture(scope="module")
def gpt():
    return pretrained(gpt_config(), seed=2)


def test_seq2seq_config_matches_each_source(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config, label_smoothing=0.2)
    assert cfg.arch == "seq2seq" and cfg.label_smoothing == 0.2 and cfg.max_seq_len == 24
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    assert (
        enc.n_layers,
        enc.n_heads,
        enc.d_ff,
        enc.norm_position,
        enc.activation,
        enc.layer_norm_eps,
    ) == (2, 4, 64, "post", "gelu", 1e-12)
    assert (
        dec.n_layers,
        dec.n_heads,
        dec.d_ff,
        dec.norm_position,
        dec.activation,
        dec.layer_norm_eps,
    ) == (3, 2, 48, "pre", "gelu_tanh", 1e-5)


def test_bert_encoder_gpt_decoder_accounts_for_every_tensor(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config, max_seq_len=32)
    model, report = warm_start(cfg, SHA, encoder=bert, decoder=gpt)
    state = model.state_dict()
    assert list(report.tensors) == list(state)

    sources = {"encoder": bert.state_dict, "decoder": gpt.state_dict}
    for key, origin in report.tensors.items():
        if origin.status == "copied":
            side, source_key = origin.source.split(":")
            assert key.startswith(side + ".")
            assert torch.equal(state[key], sources[side][source_key]), key
        elif origin.status == "resized":
            side, source_key = origin.source.split(":")
            rows = sources[side][source_key].shape[0]
            assert source_key == "embed.pos.weight" and state[key].shape[0] == 32
            assert torch.equal(state[key][:rows], sources[side][source_key])

    assert sorted(report.keys("resized")) == [
        "decoder.embed.pos.weight",
        "encoder.embed.pos.weight",
    ]
    new = report.keys("new")
    assert new and all(".cross_attn." in k or ".cross_attn_norm." in k for k in new)
    assert len(new) == 3 * (8 + 2)  # 3 decoder layers x (q, k, v, out weights and biases + norm)
    assert sorted(report.dropped) == sorted(
        f"encoder:{k}" for k in bert.state_dict if k.startswith("head.")
    )
    assert report.tensors["decoder.lm_head.weight"].source == "decoder:lm_head.weight"
    assert (
        report.summary()
        == f"copied {len(state) - 2 - len(new)}, resized 2, new {len(new)}, dropped 6"
    )
    assert "new      decoder.blocks.0.cross_attn.q_proj.weight" in str(report)


def test_warm_started_stacks_compute_what_the_sources_computed(bert, gpt):
    model, _ = warm_start(seq2seq_config(bert.config, gpt.config), SHA, encoder=bert, decoder=gpt)
    model.eval()
    source_bert = build_model(bert.config).eval()
    source_bert.load_state_dict(bert.state_dict)
    source_gpt = build_model(gpt.config).eval()
    source_gpt.load_state_dict(gpt.state_dict)

    src, tgt = ids(2, 7, seed=3), ids(2, 5, seed=4)
    src_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    memory = model.encoder(src, src_mask)
    torch.testing.assert_close(memory, Transformer.forward(source_bert, src, src_mask))
    # With the new cross-attention silenced, a pre-LN decoder is exactly the GPT.
    with torch.no_grad():
        for block in model.decoder.blocks:
            block.cross_attn.out_proj.weight.zero_()
            block.cross_attn.out_proj.bias.zero_()
    torch.testing.assert_close(model(src, src_mask, tgt).logits, source_gpt(tgt).logits)


def test_bert_decoder_and_gpt_encoder(bert, gpt):
    cfg = seq2seq_config(gpt.config, bert.config)
    model, report = warm_start(cfg, SHA, encoder=gpt, decoder=bert)
    assert "encoder:lm_head.weight" in report.dropped
    assert {k for k in report.dropped if k.startswith("decoder:")} == {
        f"decoder:{k}" for k in bert.state_dict if k.startswith("head.")
    }
    origin = report.tensors["decoder.lm_head.weight"]
    assert (origin.status, origin.source, origin.note) == (
        "copied",
        "decoder:embed.tok.weight",
        "tied to decoder.embed.tok.weight",
    )
    assert torch.equal(model.decoder.lm_head.weight, bert.state_dict["embed.tok.weight"])
    # The BERT decoder runs with a causal mask.
    assert model.decoder.causal and model.decoder.cfg.norm_position == "post"


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_one_side_only(bert, gpt, side):
    source = bert if side == "encoder" else gpt
    cfg = seq2seq_config(**{f"{side}_config": source.config})
    model, report = warm_start(cfg, SHA, **{side: source})
    other = "decoder" if side == "encoder" else "encoder"
    assert all(
        report.tensors[k].status == "new" for k in report.tensors if k.startswith(other + ".")
    )
    assert any(
        report.tensors[k].status == "copied" for k in report.tensors if k.startswith(side + ".")
    )


def test_no_sources_gives_an_all_new_model():
    model, report = warm_start(seq2seq_config(), SHA)
    assert set(report.keys("new")) == set(model.state_dict()) and not report.dropped


def test_our_own_models_of_any_config(bert):
    other_bert = pretrained(
        bert_config(
            norm_position="pre", positions="sinusoidal", activation="relu", layer_norm_eps=1e-5
        ),
        seed=5,
    )
    other_gpt = pretrained(gpt_config(norm_position="post", n_layers=1), seed=6)
    model, report = warm_start(
        seq2seq_config(other_bert.config, other_gpt.config),
        SHA,
        encoder=other_bert,
        decoder=other_gpt,
    )
    assert not report.keys("resized")
    assert torch.isfinite(model(ids(1, 5), None, ids(1, 4)).logits).all()


# --- refusals --------------------------------------------------------------------------------


def _error(*args, **kwargs) -> str:
    with pytest.raises(WarmStartError) as err:
        warm_start(*args, **kwargs)
    message = str(err.value)
    assert "\n" not in message
    return message


def test_tokenizer_hash_mismatch(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config)
    message = _error(cfg, "b" * 64, encoder=bert, decoder=gpt)
    assert "encoder source tokenizer sha256 aaaaaaaaaaaa" in message
    message = _error(
        cfg, SHA, encoder=bert, decoder=dataclasses.replace(gpt, tokenizer_sha256="c" * 64)
    )
    assert message.startswith("decoder source tokenizer")


def test_vocab_size_mismatch(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config)
    bigger = pretrained(gpt_config(vocab_size=V + 8), seed=7)
    assert "vocabulary mismatch" in _error(cfg, SHA, decoder=bigger)
    # Sources with two vocabularies (BERT2GPT2) give each stack its own; one shared matrix cannot.
    two = seq2seq_config(bert.config, bigger.config)
    assert (two.for_stack("encoder").vocab_size, two.for_stack("decoder").vocab_size) == (V, V + 8)
    model, _ = warm_start(two, SHA, encoder=bert, decoder=bigger)
    assert model.encoder.embed.tok.weight.shape[0] == V
    assert model.decoder.lm_head.weight.shape[0] == V + 8
    assert torch.equal(model.decoder.embed.tok.weight, bigger.state_dict["embed.tok.weight"])
    with pytest.raises(WarmStartError, match="differ in vocab_size"):
        seq2seq_config(bert.config, bigger.config, share_embeddings=True)
    # A config that lies about its state dict is caught by the tensor's shape.
    lying = Pretrained(bigger.state_dict, gpt.config, SHA)
    assert _error(cfg, SHA, decoder=lying).startswith(
        "vocabulary mismatch: decoder source embed.tok.weight has 48 rows"
    )


def test_architecture_mismatch(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config, decoder=StackConfig(n_heads=4))
    assert "decoder source has n_heads=2 but the Seq2Seq decoder has 4" in _error(
        cfg, SHA, decoder=gpt
    )
    cfg = seq2seq_config(bert.config, gpt.config, n_decoder_layers=4)
    assert "n_layers=3" in _error(cfg, SHA, decoder=gpt)


def test_missing_and_unknown_keys(bert, gpt):
    cfg = seq2seq_config(bert.config, gpt.config)
    partial = dict(gpt.state_dict)
    del partial["blocks.2.mlp.fc.weight"]
    assert "lacks 'blocks.2.mlp.fc.weight'" in _error(
        cfg, SHA, decoder=dataclasses.replace(gpt, state_dict=partial)
    )
    extra = {**gpt.state_dict, "blocks.3.attn.q_proj.weight": torch.zeros(32, 32)}
    assert "unknown keys" in _error(cfg, SHA, decoder=dataclasses.replace(gpt, state_dict=extra))


def test_tied_duplicates_may_be_absent_but_not_different(gpt):
    cfg = seq2seq_config(decoder_config=gpt.config)
    without = {k: v for k, v in gpt.state_dict.items() if k != "lm_head.weight"}
    model, report = warm_start(cfg, SHA, decoder=dataclasses.replace(gpt, state_dict=without))
    assert report.tensors["decoder.lm_head.weight"].source == "decoder:embed.tok.weight"
    untied = {**gpt.state_dict, "lm_head.weight": torch.zeros(V, 32)}
    assert "should be tied" in _error(cfg, SHA, decoder=dataclasses.replace(gpt, state_dict=untied))


def test_source_must_be_gpt_or_bert(gpt):
    s2s = seq2seq_config(decoder_config=gpt.config)
    assert "arch='seq2seq'" in _error(s2s, SHA, decoder=Pretrained({}, s2s, SHA))
    assert "builds a seq2seq model" in _error(gpt.config, SHA)


def test_source_state_dict_from_a_gpt_instance_loads_directly():
    source = GPT(gpt_config())
    cfg = seq2seq_config(decoder_config=source.cfg)
    model, report = warm_start(cfg, SHA, decoder=Pretrained(source.state_dict(), source.cfg, SHA))
    assert torch.equal(
        model.decoder.blocks[0].attn.q_proj.weight, source.blocks[0].attn.q_proj.weight
    )


# --- the Llama shape ------------------------------------------------------------------------


def llama_config(**overrides) -> ModelConfig:
    """A Llama-style GPT: rotary positions, RMSNorm, SwiGLU, 2 key/value heads of 4, no biases, untied head."""
    return gpt_config(
        **{
            **dict(
                n_heads=4,
                n_kv_heads=2,
                d_ff=0,
                positions="rope",
                rope_theta=500000.0,
                norm="rmsnorm",
                activation="swiglu",
                bias=False,
                tie_embeddings=False,
            ),
            **overrides,
        }
    )


def rotary_bert_config(**overrides) -> ModelConfig:
    """A rotary BERT in ModernBERT's layout: pre-norm LayerNorm without biases, GeGLU, no biases."""
    return bert_config(
        **{
            **dict(
                norm_position="pre",
                layer_norm_eps=1e-5,
                positions="rope",
                rope_theta=160000.0,
                activation="geglu",
                d_ff=48,
                bias=False,
            ),
            **overrides,
        }
    )


def test_llama_decoder_and_rotary_bert_encoder_warm_start_a_translation_model():
    """Every tensor accounted for (no position tensor on either side, the untied LM head copied,
    the new cross-attention with the decoder's key/value heads and no biases), and the stacks
    compute what their sources computed; the new cross-attention takes no rotary positions."""
    encoder, decoder = (
        pretrained(rotary_bert_config(), seed=11),
        pretrained(llama_config(), seed=12),
    )
    cfg = seq2seq_config(encoder.config, decoder.config)
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    assert (enc.positions, enc.rope_theta, enc.norm, enc.activation, enc.n_kv_heads) == (
        "rope",
        160000.0,
        "layernorm",
        "geglu",
        0,
    )
    assert (dec.positions, dec.rope_theta, dec.norm, dec.activation, dec.n_kv_heads, dec.d_ff) == (
        "rope",
        500000.0,
        "rmsnorm",
        "swiglu",
        2,
        256,
    )
    assert not cfg.bias and not cfg.tie_embeddings  # the decoder source's head is its own matrix
    model, report = warm_start(cfg, SHA, encoder=encoder, decoder=decoder)
    state = model.state_dict()
    assert list(report.tensors) == list(state) and not report.keys("resized")
    assert not any(k.endswith(".bias") or "pos" in k for k in state)
    new = report.keys("new")
    assert len(new) == 3 * 5 and all(".cross_attn." in k or ".cross_attn_norm." in k for k in new)
    # the decoder's 2 kv heads
    assert model.decoder.blocks[0].cross_attn.k_proj.weight.shape == (2 * 8, 32)
    origin = report.tensors["decoder.lm_head.weight"]
    assert (origin.status, origin.source, origin.note) == ("copied", "decoder:lm_head.weight", "")
    for key, origin in report.tensors.items():
        if origin.status == "copied":
            side, source_key = origin.source.split(":")
            assert torch.equal(
                state[key], {"encoder": encoder, "decoder": decoder}[side].state_dict[source_key]
            ), key

    model.eval()
    source_bert, source_gpt = build_model(encoder.config).eval(), build_model(decoder.config).eval()
    source_bert.load_state_dict(encoder.state_dict)
    source_gpt.load_state_dict(decoder.state_dict)
    src, tgt = ids(2, 7, seed=3), ids(2, 5, seed=4)
    src_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    torch.testing.assert_close(
        model.encoder(src, src_mask), Transformer.forward(source_bert, src, src_mask)
    )
    with torch.no_grad():
        for block in model.decoder.blocks:
            block.cross_attn.out_proj.weight.zero_()
    torch.testing.assert_close(model(src, src_mask, tgt).logits, source_gpt(tgt).logits)


def test_llama_shape_mismatches_are_refused():
    decoder = pretrained(llama_config(), seed=12)
    tied = seq2seq_config(decoder_config=decoder.config, tie_embeddings=True)
    assert "decoder source has tie_embeddings=False but the Seq2Seq decoder has True" in _error(
        tied, SHA, decoder=decoder
    )
    mha = seq2seq_config(decoder_config=decoder.config, decoder=StackConfig(n_kv_heads=0))
    assert "decoder source has n_kv_heads=2 but the Seq2Seq decoder has 0" in _error(
        mha, SHA, decoder=decoder
    )
    theta = seq2seq_config(
        decoder_config=decoder.config, rope_theta=10000.0, decoder=StackConfig(rope_theta=10000.0)
    )
    assert "rope_theta=500000.0" in _error(theta, SHA, decoder=decoder)
    # A biased BERT and a bias-free Llama cannot share one Seq2Seq: `bias` is one for both stacks.
    with pytest.raises(WarmStartError, match="differ in bias"):
        seq2seq_config(bert_config(), decoder.config)
    # The encoder side has no LM head: an untied encoder source fits a tied Seq2Seq.
    untied_bert = pretrained(rotary_bert_config(tie_embeddings=False), seed=13)
    cfg = seq2seq_config(untied_bert.config, tie_embeddings=True)
    model, report = warm_start(cfg, SHA, encoder=untied_bert)
    assert "encoder:head.decoder.weight" in report.dropped
