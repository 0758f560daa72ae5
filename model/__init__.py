"""The three networks of the project, as plain PyTorch: GPT, BERT and Seq2Seq.

Built from one set of blocks (`model.blocks`) and configured by `ModelConfig`; nothing here
imports deepspeed, ray, wandb or the `launch` and `pipeline` packages, and `transformers` is
imported only inside `model.hf`'s functions.
"""

from torch import nn

from model.bert import BERT
from model.blocks import KVCache, ModelOutput, attention_kernels
from model.config import ModelConfig, StackConfig
from model.flops import flops_per_token, llmc_flops_per_token, matmul_params, training_flops
from model.generation import Hypotheses
from model.gpt import GPT
from model.seq2seq import Seq2Seq
from model.warm_start import Pretrained, WarmStartError, WarmStartReport, seq2seq_config, warm_start

ARCH_CLASSES = {"gpt": GPT, "bert": BERT, "seq2seq": Seq2Seq}


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model `cfg.arch` names, freshly initialised; ValueError on a bad config."""
    cfg.validate()
    return ARCH_CLASSES[cfg.arch](cfg)


__all__ = [
    "BERT",
    "GPT",
    "Hypotheses",
    "KVCache",
    "ModelConfig",
    "ModelOutput",
    "Pretrained",
    "Seq2Seq",
    "StackConfig",
    "WarmStartError",
    "WarmStartReport",
    "attention_kernels",
    "build_model",
    "flops_per_token",
    "llmc_flops_per_token",
    "matmul_params",
    "seq2seq_config",
    "training_flops",
    "warm_start",
]
