"""Decontamination: training texts that overlap an evaluation text are dropped before they are
encoded, so a score on the dataset's own valid/test splits (or on a benchmark the user names)
measures generalization, not recall.

Two tests, as GPT-3 (Brown et al. 2020, appendix C) and the translation literature use: a text
of at least `ngram` words shares a word n-gram (13 by default) with an evaluation text; any text
has the same normalized form as one (`normalized`: case, punctuation, digits and printf/brace
format specifiers folded, so "Open %s..." and "open {0}" are one string). The evaluation side is
gathered once (`EvalKeys`, a sorted hash array, 8 bytes a word); the training side is checked a
chunk of texts at a time, hashed with numpy as the near-duplicate stage hashes.
"""

from __future__ import annotations

import json
import os
import re
import unicodedata
from dataclasses import dataclass, field
from typing import List

import numpy as np

from common.configure import UserError
from pipeline.prepare.curate import minhash

EVAL_FORMATS = ("text", "tsv", "jsonl")


@dataclass
class EvalFileConfig:
    # A file of evaluation texts whose overlaps are dropped from training (e.g. an lm-eval
    # task's documents exported to a file); its name in counts and samples is the file's stem.
    path: str = ""
    # text: one text per line; tsv: every column of every line is a text (pairs: both sides);
    # jsonl: the string values of `fields` in each object.
    format: str = "text"
    # jsonl: the keys whose values are evaluation texts (a list value's strings count too).
    fields: List[str] = field(default_factory=lambda: ["text"])


@dataclass
class DecontaminationConfig:
    # Drop training texts (documents and translation pairs) that overlap the dataset's own
    # valid/test splits and `eval_files`. Off unless a config turns it on.
    enabled: bool = False
    # Check against the dataset's own valid and test splits (their texts, both sides of pairs).
    own_splits: bool = True
    # Word n-gram length for long texts: a training text sharing one such n-gram with an
    # evaluation text is dropped (13: GPT-3's and datatrove's choice). Shorter texts are matched
    # by their normalized form alone.
    ngram: int = 13
    # Further evaluation files, checked as the own splits are.
    eval_files: List[EvalFileConfig] = field(default_factory=list)

    def check(self, where: str) -> None:
        if self.ngram < 1:
            raise UserError(f"{where}.ngram: must be at least 1, got {self.ngram}")
        for index, spec in enumerate(self.eval_files):
            name = f"{where}.eval_files[{index}]"
            if spec.format not in EVAL_FORMATS:
                raise UserError(
                    f"{name}.format: {spec.format!r} is not one of {', '.join(EVAL_FORMATS)}"
                )
            if not spec.path:
                raise UserError(f"{name}.path: no file given")
            if not os.path.isfile(spec.path):
                raise UserError(f"{name}.path: {spec.path} does not exist or is not a file")
            if spec.format == "jsonl" and not spec.fields:
                raise UserError(f"{name}.fields: a jsonl file needs at least one key")
            read_eval_file(spec, name, first_only=True)  # empty or unreadable: refused now
        stems = [origin_name(spec) for spec in self.eval_files]
        for stem in stems:
            if stems.count(stem) > 1 or stem in ("valid", "test"):
                raise UserError(
                    f"{where}.eval_files: two files (or a file and a split) share the name "
                    f"{stem!r}; rename one"
                )


def origin_name(spec: EvalFileConfig) -> str:
    """An evaluation file's name in counts and sample files: its file name up to the first dot."""
    return os.path.basename(spec.path).split(".", 1)[0] or "eval"


# ---------------------------------------------------------------- normal forms and hashes

# printf (%s, %1$d, %-10.3lf, %'d, %%), Python's %(name)s, Qt's %1, and brace fields ({0},
# {name}, {0:.2f}, {}): the parts of a UI string that code fills in.
_FORMAT = re.compile(
    r"%\([A-Za-z_][A-Za-z0-9_]*\)[-+#0']*\d*(?:\.\d+)?[A-Za-z]"
    r"|%(?:\d+\$)?[-+#0']*(?:\*|\d+)?(?:\.(?:\*|\d+))?(?:hh|h|ll|l|L|q|j|z|t|I64|I32)?"
    r"[diouxXeEfFgGaAcspn%]"
    r"|%\d+"
    r"|\{[A-Za-z0-9_.\[\]]*(?::[^{}]*)?\}"
)
_NOT_LETTER = re.compile(r"[\W\d_]+")


def normalized(text: str) -> str:
    """The form under which an evaluation string and a training string are the same text:
    NFKC, case folded, format specifiers removed, digits, punctuation and symbols turned into
    spaces, whitespace collapsed."""
    text = _FORMAT.sub(" ", unicodedata.normalize("NFKC", text))
    return " ".join(_NOT_LETTER.sub(" ", text.casefold()).split())


def shingles(texts: list[str], n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each text's keys, from its normalized form: its word n-grams' hashes, or one hash of all
    its words when it has fewer than n (`minhash.shingle_hashes`, the near-duplicate stage's
    vectorized hashing); as (hashes, offsets: text i's are hashes[offsets[i]:offsets[i + 1]],
    words per text)."""
    return minhash.shingle_hashes([normalized(text) for text in texts], n)


@dataclass
class EvalKeys:
    """The evaluation texts of one origin (a split's name, or an evaluation file's), as the
    sorted, distinct hashes of their keys (`shingles`)."""

    origin: str
    grams: np.ndarray  # uint64, sorted, distinct
    texts: int = 0

    @classmethod
    def from_texts(cls, origin: str, texts: list[str], n: int) -> "EvalKeys":
        hashes, _, words = shingles(texts, n)
        return cls(origin, np.unique(hashes), int((words > 0).sum()))

    @classmethod
    def merged(cls, parts: list["EvalKeys"]) -> "EvalKeys":
        """One origin's keys gathered by several tasks."""
        grams = [p.grams for p in parts]
        return cls(
            parts[0].origin,
            np.unique(np.concatenate(grams)) if grams else np.empty(0, np.uint64),
            sum(p.texts for p in parts),
        )


def _contains(sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    if not len(sorted_keys) or not len(values):
        return np.zeros(len(values), dtype=bool)
    at = np.searchsorted(sorted_keys, values).clip(max=len(sorted_keys) - 1)
    return sorted_keys[at] == values


def contaminated(texts: list[str], keys: list[EvalKeys], n: int) -> list[tuple[str, str]]:
    """For each text, ("", "") when clean, else (the first origin it overlaps, in the order of
    `keys`, and what matched: "same normalized form" for a short text, else the shared n-gram)."""
    out = [("", "")] * len(texts)
    if not keys or not texts:
        return out
    hashes, offsets, words = shingles(texts, n)
    owner = np.repeat(np.arange(len(texts)), np.diff(offsets))
    for key in keys:
        hits = np.flatnonzero(_contains(key.grams, hashes))
        if not len(hits):
            continue
        # each text's first matching key
        texts_hit, first = np.unique(owner[hits], return_index=True)
        for index, position in zip(texts_hit.tolist(), hits[first].tolist()):
            if out[index][0]:
                continue
            if words[index] < n:
                out[index] = (key.origin, "same normalized form")
            else:
                at = position - int(offsets[index])
                out[index] = (key.origin, " ".join(normalized(texts[index]).split()[at : at + n]))
    return out


def read_eval_file(spec: EvalFileConfig, where: str, first_only: bool = False) -> list[str]:
    """The texts of an evaluation file (`first_only`: its first, to check it has one); one line
    naming the key for an empty or unreadable one."""
    texts: list[str] = []
    try:
        with open(spec.path, encoding="utf-8", errors="replace") as fh:
            for number, line in enumerate(fh, 1):
                line = line.rstrip("\r\n")
                if not line.strip():
                    continue
                if spec.format == "text":
                    texts.append(line)
                elif spec.format == "tsv":
                    texts.extend(column for column in line.split("\t") if column.strip())
                else:
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError:
                        raise UserError(
                            f"{where}.path: {spec.path} line {number} is not JSON"
                        ) from None
                    if not isinstance(record, dict):
                        raise UserError(
                            f"{where}.path: {spec.path} line {number} is not a JSON object"
                        )
                    for name in spec.fields:
                        value = record.get(name)
                        values = value if isinstance(value, list) else [value]
                        texts.extend(v for v in values if isinstance(v, str) and v.strip())
                if first_only and texts:
                    return texts
    except OSError as err:
        raise UserError(f"{where}.path: cannot read {spec.path}: {err.strerror}") from None
    if not texts:
        raise UserError(
            f"{where}.path: {spec.path} holds no evaluation text"
            + (f" (no string under {', '.join(spec.fields)})" if spec.format == "jsonl" else "")
        )
    return texts
