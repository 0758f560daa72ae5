"""The per-record curation stages of one source, run in the scan: language identification,
the heuristic quality rules, PII replacement, in that order (cheapest drop first after the
language, whose drops make the quality rules' stop words meaningful). Each record is judged on
its text as read, newlines kept; a kept record may come back changed (C4's line removal, PII
placeholders) and is cleaned again by the caller.
"""

from __future__ import annotations

import time
from collections import Counter

from common.configure import UserError
from pipeline.format import SIDES
from pipeline.prepare.config import PrepareConfig, SourceConfig
from pipeline.prepare.curate.language import check_language, identifier
from pipeline.prepare.curate.pii import pii_enabled, replace_pii
from pipeline.prepare.curate.quality import judge
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.readers import is_parallel


def check_curation(cfg: PrepareConfig, sources: list[SourceConfig], wheres: list[str]) -> None:
    """One-line errors for the stages' settings, before anything is read or written."""
    for source, where in zip(sources, wheres):
        source.language.check(f"{where}.language")
        source.quality.check(f"{where}.quality")
        source.pii.check(f"{where}.pii")
        if source.language.enabled:
            check_language(source.source_lang, f"{where}.source_lang")
            if is_parallel(source):
                check_language(source.target_lang, f"{where}.target_lang")
        if source.quality.enabled and is_parallel(source):
            raise UserError(
                f"{where}.quality.enabled: the quality rules judge documents, and this source "
                "gives translation pairs (language identification and translation's length "
                "filters judge pairs)"
            )
    cfg.near_dedup.check("near_dedup")
    cfg.decontamination.check("decontamination")
    if cfg.dropped_samples < 0:
        raise UserError(f"dropped_samples: must be 0 or more, got {cfg.dropped_samples}")


class DocumentStages:
    """language -> quality -> PII for the records of one source."""

    def __init__(self, source: SourceConfig, tally: Tally):
        self.tally = tally
        self.language = identifier(source.language) if source.language.enabled else None
        self.quality = source.quality if source.quality.enabled else None
        self.pii = source.pii if pii_enabled(source.pii, source.format) else None
        self.expected = (source.source_lang, source.target_lang)
        self.languages: Counter = Counter()  # (side, detected language) -> texts
        self.seconds: Counter = Counter()  # stage -> seconds spent, for the benchmarks

    @property
    def active(self) -> bool:
        return bool(self.language or self.quality or self.pii)

    def apply(self, texts: list[str], split: str) -> list[str] | None:
        """`texts`: a record's source text, and its target's for a pair; None when a stage
        drops it, else the texts to keep (changed where a stage changes them)."""
        clock = time.perf_counter
        if self.language is not None:
            started = clock()
            try:
                if not self._language(texts, split):
                    return None
            finally:
                self.seconds["language"] += clock() - started
        if self.quality is not None:
            started = clock()
            verdict = judge(texts[0], self.quality, self.expected[0])
            self.seconds["quality"] += clock() - started
            for rule, lines in verdict.lines_removed.items():
                self.tally.count(rule, split, lines)
            if verdict.text is None:
                self.tally.drop(verdict.rule, split, texts[0], verdict.detail)
                return None
            texts = [verdict.text]
        if self.pii is not None:
            started = clock()
            replaced = []
            for text in texts:
                text, counts = replace_pii(text, self.pii)
                for rule, n in counts.items():
                    self.tally.count(rule, split, n)
                replaced.append(text)
            texts = replaced
            self.seconds["pii"] += clock() - started
        return texts

    def _language(self, texts: list[str], split: str) -> bool:
        """Whether every side is in its expected language (or too short to tell)."""
        for side, text in enumerate(texts):
            kept, rule, detail, code = self.language.verdict(text, self.expected[side])
            if code:
                self.languages[(SIDES[side], code)] += 1
            if not kept:
                self.tally.drop(rule, split, text, detail, side=SIDES[side])
                return False
            if rule:
                self.tally.count(rule, split)
        return True
