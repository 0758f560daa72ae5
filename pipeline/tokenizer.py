"""A dataset's tokenizer, as every reader loads it: the project's one SentencePiece model (Kudo
and Richardson 2018), shared by GPT, BERT and the translation model so that pretrained
embeddings transfer. Training it is `pipeline.prepare.train_tokenizer`'s.

Reserved ids are fixed (see `pipeline.format.SPECIAL_TOKENS`): <pad>=0, <unk>=1, <s>=2,
</s>=3, <mask>=4, <sep>=5, then optional language tags.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import sentencepiece as spm

from common.configure import UserError
from pipeline.format import SPECIAL_TOKENS


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
