"""What the docs tests read of a Markdown page: its prose, outside fenced code blocks."""

import re

FENCE = re.compile(r"^\s*(```|~~~)")


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    return [line for _, line in numbered_prose_lines(text)]


def numbered_prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number from 1, line) of each line outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(text.splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines
