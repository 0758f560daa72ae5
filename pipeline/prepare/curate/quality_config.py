"""The schema of the heuristic quality rules (`quality` of a source): one dataclass per rule set,
their published thresholds as defaults, and the check that names the first bad key.

`RULES` names every rule in the order `quality.judge` runs them; `disabled_rules` is checked
against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List

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
