"""Conversion between our GPT / BERT and Hugging Face's GPT2LMHeadModel / BertForMaskedLM (the
Llama-shaped decoders: `model.hf_decoders`).

The design and its reasons: docs/design.md#modelhfpy.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, Mapping

import torch
from torch import Tensor

from model.bert import BERT
from model.config import ModelConfig
from model.gpt import GPT

StateDict = Dict[str, Tensor]

# Per-layer key maps, ours -> Hugging Face's, for the .weight and .bias of each module.
GPT2_LAYER = {
    "attn_norm": "ln_1",
    "attn.out_proj": "attn.c_proj",
    "mlp_norm": "ln_2",
    "mlp.fc": "mlp.c_fc",
    "mlp.proj": "mlp.c_proj",
}
GPT2_CONV1D = {"attn.out_proj", "mlp.fc", "mlp.proj"}  # stored transposed by Hugging Face
BERT_LAYER = {
    "attn.q_proj": "attention.self.query",
    "attn.k_proj": "attention.self.key",
    "attn.v_proj": "attention.self.value",
    "attn.out_proj": "attention.output.dense",
    "attn_norm": "attention.output.LayerNorm",
    "mlp.fc": "intermediate.dense",
    "mlp.proj": "output.dense",
    "mlp_norm": "output.LayerNorm",
}
BERT_GLOBAL = {
    "embed.tok.weight": "bert.embeddings.word_embeddings.weight",
    "norm.weight": "bert.embeddings.LayerNorm.weight",
    "norm.bias": "bert.embeddings.LayerNorm.bias",
    "head.dense.weight": "cls.predictions.transform.dense.weight",
    "head.dense.bias": "cls.predictions.transform.dense.bias",
    "head.norm.weight": "cls.predictions.transform.LayerNorm.weight",
    "head.norm.bias": "cls.predictions.transform.LayerNorm.bias",
    "head.decoder.bias": "cls.predictions.bias",
}
ACTIVATION_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_new", "relu": "relu"}
ACTIVATION_FROM_HF = {
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "relu": "relu",
}


def _activation_from_hf(name: str) -> str:
    if name not in ACTIVATION_FROM_HF:
        raise ValueError(
            f"activation {name!r} has no equivalent here; expected one of "
            f"{sorted(ACTIVATION_FROM_HF)}"
        )
    return ACTIVATION_FROM_HF[name]


def require(cfg: ModelConfig, reference: str, **wanted) -> None:
    for name, value in wanted.items():
        if getattr(cfg, name) != value:
            raise ValueError(
                f"only a model with {name}={value!r} converts to Hugging Face's "
                f"{reference}; got {getattr(cfg, name)!r}"
            )


def _require_classic(cfg: ModelConfig, arch: str, norm_position: str) -> None:
    """GPT-2's and BERT's conventions (the module docstring)."""
    require(
        cfg,
        arch,
        arch=arch,
        norm_position=norm_position,
        positions="learned",
        norm="layernorm",
        bias=True,
        tie_embeddings=True,
        qkv_bias=False,
        qk_norm="none",
        sliding_window=0,
        family="",
    )
    if cfg.head_size * cfg.n_heads != cfg.d_model:
        raise ValueError(
            f"head_dim={cfg.head_dim}: Hugging Face's {arch} has heads of d_model / n_heads"
        )
    if cfg.kv_heads != cfg.n_heads:
        raise ValueError(
            f"n_kv_heads={cfg.n_kv_heads}: Hugging Face's {arch} has a "
            "key/value head per query head"
        )
    if cfg.activation not in ACTIVATION_TO_HF:
        raise ValueError(
            f"activation {cfg.activation!r} has no equivalent in Hugging Face's {arch}"
        )


def special_ids(hf_config) -> dict:
    names = {"pad_id": "pad_token_id", "bos_id": "bos_token_id", "eos_id": "eos_token_id"}
    values = {ours: getattr(hf_config, theirs, None) for ours, theirs in names.items()}
    return {name: value for name, value in values.items() if value is not None}


# --- GPT <-> GPT2LMHeadModel -----------------------------------------------------------------


def config_from_hf_gpt2(hf_config, **overrides) -> ModelConfig:
    """Our GPT config for a `GPT2Config`; `overrides` applied last.

    Special ids are taken from the Hugging Face config where set; OpenAI's GPT-2 ids (50256)
    only fit its own vocabulary, so pass bos_id=..., eos_id=... for any other.
    """
    for name, ok in (
        ("scale_attn_weights", True),
        ("scale_attn_by_inverse_layer_idx", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
    ):
        if getattr(hf_config, name, ok) != ok:
            raise ValueError(f"GPT2Config.{name}={getattr(hf_config, name)!r} is not supported")
    cfg = ModelConfig(
        arch="gpt",
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.n_embd,
        n_layers=hf_config.n_layer,
        n_heads=hf_config.n_head,
        d_ff=hf_config.n_inner or 4 * hf_config.n_embd,
        max_seq_len=hf_config.n_positions,
        dropout=float(hf_config.resid_pdrop),
        activation=_activation_from_hf(hf_config.activation_function),
        norm_position="pre",
        positions="learned",
        layer_norm_eps=hf_config.layer_norm_epsilon,
        init_std=hf_config.initializer_range,
        **special_ids(hf_config),
    )
    return dataclasses.replace(cfg, **overrides).validate()


def hf_gpt2_config(cfg: ModelConfig):
    """A `GPT2Config` for our GPT config (pre-LN, learned positions)."""
    from transformers import GPT2Config

    _require_classic(cfg, "gpt", "pre")
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.max_seq_len,
        n_embd=cfg.d_model,
        n_layer=cfg.n_layers,
        n_head=cfg.n_heads,
        n_inner=cfg.d_ff,
        activation_function=ACTIVATION_TO_HF[cfg.activation],
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps,
        initializer_range=cfg.init_std,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
        tie_word_embeddings=True,
    )


def gpt_state_dict_from_hf(hf: Mapping[str, Tensor], n_layers: int) -> StateDict:
    """A GPT2LMHeadModel state dict in our GPT's keys and layout."""
    ours = {
        "embed.tok.weight": hf["transformer.wte.weight"],
        "embed.pos.weight": hf["transformer.wpe.weight"],
        "norm.weight": hf["transformer.ln_f.weight"],
        "norm.bias": hf["transformer.ln_f.bias"],
        "lm_head.weight": hf["transformer.wte.weight"],
    }
    for i in range(n_layers):
        theirs, mine = f"transformer.h.{i}.", f"blocks.{i}."
        for our_name, hf_name in GPT2_LAYER.items():
            weight = hf[f"{theirs}{hf_name}.weight"]
            ours[f"{mine}{our_name}.weight"] = weight.t() if our_name in GPT2_CONV1D else weight
            ours[f"{mine}{our_name}.bias"] = hf[f"{theirs}{hf_name}.bias"]
        qkv_weight = hf[f"{theirs}attn.c_attn.weight"].t()  # (3C, C)
        qkv_bias = hf[f"{theirs}attn.c_attn.bias"]  # (3C,)
        for name, weight, bias in zip(
            ("q_proj", "k_proj", "v_proj"), qkv_weight.chunk(3), qkv_bias.chunk(3)
        ):
            ours[f"{mine}attn.{name}.weight"] = weight
            ours[f"{mine}attn.{name}.bias"] = bias
    return {k: v.contiguous() for k, v in ours.items()}


def gpt_state_dict_to_hf(ours: Mapping[str, Tensor], n_layers: int) -> StateDict:
    """Our GPT state dict in GPT2LMHeadModel's keys and layout."""
    hf = {
        "transformer.wte.weight": ours["embed.tok.weight"],
        "transformer.wpe.weight": ours["embed.pos.weight"],
        "transformer.ln_f.weight": ours["norm.weight"],
        "transformer.ln_f.bias": ours["norm.bias"],
        "lm_head.weight": ours["embed.tok.weight"],
    }
    for i in range(n_layers):
        theirs, mine = f"transformer.h.{i}.", f"blocks.{i}."
        for our_name, hf_name in GPT2_LAYER.items():
            weight = ours[f"{mine}{our_name}.weight"]
            hf[f"{theirs}{hf_name}.weight"] = weight.t() if our_name in GPT2_CONV1D else weight
            hf[f"{theirs}{hf_name}.bias"] = ours[f"{mine}{our_name}.bias"]
        projections = [f"{mine}attn.{name}" for name in ("q_proj", "k_proj", "v_proj")]
        # (C, 3C)
        hf[f"{theirs}attn.c_attn.weight"] = torch.cat(
            [ours[f"{p}.weight"] for p in projections]
        ).t()
        hf[f"{theirs}attn.c_attn.bias"] = torch.cat([ours[f"{p}.bias"] for p in projections])
    return {k: v.contiguous() for k, v in hf.items()}


def gpt_from_hf(hf_model, **overrides) -> GPT:
    """Our GPT with the weights of a `GPT2LMHeadModel`."""
    cfg = config_from_hf_gpt2(hf_model.config, **overrides)
    model = GPT(cfg)
    model.load_state_dict(gpt_state_dict_from_hf(hf_model.state_dict(), cfg.n_layers))
    return model


def gpt_to_hf(model: GPT):
    """A `GPT2LMHeadModel` with the weights of our GPT."""
    from transformers import GPT2LMHeadModel

    hf_model = GPT2LMHeadModel(hf_gpt2_config(model.cfg))
    hf_model.load_state_dict(gpt_state_dict_to_hf(model.state_dict(), model.cfg.n_layers))
    return hf_model


# --- BERT <-> BertForMaskedLM ---------------------------------------------------------------


def config_from_hf_bert(hf_config, **overrides) -> ModelConfig:
    """Our BERT config for a `BertConfig`; `overrides` (e.g. special ids) applied last."""
    for name, ok in (
        ("is_decoder", False),
        ("add_cross_attention", False),
        ("tie_word_embeddings", True),
        ("position_embedding_type", "absolute"),
    ):
        if getattr(hf_config, name, ok) != ok:
            raise ValueError(f"BertConfig.{name}={getattr(hf_config, name)!r} is not supported")
    cfg = ModelConfig(
        arch="bert",
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        d_ff=hf_config.intermediate_size,
        max_seq_len=hf_config.max_position_embeddings,
        dropout=float(hf_config.hidden_dropout_prob),
        activation=_activation_from_hf(hf_config.hidden_act),
        norm_position="post",
        positions="learned",
        layer_norm_eps=hf_config.layer_norm_eps,
        init_std=hf_config.initializer_range,
        **special_ids(hf_config),
    )
    return dataclasses.replace(cfg, **overrides).validate()


def hf_bert_config(cfg: ModelConfig):
    """A `BertConfig` for our BERT config (post-LN, learned positions, one token type)."""
    from transformers import BertConfig

    _require_classic(cfg, "bert", "post")
    return BertConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        intermediate_size=cfg.d_ff,
        hidden_act=ACTIVATION_TO_HF[cfg.activation],
        hidden_dropout_prob=cfg.dropout,
        attention_probs_dropout_prob=cfg.dropout,
        max_position_embeddings=cfg.max_seq_len,
        type_vocab_size=1,
        initializer_range=cfg.init_std,
        layer_norm_eps=cfg.layer_norm_eps,
        pad_token_id=cfg.pad_id,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        tie_word_embeddings=True,
    )


def bert_state_dict_from_hf(hf: Mapping[str, Tensor], n_layers: int) -> StateDict:
    """A BertForMaskedLM state dict in our BERT's keys (token type 0 folded into positions)."""
    ours = {mine: hf[theirs] for mine, theirs in BERT_GLOBAL.items()}
    token_type = hf["bert.embeddings.token_type_embeddings.weight"][0]  # (C,)
    ours["embed.pos.weight"] = hf["bert.embeddings.position_embeddings.weight"] + token_type
    ours["head.decoder.weight"] = ours["embed.tok.weight"]
    for i in range(n_layers):
        for our_name, hf_name in BERT_LAYER.items():
            for kind in ("weight", "bias"):
                ours[f"blocks.{i}.{our_name}.{kind}"] = hf[
                    f"bert.encoder.layer.{i}.{hf_name}.{kind}"
                ]
    return {k: v.contiguous() for k, v in ours.items()}


def bert_state_dict_to_hf(ours: Mapping[str, Tensor], n_layers: int) -> StateDict:
    """Our BERT state dict in BertForMaskedLM's keys (one zero token-type row)."""
    hf = {theirs: ours[mine] for mine, theirs in BERT_GLOBAL.items()}
    position = ours["embed.pos.weight"]
    hf["bert.embeddings.position_embeddings.weight"] = position
    hf["bert.embeddings.token_type_embeddings.weight"] = torch.zeros_like(position[:1])
    hf["cls.predictions.decoder.weight"] = ours["embed.tok.weight"]
    hf["cls.predictions.decoder.bias"] = ours["head.decoder.bias"]
    for i in range(n_layers):
        for our_name, hf_name in BERT_LAYER.items():
            for kind in ("weight", "bias"):
                hf[f"bert.encoder.layer.{i}.{hf_name}.{kind}"] = ours[
                    f"blocks.{i}.{our_name}.{kind}"
                ]
    return {k: v.contiguous() for k, v in hf.items()}


def bert_from_hf(hf_model, **overrides) -> BERT:
    """Our BERT with the weights of a `BertForMaskedLM`."""
    cfg = config_from_hf_bert(hf_model.config, **overrides)
    model = BERT(cfg)
    model.load_state_dict(bert_state_dict_from_hf(hf_model.state_dict(), cfg.n_layers))
    return model


def bert_to_hf(model: BERT):
    """A `BertForMaskedLM` with the weights of our BERT."""
    from transformers import BertForMaskedLM

    hf_model = BertForMaskedLM(hf_bert_config(model.cfg))
    hf_model.load_state_dict(bert_state_dict_to_hf(model.state_dict(), model.cfg.n_layers))
    return hf_model
