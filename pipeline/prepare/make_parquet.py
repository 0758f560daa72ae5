"""`python -m pipeline.prepare.make_parquet OUT.parquet \
[--max-rows N] [--row-group-rows N]`: a parquet
file of real English monolingual text that every Debian or Ubuntu machine has, for the second
source of `configs/prepare_two_sources.yaml`.

The text is the system's license texts (`/usr/share/common-licenses/*`) and the packages'
copyright notices (`/usr/share/doc/*/copyright`), cut into paragraphs (blank-line separated),
whitespace collapsed, in sorted file order; one row per paragraph with columns `text` and
`path` (the file it came from). Written in row groups of `--row-group-rows` rows, so that
prepare reads it group by group as it would a large file. The same machine gives the same file.
"""

from __future__ import annotations

import argparse
import glob
import re
import sys
from pathlib import Path

PATTERNS = ("/usr/share/common-licenses/*", "/usr/share/doc/*/copyright")
_SPACE = re.compile(r"\s+")


def paragraphs(patterns=PATTERNS):
    """(path, paragraph) of the files matching `patterns`, in sorted order; short
    fragments skipped."""
    for path in sorted(
        {p for pattern in patterns for p in glob.glob(pattern) if Path(p).is_file()}
    ):
        text = Path(path).read_bytes().decode("utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            block = _SPACE.sub(" ", block).strip()
            if len(block) >= 40:  # headings, "Files: *" lines and the like are not text
                yield path, block


def write_parquet(out: str | Path, max_rows: int, row_group_rows: int) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = []
    for path, text in paragraphs():
        rows.append((path, text))
        if len(rows) >= max_rows:
            break
    if not rows:
        # exit 1: nothing to make
        raise SystemExit(f"error: make_parquet: no text found in {', '.join(PATTERNS)}")
    table = pa.table({"text": [t for _, t in rows], "path": [p for p, _ in rows]})
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, str(out), row_group_size=row_group_rows)
    return len(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", help="the parquet file to write")
    parser.add_argument(
        "--max-rows", type=int, default=20000, help="paragraphs at most (default %(default)s)"
    )
    parser.add_argument(
        "--row-group-rows", type=int, default=2000, help="rows per row group (default %(default)s)"
    )
    args = parser.parse_args(argv)
    for name in ("max_rows", "row_group_rows"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')}: must be at least 1, got {getattr(args, name)}"
            )
    n = write_parquet(args.out, args.max_rows, args.row_group_rows)
    print(f"wrote {args.out}: {n} paragraphs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
