"""Any of our models <-> its Hugging Face class, and Hugging Face directories on disk: the class
`hf_config_for` picks (GPT-2, one of the Llama-shaped decoder families, BERT, or a BERT + GPT-2
EncoderDecoderModel), the conversions both ways (`model.hf`, `model.hf_decoders`,
`model.hf_seq2seq`), and `load_hf_dir` for a `save_pretrained` directory, ours
(`launch.export format=hf`) or a plain GPT-2, Llama, Qwen2.5, Qwen3, Mistral, OLMo 2 or BERT.

`transformers` is optional: it is imported inside the functions that build its models.
"""

from __future__ import annotations

import torch

from common.weights import load_failure
from model.bert import BERT
from model.config import ModelConfig
from model.hf import (
    bert_from_hf,
    bert_to_hf,
    gpt_from_hf,
    gpt_to_hf,
    hf_bert_config,
    hf_gpt2_config,
)
from model.hf_decoders import FAMILIES, gpt_from_hf_decoder, gpt_to_hf_decoder, hf_decoder_config
from model.hf_seq2seq import hf_encoder_decoder_config, seq2seq_from_hf, seq2seq_to_hf
from model.seq2seq import Seq2Seq

# A GPT with any of these is one of the Llama-shaped families', not a GPT-2.
DECODER_MARKS = {"positions": "rope", "norm": "rmsnorm", "activation": "swiglu"}


def is_decoder_family(cfg: ModelConfig) -> bool:
    """Whether our GPT converts to a Llama-shaped family (`model.hf_decoders`) or to GPT-2."""
    return (
        any(getattr(cfg, name) == value for name, value in DECODER_MARKS.items())
        or bool(cfg.family or cfg.qkv_bias or cfg.sliding_window or cfg.head_dim)
        or cfg.qk_norm != "none"
        or cfg.norm_position == "post_branch"
    )


def hf_config_for(cfg: ModelConfig):
    """The Hugging Face config our model converts to: GPT2Config, the config of a Llama-shaped
    family (`model.hf_decoders.family_of`), BertConfig, or an EncoderDecoderConfig for a Seq2Seq;
    ValueError, one line naming the option, for a model none of them can compute."""
    if cfg.arch == "seq2seq":
        return hf_encoder_decoder_config(cfg)
    if cfg.arch == "bert":
        return hf_bert_config(cfg)
    if is_decoder_family(cfg):
        return hf_decoder_config(cfg)
    return hf_gpt2_config(cfg)


def to_hf(model: torch.nn.Module):
    """The Hugging Face model (eval mode) with our model's weights, of the class
    `hf_config_for` picks."""
    if isinstance(model, Seq2Seq):
        return seq2seq_to_hf(model).eval()
    if isinstance(model, BERT):
        return bert_to_hf(model).eval()
    if is_decoder_family(model.cfg):
        return gpt_to_hf_decoder(model).eval()
    return gpt_to_hf(model).eval()


# Hugging Face model_type -> (the class a directory is loaded as, our converter)
HF_CLASSES = {
    "gpt2": ("GPT2LMHeadModel", gpt_from_hf),
    **{name: (family.model_class, gpt_from_hf_decoder) for name, family in FAMILIES.items()},
    "bert": ("BertForMaskedLM", bert_from_hf),
    "encoder-decoder": ("EncoderDecoderModel", seq2seq_from_hf),
}


def from_hf(hf_model, **overrides) -> torch.nn.Module:
    """Our model (eval mode) with the weights of a GPT2LMHeadModel, a decoder family's causal LM
    (`model.hf_decoders`), a BertForMaskedLM or a BERT + GPT-2 EncoderDecoderModel; `overrides`
    as the converters take them."""
    model_type = hf_model.config.model_type
    if model_type not in HF_CLASSES:
        raise ValueError(f"a Hugging Face {model_type} model: only {', '.join(HF_CLASSES)} convert")
    return HF_CLASSES[model_type][1](hf_model, **overrides).eval()


def load_hf_dir(directory: str, **overrides) -> torch.nn.Module:
    """Our model from a Hugging Face model directory on disk (`save_pretrained`'s layout): ours
    exported with `launch.export format=hf`, or a plain GPT-2, decoder family or BERT masked-LM.
    Weights the class needs but the directory lacks (a BERT saved without its MLM head) are
    refused rather than left at their random initialisation."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(directory)
    if config.model_type not in HF_CLASSES:
        raise ValueError(
            f"{directory} holds a {config.model_type} model: only {', '.join(HF_CLASSES)} convert"
        )
    hf_class = getattr(transformers, HF_CLASSES[config.model_type][0])
    try:
        hf_model, info = hf_class.from_pretrained(
            directory, dtype=torch.float32, output_loading_info=True
        )
    # a truncated model.safetensors, a pytorch_model.bin the weights-only load refuses
    except Exception as err:
        raise ValueError(f"{directory}: its weights cannot be read: {load_failure(err)}") from err
    if info["missing_keys"]:
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{directory} lacks {len(missing)} weights of {hf_class.__name__} "
            f"({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    return from_hf(hf_model, **overrides)
