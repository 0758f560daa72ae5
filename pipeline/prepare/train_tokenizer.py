"""Training the dataset's tokenizer during prepare: SentencePiece (Kudo and Richardson 2018) in the
project's layout, or with `tokenizer.kind=hf` a byte-level BPE (Radford et al. 2019, GPT-2's) by
the `tokenizers` library.

The model is trained on a sample capped at `sample_texts` texts: the ones with the smallest
salted hashes ("bottom-k" sampling), which is reproducible, independent of input order and of how
the corpus is split over workers, and needs memory for the sample only. Its reserved ids are
`pipeline.specials.SENTENCEPIECE_SPECIALS`, in that order, then the language tags.
"""

from __future__ import annotations

import heapq
import io
import json
from typing import Iterable

import sentencepiece as spm

from common.configure import UserError
from pipeline.prepare.config import TokenizerConfig
from pipeline.specials import SENTENCEPIECE_SPECIALS
from pipeline.tokenizer import HF_FILE, SENTENCEPIECE_FILE


class BottomKSample:
    """The k (hash, text) pairs with the smallest hashes seen so far; equal texts count once. A
    text may be marked as a piece of a longer one (`sample_pieces`), and the marks follow it."""

    def __init__(self, k: int):
        self.k = k
        self._heap: list[tuple[int, str]] = []  # max-heap by negated hash
        self._members: set[int] = set()
        self._cut: set[int] = set()  # members that are pieces of longer texts

    def add(self, key: int, text: str, cut: bool = False) -> None:
        if key in self._members:
            return
        if len(self._heap) < self.k:
            heapq.heappush(self._heap, (-key, text))
        elif key < -self._heap[0][0]:
            evicted = -heapq.heapreplace(self._heap, (-key, text))[0]
            self._members.discard(evicted)
            self._cut.discard(evicted)
        else:
            return
        self._members.add(key)
        if cut:
            self._cut.add(key)

    def merge(self, items: Iterable[tuple[int, str]], cut: Iterable[int] = ()) -> None:
        cut = set(cut)
        for key, text in items:
            self.add(key, text, key in cut)

    def items(self) -> list[tuple[int, str]]:
        """The sample sorted by hash: the same order whatever order the texts came in."""
        return sorted((-neg, text) for neg, text in self._heap)

    def cut_keys(self) -> list[int]:
        """The keys of the sample's texts that are pieces of longer ones, sorted."""
        return sorted(self._cut)


def sample_pieces(text: str, max_bytes: int) -> list[str]:
    """`text` as training texts SentencePiece keeps: pieces of at most `max_bytes` UTF-8 bytes
    (its `max_sentence_length`; it skips a longer text whole, without a word), cut at the last
    space or newline of each stretch where there is one in its second half, else at a character
    boundary. A text within the limit is itself."""
    if len(text) * 4 <= max_bytes:  # no character takes more than 4 bytes
        return [text]
    data = text.encode("utf-8")
    if len(data) <= max_bytes:
        return [text]
    pieces, start = [], 0
    while len(data) - start > max_bytes:
        end = start + max_bytes
        while end > start and (data[end] & 0xC0) == 0x80:  # not inside a character
            end -= 1
        space = max(data.rfind(b" ", start, end), data.rfind(b"\n", start, end))
        cut = space if space > start + max_bytes // 2 else end
        pieces.append(data[start:cut])
        start = cut
    pieces.append(data[start:])
    return [piece for piece in (p.decode("utf-8").strip() for p in pieces) if piece]


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
    the special tokens of HF_TRAINED_SPECIALS and the language tags after the
    byte alphabet's ids."""
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
