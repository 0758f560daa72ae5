"""The task table: what each of causal_lm, mlm and translation trains, on what,
and how it is scored.

One training loop (`launch.train`) serves all three and never branches on a task's name: a
`Task` owns the model it trains (`arch`), the shard set that feeds it (`dataset`, from the
data contract `pipeline.format`, since the pipeline cannot import `launch`), the one place
where its labels are made (`model_inputs`: from the loader's token batch to the model's
keyword arguments), its FLOPs, its extra evaluation metrics and whether it can be warm-started.

Labels are aligned with the positions that predict them for every task: `labels[:, t]` is
the token position t should predict, `model.loss.IGNORE_INDEX` where nothing is scored. The
models never shift them.

With `data.document_mask` the loader's batch also has `document_ids` (which document of a
packed block each token belongs to), passed on to GPT and BERT as they are: attention and
positions stay within each document (`model.blocks`). The labels do not change: the `</s>` that
ends a document still predicts the first token of the next, seeing only its own document. FLOPs
are counted as for full attention (what a dense kernel computes; FlexAttention skips part of it).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from model import ModelConfig, ModelOutput, training_flops
from model.loss import IGNORE_INDEX
from pipeline.format import DATASET_FOR_TASK

Batch = dict[str, torch.Tensor]
# Inputs whose length follows the batch's content, not its shape (BERT's count of masked
# positions): marked dynamic for torch.compile as they reach the device, so that a compiled
# model traces one graph for every count instead of a second one when the count first changes.
PER_BATCH_LENGTHS = {"scored_index"}


def _documents(batch: Batch) -> Batch:
    """The document structure of packed blocks, when the loader gives one (`data.document_mask`)."""
    return {"document_ids": batch["document_ids"]} if "document_ids" in batch else {}


def _causal_lm_inputs(batch: Batch) -> Batch:
    ids, mask = batch["input_ids"], batch["attention_mask"]
    # Position t predicts token t + 1; the last position and padding predict nothing.
    labels = F.pad(
        ids[:, 1:].masked_fill(mask[:, 1:] == 0, IGNORE_INDEX), (0, 1), value=IGNORE_INDEX
    )
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, **_documents(batch)}


def _mlm_inputs(batch: Batch) -> Batch:
    # Only the positions the masking selected are scored, against the token that was there.
    # Their flat indices are found here, on the host: the model's own boolean indexing would
    # make the device wait for the count at every batch.
    labels = batch["original_ids"].masked_fill(~batch["masked_positions"], IGNORE_INDEX)
    scored_index = (labels.reshape(-1) != IGNORE_INDEX).nonzero().squeeze(1)
    return {
        "input_ids": batch["input_ids"],
        "attention_mask": batch["attention_mask"],
        "labels": labels,
        "scored_index": scored_index,
        **_documents(batch),
    }


def _translation_inputs(batch: Batch) -> Batch:
    # tgt_ids is "<s> target </s>": the decoder reads it without its last token and predicts it
    # without its first (teacher forcing).
    tgt = batch["tgt_ids"]
    decoder_mask = batch["tgt_mask"][:, 1:]
    return {
        "src_ids": batch["src_ids"],
        "src_mask": batch["src_mask"],
        # drops the </s>; what stands in its place is never read (masked, not scored)
        "decoder_input_ids": tgt[:, :-1].masked_fill(decoder_mask == 0, 0),
        "decoder_mask": decoder_mask,
        "labels": tgt[:, 1:].masked_fill(decoder_mask == 0, IGNORE_INDEX),
    }


def _lm_flops(cfg: ModelConfig, inputs: Batch) -> float:
    rows, seq_len = inputs["input_ids"].shape
    return training_flops(cfg, seq_len) * rows


def _mlm_flops(cfg: ModelConfig, inputs: Batch) -> float:
    rows, seq_len = inputs["input_ids"].shape
    # BERT's head runs on these only (host inputs)
    scored = host_value((inputs["labels"] != IGNORE_INDEX).sum()) / rows
    return training_flops(cfg, seq_len, scored=scored) * rows


def _translation_flops(cfg: ModelConfig, inputs: Batch) -> float:
    rows, src_len = inputs["src_ids"].shape
    return training_flops(cfg, src_len, inputs["decoder_input_ids"].shape[1]) * rows


def _masked_accuracy_sums(output: ModelOutput, inputs: Batch) -> dict[str, float]:
    """Correct and scored predictions of an MLM batch; `output.scored_logits` holds the model's
    logits at the scored positions, in the order `labels != IGNORE_INDEX` lists them."""
    labels = inputs["labels"]
    targets = labels[labels != IGNORE_INDEX]  # (N,)
    correct = (output.scored_logits.argmax(-1) == targets).sum()  # on the device: no (N, V) copy
    return {"correct": float(correct), "scored": float(targets.numel())}


def _accuracy(sums: dict[str, float]) -> dict[str, float]:
    return {"eval/accuracy": sums["correct"] / max(sums["scored"], 1.0)}


def host_value(tensor: torch.Tensor) -> float | int | bool:
    """The number in a 0-dim tensor on the host (made from a loader batch), read without waiting
    for any device; refused for a device tensor, whose read would wait for its queued work. The
    training step's figures from the device are read once per step
    (`launch.train.step.train_step`)."""
    if tensor.device.type != "cpu":
        raise ValueError(
            f"host_value: a {tensor.device.type} tensor: reading it would wait for the device"
        )
    return tensor.item()


@dataclass(frozen=True)
class Task:
    name: str
    arch: str  # the model it trains
    # token batch -> the model's keyword arguments, labels made here
    make_inputs: Callable[[Batch], Batch]
    # training FLOPs of one micro batch of model inputs
    flops: Callable[[ModelConfig, Batch], float]
    warm_startable: bool = False  # init.encoder / init.decoder apply
    # Extra evaluation: per-batch sums (all-reduced over ranks), then the metrics made of them.
    eval_sums: Callable[[ModelOutput, Batch], dict[str, float]] | None = None
    eval_metrics: Callable[[dict[str, float]], dict[str, float]] | None = None

    @property
    def dataset(self) -> str:
        """The shard set that feeds this task (`pipeline.format`)."""
        return DATASET_FOR_TASK[self.name]

    def model_inputs(self, batch: Batch, device: torch.device | None = None) -> Batch:
        """The model's keyword arguments for a loader batch, on `device` (see `to_device`)."""
        inputs = self.make_inputs(batch)
        return inputs if device is None else self.to_device(inputs, device)

    @staticmethod
    def to_device(inputs: Batch, device: torch.device) -> Batch:
        """Model inputs made on the host, moved to `device`. An attention mask with no padding
        (packed pretraining blocks) is dropped, so that attention takes SDPA's fused causal or
        unmasked path; it is checked here, on the host, where it costs no device sync (the
        document structure, `document_ids`, is never dropped: it is a mask of its own). To CUDA
        every tensor goes from pinned memory (the loader pins its batches; the labels made here
        are pinned now), so the copies are asynchronous: a non_blocking copy from pageable
        memory is a synchronous one."""
        kept = {
            key: value
            for key, value in inputs.items()
            if not (
                key == "attention_mask" and value.device.type == "cpu" and host_value(value.all())
            )
        }
        if torch.device(device).type == "cuda":
            kept = {
                key: value
                if value.device.type != "cpu" or value.is_pinned()
                else value.pin_memory()
                for key, value in kept.items()
            }
        moved = {key: value.to(device, non_blocking=True) for key, value in kept.items()}
        # imported where a model is compiled; else nothing to mark
        dynamo = sys.modules.get("torch._dynamo")
        if dynamo is not None:
            for key in PER_BATCH_LENGTHS.intersection(moved):
                dynamo.maybe_mark_dynamic(moved[key], 0)
        return moved

    @staticmethod
    def target_mask(inputs: Batch) -> torch.Tensor:
        """Which positions are scored (for token-weighted losses and accuracy)."""
        return inputs["labels"] != IGNORE_INDEX

    @staticmethod
    def tokens(inputs: Batch) -> int:
        """Tokens processed: every non-pad input token (throughput and MFU count these)."""
        masks = [inputs[k] for k in ("attention_mask", "src_mask", "decoder_mask") if k in inputs]
        return int(sum(host_value(m.sum()) for m in masks))


TASKS = {
    "causal_lm": Task("causal_lm", "gpt", _causal_lm_inputs, _lm_flops),
    "mlm": Task(
        "mlm",
        "bert",
        _mlm_inputs,
        _mlm_flops,
        eval_sums=_masked_accuracy_sums,
        eval_metrics=_accuracy,
    ),
    "translation": Task(
        "translation", "seq2seq", _translation_inputs, _translation_flops, warm_startable=True
    ),
}
