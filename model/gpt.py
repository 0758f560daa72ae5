"""GPT: a decoder-only causal language model, its output layer tied to its input
embeddings by default.

Radford et al. 2019, "Language Models are Unsupervised Multitask Learners" (GPT-2);
karpathy/nanoGPT. Labels are the project's (`model.loss`): labels[:, t] is the token
position t predicts, already the next token (`launch.tasks` makes them; unlike Hugging Face's
GPT-2, nothing is shifted here), IGNORE_INDEX scores nothing. A Seq2Seq's decoder is a GPT
whose blocks have cross-attention (Rothe et al. 2020), which is why `forward` also takes
encoder memory.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor

from model.blocks import ModelOutput, Transformer, init_weights, moe_layers
from model.cache import KVCache
from model.config import ModelConfig
from model.generation import generate_causal
from model.loss import LMHead


class GPT(Transformer):
    def __init__(self, cfg: ModelConfig, cross_attention: bool = False):
        super().__init__(cfg, causal=True, cross_attention=cross_attention)
        self.lm_head = LMHead(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            # Tied (Press & Wolf 2017): the state dict lists the tensor under both names.
            self.lm_head.weight = self.embed.tok.weight
        else:
            init_weights(self.lm_head, cfg.init_std)

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
        document_ids: Optional[Tensor] = None,
    ) -> ModelOutput:
        """input_ids (B, T); attention_mask (B, T) 1 = real, 0 = pad (B, past + T with a
        cache); labels (B, T): the token each position predicts, IGNORE_INDEX for none;
        document_ids (B, T): the document of each token of a packed block, for a block-causal
        mask and positions restarting at each document (see `model.blocks`).

        With labels the output has the loss and no logits: `model.loss` computes it without
        materialising the (B, T, V) logits, which a training step never needs."""
        h = super().forward(
            input_ids,
            attention_mask,
            memory=memory,
            memory_mask=memory_mask,
            cache=cache,
            document_ids=document_ids,
        )
        if labels is None:
            return ModelOutput(logits=self.lm_head(h))  # (B, T, V)
        moe = moe_layers(self)
        return ModelOutput(
            loss=self.lm_head(h, labels, label_smoothing),
            aux_loss=sum(layer.aux_loss for layer in moe) if moe else None,
        )

    # Decoding options are defined once, by the function: `gpt.generate(input_ids, ...)`.
    generate = generate_causal
