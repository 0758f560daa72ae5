"""BERT: a bidirectional encoder with a masked-language-model head.

Devlin et al. 2019, "BERT"; pretrained RoBERTa-style (Liu et al. 2019): masked LM only, no
next-sentence task and no token types. The head has Hugging Face `BertForMaskedLM`'s shape
(dense, activation, LayerNorm, decoder tied to the token embeddings, output bias) so that
`model.hf` converts it both ways.
"""

from __future__ import annotations

from typing import Optional

from torch import Tensor, nn

from model.blocks import ModelOutput, Transformer, init_weights, make_activation, make_norm
from model.config import ModelConfig
from model.loss import IGNORE_INDEX, cross_entropy


class MLMHead(nn.Module):
    """dense, activation (a gated MLP's: its gate's, as ModernBERT's head), norm, decoder."""

    def __init__(self, cfg: ModelConfig, token_embedding: nn.Embedding):
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias)
        self.act = make_activation(cfg.activation)
        self.norm = make_norm(cfg)
        self.decoder = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.bias)
        init_weights(self.dense, cfg.init_std)
        if cfg.tie_embeddings:
            self.decoder.weight = token_embedding.weight  # tied; the bias is the head's own
        else:
            nn.init.normal_(self.decoder.weight, mean=0.0, std=cfg.init_std)
        if self.decoder.bias is not None:
            nn.init.zeros_(self.decoder.bias)

    def forward(self, h: Tensor) -> Tensor:
        return self.decoder(self.norm(self.act(self.dense(h))))  # (B, T, V)


class BERT(Transformer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, causal=False)
        self.head = MLMHead(cfg, self.embed.tok)

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
        scored_index: Optional[Tensor] = None,
        *,
        document_ids: Optional[Tensor] = None,
    ) -> ModelOutput:
        """input_ids (B, T) with masked positions replaced; attention_mask (B, T) 1 = real;
        labels (B, T): the original token at masked positions, IGNORE_INDEX elsewhere;
        document_ids (B, T): the document of each token of a packed block, for a block-diagonal
        mask and positions restarting at each document (see `model.blocks`).

        Without labels, `logits` are (B, T, V). With labels, the head runs only on the scored
        positions: `scored_logits` (N, V), one row per label that is not IGNORE_INDEX, in
        row-major order. With 15% of tokens masked that skips 85% of the head's vocabulary
        projection (as NVIDIA's and Megatron's BERT pretraining do). `scored_index` (N,), the
        flat indices of those labels, may be given (found on the host): a boolean selection on
        the device makes it wait for the count N.
        """
        h = super().forward(input_ids, attention_mask, document_ids=document_ids)  # (B, T, C)
        if labels is None:
            return ModelOutput(logits=self.head(h))  # (B, T, V)
        if scored_index is None:
            scored_index = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)  # (N,)
        logits = self.head(h.reshape(-1, h.shape[-1]).index_select(0, scored_index))  # (N, V)
        return ModelOutput(
            loss=cross_entropy(logits, labels.reshape(-1).index_select(0, scored_index)),
            scored_logits=logits,
        )
