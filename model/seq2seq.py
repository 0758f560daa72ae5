"""Seq2Seq: an encoder-decoder Transformer for translation.

Vaswani et al. 2017; laid out for warm starting as Rothe, Narayan and Severyn 2020
("Leveraging Pre-trained Checkpoints for Sequence Generation Tasks"): `encoder` is a bare
`Transformer` stack with BERT's keys, `decoder` is a `GPT` whose blocks add cross-attention,
its LM head tied to the decoder's token embeddings. A GPT or BERT state dict therefore loads
into `encoder.*` or `decoder.*` with its keys unchanged; see `model.warm_start`.
The two stacks may differ in norm position, activation, heads and so on (`ModelConfig.encoder`
and `.decoder`), but share d_model and the vocabulary. With `share_embeddings` the encoder's
token embedding is that same tensor too: `encoder.embed.tok.weight`, `decoder.embed.tok.weight`
and `decoder.lm_head.weight` name one Parameter.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

from model.blocks import ModelOutput, Transformer
from model.config import ModelConfig
from model.generation import generate_seq2seq
from model.gpt import GPT


class Seq2Seq(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Transformer(cfg.for_stack("encoder"), causal=False)
        self.decoder = GPT(cfg.for_stack("decoder"), cross_attention=True)
        if cfg.share_embeddings:
            # One matrix for source, target and output (Vaswani et al. 2017, section 3.4), tied
            # as GPT ties its head: one Parameter under three keys, counted and optimised once.
            # The decoder's (already its output projection's) is kept; both stacks scale
            # lookups by sqrt(d_model) (`model.blocks.Embeddings`).
            self.encoder.embed.tok.weight = self.decoder.embed.tok.weight
            self.register_load_state_dict_pre_hook(_refuse_different_shared_embeddings)

    def forward(
        self,
        src_ids: Tensor,
        src_mask: Optional[Tensor],
        decoder_input_ids: Tensor,
        decoder_mask: Optional[Tensor] = None,
        labels: Optional[Tensor] = None,
    ) -> ModelOutput:
        """src_ids, src_mask (B, S); decoder_input_ids = <s> + target (B, T); labels =
        target + </s>, padded with IGNORE_INDEX (aligned with the decoder's positions)."""
        memory = self.encoder(src_ids, src_mask)  # (B, S, C)
        # Logits (B, T, V) without labels; with them only the loss (see GPT.forward).
        return self.decoder(
            decoder_input_ids,
            decoder_mask,
            labels,
            memory=memory,
            memory_mask=src_mask,
            label_smoothing=self.cfg.label_smoothing,
        )

    # Decoding options are defined once, by the function: `seq2seq.generate(src_ids, ...)`.
    generate = generate_seq2seq


SHARED_EMBEDDINGS = (
    "encoder.embed.tok.weight",
    "decoder.embed.tok.weight",
    "decoder.lm_head.weight",
)


def _refuse_different_shared_embeddings(module, state_dict, prefix, *args) -> None:
    """A state dict may name the shared matrix once or under all three keys (as plain exports
    save tied weights), but loading three different matrices would keep whichever came last."""
    error_msgs = args[-1]
    values = [state_dict[prefix + key] for key in SHARED_EMBEDDINGS if prefix + key in state_dict]
    if any(v.shape != values[0].shape or not torch.equal(v, values[0]) for v in values[1:]):
        error_msgs.append(
            f"share_embeddings: {', '.join(SHARED_EMBEDDINGS)} must hold one matrix; they differ"
        )
