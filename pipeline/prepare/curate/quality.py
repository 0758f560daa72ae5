"""Heuristic document-quality rules, as published: Gopher's quality and repetition rules (Rae
et al. 2021, appendix A), C4's line and page rules (Raffel et al. 2020, section 2.2, and its
reference code, TFDS `c4_utils`), and FineWeb's additions (Penedo et al. 2024, datatrove's
`FineWebQualityFilter` defaults).

`judge(text, cfg, language)` decides one document, a pure function of its text (newlines kept).
The rules run in this fixed order, cheapest first, and the first one that fails names the drop:

1. `gopher_quality.*` on the text as given, in `RULES` order;
2. `c4.*`: lines are removed (counted per rule in `Verdict.lines_removed`), then the page rules;
   when a line was removed or changed, the kept text is the kept lines, stripped, joined by
   newlines, with one blank line where a paragraph broke; otherwise the text is kept as given;
3. `fineweb.*` on the text C4 kept (the order of FineWeb's pipeline: C4, then its own rules);
4. `gopher_repetition.*` on the text as given (the costliest: n-gram counts).

Definitions shared by the rules:

- a *word* is a run of non-whitespace characters (`str.split()`), punctuation attached;
- a *line* is a piece of the text between two newlines with its surrounding whitespace
  stripped; blank lines are not lines (the paragraph rule uses them as separators);
- a *paragraph* is a block between blank lines, stripped;
- a *duplicate* line or paragraph is each occurrence after its first; the character fractions
  are over the characters of all lines (paragraphs);
- the n-gram rules work on word positions: a top n-gram's fraction is the characters of the
  words covered by the occurrences of the most frequent n-gram (only when it occurs at least
  twice; a tie goes to the one covering most characters), a duplicate n-gram fraction the
  characters of the words covered by any n-gram that occurs more than once, every occurrence
  (the first included), words covered by overlapping occurrences counted once; both over the
  characters of all words (whitespace excluded).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import List, Optional

import numpy as np

from common.configure import UserError

RULES: tuple[str, ...] = (
    "gopher_quality.word_count",
    "gopher_quality.mean_word_length",
    "gopher_quality.hash_ratio",
    "gopher_quality.ellipsis_ratio",
    "gopher_quality.bullet_lines",
    "gopher_quality.ellipsis_lines",
    "gopher_quality.alpha_words",
    "gopher_quality.stop_words",
    # C4's line rules: each removes lines, and drops nothing by itself.
    "c4.long_word",
    "c4.terminal_punct",
    "c4.min_words",
    "c4.javascript",
    "c4.policy",
    # C4's page rules.
    "c4.lorem_ipsum",
    "c4.curly_bracket",
    "c4.min_sentences",
    "fineweb.line_punct",
    "fineweb.short_lines",
    "fineweb.dup_line_chars",
    "fineweb.newline_ratio",
    "gopher_repetition.dup_line_fraction",
    "gopher_repetition.dup_paragraph_fraction",
    "gopher_repetition.dup_line_chars",
    "gopher_repetition.dup_paragraph_chars",
    "gopher_repetition.top_ngram_chars",
    "gopher_repetition.dup_ngram_chars",
)

# Gopher's stop words (Rae et al. 2021, appendix A.1.1).
GOPHER_STOP_WORDS = ["the", "be", "to", "of", "and", "that", "have", "with"]
# C4's policy phrases (TFDS c4_utils `_POLICY_SUBSTRINGS`).
C4_POLICY_PHRASES = [
    "terms of use",
    "privacy policy",
    "cookie policy",
    "uses cookies",
    "use of cookies",
    "use cookies",
]


@dataclass
class GopherQualityConfig:
    # Gopher's quality rules (Rae et al. 2021, appendix A.1.1).
    enabled: bool = True
    # Gopher: a document needs at least this many words ...
    min_words: int = 50
    # Gopher: ... and at most this many.
    max_words: int = 100000
    # Gopher: the mean word length (characters, punctuation attached) must be at least this ...
    min_mean_word_length: float = 3.0
    # Gopher: ... and at most this.
    max_mean_word_length: float = 10.0
    # Gopher: at most this many "#" per word, and, a separate rule with the same bound, at most
    # this many ellipses ("..." or "…") per word ("for either the hash symbol or the ellipsis").
    max_symbol_word_ratio: float = 0.1
    # Gopher: at most this fraction of the lines may start with a bullet (`bullets`).
    max_bullet_line_fraction: float = 0.9
    # What counts as a bullet at the start of a line (after its indentation).
    bullets: List[str] = field(
        default_factory=lambda: ["•", "‣", "●", "○", "◦", "▪", "■", "-", "*"]
    )
    # Gopher: at most this fraction of the lines may end with an ellipsis ("..." or "…").
    max_ellipsis_line_fraction: float = 0.3
    # Gopher: at least this fraction of the words must contain an alphabetic character.
    min_alpha_word_fraction: float = 0.8
    # Gopher: at least this many occurrences of `stop_words` (a word matches when equal after
    # lowercasing and stripping the punctuation around it).
    min_stop_words: int = 2
    # The stop words; Gopher's English list by default. The rule applies only to documents
    # whose language is in `stop_words_languages`: for another language give its own list
    # here and its code there (e.g. stop_words=[der,die,und,...] stop_words_languages=[de]).
    stop_words: List[str] = field(default_factory=lambda: list(GOPHER_STOP_WORDS))
    # Languages (as the source's `source_lang`, compared exactly) `stop_words` is for; the
    # stop-word rule is skipped for a document in any other language.
    stop_words_languages: List[str] = field(default_factory=lambda: ["en"])


@dataclass
class GopherRepetitionConfig:
    # Gopher's repetition rules (Rae et al. 2021, appendix A.1.1, table A1).
    enabled: bool = True
    # Gopher: at most this fraction of the lines may be duplicates.
    max_dup_line_fraction: float = 0.3
    # Gopher: at most this fraction of the paragraphs may be duplicates.
    max_dup_paragraph_fraction: float = 0.3
    # Gopher: at most this fraction of the characters may be in duplicate lines.
    max_dup_line_char_fraction: float = 0.2
    # Gopher: at most this fraction of the characters may be in duplicate paragraphs.
    max_dup_paragraph_char_fraction: float = 0.2
    # Gopher: the n of the top n-gram rules ...
    top_ngram_sizes: List[int] = field(default_factory=lambda: [2, 3, 4])
    # Gopher: ... and, one per n, the largest fraction of the word characters covered by the
    # most frequent n-gram.
    max_top_ngram_char_fractions: List[float] = field(default_factory=lambda: [0.20, 0.18, 0.16])
    # Gopher: the n of the duplicate n-gram rules ...
    dup_ngram_sizes: List[int] = field(default_factory=lambda: [5, 6, 7, 8, 9, 10])
    # Gopher: ... and, one per n, the largest fraction of the word characters covered by
    # n-grams that occur more than once.
    max_dup_ngram_char_fractions: List[float] = field(
        default_factory=lambda: [0.15, 0.14, 0.13, 0.12, 0.11, 0.10]
    )


@dataclass
class C4Config:
    # C4's rules (Raffel et al. 2020, section 2.2, and its reference code, TFDS c4_utils). Lines
    # failing a line rule are removed from the kept text; the page rules (`c4.lorem_ipsum`,
    # `c4.curly_bracket`) look, as the reference code does, only at the lines that passed the
    # terminal-punctuation and word-count rules. The bad-words list is not applied.
    enabled: bool = True
    # C4 code: remove Wikipedia-style citation marks ("[1]", "[edit]", "[citation needed]")
    # from each line before its rules (changes the text, drops nothing).
    remove_citations: bool = True
    # C4 code: remove a line holding a word longer than this many characters (c4.long_word).
    max_word_length: int = 1000
    # C4: keep only lines ending in one of these (c4.terminal_punct); a line ending in "..."
    # is removed anyway.
    terminal_punctuation: List[str] = field(
        default_factory=lambda: [".", "!", "?", '"', "'", "”", "’"]
    )
    # C4: remove lines of fewer words than this (c4.min_words).
    min_words_per_line: int = 3
    # C4: drop a page with fewer sentences than this in its kept lines (c4.min_sentences);
    # sentences end at ".", "!" or "?" (closing quotes and brackets after it) before whitespace
    # or the line's end, and a kept line counts as at least one.
    min_sentences: int = 5
    # C4 code: remove lines containing any of these, case-insensitively (c4.policy). Lines
    # containing "javascript" are removed too (c4.javascript).
    policy_phrases: List[str] = field(default_factory=lambda: list(C4_POLICY_PHRASES))


@dataclass
class FineWebConfig:
    # FineWeb's own rules (Penedo et al. 2024; datatrove FineWebQualityFilter), on the text C4
    # kept.
    enabled: bool = True
    # FineWeb: drop a document unless more than this fraction of its lines end in
    # `line_end_punctuation` (fineweb.line_punct; a fraction equal to it drops).
    min_line_punct_fraction: float = 0.12
    # FineWeb: what counts as a line's final punctuation for `min_line_punct_fraction`.
    line_end_punctuation: List[str] = field(default_factory=lambda: [".", "'", '"', "!", "?"])
    # FineWeb: a line of at most this many characters is short.
    short_line_length: int = 30
    # FineWeb: drop a document when this fraction of its lines or more are short
    # (fineweb.short_lines).
    max_short_line_fraction: float = 0.67
    # FineWeb: drop a document when this fraction of its line characters or more are in
    # duplicate lines (fineweb.dup_line_chars).
    max_dup_line_char_fraction: float = 0.01
    # FineWeb: drop a document with more newlines per word than this (fineweb.newline_ratio).
    max_newline_word_ratio: float = 0.3


@dataclass
class QualityConfig:
    # Run the heuristic quality rules on this source's documents (off unless a config turns it
    # on); then every rule set below runs unless its own `enabled` is false.
    enabled: bool = False
    # Rules to skip, by name (e.g. c4.terminal_punct, which FineWeb itself turned off):
    # gopher_quality.word_count, gopher_quality.mean_word_length, gopher_quality.hash_ratio,
    # gopher_quality.ellipsis_ratio, gopher_quality.bullet_lines, gopher_quality.ellipsis_lines,
    # gopher_quality.alpha_words, gopher_quality.stop_words, c4.long_word, c4.terminal_punct,
    # c4.min_words, c4.javascript, c4.policy, c4.lorem_ipsum, c4.curly_bracket,
    # c4.min_sentences, fineweb.line_punct, fineweb.short_lines, fineweb.dup_line_chars,
    # fineweb.newline_ratio, gopher_repetition.dup_line_fraction,
    # gopher_repetition.dup_paragraph_fraction, gopher_repetition.dup_line_chars,
    # gopher_repetition.dup_paragraph_chars, gopher_repetition.top_ngram_chars,
    # gopher_repetition.dup_ngram_chars.
    disabled_rules: List[str] = field(default_factory=list)
    # Gopher's quality rules (Rae et al. 2021), run first, on the text as given.
    gopher_quality: GopherQualityConfig = field(default_factory=GopherQualityConfig)
    # Gopher's repetition rules (Rae et al. 2021), run last (the costliest), on the text as given.
    gopher_repetition: GopherRepetitionConfig = field(default_factory=GopherRepetitionConfig)
    # C4's line and page rules (Raffel et al. 2020), run second; the text they keep is the one
    # kept and the one FineWeb's rules judge.
    c4: C4Config = field(default_factory=C4Config)
    # FineWeb's rules (Penedo et al. 2024), run third, on the text C4 kept.
    fineweb: FineWebConfig = field(default_factory=FineWebConfig)

    def check(self, where: str) -> None:
        """Raise `UserError` naming the first bad key."""
        for name in self.disabled_rules:
            if name not in RULES:
                raise UserError(
                    f"{where}.disabled_rules: unknown rule {name!r} (rules: {', '.join(RULES)})"
                )
        g = self.gopher_quality
        w = f"{where}.gopher_quality"
        _at_least(f"{w}.min_words", g.min_words, 0)
        _at_least(f"{w}.max_words", g.max_words, g.min_words, "min_words")
        _at_least(f"{w}.min_mean_word_length", g.min_mean_word_length, 0)
        if g.max_mean_word_length <= g.min_mean_word_length:
            raise UserError(
                f"{w}.max_mean_word_length: must be > min_mean_word_length "
                f"({g.min_mean_word_length}), got {g.max_mean_word_length}"
            )
        _at_least(f"{w}.max_symbol_word_ratio", g.max_symbol_word_ratio, 0)
        _fraction(f"{w}.max_bullet_line_fraction", g.max_bullet_line_fraction)
        _fraction(f"{w}.max_ellipsis_line_fraction", g.max_ellipsis_line_fraction)
        _fraction(f"{w}.min_alpha_word_fraction", g.min_alpha_word_fraction)
        _at_least(f"{w}.min_stop_words", g.min_stop_words, 0)
        _no_empty(f"{w}.bullets", g.bullets)
        _no_empty(f"{w}.stop_words", g.stop_words)
        r = self.gopher_repetition
        w = f"{where}.gopher_repetition"
        for key in (
            "max_dup_line_fraction",
            "max_dup_paragraph_fraction",
            "max_dup_line_char_fraction",
            "max_dup_paragraph_char_fraction",
        ):
            _fraction(f"{w}.{key}", getattr(r, key))
        for sizes_key, fractions_key in (
            ("top_ngram_sizes", "max_top_ngram_char_fractions"),
            ("dup_ngram_sizes", "max_dup_ngram_char_fractions"),
        ):
            sizes, fractions = getattr(r, sizes_key), getattr(r, fractions_key)
            if len(fractions) != len(sizes):
                raise UserError(
                    f"{w}.{fractions_key}: must have one value per n of {sizes_key} "
                    f"({len(sizes)}), got {len(fractions)}"
                )
            for i, n in enumerate(sizes):
                _at_least(f"{w}.{sizes_key}[{i}]", n, 1)
            for i, frac in enumerate(fractions):
                _fraction(f"{w}.{fractions_key}[{i}]", frac)
        c = self.c4
        w = f"{where}.c4"
        _at_least(f"{w}.max_word_length", c.max_word_length, 1)
        _at_least(f"{w}.min_words_per_line", c.min_words_per_line, 0)
        _at_least(f"{w}.min_sentences", c.min_sentences, 0)
        _no_empty(f"{w}.terminal_punctuation", c.terminal_punctuation)
        _no_empty(f"{w}.policy_phrases", c.policy_phrases)
        f = self.fineweb
        w = f"{where}.fineweb"
        _fraction(f"{w}.min_line_punct_fraction", f.min_line_punct_fraction)
        _no_empty(f"{w}.line_end_punctuation", f.line_end_punctuation)
        _at_least(f"{w}.short_line_length", f.short_line_length, 0)
        _fraction(f"{w}.max_short_line_fraction", f.max_short_line_fraction)
        _fraction(f"{w}.max_dup_line_char_fraction", f.max_dup_line_char_fraction)
        _at_least(f"{w}.max_newline_word_ratio", f.max_newline_word_ratio, 0)


def _at_least(key: str, value: float, low: float, low_name: str = "") -> None:
    if value < low:
        bound = f"{low_name} ({low})" if low_name else f"{low}"
        raise UserError(f"{key}: must be >= {bound}, got {value}")


def _fraction(key: str, value: float) -> None:
    if not 0.0 <= value <= 1.0:
        raise UserError(f"{key}: must be a fraction in [0, 1], got {value}")


def _no_empty(key: str, values: List[str]) -> None:
    for i, value in enumerate(values):
        if not value:
            raise UserError(f"{key}[{i}]: must not be empty")


@dataclass(frozen=True)
class Verdict:
    """`text`: the document to keep (C4's line removal applied), None when dropped; `rule`: the
    rule that dropped it ("" when kept); `detail`: its measurement against the threshold;
    `lines_removed`: C4 line rule -> lines it removed from the kept text (empty when dropped)."""

    text: Optional[str]
    rule: str = ""
    detail: str = ""
    lines_removed: dict = field(default_factory=dict)


_PARAGRAPH_BREAK = re.compile(r"\n[^\S\n]*\n\s*")  # a blank line (and any that follow)
_ALPHA_WORD = re.compile(r"(?<!\S)\S*?[^\W\d_]")  # a word (from its start) up to a letter
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")


@lru_cache(maxsize=16)
def _stop_word_regex(words: tuple[str, ...]) -> re.Pattern:
    """A whole word equal to one of `words` once lowercased and stripped of the punctuation
    around it."""
    alternatives = "|".join(re.escape(w.lower()) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?<!\S)[^\w\s]*(?:{alternatives})[^\w\s]*(?!\S)", re.IGNORECASE)


def _g(x: float) -> str:
    return f"{x:.4g}"


def _duplicates(items: list[str]) -> tuple[int, int, int]:
    """(duplicate items, characters in them, characters in all): an item is a duplicate from its
    second occurrence on."""
    total = sum(map(len, items))
    distinct = set(items)
    return len(items) - len(distinct), total - sum(map(len, distinct)), total


def _lines(text: str) -> list[str]:
    return [s for s in map(str.strip, text.split("\n")) if s]


def judge(text: str, cfg: QualityConfig, language: str = "en") -> Verdict:
    """The verdict of every enabled rule on one document (see the module's docstring)."""
    off = frozenset(cfg.disabled_rules)
    words = text.split()
    lines = _lines(text)
    if cfg.gopher_quality.enabled:
        failed = _gopher_quality(text, words, lines, cfg.gopher_quality, language, off)
        if failed:
            return Verdict(None, *failed)
    kept, kept_lines, kept_words, removed = text, lines, len(words), {}
    if cfg.c4.enabled:
        failed, parts, kept_words, removed, changed = _c4(text, cfg.c4, off)
        if failed:
            return Verdict(None, *failed)
        if changed:
            kept = "\n".join(parts)
            kept_lines = [s for s in parts if s]
    if cfg.fineweb.enabled:
        failed = _fineweb(kept, kept_lines, kept_words, cfg.fineweb, off)
        if failed:
            return Verdict(None, *failed)
    if cfg.gopher_repetition.enabled:
        failed = _gopher_repetition(text, words, lines, cfg.gopher_repetition, off)
        if failed:
            return Verdict(None, *failed)
    return Verdict(kept, lines_removed=removed)


def _gopher_quality(
    text: str,
    words: list[str],
    lines: list[str],
    g: GopherQualityConfig,
    language: str,
    off: frozenset,
) -> tuple[str, str] | None:
    n = len(words)
    if "gopher_quality.word_count" not in off:
        if n < g.min_words:
            return "gopher_quality.word_count", f"{n} words < {g.min_words}"
        if n > g.max_words:
            return "gopher_quality.word_count", f"{n} words > {g.max_words}"
    if n == 0:
        return None  # the ratios below are per word; a document without words has none
    if "gopher_quality.mean_word_length" not in off:
        mean = sum(map(len, words)) / n
        if mean < g.min_mean_word_length:
            return "gopher_quality.mean_word_length", (
                f"mean word length {_g(mean)} < {_g(g.min_mean_word_length)}"
            )
        if mean > g.max_mean_word_length:
            return "gopher_quality.mean_word_length", (
                f"mean word length {_g(mean)} > {_g(g.max_mean_word_length)}"
            )
    if "gopher_quality.hash_ratio" not in off:
        ratio = text.count("#") / n
        if ratio > g.max_symbol_word_ratio:
            return "gopher_quality.hash_ratio", (
                f"'#' per word {_g(ratio)} > {_g(g.max_symbol_word_ratio)}"
            )
    if "gopher_quality.ellipsis_ratio" not in off:
        ratio = (text.count("...") + text.count("…")) / n
        if ratio > g.max_symbol_word_ratio:
            return "gopher_quality.ellipsis_ratio", (
                f"ellipses per word {_g(ratio)} > {_g(g.max_symbol_word_ratio)}"
            )
    if lines and "gopher_quality.bullet_lines" not in off:
        bullets = tuple(g.bullets)
        frac = sum(1 for s in lines if s.startswith(bullets)) / len(lines)
        if frac > g.max_bullet_line_fraction:
            return "gopher_quality.bullet_lines", (
                f"bullet lines {_g(frac)} > {_g(g.max_bullet_line_fraction)}"
            )
    if lines and "gopher_quality.ellipsis_lines" not in off:
        frac = sum(1 for s in lines if s.endswith(("...", "…"))) / len(lines)
        if frac > g.max_ellipsis_line_fraction:
            return "gopher_quality.ellipsis_lines", (
                f"lines ending in an ellipsis {_g(frac)} > {_g(g.max_ellipsis_line_fraction)}"
            )
    if "gopher_quality.alpha_words" not in off:
        frac = len(_ALPHA_WORD.findall(text)) / n
        if frac < g.min_alpha_word_fraction:
            return "gopher_quality.alpha_words", (
                f"words with a letter {_g(frac)} < {_g(g.min_alpha_word_fraction)}"
            )
    if (
        g.min_stop_words > 0
        and "gopher_quality.stop_words" not in off
        and language in g.stop_words_languages
    ):
        found = 0
        for _ in _stop_word_regex(tuple(g.stop_words)).finditer(text):
            found += 1
            if found >= g.min_stop_words:
                break
        else:
            return "gopher_quality.stop_words", f"{found} stop words < {g.min_stop_words}"
    return None


def _c4(text: str, c: C4Config, off: frozenset):
    """(None, kept lines with "" where a paragraph broke, their words, {line rule: lines
    removed}, whether a line was removed or changed), or ((page rule, detail), ...)."""
    long_word = "c4.long_word" not in off
    terminal = "c4.terminal_punct" not in off
    min_words = c.min_words_per_line if "c4.min_words" not in off else 0
    lorem = "c4.lorem_ipsum" not in off
    javascript = "c4.javascript" not in off
    curly = "c4.curly_bracket" not in off
    policy = tuple(c.policy_phrases) if "c4.policy" not in off else ()
    ends = tuple(c.terminal_punctuation)
    parts: list[str] = []
    removed: dict[str, int] = {}
    sentences = n_words = 0
    blank_before = changed = False
    for line in text.split("\n"):
        line = line.strip()
        if not line:
            blank_before = True
            continue
        words = line.split()
        rule = ""
        if long_word and max(map(len, words)) > c.max_word_length:
            rule = "c4.long_word"
        else:
            if c.remove_citations and "[" in line:
                cleaned = _CITATION.sub("", line).strip()
                changed = changed or cleaned != line
                line = cleaned
            if terminal and (not line.endswith(ends) or line.endswith("...")):
                rule = "c4.terminal_punct"
            elif len(words) < min_words:
                rule = "c4.min_words"
            else:
                low = line.lower()
                if lorem and "lorem ipsum" in low:
                    return ("c4.lorem_ipsum", "'lorem ipsum' in a kept line"), [], 0, {}, True
                if javascript and "javascript" in low:
                    rule = "c4.javascript"
                elif curly and "{" in line:
                    return ("c4.curly_bracket", "'{' in a kept line"), [], 0, {}, True
                elif policy and any(p in low for p in policy):
                    rule = "c4.policy"
        if rule:
            removed[rule] = removed.get(rule, 0) + 1
            continue
        if sentences < c.min_sentences:
            sentences += max(1, len(_SENTENCE_END.findall(line)))
        n_words += len(words)
        if blank_before and parts:
            parts.append("")
        blank_before = False
        parts.append(line)
    if "c4.min_sentences" not in off and sentences < c.min_sentences:
        failed = ("c4.min_sentences", f"{sentences} sentences < {c.min_sentences}")
        return failed, [], 0, {}, True
    return None, parts, n_words, removed, changed or bool(removed)


def _fineweb(
    text: str, lines: list[str], n_words: int, f: FineWebConfig, off: frozenset
) -> tuple[str, str] | None:
    n_lines = len(lines)
    if "fineweb.line_punct" not in off:
        ends = tuple(f.line_end_punctuation)
        frac = sum(1 for s in lines if s.endswith(ends)) / n_lines if n_lines else 0.0
        if frac <= f.min_line_punct_fraction:
            return "fineweb.line_punct", (
                f"lines ending in punctuation {_g(frac)} <= {_g(f.min_line_punct_fraction)}"
            )
    if n_lines and "fineweb.short_lines" not in off:
        frac = sum(1 for s in lines if len(s) <= f.short_line_length) / n_lines
        if frac >= f.max_short_line_fraction:
            return "fineweb.short_lines", (
                f"short lines {_g(frac)} >= {_g(f.max_short_line_fraction)}"
            )
    if n_lines and "fineweb.dup_line_chars" not in off:
        _, dup_chars, total = _duplicates(lines)
        frac = dup_chars / total
        if frac >= f.max_dup_line_char_fraction:
            return "fineweb.dup_line_chars", (
                f"characters in duplicate lines {_g(frac)} >= {_g(f.max_dup_line_char_fraction)}"
            )
    if "fineweb.newline_ratio" not in off:
        newlines = text.count("\n")
        ratio = newlines / n_words if n_words else (float("inf") if newlines else 0.0)
        if ratio > f.max_newline_word_ratio:
            return "fineweb.newline_ratio", (
                f"newlines per word {_g(ratio)} > {_g(f.max_newline_word_ratio)}"
            )
    return None


def _gopher_repetition(
    text: str, words: list[str], lines: list[str], r: GopherRepetitionConfig, off: frozenset
) -> tuple[str, str] | None:
    check_lines = "gopher_repetition.dup_line_fraction" not in off
    check_line_chars = "gopher_repetition.dup_line_chars" not in off
    if lines and (check_lines or check_line_chars):
        dups, dup_chars, total = _duplicates(lines)
        frac = dups / len(lines)
        if check_lines and frac > r.max_dup_line_fraction:
            return "gopher_repetition.dup_line_fraction", (
                f"duplicate lines {_g(frac)} > {_g(r.max_dup_line_fraction)}"
            )
        frac = dup_chars / total
        if check_line_chars and frac > r.max_dup_line_char_fraction:
            return "gopher_repetition.dup_line_chars", (
                f"characters in duplicate lines {_g(frac)} > {_g(r.max_dup_line_char_fraction)}"
            )
    check_paras = "gopher_repetition.dup_paragraph_fraction" not in off
    check_para_chars = "gopher_repetition.dup_paragraph_chars" not in off
    if check_paras or check_para_chars:
        paragraphs = [p for p in (p.strip() for p in _PARAGRAPH_BREAK.split(text)) if p]
        if paragraphs:
            dups, dup_chars, total = _duplicates(paragraphs)
            frac = dups / len(paragraphs)
            if check_paras and frac > r.max_dup_paragraph_fraction:
                return "gopher_repetition.dup_paragraph_fraction", (
                    f"duplicate paragraphs {_g(frac)} > {_g(r.max_dup_paragraph_fraction)}"
                )
            frac = dup_chars / total
            if check_para_chars and frac > r.max_dup_paragraph_char_fraction:
                return "gopher_repetition.dup_paragraph_chars", (
                    f"characters in duplicate paragraphs {_g(frac)} > "
                    f"{_g(r.max_dup_paragraph_char_fraction)}"
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


def _ngram_rules(words: list[str], top: list, dup: list) -> tuple[str, str] | None:
    grams = _NGrams(words)
    total = grams.total_chars
    if total == 0:
        return None
    for n, limit in top:
        frac = grams.top_chars(n) / total
        if frac > limit:
            return "gopher_repetition.top_ngram_chars", (
                f"top {n}-gram characters {_g(frac)} > {_g(limit)}"
            )
    for n, limit in dup:
        frac = grams.dup_chars(n) / total
        if frac > limit:
            return "gopher_repetition.dup_ngram_chars", (
                f"duplicate {n}-gram characters {_g(frac)} > {_g(limit)}"
            )
    return None
