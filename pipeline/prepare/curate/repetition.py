"""Gopher's repetition rules (Rae et al. 2021, appendix A.1.1, table A1): duplicate lines and
paragraphs, and the characters covered by repeated word n-grams.

The n-gram rules work on word positions: a top n-gram's fraction is the characters of the words
covered by the occurrences of the most frequent n-gram (only when it occurs at least twice; a tie
goes to the one covering most characters), a duplicate n-gram fraction the characters of the
words covered by any n-gram that occurs more than once, every occurrence (the first included),
words covered by overlapping occurrences counted once; both over the characters of all words
(whitespace excluded).

`duplicates` (FineWeb's duplicate-line rule counts with it too) and `figure` (how every rule's
detail prints a measurement) are shared with the other rules in `quality`.
"""

from __future__ import annotations

import re

import numpy as np

from pipeline.prepare.curate.quality_config import GopherRepetitionConfig

_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")  # a blank line (and any that follow)


def gopher_repetition(
    text: str, words: list[str], lines: list[str], r: GopherRepetitionConfig, off: frozenset
) -> tuple[str, str] | None:
    check_lines = "gopher_repetition.dup_line_fraction" not in off
    check_line_chars = "gopher_repetition.dup_line_chars" not in off
    if lines and (check_lines or check_line_chars):
        dups, dup_chars, total = duplicates(lines)
        frac = dups / len(lines)
        if check_lines and frac > r.max_dup_line_fraction:
            return "gopher_repetition.dup_line_fraction", (
                f"duplicate lines {figure(frac)} > {figure(r.max_dup_line_fraction)}"
            )
        frac = dup_chars / total
        if check_line_chars and frac > r.max_dup_line_char_fraction:
            return "gopher_repetition.dup_line_chars", (
                f"characters in duplicate lines {figure(frac)} > "
                f"{figure(r.max_dup_line_char_fraction)}"
            )
    check_paras = "gopher_repetition.dup_paragraph_fraction" not in off
    check_para_chars = "gopher_repetition.dup_paragraph_chars" not in off
    if check_paras or check_para_chars:
        paragraphs = [p for p in (p.strip() for p in _PARAGRAPH_BREAK.split(text)) if p]
        if paragraphs:
            dups, dup_chars, total = duplicates(paragraphs)
            frac = dups / len(paragraphs)
            if check_paras and frac > r.max_dup_paragraph_fraction:
                return "gopher_repetition.dup_paragraph_fraction", (
                    f"duplicate paragraphs {figure(frac)} > {figure(r.max_dup_paragraph_fraction)}"
                )
            frac = dup_chars / total
            if check_para_chars and frac > r.max_dup_paragraph_char_fraction:
                return "gopher_repetition.dup_paragraph_chars", (
                    f"characters in duplicate paragraphs {figure(frac)} > "
                    f"{figure(r.max_dup_paragraph_char_fraction)}"
                )
    top = (
        list(zip(r.top_ngram_sizes, r.max_top_ngram_char_fractions))
        if "gopher_repetition.top_ngram_chars" not in off
        else []
    )
    dup = (
        list(zip(r.dup_ngram_sizes, r.max_dup_ngram_char_fractions))
        if "gopher_repetition.dup_ngram_chars" not in off
        else []
    )
    if (top or dup) and words:
        return _ngram_rules(words, top, dup)
    return None


def _ngram_rules(words: list[str], top: list, dup: list) -> tuple[str, str] | None:
    grams = _NGrams(words)
    total = grams.total_chars
    if total == 0:
        return None
    for n, limit in top:
        frac = grams.top_chars(n) / total
        if frac > limit:
            return "gopher_repetition.top_ngram_chars", (
                f"top {n}-gram characters {figure(frac)} > {figure(limit)}"
            )
    for n, limit in dup:
        frac = grams.dup_chars(n) / total
        if frac > limit:
            return "gopher_repetition.dup_ngram_chars", (
                f"duplicate {n}-gram characters {figure(frac)} > {figure(limit)}"
            )
    return None


class _NGrams:
    """Exact n-gram ids of a word sequence, built n by n: the n-gram at i is the pair
    (its (n-1)-gram id, the id of word i+n-1), ranked densely by `np.unique`."""

    def __init__(self, words: list[str]):
        vocab: dict[str, int] = {}
        self.n_words = len(words)
        self.ids = np.fromiter(
            (vocab.setdefault(w, len(vocab)) for w in words), np.int64, self.n_words
        )
        self.vocab = len(vocab)
        self.lengths = np.fromiter(map(len, words), np.int64, self.n_words)
        self.cum = np.zeros(self.n_words + 1, np.int64)
        np.cumsum(self.lengths, out=self.cum[1:])
        self.total_chars = int(self.cum[-1])
        self._n = 1
        self._ids, self._counts = self.ids, np.bincount(self.ids)
        self._cache: dict[int, tuple[np.ndarray, np.ndarray]] = {1: (self._ids, self._counts)}
        # the largest n with a repeated n-gram is below this (no repeat at n: none at n + 1)
        self.no_repeat_from = self.n_words + 1 if self._counts.max() > 1 else 1

    def get(self, n: int) -> tuple[np.ndarray, np.ndarray] | None:
        """(n-gram id at each position, count of each id), None when no n-gram repeats."""
        if n >= self.no_repeat_from or n > self.n_words:
            return None
        while self._n < n:
            m = self._n + 1
            key = self._ids[: self.n_words - m + 1] * self.vocab + self.ids[m - 1 :]
            _, self._ids, self._counts = np.unique(key, return_inverse=True, return_counts=True)
            self._ids = self._ids.reshape(-1)
            self._n = m
            self._cache[m] = (self._ids, self._counts)
            if self._counts.max() < 2:
                self.no_repeat_from = m
                return None
        return self._cache[n]

    def covered_chars(self, starts: np.ndarray, n: int) -> int:
        """Characters of the words covered by n-grams starting at `starts`."""
        edges = np.bincount(starts, minlength=self.n_words + 1)
        edges = edges - np.bincount(starts + n, minlength=self.n_words + 1)
        covered = np.cumsum(edges[: self.n_words]) > 0
        return int(self.lengths[covered].sum())

    def top_chars(self, n: int) -> int:
        """Characters covered by the most frequent n-gram (0 unless it occurs twice or more)."""
        got = self.get(n)
        if got is None:
            return 0
        ids, counts = got
        most = counts.max()
        candidates = np.flatnonzero(counts == most)
        if len(candidates) == 1:
            return self.covered_chars(np.flatnonzero(ids == candidates[0]), n)
        # a tie: each candidate's coverage, its occurrences cut where the next one starts
        positions = np.flatnonzero((counts == most)[ids])
        group = ids[positions]
        order = np.argsort(group, kind="stable")
        positions, group = positions[order], group[order]
        ends = positions + n
        same = group[1:] == group[:-1]
        ends[:-1] = np.where(same, np.minimum(ends[:-1], positions[1:]), ends[:-1])
        chars = self.cum[ends] - self.cum[positions]
        return int(np.bincount(group, weights=chars).max())

    def dup_chars(self, n: int) -> int:
        """Characters covered by the n-grams that occur more than once."""
        got = self.get(n)
        if got is None:
            return 0
        ids, counts = got
        return self.covered_chars(np.flatnonzero(counts[ids] > 1), n)


def duplicates(items: list[str]) -> tuple[int, int, int]:
    """(duplicate items, characters in them, characters in all): an item is a duplicate from its
    second occurrence on."""
    total = sum(map(len, items))
    distinct = set(items)
    return len(items) - len(distinct), total - sum(map(len, distinct)), total


def figure(x: float) -> str:
    """A measurement or threshold as a rule's detail shows it: four significant digits."""
    return f"{x:.4g}"
