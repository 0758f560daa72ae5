"""The project's one SentencePiece tokenizer (Kudo and Richardson 2018), shared by GPT, BERT
and the translation model so that pretrained embeddings transfer.

Reserved ids are fixed (see `pipeline.format.SPECIAL_TOKENS`): <pad>=0, <unk>=1, <s>=2,
</s>=3, <mask>=4, <sep>=5, then optional language tags. The model is trained on a sample
capped at `sample_texts` texts: the ones with the smallest salted hashes ("bottom-k"
sampling), which is reproducible, independent of input order and of how the corpus is
split over workers, and needs memory for the sample only.
"""

from __future__ import annotations

import hashlib
import heapq
import io
from pathlib import Path
from typing import Iterable

import sentencepiece as spm

from common.configure import UserError
from pipeline.config import TokenizerConfig
from pipeline.format import SPECIAL_TOKENS


class BottomKSample:
    """The k (hash, text) pairs with the smallest hashes seen so far; equal texts count once."""

    def __init__(self, k: int):
        self.k = k
        self._heap: list[tuple[int, str]] = []  # max-heap by negated hash
        self._members: set[int] = set()

    def add(self, key: int, text: str) -> None:
        if key in self._members:
            return
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (-key, text))
            self._members.add(key)
        elif key < -self._heap[0][0]:
            evicted = heapq.heapreplace(self._heap, (-key, text))
            self._members.discard(-evicted[0])
            self._members.add(key)

    def merge(self, items: Iterable[tuple[int, str]]) -> None:
        for key, text in items:
            self.add(key, text)

    def items(self) -> list[tuple[int, str]]:
        """The sample sorted by hash: the same order whatever order the texts came in."""
        return sorted((-neg, text) for neg, text in self._heap)


def train_tokenizer(texts: list[str], cfg: TokenizerConfig, seed: int = 0) -> bytes:
    """Train a SentencePiece model on `texts`; returns the serialized model."""
    if cfg.model_type not in ("unigram", "bpe"):
        raise UserError(f"tokenizer.model_type: {cfg.model_type!r} is not 'unigram' or 'bpe'")
    if not texts:
        raise UserError("no training text for the tokenizer: the train split is empty")
    spm.set_random_generator_seed(seed)
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(texts),
            model_writer=model,
            model_type=cfg.model_type,
            vocab_size=cfg.vocab_size,
            character_coverage=cfg.character_coverage,
            byte_fallback=cfg.byte_fallback,
            pad_id=0,
            unk_id=1,
            bos_id=2,
            eos_id=3,
            control_symbols=list(SPECIAL_TOKENS[4:]) + list(cfg.lang_tags),
            # A small corpus may not support the requested size; the real size is read back.
            hard_vocab_limit=False,
            max_sentence_length=cfg.max_sentence_length,
            input_sentence_size=0,
            shuffle_input_sentence=False,
            split_digits=True,
            num_threads=cfg.num_threads,
            minloglevel=2,
        )
    except RuntimeError as err:
        raise UserError(f"tokenizer training failed: {str(err).splitlines()[0]}") from err
    return model.getvalue()


def model_sha256(model_bytes: bytes) -> str:
    return hashlib.sha256(model_bytes).hexdigest()


def load_tokenizer(path: str | Path) -> spm.SentencePieceProcessor:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"tokenizer not found: {path}")
    return processor_from_bytes(path.read_bytes(), source=str(path))


def processor_from_bytes(
    model_bytes: bytes, source: str = "tokenizer"
) -> spm.SentencePieceProcessor:
    processor = spm.SentencePieceProcessor()
    try:
        processor.LoadFromSerializedProto(model_bytes)
    except (RuntimeError, OSError) as err:
        raise UserError(f"{source}: not a SentencePiece model") from err
    check_reserved_ids(processor, source)
    return processor


def check_reserved_ids(processor: spm.SentencePieceProcessor, source: str = "tokenizer") -> None:
    """Refuse a model whose reserved ids differ from the project's (it would scramble every model)."""
    for expected_id, piece in enumerate(SPECIAL_TOKENS):
        got = processor.piece_to_id(piece)
        if got != expected_id:
            raise UserError(
                f"{source}: {piece} has id {got}, expected {expected_id}; train it with pipeline.prepare"
            )


def tokenizer_info(
    processor: spm.SentencePieceProcessor, model_bytes: bytes, lang_tags: list[str]
) -> dict:
    """The manifest's description of a tokenizer."""
    tags = {tag: processor.piece_to_id(tag) for tag in lang_tags}
    return {
        "sha256": model_sha256(model_bytes),
        "vocab_size": processor.get_piece_size(),
        "special_ids": list(range(len(SPECIAL_TOKENS))) + sorted(tags.values()),
        "special_tokens": {piece: i for i, piece in enumerate(SPECIAL_TOKENS)},
        "lang_tags": tags,
    }
