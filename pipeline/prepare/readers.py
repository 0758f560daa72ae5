"""Reading a work unit of a source into records: one reader per format (text, jsonl, tsv,
gettext .mo/.po, parquet, man pages), each counting what it skips; and what was skipped, in
words, for prepare's summary and its refusal of an unusable source.

The design and its reasons: docs/design.md#pipelinepreparesourcespy.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections import Counter
from typing import Iterator, Mapping

from common.configure import UserError
from pipeline.prepare.config import SourceConfig
from pipeline.prepare.manpage import man_paragraphs, page_encoding
from pipeline.prepare.units import (
    Record,
    Unit,
    clean_text,
    decode_counting,
    open_binary,
    parquet_columns,
    reading_file,
    unit_lines,
)

_CHARSET = re.compile(rb"charset\s*=\s*([A-Za-z0-9_.:-]+)")
MO_MAGIC_LE = 0x950412DE


# ---------------------------------------------------------------- readers


def _read_text(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    if cfg.text_split not in ("line", "paragraph"):
        raise UserError(f"source.text_split: {cfg.text_split!r} is not 'line' or 'paragraph'")
    paragraph: list[str] = []
    for raw in unit_lines(unit):
        text, bad = decode_counting(raw)
        stats["bad_bytes_replaced"] += bad
        if cfg.text_split == "line":
            yield text, None
        elif text.strip():
            paragraph.append(text.rstrip("\r\n"))
        elif paragraph:
            yield "\n".join(paragraph), None
            paragraph = []
    if paragraph:
        yield "\n".join(paragraph), None


def _malformed(stats: Counter, reason: str) -> None:
    """Count a line that yields no record, in total and by reason (see `describe_skipped`)."""
    stats["malformed_records"] += 1
    stats[f"malformed_{reason}"] += 1


def _read_jsonl(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    for raw in unit_lines(unit):
        if not raw.strip():
            continue
        stats["lines"] += 1
        text, bad = decode_counting(raw)
        stats["bad_bytes_replaced"] += bad
        try:
            record = json.loads(text)
        except json.JSONDecodeError:
            _malformed(stats, "not_json")
            continue
        if not isinstance(record, dict):
            _malformed(stats, "not_object")
            continue
        problem = _field_problem(record, cfg.text_field, "text")
        if not problem and cfg.target_field:
            problem = _field_problem(record, cfg.target_field, "target")
        if problem:
            _malformed(stats, problem)
            continue
        yield record[cfg.text_field], (record[cfg.target_field] if cfg.target_field else None)


def _field_problem(record: dict, name: str, role: str) -> str:
    """Why `record[name]` is no usable text ("" when it is)."""
    if name not in record:
        return f"no_{role}_field"
    if not isinstance(record[name], str):
        return f"{role}_not_string"
    return ""


def tsv_columns(cfg: SourceConfig) -> int:
    """How many tab-separated columns a tsv line has: `columns`, or just those that
    `source_column` and `target_column` need."""
    return cfg.columns or max(cfg.source_column, cfg.target_column) + 1


def _read_tsv(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    want = tsv_columns(cfg)
    for raw in unit_lines(unit):
        text, bad = decode_counting(raw.rstrip(b"\r\n"))
        stats["bad_bytes_replaced"] += bad
        if not text.strip():
            continue
        stats["lines"] += 1
        columns = text.split("\t")
        if len(columns) != want:
            # By column count: "300 of 300 lines have 1 column" tells a space-separated file, "1
            # of 300 lines have 3 columns" a tab inside a text, whose pair would be cut short or
            # shifted if read: skipped and counted like a jsonl line that is not JSON.
            _malformed(stats, f"{len(columns)}_columns")
            continue
        yield columns[cfg.source_column], columns[cfg.target_column]


def _catalog_charset(header: bytes) -> str:
    match = _CHARSET.search(header)
    name = match.group(1).decode("ascii") if match else "utf-8"
    try:
        "".encode(name)
    except LookupError:
        return "utf-8"
    return name


def _gettext_pairs(msgid: str, plural: str | None, forms: list[str]) -> Iterator[Record]:
    """(msgid, first form) and, for plural entries, (msgid_plural, second form): untranslated
    forms are skipped."""
    if forms and forms[0]:
        yield msgid, forms[0]
    if plural and len(forms) > 1 and forms[1]:
        yield plural, forms[1]


def read_mo(data: bytes, stats: Counter) -> Iterator[Record]:
    """Pairs of a compiled catalog. msgfmt leaves fuzzy entries out unless told otherwise."""
    if len(data) < 20:
        raise ValueError("too short for a .mo file")
    (magic,) = struct.unpack("<I", data[:4])
    order = "<" if magic == MO_MAGIC_LE else ">"
    if struct.unpack(order + "I", data[:4])[0] != MO_MAGIC_LE:
        raise ValueError("bad .mo magic number")
    _, count, originals_at, translations_at = struct.unpack(order + "4I", data[4:20])
    table = struct.Struct(order + "2I")

    def entry(base: int, index: int) -> bytes:
        length, offset = table.unpack_from(data, base + 8 * index)
        if offset + length > len(data):
            raise ValueError("string table points past the end of the file")
        return data[offset : offset + length]

    charset = "utf-8"
    for index in range(count):
        original, translation = entry(originals_at, index), entry(translations_at, index)
        if not original:  # the header entry (msgid "") names the charset
            charset = _catalog_charset(translation)
            continue
        if b"\x04" in original:  # msgctxt EOT msgid: the context is not part of the text
            original = original.split(b"\x04", 1)[1]
        msgid_raw, _, plural_raw = original.partition(b"\x00")
        msgid, bad1 = decode_counting(msgid_raw, charset)
        forms_text, bad2 = decode_counting(translation, charset)
        plural = None
        if plural_raw:
            plural, bad3 = decode_counting(plural_raw, charset)
            stats["bad_bytes_replaced"] += bad3
        stats["bad_bytes_replaced"] += bad1 + bad2
        if not forms_text.replace("\x00", ""):
            stats["untranslated"] += 1
            continue
        yield from _gettext_pairs(msgid, plural, forms_text.split("\x00"))


def read_po(data: bytes, stats: Counter) -> Iterator[Record]:
    """Pairs of a source catalog: header, obsolete, fuzzy and untranslated entries are skipped."""
    import polib

    text, bad = decode_counting(data, _catalog_charset(data[:4096]))
    stats["bad_bytes_replaced"] += bad
    catalog = polib.pofile(text)
    for entry in catalog:
        if entry.obsolete or not entry.msgid:
            continue
        if "fuzzy" in entry.flags:
            stats["fuzzy"] += 1
            continue
        if entry.msgid_plural:
            forms = [entry.msgstr_plural[k] for k in sorted(entry.msgstr_plural)]
        else:
            forms = [entry.msgstr]
        if not any(forms):
            stats["untranslated"] += 1
            continue
        yield from _gettext_pairs(entry.msgid, entry.msgid_plural or None, forms)


def _read_gettext(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    with open_binary(unit.path) as fh:
        data = fh.read()
    reader = read_po if unit.path.endswith((".po", ".po.gz", ".pot")) else read_mo
    try:
        yield from reader(data, stats)
    except (ValueError, struct.error, OSError) as err:
        # One broken catalog among thousands is data, not a reason to stop: counted and reported.
        stats["unreadable_files"] += 1
        stats[f"unreadable: {os.path.basename(unit.path)}: {err}"] += 1


PARQUET_BATCH_ROWS = 8192  # rows per record batch read from a row group


def _read_parquet(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    """The rows of row groups [start, end), batch by batch: memory holds one batch of
    the needed columns."""
    import pyarrow.parquet as pq

    columns = parquet_columns(cfg)
    with pq.ParquetFile(unit.path) as parquet:
        for group in range(unit.start, unit.end):
            for batch in parquet.iter_batches(
                batch_size=PARQUET_BATCH_ROWS, row_groups=[group], columns=columns
            ):
                texts = batch.column(0).to_pylist()
                targets = batch.column(1).to_pylist() if cfg.target_field else [None] * len(texts)
                for text, target in zip(texts, targets):
                    stats["lines"] += 1
                    if text is None or (cfg.target_field and target is None):
                        _malformed(
                            stats, "text_not_string" if text is None else "target_not_string"
                        )
                        continue
                    yield text, target


def _read_manpage(unit: Unit, cfg: SourceConfig, stats: Counter) -> Iterator[Record]:
    """The paragraphs of running text of one roff page (see `pipeline.prepare.manpage`)."""
    with open_binary(unit.path) as fh:
        data = fh.read()
    text, bad = decode_counting(data, page_encoding(data[:1024]))
    stats["bad_bytes_replaced"] += bad
    for paragraph in man_paragraphs(text, cfg.min_words, stats):
        yield paragraph, None


_READERS = {
    "text": _read_text,
    "jsonl": _read_jsonl,
    "tsv": _read_tsv,
    "gettext": _read_gettext,
    "parquet": _read_parquet,
    "manpage": _read_manpage,
}


# The source formats a config may name: this table's, so that a new reader is one edit.
FORMATS = tuple(_READERS)


def is_parallel(cfg: SourceConfig) -> bool:
    """Whether the source yields (source, target) pairs."""
    return cfg.format in ("tsv", "gettext") or (
        cfg.format in ("jsonl", "parquet") and bool(cfg.target_field)
    )


def read_unit(unit: Unit, cfg: SourceConfig, stats: Counter, raw: bool = False) -> Iterator:
    """Cleaned records of one unit; empty and mostly undecodable texts are dropped and counted.
    `raw`: each record followed by the texts as read, newlines kept (the curation stages judge
    lines and paragraphs), as `(source, target, raw_source, raw_target)`."""
    parallel = is_parallel(cfg)
    limit = cfg.max_replaced_fraction
    with reading_file(unit.path):
        for raw_source, raw_target in _READERS[cfg.format](unit, cfg, stats):
            source = clean_text(raw_source)
            target = clean_text(raw_target) if raw_target is not None else None
            if not source or (parallel and not target):
                stats["empty"] += 1
                continue
            if _undecodable(source, limit) or (target is not None and _undecodable(target, limit)):
                stats["undecodable_dropped"] += 1
                continue
            stats["records"] += 1
            yield (source, target, raw_source, raw_target) if raw else (source, target)


def _undecodable(text: str, limit: float) -> bool:
    # Counted on the decoded text rather than the raw bytes, so that every format is measured
    # the same way (a JSON line's syntax or a TSV line's other column does not dilute it).
    return "\ufffd" in text and text.count("\ufffd") > limit * len(text)


def chunk_text(text: str, max_chars: int) -> list[str]:
    """Cut an over-long document at spaces into pieces of at most `max_chars` characters."""
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while start < len(text):
        end = min(start + max_chars, len(text))
        if end < len(text):
            space = text.rfind(" ", start + 1, end)
            end = space if space > start else end
        pieces.append(text[start:end].strip())
        start = end
    return [p for p in pieces if p]


# ---------------------------------------------------------------- what was skipped, in words


def check_usable(
    stats: Mapping[str, int], cfg: SourceConfig, files: int, undecodable_by_file: Mapping[str, int]
) -> None:
    """Stop with the cause, in one line, when the input yields no record or is mostly
    undecodable, rather than later with a symptom ("the train split is empty")."""
    records, undecodable = stats.get("records", 0), stats.get("undecodable_dropped", 0)
    if undecodable > records:
        worst = max(sorted(undecodable_by_file), key=lambda path: undecodable_by_file[path])
        raise UserError(
            f"source is mostly undecodable (binary, or not UTF-8): {undecodable} of "
            f"{records + undecodable} {_record_noun(cfg)} have more than "
            f"{cfg.max_replaced_fraction * 100:g}% undecodable characters "
            f"(source.max_replaced_fraction={cfg.max_replaced_fraction}), "
            f"{undecodable_by_file[worst]} of them in {worst}"
        )
    if records == 0:
        why = describe_skipped(stats, cfg, filtered=True) or f"{cfg.format}: the files hold no text"
        raise UserError(
            f"no usable records in {files} file{'s' if files != 1 else ''} of source.paths: {why}"
        )


# malformed_<reason> counts of the jsonl reader, and how a message says them.
_LINE_REASONS = (
    ("not_json", "are not JSON"),
    ("not_object", "are JSON but not objects"),
    ("no_text_field", "lack the field {text_field!r}"),
    ("text_not_string", "have a non-string {text_field!r}"),
    ("no_target_field", "lack the field {target_field!r}"),
    ("target_not_string", "have a non-string {target_field!r}"),
)
_COLUMNS_KEY = re.compile(r"malformed_(\d+)_columns")
# Ordinary filtering, not faults of the input (from short_paragraphs on: man pages).
_FILTERED = (
    "empty",
    "untranslated",
    "fuzzy",
    "short_paragraphs",
    "command_examples",
    "so_redirects",
    "mdoc_pages_skipped",
)


def describe_skipped(stats: Mapping[str, int], cfg: SourceConfig, *, filtered: bool = False) -> str:
    """What of the input was unusable and why, in one line ("jsonl: 500 of 500 lines lack the
    field 'text'"), from the merged reader statistics; "" when nothing was. `filtered` adds
    the ordinary drops (empty texts, untranslated and fuzzy catalog entries)."""
    lines = stats.get("lines", 0)
    names = {"text_field": cfg.text_field, "target_field": cfg.target_field}
    parts = [
        f"{stats[f'malformed_{reason}']} of {lines} lines {words.format(**names)}"
        for reason, words in _LINE_REASONS
        if stats.get(f"malformed_{reason}")
    ]
    columns = sorted(
        (int(m.group(1)), n) for key, n in stats.items() if (m := _COLUMNS_KEY.fullmatch(key)) and n
    )
    if columns:
        need = max(cfg.source_column, cfg.target_column) + 1
        want = tsv_columns(cfg)
        if len(columns) == 1:
            have = f"have {columns[0][0]} column{'s' if columns[0][0] != 1 else ''}"
        else:
            than = (
                "fewer than"
                if columns[-1][0] < want
                else "more than"
                if columns[0][0] > want
                else "other than"
            )
            have = f"have {than} {want} columns ({', '.join(f'{n} with {k}' for k, n in columns)})"
        if cfg.columns:
            why = f"source.columns={cfg.columns}"
        else:
            why = (
                f"source_column={cfg.source_column} and target_column={cfg.target_column} "
                f"need {need}"
            )
            if columns[-1][0] > want:
                why += (
                    ", and a line has exactly that many: a tab inside a text adds one; "
                    "source.columns=N takes lines of N"
                )
        parts.append(f"{sum(n for _, n in columns)} of {lines} lines {have} ({why})")
    undecodable = stats.get("undecodable_dropped", 0)
    if undecodable:
        parts.append(
            f"{undecodable} of {stats.get('records', 0) + undecodable} {_record_noun(cfg)} "
            f"have more than {cfg.max_replaced_fraction * 100:g}% undecodable characters "
            f"(source.max_replaced_fraction={cfg.max_replaced_fraction})"
        )
    if stats.get("unreadable_files"):
        first = min(key for key in stats if key.startswith("unreadable: "))[len("unreadable: ") :]
        parts.append(f"{stats['unreadable_files']} unreadable files (first: {first})")
    if filtered:
        parts += [f"{stats[key]} {key}" for key in _FILTERED if stats.get(key)]
    return f"{cfg.format}: {', '.join(parts)}" if parts else ""


def _record_noun(cfg: SourceConfig) -> str:
    return "pairs" if is_parallel(cfg) else "texts"
