"""Turn one micro batch of decoded samples into the loader's token batch (the contract
is `pipeline.format`).

Collation is split in two. In a DataLoader worker, `pack(task, samples, ...)` turns the
samples into a few numpy arrays: the token ids padded to the longest row (in their stored
dtype), the row lengths, and for MLM the results of the seeded masking. In the main process,
`unpack(task, packed)` makes the int64 tensors and attention masks of the token batch. A dict
of numpy arrays crosses from a worker pickled in one message; torch tensors would each take a
separate trip through shared memory, which for batches of this size costs more than building
the masks again.

With `data.document_mask`, a packed sample also holds its `doc_starts` (where each document
starts in the block, `pipeline.format`), and the batch gains `document_ids` (B, T) int64: the
document of each token, counted from 0 in each row (padding takes its row's last document).
The model keeps attention, and positions, within each document (`model.blocks`).

The token batch carries no labels: what a task predicts is the trainer's business
(`launch.tasks` makes the labels, with the ignore index of `model.loss`).
"""

from __future__ import annotations

import numpy as np
import torch

from pipeline.specials import Specials


def pack(
    task: str,
    samples: list[list[np.ndarray]],
    specials: Specials,
    mlm_masking: MLMMasking | None = None,
    generators: list[torch.Generator] | None = None,
    document_mask: bool = False,
    target_specials: Specials | None = None,
) -> dict[str, np.ndarray]:
    """A micro batch of decoded samples (one list of field arrays each: input_ids, and
    doc_starts with `document_mask`) as numpy arrays, padded with the dataset's pad id (a pair
    framed as its tokenizers frame a source and a target: `specials` the source side's,
    `target_specials` the target side's when it has a tokenizer of its own); MLM draws each
    sample's mask from its own generator, so a mask depends on that seed alone."""
    if task == "translation":
        return _pack_translation(
            [(src, tgt) for src, tgt in samples], specials, target_specials or specials
        )
    pad = specials.pad_id
    if document_mask:
        blocks, doc_starts = zip(*samples)
        ids, lengths = _stack(list(blocks), pad)
        packed = {
            "ids": ids,
            "lengths": lengths,
            "document_ids": _document_ids(doc_starts, ids.shape[1]),
        }
    else:
        ids, lengths = _stack([ids for (ids,) in samples], pad)
        packed = {"ids": ids, "lengths": lengths}
    if task == "causal_lm":
        return packed
    return {**packed, **mlm_masking.apply(ids, lengths, generators)}


def unpack(task: str, packed: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The token batch of `pipeline.format.BATCH_FIELDS[task]`, from what `pack` made."""
    if task == "translation":
        return {
            "src_ids": _long(packed["src_ids"]),
            "src_mask": _mask(packed["src_lengths"], packed["src_ids"].shape[1]),
            "tgt_ids": _long(packed["tgt_ids"]),
            "tgt_mask": _mask(packed["tgt_lengths"], packed["tgt_ids"].shape[1]),
        }
    batch = {
        "input_ids": _long(packed["ids"]),
        "attention_mask": _mask(packed["lengths"], packed["ids"].shape[1]),
    }
    if task == "mlm":
        batch["original_ids"] = _long(packed["original_ids"])
        batch["masked_positions"] = torch.from_numpy(packed["masked_positions"])
    if "document_ids" in packed:
        batch["document_ids"] = _long(packed["document_ids"])
    return batch


class MLMMasking:
    """BERT's masking (Devlin et al. 2019, section 3.1): select `probability` of the real,
    non-special tokens; of those, `mask_fraction` become the mask token (`mask_id`),
    `random_fraction` a random non-special token, the rest stay as they are."""

    def __init__(
        self,
        vocab_size: int,
        special_ids: list[int],
        mask_id: int,
        probability: float,
        mask_fraction: float,
        random_fraction: float,
    ):
        self.special_ids = torch.tensor(sorted(special_ids), dtype=torch.long)
        self.mask_id = mask_id
        keep = np.ones(vocab_size, dtype=bool)
        keep[[i for i in special_ids if i < vocab_size]] = False
        self.replacement_ids = torch.from_numpy(np.flatnonzero(keep))
        self.probability, self.mask_fraction, self.random_fraction = (
            probability,
            mask_fraction,
            random_fraction,
        )

    def apply(
        self, ids: np.ndarray, lengths: np.ndarray, generators: list[torch.Generator]
    ) -> dict[str, np.ndarray]:
        """The masked ids (replacing `ids` in the batch), the original ids and the selected
        positions. Row b's draws come from generators[b] and cover its own length only, so a
        sample's mask does not depend on the batch it is in."""
        original = torch.from_numpy(ids.astype(np.int64))
        select_draw = torch.ones(original.shape)  # 1 on padding: never below the probability
        action = torch.ones(original.shape)
        random_ids = torch.zeros(original.shape, dtype=torch.long)
        for row, (length, generator) in enumerate(zip(lengths.tolist(), generators, strict=True)):
            select_draw[row, :length] = torch.rand(length, generator=generator)
            action[row, :length] = torch.rand(length, generator=generator)
            random_ids[row, :length] = self.replacement_ids[
                torch.randint(len(self.replacement_ids), (length,), generator=generator)
            ]
        selected = ~torch.isin(original, self.special_ids) & (select_draw < self.probability)
        to_mask = selected & (action < self.mask_fraction)
        to_random = (
            selected
            & (action >= self.mask_fraction)
            & (action < self.mask_fraction + self.random_fraction)
        )
        masked = torch.where(to_mask, torch.full_like(original, self.mask_id), original)
        masked = torch.where(to_random, random_ids, masked)
        return {"ids": masked.numpy(), "original_ids": ids, "masked_positions": selected.numpy()}


def _pack_translation(
    pairs: list[tuple[np.ndarray, np.ndarray]], source: Specials, target: Specials
) -> dict[str, np.ndarray]:
    (src_before, src_after), (tgt_before, tgt_after) = source.source, target.target
    src, src_lengths = _stack(
        [np.concatenate([src_before, src, src_after]).astype(src.dtype) for src, _ in pairs],
        source.pad_id,
    )
    tgt, tgt_lengths = _stack(
        [np.concatenate([tgt_before, tgt, tgt_after]).astype(tgt.dtype) for _, tgt in pairs],
        target.pad_id,
    )
    return {"src_ids": src, "src_lengths": src_lengths, "tgt_ids": tgt, "tgt_lengths": tgt_lengths}


def _stack(sequences: list[np.ndarray], pad: int) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) ids padded with `pad` to the longest, and the (B,) lengths."""
    lengths = np.array([len(seq) for seq in sequences], dtype=np.int64)
    longest = int(lengths.max())
    if (lengths == longest).all():  # packed blocks: all of one length
        return np.stack(sequences), lengths
    ids = np.full((len(sequences), longest), pad, dtype=np.result_type(*sequences))
    # row by row, each row's start
    ids[np.arange(longest) < lengths[:, None]] = np.concatenate(sequences)
    return ids, lengths


def _document_ids(doc_starts: tuple[np.ndarray, ...], width: int) -> np.ndarray:
    """(B, width) int32: the document of each position, 0 from each row's start, +1 at each of
    its doc_starts after the first; positions past a row's end keep its last document."""
    boundaries = np.zeros((len(doc_starts), width), dtype=np.int32)
    rows = np.repeat(np.arange(len(doc_starts)), [len(starts) - 1 for starts in doc_starts])
    boundaries[rows, np.concatenate([starts[1:] for starts in doc_starts]).astype(np.int64)] = 1
    return boundaries.cumsum(axis=1, dtype=np.int32)


def _long(ids: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(ids.astype(np.int64, copy=False))


def _mask(lengths: np.ndarray, width: int) -> torch.Tensor:
    """(B, width) attention mask: 1 over the first `lengths[b]` positions of row b, 0
    over the padding."""
    return torch.from_numpy((np.arange(width) < lengths[:, None]).astype(np.int64))
