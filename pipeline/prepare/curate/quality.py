"""Heuristic document-quality rules, as published: Gopher's quality and repetition rules (Rae
et al. 2021, appendix A), C4's line and page rules (Raffel et al. 2020, section 2.2, and its
reference code, TFDS `c4_utils`), and FineWeb's additions (Penedo et al. 2024, datatrove's
`FineWebQualityFilter` defaults).

`judge(text, cfg, language)` decides one document, a pure function of its text (newlines kept).
The rules run in this fixed order, cheapest first, and the first one that fails names the drop:

1. `gopher_quality.*` on the text as given, in `RULES` order (`quality_config`, the schema);
2. `c4.*`: lines are removed (counted per rule in `Verdict.lines_removed`), then the page rules;
   when a line was removed or changed, the kept text is the kept lines, stripped, joined by
   newlines, with one blank line where a paragraph broke; otherwise the text is kept as given;
3. `fineweb.*` on the text C4 kept (the order of FineWeb's pipeline: C4, then its own rules);
4. `gopher_repetition.*` on the text as given (the costliest: n-gram counts; `repetition`).

Definitions shared by the rules:

- a *word* is a run of non-whitespace characters (`str.split()`), punctuation attached;
- a *line* is a piece of the text between two newlines with its surrounding whitespace
  stripped; blank lines are not lines (the paragraph rule uses them as separators);
- a *paragraph* is a block between blank lines, stripped;
- a *duplicate* line or paragraph is each occurrence after its first; the character fractions
  are over the characters of all lines (paragraphs);
- the n-gram rules' fractions are defined in `repetition`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional

from pipeline.prepare.curate.quality_config import (
    C4Config,
    FineWebConfig,
    GopherQualityConfig,
    QualityConfig,
)
from pipeline.prepare.curate.repetition import duplicates, figure, gopher_repetition


@dataclass(frozen=True)
class Verdict:
    """`text`: the document to keep (C4's line removal applied), None when dropped; `rule`: the
    rule that dropped it ("" when kept); `detail`: its measurement against the threshold;
    `lines_removed`: C4 line rule -> lines it removed from the kept text (empty when dropped)."""

    text: Optional[str]
    rule: str = ""
    detail: str = ""
    lines_removed: dict = field(default_factory=dict)


_ALPHA_WORD = re.compile(r"(?<!\S)\S*?[^\W\d_]")  # a word (from its start) up to a letter
_CITATION = re.compile(r"\[\d*\]|\[edit\]|\[citation needed\]")
_SENTENCE_END = re.compile(r"[.!?]+[\"'”’)\]]*(?=\s|$)")


@lru_cache(maxsize=16)
def _stop_word_regex(words: tuple[str, ...]) -> re.Pattern:
    """A whole word equal to one of `words` once lowercased and stripped of the punctuation
    around it."""
    alternatives = "|".join(re.escape(w.lower()) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"(?<!\S)[^\w\s]*(?:{alternatives})[^\w\s]*(?!\S)", re.IGNORECASE)


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
        failed = gopher_repetition(text, words, lines, cfg.gopher_repetition, off)
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
                f"mean word length {figure(mean)} < {figure(g.min_mean_word_length)}"
            )
        if mean > g.max_mean_word_length:
            return "gopher_quality.mean_word_length", (
                f"mean word length {figure(mean)} > {figure(g.max_mean_word_length)}"
            )
    if "gopher_quality.hash_ratio" not in off:
        ratio = text.count("#") / n
        if ratio > g.max_symbol_word_ratio:
            return "gopher_quality.hash_ratio", (
                f"'#' per word {figure(ratio)} > {figure(g.max_symbol_word_ratio)}"
            )
    if "gopher_quality.ellipsis_ratio" not in off:
        ratio = (text.count("...") + text.count("…")) / n
        if ratio > g.max_symbol_word_ratio:
            return "gopher_quality.ellipsis_ratio", (
                f"ellipses per word {figure(ratio)} > {figure(g.max_symbol_word_ratio)}"
            )
    if lines and "gopher_quality.bullet_lines" not in off:
        bullets = tuple(g.bullets)
        frac = sum(1 for s in lines if s.startswith(bullets)) / len(lines)
        if frac > g.max_bullet_line_fraction:
            return "gopher_quality.bullet_lines", (
                f"bullet lines {figure(frac)} > {figure(g.max_bullet_line_fraction)}"
            )
    if lines and "gopher_quality.ellipsis_lines" not in off:
        frac = sum(1 for s in lines if s.endswith(("...", "…"))) / len(lines)
        if frac > g.max_ellipsis_line_fraction:
            return "gopher_quality.ellipsis_lines", (
                f"lines ending in an ellipsis {figure(frac)} > "
                f"{figure(g.max_ellipsis_line_fraction)}"
            )
    if "gopher_quality.alpha_words" not in off:
        frac = len(_ALPHA_WORD.findall(text)) / n
        if frac < g.min_alpha_word_fraction:
            return "gopher_quality.alpha_words", (
                f"words with a letter {figure(frac)} < {figure(g.min_alpha_word_fraction)}"
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
                f"lines ending in punctuation {figure(frac)} <= {figure(f.min_line_punct_fraction)}"
            )
    if n_lines and "fineweb.short_lines" not in off:
        frac = sum(1 for s in lines if len(s) <= f.short_line_length) / n_lines
        if frac >= f.max_short_line_fraction:
            return "fineweb.short_lines", (
                f"short lines {figure(frac)} >= {figure(f.max_short_line_fraction)}"
            )
    if n_lines and "fineweb.dup_line_chars" not in off:
        _, dup_chars, total = duplicates(lines)
        frac = dup_chars / total
        if frac >= f.max_dup_line_char_fraction:
            return "fineweb.dup_line_chars", (
                f"characters in duplicate lines {figure(frac)} >= "
                f"{figure(f.max_dup_line_char_fraction)}"
            )
    if "fineweb.newline_ratio" not in off:
        newlines = text.count("\n")
        ratio = newlines / n_words if n_words else (float("inf") if newlines else 0.0)
        if ratio > f.max_newline_word_ratio:
            return "fineweb.newline_ratio", (
                f"newlines per word {figure(ratio)} > {figure(f.max_newline_word_ratio)}"
            )
    return None
