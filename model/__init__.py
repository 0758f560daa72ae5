"""The three networks of the project, as plain PyTorch: GPT, BERT and Seq2Seq.

Built from one set of blocks (`model.blocks`) and configured by `ModelConfig`; nothing here
imports deepspeed, ray, wandb or the `launch` and `pipeline` packages, and `transformers` is
imported only inside `model.hf`'s functions.

The names below load their module at first use (PEP 562): `from model.config import
ModelConfig`, which every command line's schema needs, then imports neither torch nor the
networks, so `--help` and a config's errors answer without torch's import
(docs/design.md#a-ranks-start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from model.config import ModelConfig

# Each public name and the module that defines it, imported when the name is first asked for.
_HOMES = {
    "BERT": "model.bert",
    "GPT": "model.gpt",
    "Seq2Seq": "model.seq2seq",
    "KVCache": "model.cache",
    "ModelOutput": "model.blocks",
    "attention_kernels": "model.blocks",
    "ModelConfig": "model.config",
    "StackConfig": "model.config",
    "flops_per_token": "model.flops",
    "llmc_flops_per_token": "model.flops",
    "matmul_params": "model.flops",
    "training_flops": "model.flops",
    "Hypotheses": "model.generation",
    "Pretrained": "model.warm_start",
    "WarmStartError": "model.warm_start",
    "WarmStartReport": "model.warm_start",
    "seq2seq_config": "model.warm_start",
}
# Not here: the function `warm_start`, whose name is its module's (`from model.warm_start import
# warm_start`); importing that module binds `model.warm_start` to the module, as for any package.
_ARCH_CLASS_NAMES = {"gpt": "GPT", "bert": "BERT", "seq2seq": "Seq2Seq"}


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value  # found directly from now on
    return value


def build_model(cfg: ModelConfig) -> nn.Module:
    """The model `cfg.arch` names, freshly initialised; ValueError on a bad config."""
    cfg.validate()
    return __getattr__(_ARCH_CLASS_NAMES[cfg.arch])(cfg)


__all__ = [*_HOMES, "build_model"]
