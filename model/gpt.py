"""GPT: a decoder-only causal language model with tied input and output embeddings.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2);
karpathy/nanoGPT. Labels follow the Hugging Face convention: aligned with `input_ids`,
shifted inside `forward`, -100 ignored. A Seq2Seq's decoder is a GPT whose blocks have
cross-attention (Rothe et al. 2020), which is why `forward` also takes encoder memory.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from model.blocks import KVCache, ModelOutput, Transformer, cross_entropy
from model.config import ModelConfig
from model.generation import generate_causal


class GPT(Transformer):
    def __init__(self, cfg: ModelConfig, cross_attention: bool = False):
        super().__init__(cfg, causal=True, cross_attention=cross_attention)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
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
    ) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T) 1 = real, 0 = pad (B, past + T with a
        cache); labels (B, T) aligned with input_ids, -100 ignored."""
        h = super().forward(input_ids, attention_mask, memory=memory, memory_mask=memory_mask, cache=cache)
        logits = self.lm_head(h)  # (B, T, V)
        loss = None if labels is None else cross_entropy(logits[:, :-1], labels[:, 1:])
        return ModelOutput(logits=logits, loss=loss)

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
