"""Conversion between our Seq2Seq and Hugging Face's `EncoderDecoderModel` with a BERT encoder
and a GPT-2 decoder with cross-attention: the layout of Rothe, Narayan and Severyn 2020 as
`transformers` builds it, so that its `generate` translates with our weights.

The encoder stack is a `BertModel` (post-LN, learned positions; its token types and pooler are
not ours: one zero token-type row, as `model.hf` writes for BERT, and a zero pooler, which the
encoder-decoder never reads), the decoder a `GPT2LMHeadModel` whose blocks add `ln_cross_attn`
and `crossattention` (queries from `q_attn`, keys and values fused in `c_attn`, all GPT-2
`Conv1D`s, stored transposed) between self-attention and the MLP, where our `DecoderBlock`
has `cross_attn_norm` and `cross_attn`. A Seq2Seq that these classes cannot compute (a pre-LN
encoder, sinusoidal positions, shared scaled embeddings, grouped key/value heads, ...) is refused
with a ValueError naming the option. `transformers` is imported inside the functions only.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import Mapping

import torch
from torch import Tensor

from model.config import ModelConfig
from model.hf import (
    BERT_LAYER,
    StateDict,
    config_from_hf_bert,
    config_from_hf_gpt2,
    gpt_state_dict_from_hf,
    gpt_state_dict_to_hf,
    hf_bert_config,
    hf_gpt2_config,
)
from model.seq2seq import Seq2Seq

CROSS = "crossattention"


def stack_configs(cfg: ModelConfig) -> tuple[ModelConfig, ModelConfig]:
    """The encoder as a BERT config and the decoder as a GPT config, for the HF config builders."""
    if cfg.share_embeddings:
        raise ValueError(
            "share_embeddings=True (one matrix scaled by sqrt(d_model)) has no equivalent in "
            "Hugging Face's BERT/GPT-2 encoder-decoder"
        )
    # The encoder has no output layer, so tie_embeddings only describes the decoder's.
    encoder = dataclasses.replace(cfg.for_stack("encoder"), arch="bert", tie_embeddings=True)
    decoder = dataclasses.replace(cfg.for_stack("decoder"), arch="gpt")
    return encoder, decoder


def hf_encoder_decoder_config(cfg: ModelConfig):
    """An `EncoderDecoderConfig` (BertConfig + GPT2Config with cross-attention) for
    our Seq2Seq config."""
    from transformers import EncoderDecoderConfig

    encoder, decoder = stack_configs(cfg)
    try:
        encoder_config = hf_bert_config(encoder)
    except ValueError as err:
        raise ValueError(f"encoder: {err}") from None
    try:
        decoder_config = hf_gpt2_config(decoder)
    except ValueError as err:
        raise ValueError(f"decoder: {err}") from None
    decoder_config.is_decoder = decoder_config.add_cross_attention = True
    config = EncoderDecoderConfig.from_encoder_decoder_configs(encoder_config, decoder_config)
    # generation's ids are the decoder's (its tokenizer's, when the sides have two)
    ids = cfg.for_stack("decoder")
    config.decoder_start_token_id, config.bos_token_id = ids.bos_id, ids.bos_id
    config.eos_token_id, config.pad_token_id = ids.eos_id, ids.pad_id
    # the encoder's and the decoder's embeddings are two matrices
    config.tie_word_embeddings = False
    return config


def seq2seq_state_dict_to_hf(ours: Mapping[str, Tensor], cfg: ModelConfig) -> StateDict:
    """Our Seq2Seq state dict in EncoderDecoderModel's keys and layout."""
    n_encoder, n_decoder = cfg.n_layers, cfg.n_decoder_layers or cfg.n_layers
    position = ours["encoder.embed.pos.weight"]
    hf = {
        "encoder.embeddings.word_embeddings.weight": ours["encoder.embed.tok.weight"],
        "encoder.embeddings.position_embeddings.weight": position,
        "encoder.embeddings.token_type_embeddings.weight": torch.zeros_like(position[:1]),
        "encoder.embeddings.LayerNorm.weight": ours["encoder.norm.weight"],
        "encoder.embeddings.LayerNorm.bias": ours["encoder.norm.bias"],
        "encoder.pooler.dense.weight": torch.zeros(cfg.d_model, cfg.d_model),
        "encoder.pooler.dense.bias": torch.zeros(cfg.d_model),
    }
    for i in range(n_encoder):
        for our_name, hf_name in BERT_LAYER.items():
            for kind in ("weight", "bias"):
                hf[f"encoder.encoder.layer.{i}.{hf_name}.{kind}"] = ours[
                    f"encoder.blocks.{i}.{our_name}.{kind}"
                ]
    decoder = {
        key[len("decoder.") :]: value for key, value in ours.items() if key.startswith("decoder.")
    }
    hf.update(
        {f"decoder.{key}": value for key, value in gpt_state_dict_to_hf(decoder, n_decoder).items()}
    )
    for i in range(n_decoder):
        mine, theirs = f"blocks.{i}.cross_attn", f"decoder.transformer.h.{i}."
        hf[f"{theirs}ln_cross_attn.weight"] = decoder[f"blocks.{i}.cross_attn_norm.weight"]
        hf[f"{theirs}ln_cross_attn.bias"] = decoder[f"blocks.{i}.cross_attn_norm.bias"]
        # Conv1D: (in, out)
        hf[f"{theirs}{CROSS}.q_attn.weight"] = decoder[f"{mine}.q_proj.weight"].t()
        hf[f"{theirs}{CROSS}.q_attn.bias"] = decoder[f"{mine}.q_proj.bias"]
        kv = [f"{mine}.k_proj", f"{mine}.v_proj"]
        # (C, 2C)
        hf[f"{theirs}{CROSS}.c_attn.weight"] = torch.cat([decoder[f"{p}.weight"] for p in kv]).t()
        hf[f"{theirs}{CROSS}.c_attn.bias"] = torch.cat([decoder[f"{p}.bias"] for p in kv])
        hf[f"{theirs}{CROSS}.c_proj.weight"] = decoder[f"{mine}.out_proj.weight"].t()
        hf[f"{theirs}{CROSS}.c_proj.bias"] = decoder[f"{mine}.out_proj.bias"]
    return {k: v.contiguous() for k, v in hf.items()}


def seq2seq_state_dict_from_hf(hf: Mapping[str, Tensor], cfg: ModelConfig) -> StateDict:
    """An EncoderDecoderModel (BERT + GPT-2) state dict in our Seq2Seq's keys (token type 0 folded
    into the encoder's positions, the pooler dropped)."""
    n_encoder, n_decoder = cfg.n_layers, cfg.n_decoder_layers or cfg.n_layers
    token_type = hf["encoder.embeddings.token_type_embeddings.weight"][0]  # (C,)
    ours = {
        "encoder.embed.tok.weight": hf["encoder.embeddings.word_embeddings.weight"],
        "encoder.embed.pos.weight": hf["encoder.embeddings.position_embeddings.weight"]
        + token_type,
        "encoder.norm.weight": hf["encoder.embeddings.LayerNorm.weight"],
        "encoder.norm.bias": hf["encoder.embeddings.LayerNorm.bias"],
    }
    for i in range(n_encoder):
        for our_name, hf_name in BERT_LAYER.items():
            for kind in ("weight", "bias"):
                ours[f"encoder.blocks.{i}.{our_name}.{kind}"] = hf[
                    f"encoder.encoder.layer.{i}.{hf_name}.{kind}"
                ]
    decoder = {
        key[len("decoder.") :]: value for key, value in hf.items() if key.startswith("decoder.")
    }
    ours.update(
        {
            f"decoder.{key}": value
            for key, value in gpt_state_dict_from_hf(decoder, n_decoder).items()
        }
    )
    for i in range(n_decoder):
        mine, theirs = f"decoder.blocks.{i}.cross_attn", f"transformer.h.{i}."
        ours[f"decoder.blocks.{i}.cross_attn_norm.weight"] = decoder[
            f"{theirs}ln_cross_attn.weight"
        ]
        ours[f"decoder.blocks.{i}.cross_attn_norm.bias"] = decoder[f"{theirs}ln_cross_attn.bias"]
        ours[f"{mine}.q_proj.weight"] = decoder[f"{theirs}{CROSS}.q_attn.weight"].t()
        ours[f"{mine}.q_proj.bias"] = decoder[f"{theirs}{CROSS}.q_attn.bias"]
        k_weight, v_weight = decoder[f"{theirs}{CROSS}.c_attn.weight"].t().chunk(2)  # (C, C) each
        k_bias, v_bias = decoder[f"{theirs}{CROSS}.c_attn.bias"].chunk(2)
        ours[f"{mine}.k_proj.weight"], ours[f"{mine}.v_proj.weight"] = k_weight, v_weight
        ours[f"{mine}.k_proj.bias"], ours[f"{mine}.v_proj.bias"] = k_bias, v_bias
        ours[f"{mine}.out_proj.weight"] = decoder[f"{theirs}{CROSS}.c_proj.weight"].t()
        ours[f"{mine}.out_proj.bias"] = decoder[f"{theirs}{CROSS}.c_proj.bias"]
    return {k: v.contiguous() for k, v in ours.items()}


def config_from_hf_encoder_decoder(hf_config, **overrides) -> ModelConfig:
    """Our Seq2Seq config for an `EncoderDecoderConfig` of a BERT encoder and a GPT-2 decoder."""
    from model.warm_start import seq2seq_config

    kinds = (hf_config.encoder.model_type, hf_config.decoder.model_type)
    if kinds != ("bert", "gpt2"):
        raise ValueError(
            f"an encoder-decoder of {kinds[0]} and {kinds[1]}: only BERT + GPT-2 converts"
        )
    if not getattr(hf_config.decoder, "add_cross_attention", False):
        raise ValueError("the GPT-2 decoder has no cross-attention (add_cross_attention=False)")
    decoder_config = copy.deepcopy(hf_config.decoder)
    decoder_config.add_cross_attention, decoder_config.is_decoder = False, False
    ids = {
        ours: getattr(hf_config, theirs)
        for ours, theirs in (
            ("bos_id", "decoder_start_token_id"),
            ("eos_id", "eos_token_id"),
            ("pad_id", "pad_token_id"),
        )
        if getattr(hf_config, theirs, None) is not None
    }
    # Two vocabularies (BERT2GPT2): the generation ids are the decoder's; the encoder keeps its own.
    two = hf_config.encoder.vocab_size != hf_config.decoder.vocab_size
    encoder = config_from_hf_bert(hf_config.encoder, **({} if two else ids))
    decoder = config_from_hf_gpt2(decoder_config, **ids)
    return seq2seq_config(encoder, decoder, **overrides)


def seq2seq_to_hf(model: Seq2Seq):
    """An `EncoderDecoderModel` with the weights of our Seq2Seq."""
    from transformers import EncoderDecoderModel

    hf_model = EncoderDecoderModel(config=hf_encoder_decoder_config(model.cfg))
    hf_model.load_state_dict(seq2seq_state_dict_to_hf(model.state_dict(), model.cfg))
    ids = model.cfg.for_stack("decoder")
    hf_model.generation_config.decoder_start_token_id = ids.bos_id
    hf_model.generation_config.bos_token_id = ids.bos_id
    hf_model.generation_config.eos_token_id = ids.eos_id
    hf_model.generation_config.pad_token_id = ids.pad_id
    return hf_model


def seq2seq_from_hf(hf_model, **overrides) -> Seq2Seq:
    """Our Seq2Seq with the weights of an `EncoderDecoderModel` (BERT encoder, GPT-2 decoder)."""
    cfg = config_from_hf_encoder_decoder(hf_model.config, **overrides)
    model = Seq2Seq(cfg)
    model.load_state_dict(seq2seq_state_dict_from_hf(hf_model.state_dict(), cfg))
    return model
