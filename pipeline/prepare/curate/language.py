"""Language identification: a document is kept when the language detected in it is its source's
language (`source_lang` / `target_lang`, ISO 639-1) with enough confidence.

The detector is CLD2 (Google's Compact Language Detector 2, through `pycld2`): its model is
compiled into the extension (no download at run time), it knows 160-odd languages, it is
deterministic, and it runs at about 18 MB/s of English prose on one core, ~150,000 UI strings/s.
On this machine's gettext catalogs (English msgids, German msgstrs) and English licence texts
it found the right language for 90 % (en) / 77 % (de) of 20-30 character strings, 99 % / 90 %
of 30-60 and 98-99.5 % / 97 % of longer ones, but only 27-73 % below 20 characters, hence
`min_chars`. lingua-language-detector (all languages, high accuracy) was 100-500x slower
(0.03-0.14 MB/s) and no more accurate on the same texts.

The confidence is CLD2's share of the text (its letters, in percent / 100) in the detected
language, halved when CLD2 does not call the result reliable: about 1.0 for a monolingual text,
about 0.6 for a text that is 60 % one language; not a probability (fastText's is).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import pycld2

from common.configure import UserError

TOO_SHORT = "language.too_short"
WRONG_LANGUAGE = "language.wrong_language"
LOW_CONFIDENCE = "language.low_confidence"
UNDETERMINED = "und"

# CLD2's own codes that are not the current ISO 639 ones (or are a script variant of one).
_FROM_CLD2 = {"iw": "he", "jw": "jv", "zh-Hant": "zh", "sr-ME": "sr"}
# Codes a user may write for a language CLD2 reports under another code.
_ALIASES = {"iw": "he", "jw": "jv", "nb": "no"}
# Code points CLD2 refuses as "invalid UTF-8" (C0/C1 controls but tab/newline/cr/form feed,
# Unicode noncharacters) and lone surrogates (which do not encode to UTF-8 at all).
_REFUSED = re.compile(
    "[\x00-\x08\x0b\x0e-\x1f\x7f-\x9f\ufdd0-\ufdef\ud800-\udfff"
    + "".join(
        f"{chr(plane * 0x10000 + 0xFFFE)}{chr(plane * 0x10000 + 0xFFFF)}" for plane in range(17)
    )
    + "]"
)


def _known_codes() -> frozenset[str]:
    names = set(pycld2.DETECTED_LANGUAGES)
    codes = {_FROM_CLD2.get(code, code) for name, code in pycld2.LANGUAGES if name in names}
    # Script-only results ("xx-Latn": some language in Latin script) are not a language.
    return frozenset(code for code in codes if not code.startswith(("xx", "zz")))


KNOWN_CODES = _known_codes()


def _normalize(code: str) -> str:
    code = code.strip()
    return _ALIASES.get(code.lower(), code.lower())


def check_language(code: str, where: str) -> None:
    """Refuse, in one line naming `where`, a language code the detector cannot report."""
    if _normalize(code) not in KNOWN_CODES:
        raise UserError(
            f"{where}: unknown language code {code!r} for language identification "
            f"(ISO 639-1, e.g. en, de, fr, es, zh; {len(KNOWN_CODES)} known)"
        )


@dataclass
class LanguageConfig:
    # Drop documents that are not in their source's language (source_lang / target_lang). Off
    # unless a config turns it on.
    enabled: bool = False
    # Least confidence, in [0, 1], for the expected language: CLD2's share of the text in it,
    # halved when CLD2 calls the result unreliable. 0.5 (the expected language is most of the
    # text) is CCNet's fastText threshold; CLD2 gives about 1.0 for a text in one language.
    min_confidence: float = 0.5
    # Texts shorter than this many characters (leading/trailing spaces aside) are kept unjudged
    # and counted as language.too_short: CLD2 is wrong on a quarter to a half of menu labels
    # under 20 characters, right on 90 % (en) / 77 % (de) of 20-30 and more of longer ones.
    min_chars: int = 20

    def check(self, where: str) -> None:
        if not 0.0 <= self.min_confidence <= 1.0:
            raise UserError(f"{where}.min_confidence: must be in [0, 1], got {self.min_confidence}")
        if self.min_chars < 0:
            raise UserError(f"{where}.min_chars: must be 0 or more, got {self.min_chars}")


def _detect(text: str) -> tuple[str, float]:
    try:
        reliable, _, details = pycld2.detect(text, isPlainText=True, bestEffort=True)
    except (pycld2.error, UnicodeEncodeError):
        reliable, _, details = pycld2.detect(
            _REFUSED.sub(" ", text), isPlainText=True, bestEffort=True
        )
    code, percent = details[0][1], details[0][2]
    code = _FROM_CLD2.get(code, code)
    if code == "un" or code.startswith(("xx", "zz")) or percent <= 0:
        return UNDETERMINED, 0.0
    confidence = min(percent, 100) / 100.0
    return code, confidence if reliable else confidence / 2


class LanguageIdentifier:
    """Detects a text's language and judges it against the expected one. CLD2's model is static
    in the extension, so this holds only the config; `identifier(cfg)` shares one per config."""

    def __init__(self, cfg: LanguageConfig):
        self.min_confidence = float(cfg.min_confidence)
        self.min_chars = int(cfg.min_chars)

    def detect(self, text: str) -> tuple[str, float]:
        """(ISO 639-1 code, or CLD2's ISO 639-2/3 code for a language without one, or "und";
        confidence in [0, 1])."""
        return _detect(text)

    def verdict(self, text: str, expected: str) -> tuple[bool, str, str, str]:
        """`judge`'s (kept, rule, detail) and the language detected ("" when too short to
        judge), for the per-language counts."""
        if len(text.strip()) < self.min_chars:
            return True, TOO_SHORT, "", ""
        code, confidence = _detect(text)
        return (*self._decide(code, confidence, _normalize(expected)), code)

    def judge(self, text: str, expected: str) -> tuple[bool, str, str]:
        """(kept, rule, detail): rule is "" for an ordinary keep, TOO_SHORT for a kept text too
        short to judge, WRONG_LANGUAGE or LOW_CONFIDENCE for a dropped one."""
        if len(text.strip()) < self.min_chars:
            return True, TOO_SHORT, ""
        code, confidence = _detect(text)
        return self._decide(code, confidence, _normalize(expected))

    def _decide(self, code: str, confidence: float, expected: str) -> tuple[bool, str, str]:
        if code == UNDETERMINED:
            return False, LOW_CONFIDENCE, f"no language detected, expected {expected}"
        if code != expected:
            return False, WRONG_LANGUAGE, f"detected {code} {confidence:.2f}, expected {expected}"
        if confidence < self.min_confidence:
            return False, LOW_CONFIDENCE, f"{code} {confidence:.2f} < {self.min_confidence:.2f}"
        return True, "", ""

    def judge_batch(self, texts: list[str], expected: str) -> list[tuple[bool, str, str]]:
        """`judge` of each text (CLD2 has no batch call: a convenience, not a speed-up)."""
        return [self.judge(text, expected) for text in texts]


@functools.lru_cache(maxsize=8)
def _identifier(min_confidence: float, min_chars: int) -> LanguageIdentifier:
    return LanguageIdentifier(LanguageConfig(min_confidence=min_confidence, min_chars=min_chars))


def identifier(cfg: LanguageConfig) -> LanguageIdentifier:
    """The process's identifier for this config (one per distinct config)."""
    return _identifier(float(cfg.min_confidence), int(cfg.min_chars))
