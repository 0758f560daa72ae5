"""README.md and docs/ say what is true now. What changed, and when, lives in git log: a page that
narrates it (a work session, an issue number, "no longer", "used to", a dated heading, a fix told
as a story) fails here, naming the file, the line and the phrase. Fenced code (logs, error lines)
is not read."""

import re
from pathlib import Path

from mdprose import numbered_prose_lines

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# Each pattern, case-insensitive, is history or the project's internal wording, not a user's.
HISTORY = [
    r"\b(first|second|third) contact\b",
    r"\bthis (morning|afternoon|evening)\b",
    r"\byesterday\b",
    r"\blast (week|night|time)\b",
    r"(?<!ssh )(?<!terminal )\bsessions?\b",
    r"\bissue #?\d+",
    r"\bno longer\b",
    r"\bused to\b",
    r"\bdefects? fixed\b",
    r"\b(was|were|has been|have been) fixed\b",
    r"\bfixed (since|in the commit|later)\b",
    r"\bfirst try\b",
    r"\bthe device tool\b",
    r"\b\d+% target\b",
    r"\bold order\b",
    r"\bhad given\b",
    r"\bversion 1/2\b",
    r"\bearlier scheme\b",
    r"\bolder per-rank\b",
    r"\bbefore this (order|change|commit)\b",
    r"\b(landed|added|removed|introduced) (next|since|recently)\b",
]
PATTERN = re.compile("|".join(f"(?:{p})" for p in HISTORY), re.IGNORECASE)
# A date in a heading makes the section a diary entry; tables and provenance lines carry dates.
DATED_HEADING = re.compile(r"^ {0,3}#{1,6}\s.*\b20\d\d-\d\d-\d\d\b")


def history_in(text: str) -> list[tuple[int, str]]:
    """(line, phrase) of every history phrase or dated heading in a page's prose."""
    found = []
    for number, line in numbered_prose_lines(text):
        found += [(number, m.group(0)) for m in PATTERN.finditer(line)]
        if DATED_HEADING.match(line):
            found.append((number, line.strip()))
    return found


def test_the_pages_carry_no_history():
    found = [
        f"{page.relative_to(ROOT)}:{line}: {phrase!r}"
        for page in PAGES
        for line, phrase in history_in(page.read_text(encoding="utf-8"))
    ]
    assert not found, "history in the docs (say what is true now):\n" + "\n".join(found)


def test_a_planted_history_phrase_is_caught():
    planted = [
        "### Second contact on an H200",
        "Measured this morning, 0.826 of the bench.",
        "A first try failed on the positions, fixed in the commit after.",
        "The loader no longer cuts the order by rank.",
        "This key used to default to 8.",
        "Seed 0 was the old order's best draw.",
        "As issue #63 asks, the pages are short.",
        "Found in the last session.",
        "## The check, 2026-11-28",
    ]
    for line in planted:
        text = f"# Page\n\nA true sentence.\n{line}\n"
        assert history_in(text) and history_in(text)[0][0] == 4, line


def test_present_tense_passes():
    fine = [
        "The terminal or SSH session that started it closed.",
        "A failed stage leaves the earlier stages' outputs intact.",
        "- Machine: the 2-core Intel Xeon VM (AMX); commit 8c65532; 2026-12-07.",
        "| bench, compiled | 481,993 | 41.6% |",
        "The check profiles steps 301-303.",
    ]
    for line in fine:
        assert history_in(f"{line}\n") == [], line
    assert history_in("```\nno longer, used to, this morning\n```\n") == []
