"""The sources of a prepare: their files (globs, links, what is not a regular file) and the work
units they are cut into (compressed streams marked for chunks, parquet by row groups);
`pipeline.prepare.units` reads a unit's bytes and `pipeline.prepare.readers` turns them into
records (text, jsonl, tsv, gettext, parquet, man pages: its table is the list of formats).

The design and its reasons: docs/design.md#pipelinepreparesourcespy.
"""

from __future__ import annotations

import errno
import glob
import logging
import os
import re
import stat
import struct

from common.configure import UserError, config_from_dict
from pipeline.prepare.config import PrepareConfig, SourceConfig
from pipeline.prepare.readers import FORMATS
from pipeline.prepare.units import Unit

log = logging.getLogger(__name__)


# ---------------------------------------------------------------- work units


_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


def source_list(cfg: PrepareConfig) -> list[SourceConfig]:
    """The sources of a prepare: `sources`, or the single `source` as a list of one."""
    return list(cfg.sources) if cfg.sources else [cfg.source]


def source_where(cfg: PrepareConfig, index: int) -> str:
    """How messages name a source's keys: `source` for the single source, `sources[i]` (with
    its name) otherwise."""
    return f"sources[{index}] ({cfg.sources[index].name})" if cfg.sources else "source"


def check_sources(cfg: PrepareConfig) -> None:
    """One-line errors for a mixture of nothing, `source` and `sources` both given, duplicate or
    unusable names, unknown formats, a tsv `columns` too few for its two columns and shares that
    are not positive numbers."""
    # `source` with its defaults (paths resolved, as in a loaded config) means it was not given.
    if cfg.sources and cfg.source != config_from_dict(PrepareConfig, {}).source:
        raise UserError(
            "source and sources: both given; put the single source in the list "
            "`sources` (or give only `source`)"
        )
    names = [s.name for s in source_list(cfg)]
    for index, source in enumerate(source_list(cfg)):
        where = source_where(cfg, index)
        if not _NAME.fullmatch(source.name):
            raise UserError(
                f"{where}.name: {source.name!r} is not a name (letters, digits, '_', '.', '-'; "
                "it becomes a folder of shards)"
            )
        if names.count(source.name) > 1:
            raise UserError(
                f"sources: the name {source.name!r} is given to "
                f"{names.count(source.name)} sources; names must differ"
            )
        if source.format not in FORMATS:
            raise UserError(f"{where}.format: {source.format!r} is not one of {', '.join(FORMATS)}")
        if not source.tokenizer_share > 0:
            raise UserError(
                f"{where}.tokenizer_share: must be a positive number, got {source.tokenizer_share}"
            )
        need = max(source.source_column, source.target_column) + 1
        if source.format == "tsv" and (source.columns < 0 or 0 < source.columns < need):
            raise UserError(
                f"{where}.columns: {source.columns} is too few for source_column="
                f"{source.source_column} and target_column={source.target_column} (they need "
                f"{need} columns; 0 = exactly that many)"
            )
        if not 0 <= source.max_replaced_fraction <= 1:
            raise UserError(
                f"{where}.max_replaced_fraction: a fraction in [0, 1], got "
                f"{source.max_replaced_fraction}"
            )


def expand_paths(cfg: SourceConfig, where: str = "source") -> list[str]:
    """The sorted list of input files, each file once under one name; a clear error for a path
    that matches nothing or is not a regular file.

    A file reached under several names (a symbolic link to it, a linked directory) would be read,
    and its texts counted, once per name: it is kept under the name with the fewest symbolic
    links, and the others are counted in one warning line. A `**` skips a symbolic link that
    leads back into a directory it is already inside (`_glob`), with a warning, rather than
    refusing the source: such a loop adds no file the walk does not reach anyway, and the trees
    that hold one (`/usr/bin/X11 -> .`) are often not the user's to change."""
    if cfg.format not in FORMATS:
        raise UserError(f"{where}.format: {cfg.format!r} is not one of {', '.join(FORMATS)}")
    if not cfg.paths:
        raise UserError(f"{where}.paths: no input files given")
    files: set[str] = set()
    loops: list[tuple[str, str]] = []
    for pattern in cfg.paths:
        if glob.has_magic(pattern):
            matched = [p for p in _glob(pattern, loops) if os.path.isfile(p)]
            if not matched:
                raise UserError(f"{where}.paths: no file matches {pattern!r}")
            files.update(matched)
        elif os.path.isfile(pattern):
            files.add(pattern)
        else:
            raise UserError(f"{where}.paths: {_unusable(pattern)}")
    # a loop met by several walks (`**` twice in a pattern, overlapping patterns) is one loop
    if loops:
        link, target = min(set(loops))
        count = len(set(loops))
        log.warning(
            "warning: %s.paths: %d symlink loop%s not followed (a link back into a directory the "
            "glob is already inside adds no file), e.g. %s -> %s",
            where,
            count,
            "s" if count > 1 else "",
            link,
            target,
        )
    unread = sorted(path for path in files if path.endswith(UNREAD_COMPRESSION))
    if unread:
        raise UserError(
            f"{where}.paths: {unread[0]} is compressed ({os.path.splitext(unread[0])[1]}), which "
            f"prepare does not decompress: it would be read as raw bytes; decompress it, or "
            f"recompress it as .zst or .gz"
            + (f" (and {len(unread) - 1} more such files)" if len(unread) > 1 else "")
        )
    kept, others = _one_name_each(files)
    if others:
        other, name = min(others)
        log.warning(
            "warning: %s.paths: %d path%s name a file listed under another name (symbolic links); "
            "each file is read once, e.g. %s is %s",
            where,
            len(others),
            "s" if len(others) > 1 else "",
            other,
            name,
        )
    return kept


def _glob(pattern: str, loops: list[tuple[str, str]]) -> list[str]:
    """`glob.glob(pattern, recursive=True)`, except that a `**` does not follow a symbolic link
    back into a directory it is already inside: glob follows such a loop until the kernel's
    limit of 40 links, which turns a few files into hundreds of paths (or, with two loops,
    into more than a walk can list). The links not followed are appended to `loops` as (link,
    its target)."""
    parts = pattern.split(os.sep)
    if "**" not in parts:
        return glob.glob(pattern, recursive=True)  # without `**` nothing is walked: no loop
    at = parts.index("**")
    head = os.sep.join(parts[:at]) or (os.sep if at else "")
    tail = os.sep.join(parts[at + 1 :]) or "*"  # `DIR/**`: every entry of every directory below
    tops = [d for d in glob.glob(head) if os.path.isdir(d)] if glob.has_magic(head) else [head]
    matched = []
    for top in tops:
        for directory in _directories(top, loops):
            matched.extend(_glob(os.path.join(glob.escape(directory), tail), loops))
    return matched


def _directories(top: str, loops: list[tuple[str, str]]) -> list[str]:
    """`top` and the directories below it, as `**` reaches them: hidden ones left out (as glob
    leaves them out), symbolic links to directories followed unless the directory is one of
    those the walk is inside (a loop: appended to `loops`)."""
    try:
        info = os.stat(top or os.curdir)
    except OSError:
        return []
    found, stack = [], [(top, frozenset({(info.st_dev, info.st_ino)}))]
    while stack:
        path, inside = stack.pop()
        found.append(path)
        try:
            entries = list(os.scandir(path or os.curdir))
        except OSError:
            continue
        for entry in entries:
            try:
                if entry.name.startswith(".") or not entry.is_dir():
                    continue
                info = entry.stat()
            except OSError:
                continue
            below = os.path.join(path, entry.name)
            if (info.st_dev, info.st_ino) in inside:
                loops.append((below, os.path.realpath(below)))
            else:
                stack.append((below, inside | {(info.st_dev, info.st_ino)}))
    return found


def _one_name_each(files: set[str]) -> tuple[list[str], list[tuple[str, str]]]:
    """The files, sorted, each under one name (its own rather than a link's: the fewest symbolic
    links on the way), and the (other name, name kept) of the rest."""
    names: dict[str, list[str]] = {}
    for path in files:
        names.setdefault(os.path.realpath(path), []).append(path)
    kept, others = [], []
    for group in names.values():
        name = group[0] if len(group) == 1 else min(group, key=lambda path: (_links_on(path), path))
        kept.append(name)
        others.extend((other, name) for other in group if other != name)
    return sorted(kept), others


def _links_on(path: str) -> int:
    """How many of the components of `path` are symbolic links."""
    count, path = 0, os.path.abspath(path)
    while path != os.path.dirname(path):
        count += os.path.islink(path)
        path = os.path.dirname(path)
    return count


def _unusable(path: str) -> str:
    """Why `path`, given as an input file, is not one: the rest of a one-line message."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        if os.path.islink(path):
            return (
                f"file not found: {path} is a symbolic link to "
                f"{os.readlink(path)}, which does not exist"
            )
        return f"file not found: {path}"
    except OSError as err:
        if err.errno == errno.ELOOP:
            return f"not a regular file: {path} is a symbolic link loop"
        return f"cannot read {path}: {err.strerror}"
    kinds = (
        (stat.S_ISDIR, f"a directory (its files: a glob such as {os.path.join(path, '**', '*')})"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    kind = next(
        (words for test, words in kinds if test(mode)), f"of file type {stat.S_IFMT(mode):#o}"
    )
    return f"not a regular file: {path} is {kind}"


COMPRESSED = (".gz", ".zst")
# compressed files no reader here decompresses: refused, not read as raw bytes
UNREAD_COMPRESSION = (".xz", ".bz2", ".lzma", ".lz4", ".zip", ".7z")


# Inputs are cut into at least this many units (down to MIN_UNIT_BYTES each), so that the last
# scan tasks are small and no worker is left alone with a big one at the end.
UNITS_WANTED = 64
MIN_UNIT_BYTES = 8 << 20


def planned_unit_bytes(unit_bytes: int, total: int) -> int:
    """The unit size the plan uses: `unit_bytes` (the most), less for inputs under UNITS_WANTED
    units of it; chosen from the inputs' size alone, so the plan is the same for any workers."""
    return min(unit_bytes, max(MIN_UNIT_BYTES, -(-total // UNITS_WANTED)))


def plan_units(
    files: list[str], cfg: SourceConfig, chunk_bytes: int, source: int = 0, where: str = "source"
) -> list[Unit]:
    """Split the inputs into work units. Uncompressed line-oriented files are cut into byte
    ranges (a reader can start mid-file at the next newline), parquet files into runs of row
    groups; compressed line-oriented files larger than `chunk_bytes` are marked `stream`, for
    the driver to cut into chunks as it decompresses them; the rest are whole. Paragraph text
    is never cut: a paragraph may span any newline."""
    units = []
    for path in files:
        if cfg.format == "parquet":
            units.extend(_parquet_units(path, cfg, chunk_bytes, source, where))
            continue
        size = os.path.getsize(path)
        splittable = cfg.format in ("text", "jsonl", "tsv") and not (
            cfg.format == "text" and cfg.text_split == "paragraph"
        )
        if not splittable or size <= chunk_bytes:
            units.append(Unit(path, source=source))
        elif path.endswith(COMPRESSED):
            units.append(Unit(path, source=source, stream=True))
        else:
            units.extend(
                Unit(path, start, min(start + chunk_bytes, size), source)
                for start in range(0, size, chunk_bytes)
            )
    return units


ASSUMED_RATIO = 5  # decompressed / compressed size of a .zst whose header does not say (text: 3-6)


def decompressed_size(path: str) -> int:
    """About how many bytes `path` holds decompressed, without decompressing it, for the
    scratch-space estimate: a .zst's first frame header (the whole file's size when it is one
    frame, as `zstd FILE` writes it), a .gz's trailer (ISIZE: the size modulo 2**32 of its last
    member), any other file's size. A size the file does not declare, or one smaller than the
    compressed file (several frames or members, or a .gz over 4 GiB whose ISIZE wrapped), is
    taken as ASSUMED_RATIO x the compressed size."""
    size = os.path.getsize(path)
    declared = -1
    if path.endswith(".zst"):
        import zstandard

        with open(path, "rb") as fh:
            head = fh.read(18)  # the largest frame header
        try:
            declared = zstandard.frame_content_size(head)
        except zstandard.ZstdError:
            pass
    elif path.endswith(".gz") and size >= 18:
        with open(path, "rb") as fh:
            fh.seek(-4, os.SEEK_END)
            (declared,) = struct.unpack("<I", fh.read(4))
    else:
        return size
    return declared if declared >= size else ASSUMED_RATIO * size


def _parquet_units(
    path: str, cfg: SourceConfig, chunk_bytes: int, source: int, where: str
) -> list[Unit]:
    """Runs of whole row groups of about `chunk_bytes` (uncompressed) each; the schema is
    checked here, once."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.ParquetFile(path).metadata
        schema = meta.schema.to_arrow_schema()
    except (OSError, pa.ArrowException) as err:
        raise UserError(
            f"{where}.paths: {path}: not a readable parquet file: {str(err).splitlines()[0]}"
        ) from err
    for key, column in (("text_field", cfg.text_field), ("target_field", cfg.target_field)):
        if not column:
            continue
        if column not in schema.names:
            raise UserError(
                f"{where}.{key}: {path} has no column {column!r} "
                f"(columns: {', '.join(schema.names)})"
            )
        kind = schema.field(column).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise UserError(f"{where}.{key}: column {column!r} of {path} holds {kind}, not strings")
    units, start, size = [], 0, 0
    for group in range(meta.num_row_groups):
        size += meta.row_group(group).total_byte_size
        if size >= chunk_bytes:
            units.append(Unit(path, start, group + 1, source))
            start, size = group + 1, 0
    if start < meta.num_row_groups or not units:
        units.append(Unit(path, start, meta.num_row_groups, source))
    return units
