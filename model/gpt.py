"""GPT: a decoder-only causal language model with tied input and output embeddings.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2);
karpathy/nanoGPT. Labels follow the Hugging Face convention: aligned with `input_ids`,
shifted inside `forward`, -100 ignored. A Seq2Seq's decoder is a GPT whose blocks have
cross-attention (Rothe et al. 2020), which is why `forward` also takes encoder memory.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from model.blocks import IGNORE_INDEX, KVCache, ModelOutput, Transformer
from model.config import ModelConfig
from model.generation import generate_causal
from model.loss import LMHead


class GPT(Transformer):
    def __init__(self, cfg: ModelConfig, cross_attention: bool = False):
        super().__init__(cfg, causal=True, cross_attention=cross_attention)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        # Tied (Press & Wolf 2017): the state dict lists the tensor under both names.
        self.lm_head.weight = self.embed.tok.weight

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        *,
        memory: Optional[Tensor] = None,
        memory_mask: Optional[Tensor] = None,
        cache: Optional[KVCache] = None,
        label_smoothing: float = 0.0,
        shift_labels: bool = True,
    ) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T) 1 = real, 0 = pad (B, past + T with a
        cache); labels (B, T) aligned with input_ids and shifted here (or already the next
        tokens, shift_labels=False, as a Seq2Seq passes them), -100 ignored.

        With labels the output has the loss and no logits: `model.loss` computes it without
        materialising the (B, T, V) logits, which a training step never needs."""
        h = super().forward(input_ids, attention_mask, memory=memory, memory_mask=memory_mask, cache=cache)
        if labels is None:
            return ModelOutput(logits=self.lm_head(h))  # (B, T, V)
        if shift_labels:
            labels = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)  # the last position has no target
        return ModelOutput(logits=None, loss=self.lm_head(h, labels, label_smoothing))

    def generate(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        max_new_tokens: int = 32,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        eos_id: Optional[int] = None,
        generator: Optional[torch.Generator] = None,
        synced: bool = False,
    ) -> Tensor:
        """Continue left-padded prompts; see `model.generation.generate_causal`."""
        return generate_causal(
            self,
            input_ids,
            attention_mask,
            max_new_tokens=max_new_tokens,
            do_sample=do_sample,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            eos_id=eos_id,
            generator=generator,
            synced=synced,
        )
