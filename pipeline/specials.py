"""A tokenizer's special tokens as the pipeline uses them (`Specials`): each role's id, every
special id, the language tags, and the frames put around a pretraining document and a
translation pair; the SentencePiece kind's own layout (`sentencepiece_specials`). Read from a
tokenizer by `pipeline.tokenizer`, recorded in the manifest, carried by the loader and the
trainer."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.configure import UserError

# The roles a special token plays, in the order of the SentencePiece layout's ids.
ROLES = ("pad", "unk", "bos", "eos", "mask", "sep")


# The SentencePiece kind's reserved pieces, ids 0-5 in ROLES' order.
SENTENCEPIECE_SPECIALS = ("<pad>", "<unk>", "<s>", "</s>", "<mask>", "<sep>")


Frame = tuple[tuple[int, ...], tuple[int, ...]]  # (ids before a text, ids after it)


@dataclass(frozen=True)
class Specials:
    """A tokenizer's special tokens: each role's id (None: the tokenizer has none), every special
    id (never masked, never drawn as MLM's random replacement), the language tags, and the frames
    the pipeline puts around a text: a pretraining document, a translation source and target.

    The rules for what a tokenizer lacks: no pad (GPT-2) -> `pad_id` is another special id, which
    no loss reads (padding is masked out of attention and labels by length, never by id); no mask
    -> MLM is refused (`require`); no bos -> a document is framed as the tokenizer's own
    post-processor frames a text, with eos after it (GPT-2: `text <|endoftext|>`), and a target
    starts with eos (GPT-2's decoder start)."""

    pad: int | None = None
    unk: int | None = None
    bos: int | None = None
    eos: int | None = None
    mask: int | None = None
    sep: int | None = None
    ids: tuple[int, ...] = ()
    lang_tags: dict[str, int] = field(default_factory=dict)
    document: Frame = ((), ())
    source: Frame = ((), ())
    target: Frame = ((), ())

    @property
    def pad_id(self) -> int:
        """The id padding is written with: the pad token, else the first other special id."""
        for value in (self.pad, self.eos, self.unk, *self.ids):
            if value is not None:
                return value
        return 0

    @property
    def document_end(self) -> int:
        """The last token of a packed document (ours </s>, GPT-2's <|endoftext|>, BERT's [SEP])."""
        _, after = self.document
        return after[-1] if after else self.require("eos", "the end of a document")

    @property
    def document_prefix(self) -> int:
        """The token a document's first token follows in packed data: the last of the tokenizer's
        document prefix (Llama's <s>), else the previous document's end."""
        before, _ = self.document
        return before[-1] if before else self.document_end

    def require(self, role: str, why: str) -> int:
        value = getattr(self, role)
        if value is None:
            raise UserError(f"the tokenizer has no {role} token, which {why} needs")
        return value

    def to_manifest(self) -> dict:
        return {
            **{role: getattr(self, role) for role in ROLES},
            "ids": list(self.ids),
            "lang_tags": dict(self.lang_tags),
            "frames": {
                name: [list(before), list(after)]
                for name, (before, after) in (
                    ("document", self.document),
                    ("source", self.source),
                    ("target", self.target),
                )
            },
        }

    @classmethod
    def from_manifest(cls, info: dict) -> Specials:
        """From a manifest's `tokenizer` entry; one written before the entry held `specials`
        (a SentencePiece dataset of the fixed layout) gets that layout."""
        entry = info.get("specials")
        if entry is None:
            return sentencepiece_specials(dict(info.get("lang_tags", {})))
        frames = entry.get("frames", {})
        return cls(
            **{role: entry.get(role) for role in ROLES},
            ids=tuple(entry.get("ids", ())),
            lang_tags=dict(entry.get("lang_tags", {})),
            **{
                name: (tuple(frames[name][0]), tuple(frames[name][1]))
                for name in ("document", "source", "target")
                if name in frames
            },
        )


def sentencepiece_specials(lang_tags: dict[str, int] | None = None) -> Specials:
    """The fixed layout of the project's SentencePiece models: a document and a source end with
    </s>, a target is `<s> text </s>`."""
    pad, unk, bos, eos, mask, sep = range(len(SENTENCEPIECE_SPECIALS))
    tags = dict(lang_tags or {})
    return Specials(
        pad=pad,
        unk=unk,
        bos=bos,
        eos=eos,
        mask=mask,
        sep=sep,
        ids=tuple(sorted({pad, unk, bos, eos, mask, sep, *tags.values()})),
        lang_tags=tags,
        document=((), (eos,)),
        source=((), (eos,)),
        target=((bos,), (eos,)),
    )
