"""Our SentencePiece model as a Hugging Face fast tokenizer that gives exactly its ids.

`AutoTokenizer.from_pretrained(DIR)` then encodes as `SentencePieceProcessor.encode` does, plus
the frame training put around the model's inputs when asked (`frame`: a translation source's
`text </s>`, as `tokenizer(text)` adds it by default), decodes as `decode` does, and names our
reserved ids (`pipeline.specials.SENTENCEPIECE_SPECIALS`) as its pad/unk/bos/eos/mask/sep tokens.
Each step SentencePiece takes is rebuilt with the `tokenizers` library (its own character map, its
whitespace rules, one lattice per text, pieces text never produces kept out of the lattice, byte
fallback), which is what the generic conversions get wrong (transformers #25316, #28370): see
docs/design.md#the-hugging-face-tokenizer. Checked on real texts in
tests/launch/test_hf_tokenizer.py.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.specials import SENTENCEPIECE_SPECIALS
from pipeline.tokenizer import SentencePieceTokenizer

# Score of the pieces text never produces: below any path of real pieces (each scores above -100
# per character in a model of a few million pieces at most), above -inf so the lattice stays finite.
NEVER = -1e9
# SentencePiece's piece types (sentencepiece_model.proto, ModelProto.SentencePiece.Type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# Hugging Face's names of our reserved pieces (SENTENCEPIECE_SPECIALS, ids 0-5).
SPECIAL_NAMES = dict(
    zip(
        ("pad_token", "unk_token", "bos_token", "eos_token", "mask_token", "sep_token"),
        SENTENCEPIECE_SPECIALS,
    )
)


def hf_tokenizer(
    model_path: str | Path,
    model_max_length: int | None = None,
    frame: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
):
    """A `transformers` fast tokenizer equal to the SentencePiece model at `model_path`; it
    truncates (when asked to) at `model_max_length`, the positions of the model it is saved with,
    and its post-processor puts the ids of `frame` (special ids of our layout) around a text."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import (
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    model_bytes = Path(model_path).read_bytes()
    SentencePieceTokenizer(model_bytes, source=str(model_path))  # our reserved ids, or one line
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    if proto.trainer_spec.model_type != sentencepiece_model_pb2.TrainerSpec.UNIGRAM:
        raise ValueError(
            f"{model_path}: only unigram SentencePiece models convert (pipeline.prepare's default)"
        )
    if (
        trainer.treat_whitespace_as_suffix
        or not spec.escape_whitespaces
        or spec.normalization_rule_tsv
    ):
        raise ValueError(
            f"{model_path}: a whitespace or normalisation option that "
            "the conversion does not rebuild"
        )
    if any(piece.type == USER_DEFINED for piece in proto.pieces):
        raise ValueError(f"{model_path}: user-defined pieces are not converted")

    vocab = [
        (piece.piece, piece.score if piece.type == NORMAL else NEVER) for piece in proto.pieces
    ]
    unk_id = next(i for i, piece in enumerate(proto.pieces) if piece.type == UNKNOWN)
    tokenizer = Tokenizer(models.Unigram(vocab, unk_id=unk_id, byte_fallback=trainer.byte_fallback))
    steps = (
        [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    )
    if spec.remove_extra_whitespaces:
        steps += [
            normalizers.Replace(Regex("^ +| +$"), ""),
            normalizers.Replace(Regex(" {2,}"), " "),
        ]
    if steps:
        tokenizer.normalizer = normalizers.Sequence(steps)
    prepend = "always" if spec.add_dummy_prefix else "never"
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="\u2581", prepend_scheme=prepend, split=False
    )
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
        + ([decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else [])
    )
    before, after = ([SENTENCEPIECE_SPECIALS[i] for i in ids] for ids in frame)
    if before or after:
        single = " ".join([*before, "$A", *after])
        pair = " ".join([*before, "$A", *after, *(f"{t}:1" for t in ("$B", *after))])
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single,
            pair=pair,
            special_tokens=[
                (piece, SENTENCEPIECE_SPECIALS.index(piece)) for piece in {*before, *after}
            ],
        )
    control = [
        piece.piece
        for piece in proto.pieces
        if piece.type == CONTROL and piece.piece not in SENTENCEPIECE_SPECIALS
    ]
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        **SPECIAL_NAMES,
        additional_special_tokens=control,
        split_special_tokens=True,
        clean_up_tokenization_spaces=False,
        **({"model_max_length": model_max_length} if model_max_length else {}),
    )


def save_hf_tokenizer(
    model_path: str | Path,
    out: str | Path,
    model_max_length: int | None = None,
    frame: tuple[tuple[int, ...], tuple[int, ...]] = ((), ()),
) -> None:
    """The fast tokenizer of `model_path` in `out` (tokenizer.json, tokenizer_config.json, ...).

    Its class is recorded as `PreTrainedTokenizerFast`, which transformers 5 loads as it loads
    its own name for it (`TokenizersBackend`) and transformers 4 knows; an empty list of extra
    special tokens is left out, where transformers 4 expects a mapping."""
    hf_tokenizer(model_path, model_max_length, frame).save_pretrained(str(out))
    path = Path(out) / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    if not config.get("extra_special_tokens", True):
        del config["extra_special_tokens"]
    path.write_text(json.dumps(config, indent=2) + "\n")
