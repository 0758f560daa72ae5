"""Whether two tokenizers are one by the ids they give (`difference`): the vocabulary, the special
ids, and the ids of a sample of texts (`identity_sample`), whatever their files' bytes. Used where
a model's tokenizer must be the dataset's (`launch.init_model.check_tokenizer`)."""

from __future__ import annotations

from pipeline.specials import ROLES
from pipeline.tokenizer import Tokenizer

# What two tokenizers are compared on besides their vocabularies and special ids (`difference`):
# these texts (prose in a few scripts, digits, code, runs of whitespace), every entry of the first
# one's vocabulary as text, sentences of SAMPLE_SENTENCE_PIECES consecutive entries, and runs of
# characters a vocabulary rarely holds (for its byte pieces: private use, Cyrillic, CJK, emoji).
IDENTITY_TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Die kleine Katze öffnet das Fenster, und der alte Hund schläft. Straße, naïve café.",
    "  two  spaces\tand a tab\nand a new line   ",
    "def f(x):\n    return x ** 2  # 3.14159, 1,000,000 and 42%",
    "Ελληνικά, русский, 日本語, 中文, 한국어 🙂",
    "",
)


SAMPLE_SENTENCE_PIECES = 12


_RARE_RUNS = (0xE000, 0xE040, 0x0400, 0x4E00, 0x1F600)


def identity_sample(tokenizer: Tokenizer) -> list[str]:
    """The texts on which `difference` compares another tokenizer's ids with `tokenizer`'s."""
    words = tokenizer.vocabulary_texts()
    sentences = [
        "".join(words[i : i + SAMPLE_SENTENCE_PIECES])
        for i in range(0, len(words), SAMPLE_SENTENCE_PIECES)
    ]
    rare = ["".join(map(chr, range(start, start + 64))) for start in _RARE_RUNS]
    return [*IDENTITY_TEXTS, *words, *sentences, *rare]


def difference(
    ours: Tokenizer, theirs: Tokenizer, names: tuple[str, str] = ("here", "there")
) -> str | None:
    """None when the two are one tokenizer by the ids they give, else the first thing that differs,
    in words (`names`: how the line calls `ours` and `theirs`): the vocabulary (each entry's id),
    the id of each special role both name, the ids of each text of `identity_sample(ours)`.

    A tokenizer is known by its ids, not by its file's bytes: transformers rewrites a
    tokenizer.json it saves (with the truncation and padding of its last call, in its own layout)
    without changing an id. Equal hashes of the same kind's file are answer enough for the ids."""
    here, there = names
    same_file = ours.kind == theirs.kind and ours.sha256 == theirs.sha256
    if not same_file:
        found = _vocabulary_difference(ours.vocabulary(), theirs.vocabulary())
        if found is not None:
            token_id, mine, other = found
            return f"id {token_id} is {_entries(mine)} {here}, {_entries(other)} {there}"
    for role in ROLES:
        mine, other = getattr(ours.specials, role), getattr(theirs.specials, role)
        if mine is not None and other is not None and mine != other:
            return f"the {role} token is id {mine} {here}, id {other} {there}"
    if same_file:
        return None
    sample = identity_sample(ours)
    for text, mine, other in zip(sample, ours.encode_batch(sample), theirs.encode_batch(sample)):
        if mine != other:
            return f"{text[:40]!r} is {_ids(mine)} {here}, {_ids(other)} {there}"
    return None


def _vocabulary_difference(
    ours: dict[str, int], theirs: dict[str, int]
) -> tuple[int, list[str], list[str]] | None:
    """The lowest id whose entries differ between two vocabularies, with each one's entries."""
    if ours == theirs:
        return None
    by_id: dict[int, tuple[list[str], list[str]]] = {}
    for side, vocabulary in enumerate((ours, theirs)):
        for token, token_id in vocabulary.items():
            by_id.setdefault(token_id, ([], []))[side].append(token)
    for token_id in sorted(by_id):
        mine, other = (sorted(entries) for entries in by_id[token_id])
        if mine != other:
            return token_id, mine, other
    return None


def _entries(tokens: list[str]) -> str:
    return " / ".join(repr(token) for token in tokens) if tokens else "no entry"


def _ids(ids: list[int]) -> str:
    return str(ids[:8])[:-1] + ", ...]" if len(ids) > 8 else str(ids)
