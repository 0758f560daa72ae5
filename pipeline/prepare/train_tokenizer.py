"""Training the dataset's tokenizer during prepare: SentencePiece (Kudo and Richardson 2018) in the
project's layout, or with `tokenizer.kind=hf` a byte-level BPE (Radford et al. 2019, GPT-2's) by
the `tokenizers` library.

The model is trained on a sample capped at `sample_texts` texts: the ones with the smallest
salted hashes ("bottom-k" sampling), which is reproducible, independent of input order and of how
the corpus is split over workers, and needs memory for the sample only. Its reserved ids are
`pipeline.tokenizer.SENTENCEPIECE_SPECIALS`, in that order, then the language tags.
"""

from __future__ import annotations

import heapq
import io
import json
from typing import Iterable

import sentencepiece as spm

from common.configure import UserError
from pipeline.prepare.config import TokenizerConfig
from pipeline.tokenizer import HF_FILE, SENTENCEPIECE_FILE, SENTENCEPIECE_SPECIALS


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


# The special tokens of a byte-level BPE trained here (RoBERTa's spelling; byte-level needs no unk).
HF_TRAINED_SPECIALS = {
    "pad_token": "<pad>",
    "bos_token": "<s>",
    "eos_token": "</s>",
    "mask_token": "<mask>",
}


def train(texts: list[str], cfg: TokenizerConfig, seed: int = 0) -> dict[str, bytes]:
    """A tokenizer of `cfg.kind` trained on `texts`, as the files that make it."""
    if cfg.kind == "hf":
        return train_byte_level_bpe(texts, cfg)
    if cfg.kind != "sentencepiece":
        raise UserError(f"tokenizer.kind: {cfg.kind!r} is not 'sentencepiece' or 'hf'")
    return {SENTENCEPIECE_FILE: train_tokenizer(texts, cfg, seed)}


def train_byte_level_bpe(texts: list[str], cfg: TokenizerConfig) -> dict[str, bytes]:
    """GPT-2's tokenizer design (bytes as the alphabet, no unknown token) trained on `texts`, with
    the special tokens of HF_TRAINED_SPECIALS and the language tags after the byte alphabet's ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if cfg.model_type != "bpe":
        raise UserError(
            f"tokenizer.model_type: {cfg.model_type!r}: tokenizer.kind=hf trains a byte-level bpe"
        )
    if not texts:
        raise UserError("no training text for the tokenizer: the train split is empty")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=cfg.vocab_size,
        special_tokens=[*HF_TRAINED_SPECIALS.values(), *cfg.lang_tags],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **HF_TRAINED_SPECIALS,
        "additional_special_tokens": list(cfg.lang_tags),
        "clean_up_tokenization_spaces": False,
    }
    return {
        HF_FILE: tokenizer.to_str().encode("utf-8"),
        "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode("utf-8"),
    }


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
            control_symbols=list(SENTENCEPIECE_SPECIALS[4:]) + list(cfg.lang_tags),
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
