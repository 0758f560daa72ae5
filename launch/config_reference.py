"""The configuration reference (docs/configuration.md), \
generated from the config dataclasses themselves.

One table per entry point lists every leaf key of its schema (nested dataclasses as dotted keys),
its type, its default and its description: the comment written with the field, either `#` lines
directly above it or a trailing `# ...` (read by `common.configure.field_comments`, which every
entry point's `--help` uses too). docs/configuration.md keeps the generated text between two
markers; `tests/launch/test_config_reference.py` fails when it goes stale.

    python -m launch.config_reference                  # print the reference
    python -m launch.config_reference --write          # replace docs/configuration.md's block
    python -m launch.config_reference --check          # exit 1 naming the first stale key
    python -m launch.config_reference --check FILE.md  # the same for another file with the markers

Exit status: 1 for a stale reference (`--check`), 2 for a FILE that cannot be
read or has no markers.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

from omegaconf import MISSING

from common.configure import leaf_rows, show
from launch.config import (
    AverageConfig,
    EvaluateConfig,
    ExportConfig,
    MainConfig,
    ReportConfig,
    TrainConfig,
    TranslateConfig,
)
from launch.lm_eval.config import LmEvalConfig
from pipeline.prepare.config import PrepareConfig
from pipeline.validate import ValidateConfig

BEGIN = "<!-- config-reference:begin -->"
END = "<!-- config-reference:end -->"
# The file --write and --check work on when given no path: the repository's, wherever the
# command runs from.
DEFAULT_PATH = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"
# (entry point, its schema, whether the CONFIG.yaml is optional), in the order a run uses them.
SCHEMAS = (
    ("pipeline.prepare", PrepareConfig, False),
    ("pipeline.validate", ValidateConfig, True),
    ("launch.train", TrainConfig, False),
    ("launch.export", ExportConfig, True),
    ("launch.average", AverageConfig, True),
    ("launch.evaluate", EvaluateConfig, True),
    ("launch.translate", TranslateConfig, True),
    ("launch.lm_eval", LmEvalConfig, True),
    ("launch.report", ReportConfig, True),
    ("launch.main", MainConfig, False),
)


def _default(value) -> str:
    # A required key has no default to show as a value: say so in words.
    return "required" if value == MISSING else f"`{_cell(show(value))}`"


def _cell(text: str) -> str:
    # A `|` would end the cell, and a `<` outside a code span may open an HTML tag (`<s>`).
    parts = text.replace("|", r"\|").split("`")
    return "`".join(p.replace("<", "&lt;") if i % 2 == 0 else p for i, p in enumerate(parts))


def reference() -> str:
    """The Markdown reference of every schema, ending in a newline."""
    out = []
    for entry, cls, config_optional in SCHEMAS:
        config = "[CONFIG.yaml]" if config_optional else "CONFIG.yaml"
        out += [
            f"### {entry}",
            "",
            f"`python -m {entry} {config} [key.sub=value ...]` reads "
            f"`{cls.__module__}.{cls.__qualname__}`.",
            "",
            "| key | type | default | description |",
            "|---|---|---|---|",
        ]
        out += [
            f"| `{key}` | {_cell(kind)} | {_default(value)} | {_cell(text)} |"
            for key, kind, value, text in leaf_rows(cls)
        ]
        out.append("")
    return "\n".join(out)


def _rows(block: str) -> dict[tuple[str, str], str]:
    section, rows = "", {}
    for line in block.splitlines():
        if line.startswith("### "):
            section = line[4:].strip()
        elif line.startswith("| `"):
            rows[(section, line.split("|")[1].strip().strip("`"))] = line
    return rows


def first_difference(old: str, new: str) -> str | None:
    """Where the file's block `old` first departs from the generated `new`; None if equal."""
    if old == new:
        return None
    old_rows, new_rows = _rows(old), _rows(new)
    for (section, key), line in new_rows.items():
        if (section, key) not in old_rows:
            return f"{section} {key}: missing"
        if old_rows[(section, key)] != line:
            return f"{section} {key}: differs"
    for section, key in old_rows.keys() - new_rows.keys():
        return f"{section} {key}: not in the schema"
    pairs = itertools.zip_longest(old.splitlines(), new.splitlines())
    line = next(i for i, (a, b) in enumerate(pairs, 1) if a != b)
    return f"line {line} of the block"


def block_span(text: str) -> tuple[int, int]:
    """Start and end offsets of the text between the marker lines; ValueError without them."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(END) < text.index(BEGIN):
        raise ValueError(f"no single {BEGIN} ... {END} block")
    start = text.find("\n", text.index(BEGIN)) + 1
    if not 0 < start <= text.index(END):
        raise ValueError(f"{END} must be on a line after {BEGIN}")
    return start, text.index(END)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch.config_reference", description=__doc__.splitlines()[0]
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--check",
        metavar="FILE",
        nargs="?",
        const=DEFAULT_PATH,
        help=(
            "exit 1 if FILE's block differs from the generated text "
            "(default: docs/configuration.md)"
        ),
    )
    mode.add_argument(
        "--write",
        metavar="FILE",
        nargs="?",
        const=DEFAULT_PATH,
        help="replace FILE's block with the generated text (default: docs/configuration.md)",
    )
    args = parser.parse_args(argv)
    generated = reference()
    if not (args.check or args.write):
        sys.stdout.write(generated)
        return 0
    path = Path(args.check or args.write)
    try:
        with open(path, encoding="utf-8", newline="") as fh:
            text = fh.read()
        start, end = block_span(text)
    except (OSError, ValueError) as err:  # the user's FILE, not a stale reference
        print(f"error: {path}: {err}", file=sys.stderr)
        return 2
    difference = first_difference(text[start:end], generated)
    if args.check:
        if difference:
            print(
                f"error: {path}: config reference is stale ({difference}); "
                "run python -m launch.config_reference "
                f"--write{'' if path == DEFAULT_PATH else f' {path}'}",
                file=sys.stderr,
            )
            return 1
        return 0
    if difference:
        with open(path, "w", encoding="utf-8", newline="") as fh:
            fh.write(text[:start] + generated + text[end:])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
