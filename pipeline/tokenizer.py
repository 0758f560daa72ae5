"""A dataset's tokenizer, of either kind, as every reader loads it, and its special tokens.

Two kinds (`KINDS`). `sentencepiece`: the project's own model (Kudo and Richardson 2018), trained
by `pipeline.prepare.train_tokenizer` with fixed reserved ids (`SENTENCEPIECE_SPECIALS`: <pad>=0,
<unk>=1, <s>=2, </s>=3, <mask>=4, <sep>=5, then language tags) or given as a `.model` file with
the same layout. `hf`: a Hugging Face fast tokenizer (`tokenizer.json`, with the
`tokenizer_config.json` and `special_tokens_map.json` of its directory when given one), read with
the `tokenizers` library: GPT-2's byte-level BPE, a Llama tokenizer, a BERT WordPiece.

Whatever the kind, a reader never assumes an id: `Specials` holds each role's id (None where the
tokenizer has none) and how a text is framed, and travels in the manifest
(`Specials.to_manifest` / `from_manifest`). This module and the SentencePiece training are the only
code that knows the fixed layout (tests/pipeline/test_tokenizer_kinds.py checks it).

A tokenizer's `vocab_size` is its id range, highest id + 1 (a Hugging Face vocabulary's ids may
have gaps; tests/pipeline/test_tokenizer_ids.py). Two tokenizers are the same when they give the
same ids (`pipeline.tokenizer_identity.difference`: vocabulary, special ids, a sample's ids),
whatever their files' bytes.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

from common.configure import UserError
from pipeline.specials import ROLES, SENTENCEPIECE_SPECIALS, Frame, Specials, sentencepiece_specials

KINDS = ("sentencepiece", "hf")
SENTENCEPIECE_FILE = "tokenizer.model"
HF_FILE = "tokenizer.json"
# What of a Hugging Face tokenizer directory travels with it (the ids are tokenizer.json's; the
# other two name its special tokens and its class).
HF_FILES = (HF_FILE, "tokenizer_config.json", "special_tokens_map.json")


class Tokenizer:
    """What every reader of a dataset needs of its tokenizer, whatever its kind."""

    kind: str
    specials: Specials
    files: dict[str, bytes]  # the files that make it, by name, as a dataset or an export holds them
    sha256: str  # of the file that fixes its ids (tokenizer.model, tokenizer.json)

    @property
    def vocab_size(self) -> int:
        """The tokenizer's id range, highest id + 1: what an embedding needs rows for, what every
        id of the data stays under. Not a count of the tokens, which is less where the ids have
        gaps (a Hugging Face vocabulary with added tokens above a hole)."""
        raise NotImplementedError

    def vocabulary(self) -> dict[str, int]:
        """Every entry of the vocabulary (added tokens included) and its id."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Each text's ids with nothing added (the frames are the pipeline's to add)."""
        raise NotImplementedError

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def decode(self, ids: list[int]) -> str:
        """The text of `ids`, special tokens left out."""
        raise NotImplementedError

    def token(self, token_id: int) -> str:
        """The vocabulary entry of one id, as the tokenizer stores it."""
        raise NotImplementedError

    def vocabulary_texts(self) -> list[str]:
        """Each ordinary entry of the vocabulary as the text it stands for (leading spaces kept),
        in id order: a sample on which two tokenizers that should agree are compared."""
        raise NotImplementedError

    def info(self) -> dict:
        """The manifest's description of this tokenizer (files relative to the dataset)."""
        return {
            "kind": self.kind,
            "file": self.main_file,
            "files": sorted(self.files),
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            "special_ids": list(self.specials.ids),
            "lang_tags": dict(self.specials.lang_tags),
            "specials": self.specials.to_manifest(),
        }

    @property
    def main_file(self) -> str:
        return SENTENCEPIECE_FILE if self.kind == "sentencepiece" else HF_FILE

    def save(self, directory: str | Path) -> None:
        for name, data in self.files.items():
            (Path(directory) / name).write_bytes(data)


class SentencePieceTokenizer(Tokenizer):
    kind = "sentencepiece"

    def __init__(self, model_bytes: bytes, source: str = "tokenizer", lang_tags=()):
        import sentencepiece as spm

        self.processor = spm.SentencePieceProcessor()
        try:
            self.processor.LoadFromSerializedProto(model_bytes)
        except (RuntimeError, OSError) as err:
            raise UserError(f"{source}: not a SentencePiece model") from err
        for expected_id, piece in enumerate(SENTENCEPIECE_SPECIALS):
            got = self.processor.piece_to_id(piece)
            if got != expected_id:
                raise UserError(
                    f"{source}: {piece} has id {got}, expected {expected_id} (the project's "
                    "SentencePiece layout); train it with pipeline.prepare, or give a Hugging Face "
                    "tokenizer.json"
                )
        self.files = {SENTENCEPIECE_FILE: model_bytes}
        self.sha256 = hashlib.sha256(model_bytes).hexdigest()
        self.specials = sentencepiece_specials(
            {tag: self.processor.piece_to_id(tag) for tag in lang_tags}
        )
        self._encode_one: Callable[..., list[int]] | None = _in_thread_binding(self.processor)

    @property
    def vocab_size(self) -> int:
        return self.processor.get_piece_size()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self._encode_one is not None:
            return [self._encode_one(text, *_PLAIN) for text in texts]
        # One thread: a Ray worker is one CPU; SentencePiece's default would use every core.
        return self.processor.encode(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.processor.decode(ids)

    def token(self, token_id: int) -> str:
        return self.processor.id_to_piece(token_id)

    def vocabulary(self) -> dict[str, int]:
        return {self.processor.id_to_piece(i): i for i in range(self.processor.get_piece_size())}

    def vocabulary_texts(self) -> list[str]:
        sp = self.processor
        return [
            sp.id_to_piece(i).replace("\u2581", " ")
            for i in range(sp.get_piece_size())
            if not (sp.is_control(i) or sp.is_unknown(i) or sp.is_byte(i))
        ]


# the one-text binding's options: no sampling, no bos/eos, not reversed
_PLAIN = (False, 0, 0.0, False, False, False)


def _in_thread_binding(processor) -> Callable[..., list[int]] | None:
    """SentencePiece's one-text C++ call, or None where this version lacks it.

    Its batch call starts a thread per call even with `num_threads=1` and waits for it; with
    every CPU busy (one Ray worker per core) each hand-over waits for the scheduler, which cost
    the 2-worker encode stage about a tenth over one worker. The one-text call runs in the
    calling thread, and skips `encode`'s per-call argument handling. It is checked against the
    public call, so a version whose binding differs falls back to that."""
    binding = getattr(getattr(processor, "_processor", None), "_EncodeAsIds", None)
    if binding is None:
        return None
    probe = ["Hallo, Welt! \u00e4\u00f6\u00fc", "", "  two  spaces\tand a tab"]
    try:
        if [binding(text, *_PLAIN) for text in probe] != processor.encode(probe, num_threads=1):
            return None
    except (TypeError, ValueError, RuntimeError):
        return None
    return binding


# tokenizer_config.json's names of the special tokens, by role. A BERT has [CLS] and [SEP] where
# others have bos and eos: they frame its texts and start and end its decoder's (as in
# transformers' BERT2BERT), so they fill those roles when bos and eos are not named.
_HF_NAMES = {
    "pad": ("pad_token",),
    "unk": ("unk_token",),
    "bos": ("bos_token", "cls_token"),
    "eos": ("eos_token", "sep_token"),
    "mask": ("mask_token",),
    "sep": ("sep_token",),
}
# A bare tokenizer.json names no roles: its special tokens are recognised by these spellings.
_KNOWN_TOKENS = {
    "pad": ("<pad>", "[PAD]", "<|pad|>"),
    "unk": ("<unk>", "[UNK]", "<|endoftext|>"),
    "bos": ("<s>", "[CLS]", "<|begin_of_text|>", "<|endoftext|>"),
    "eos": ("</s>", "[SEP]", "<|end_of_text|>", "<|endoftext|>"),
    "mask": ("<mask>", "[MASK]"),
    "sep": ("<sep>", "[SEP]"),
}
_PROBE = "hello world"


class HFTokenizer(Tokenizer):
    kind = "hf"

    def __init__(self, files: dict[str, bytes], source: str = "tokenizer", lang_tags=()):
        from tokenizers import Tokenizer as RustTokenizer

        if HF_FILE not in files:
            raise UserError(
                f"{source}: no {HF_FILE} (a fast tokenizer's file; save_pretrained of a fast "
                "tokenizer writes it)"
            )
        try:
            self.backend = RustTokenizer.from_str(files[HF_FILE].decode("utf-8"))
        except (Exception, BaseException) as err:  # the Rust side raises its own exception type
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise UserError(
                f"{source}: {HF_FILE} is not a Hugging Face tokenizer "
                f"({str(err).splitlines()[0][:120] if str(err) else type(err).__name__})"
            ) from None
        # A tokenizer.json saved after a call that truncated or padded keeps those settings
        # (transformers sets them on the backend for a call and saves them with it): a text's ids
        # are its whole ids, unpadded, as AutoTokenizer gives them unless asked to cut or pad.
        self.backend.no_truncation()
        self.backend.no_padding()
        self.files = {name: files[name] for name in HF_FILES if name in files}
        self.sha256 = hashlib.sha256(files[HF_FILE]).hexdigest()
        config = {}
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            if name in files:
                try:
                    config.update(json.loads(files[name]))
                except (ValueError, UnicodeDecodeError):
                    raise UserError(f"{source}: {name} is not JSON") from None
        self._id_range: int | None = None
        self.specials = self._specials(config, source, lang_tags)

    def _specials(self, config: dict, source: str, lang_tags) -> Specials:
        added = {
            token.content: index
            for index, token in self.backend.get_added_tokens_decoder().items()
            if token.special
        }
        roles: dict[str, int | None] = {}
        for role in ROLES:
            roles[role] = None
            if config:
                names = [_token_text(config.get(key)) for key in _HF_NAMES[role]]
            else:
                names = [text for text in _KNOWN_TOKENS[role] if text in added]
            for text in names:
                if text is not None and self.backend.token_to_id(text) is not None:
                    roles[role] = self.backend.token_to_id(text)
                    break
        tags = {}
        for tag in lang_tags:
            if self.backend.token_to_id(tag) is None:
                raise UserError(f"{source}: language tag {tag!r} is not in the vocabulary")
            tags[tag] = self.backend.token_to_id(tag)
        framed = self.backend.encode(_PROBE, add_special_tokens=True).ids
        plain = self.backend.encode(_PROBE, add_special_tokens=False).ids
        before, after = _frame_of(framed, plain)
        eos, bos = roles["eos"], roles["bos"]
        # A document or a source ends as the tokenizer frames a text, with eos if that adds nothing.
        ending = after or ((eos,) if eos is not None else ())
        start = bos if bos is not None else eos
        return Specials(
            **roles,
            ids=tuple(
                sorted(
                    {v for v in roles.values() if v is not None}
                    | set(added.values())
                    | set(tags.values())
                )
            ),
            lang_tags=tags,
            document=(before, ending),
            source=(before, ending),
            target=((start,) if start is not None else (), (eos,) if eos is not None else ()),
        )

    @property
    def vocab_size(self) -> int:
        # Not get_vocab_size(), a count: a vocabulary's ids may skip values (added tokens placed
        # above a hole), and every id must index an embedding row.
        if self._id_range is None:
            self._id_range = max(self.vocabulary().values(), default=-1) + 1
        return self._id_range

    def vocabulary(self) -> dict[str, int]:
        return self.backend.get_vocab(with_added_tokens=True)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=True)

    def token(self, token_id: int) -> str:
        return self.backend.id_to_token(token_id)

    def vocabulary_texts(self) -> list[str]:
        special = set(self.specials.ids)
        texts = (
            self.backend.decode([i], skip_special_tokens=False)
            for i in sorted(set(self.vocabulary().values()))  # the ids there are, gaps skipped
            if i not in special
        )
        # a byte-level piece of part of a character decodes to U+FFFD: not a text of its own
        return [text for text in texts if text and "\ufffd" not in text]


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _frame_of(framed: list[int], plain: list[int]) -> Frame:
    """What a post-processor puts before and after a text's ids."""
    for start in range(len(framed) - len(plain) + 1):
        if framed[start : start + len(plain)] == plain:
            return tuple(framed[:start]), tuple(framed[start + len(plain) :])
    return (), ()


def kind_of(path: str | Path) -> str:
    """The kind a given tokenizer path names: a `.model` file is SentencePiece's; a `.json` file
    or a directory with a tokenizer.json is Hugging Face's."""
    path = Path(path)
    if path.is_dir():
        if (path / HF_FILE).is_file():
            return "hf"
        if (path / SENTENCEPIECE_FILE).is_file():
            return "sentencepiece"
        raise UserError(f"{path}: neither {HF_FILE} nor {SENTENCEPIECE_FILE} in this directory")
    if not path.is_file():
        raise UserError(f"tokenizer not found: {path}")
    return "hf" if path.suffix == ".json" else "sentencepiece"


def tokenizer_file_in(directory: str | Path) -> Path:
    """The file that fixes the ids of the tokenizer a directory holds (a dataset, a run, an export,
    a Hugging Face directory): its tokenizer.json, else its tokenizer.model (which is where a
    missing one is reported)."""
    directory = Path(directory)
    hf = directory / HF_FILE
    return hf if hf.is_file() else directory / SENTENCEPIECE_FILE


def read_files(path: str | Path) -> dict[str, bytes]:
    """The files that make the tokenizer at `path` (a file, or a directory holding one), by name."""
    path = Path(path)
    if kind_of(path) == "sentencepiece":
        file = path / SENTENCEPIECE_FILE if path.is_dir() else path
        return {SENTENCEPIECE_FILE: file.read_bytes()}
    if not path.is_dir() and path.name != HF_FILE:  # a lone tokenizer file under another name
        return {HF_FILE: path.read_bytes()}
    # tokenizer.json and the files beside it that name its special tokens
    directory = path if path.is_dir() else path.parent
    return {
        name: (directory / name).read_bytes() for name in HF_FILES if (directory / name).is_file()
    }


def tokenizer_from_files(
    files: dict[str, bytes], source: str = "tokenizer", lang_tags=()
) -> Tokenizer:
    if HF_FILE in files:
        return HFTokenizer(files, source, lang_tags)
    if SENTENCEPIECE_FILE in files:
        return SentencePieceTokenizer(files[SENTENCEPIECE_FILE], source, lang_tags)
    raise UserError(f"{source}: neither {HF_FILE} nor {SENTENCEPIECE_FILE}")


def load_tokenizer(path: str | Path, lang_tags=()) -> Tokenizer:
    """The tokenizer at `path`: a tokenizer.model, a tokenizer.json, or a directory holding one
    (a Hugging Face tokenizer or model directory, a dataset, a run, an export)."""
    return tokenizer_from_files(read_files(path), str(path), lang_tags)
