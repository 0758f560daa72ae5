"""The task table: what each of causal_lm, mlm and translation trains and how it is scored.

One training loop serves all three; a task only says which model it trains, which shards
feed it, which batch fields go into the model, and how to count its targets.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Task:
    name: str
    arch: str
    inputs: tuple[str, ...]  # batch fields passed to the model's forward
    shifted: bool  # labels aligned with inputs and shifted inside the model (causal LM)

    def model_inputs(self, batch: dict, device: torch.device) -> dict:
        return {key: batch[key].to(device, non_blocking=True) for key in self.inputs}

    def target_mask(self, batch: dict) -> torch.Tensor:
        """Which label positions are scored (for token-weighted losses and accuracy)."""
        labels = batch["labels"][:, 1:] if self.shifted else batch["labels"]
        return labels != -100

    def tokens(self, batch: dict) -> int:
        """Tokens processed: every non-pad input token (throughput and MFU count these)."""
        masks = [batch[k] for k in ("attention_mask", "src_mask", "decoder_mask") if k in batch]
        return int(sum(int(m.sum()) for m in masks))


TASKS = {
    "causal_lm": Task("causal_lm", "gpt", ("input_ids", "attention_mask", "labels"), shifted=True),
    "mlm": Task("mlm", "bert", ("input_ids", "attention_mask", "labels"), shifted=False),
    "translation": Task("translation", "seq2seq", ("src_ids", "src_mask", "decoder_input_ids", "decoder_mask", "labels"), shifted=False),
}


def masked_accuracy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int]:
    """(correct, total) predictions at the scored positions of an MLM batch: logits (N, V) are
    the model's at those positions only (see `model.bert.BERT.forward`), labels (B, T)."""
    targets = labels[labels != -100]  # (N,)
    return int((logits.argmax(-1) == targets).sum()), targets.numel()
