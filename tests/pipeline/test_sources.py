"""Corpus readers: edge cases, and the .mo reader against Python's own gettext parser."""

import gettext
import glob
import gzip
import json
import logging
import os
import random
from collections import Counter

import polib
import pytest
from sourcecfg import source_cfg

from common.configure import UserError, load_config
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.readers import (
    check_usable,
    chunk_text,
    describe_skipped,
    read_mo,
    read_po,
    read_unit,
)
from pipeline.prepare.sources import ASSUMED_RATIO, decompressed_size, expand_paths, plan_units
from pipeline.prepare.units import Unit, decode_counting, stream_chunks


def read_all(path, **overrides):
    cfg = source_cfg(paths=f"[{path}]", **overrides)
    stats = Counter()
    records = [
        r
        for unit in plan_units(expand_paths(cfg), cfg, 1 << 20)
        for r in read_unit(unit, cfg, stats)
    ]
    return records, stats


def test_decode_counting_replaces_and_counts():
    assert decode_counting(b"ok") == ("ok", 0)
    text, bad = decode_counting(b"a\xffb\xc3\x28c\xe2\x82")
    assert text == "a\ufffdb\ufffd(c\ufffd"
    assert bad == 4


def test_text_bad_bytes_empty_lines_and_whitespace(tmp_path):
    path = tmp_path / "a.txt"
    path.write_bytes(b"Hello\tworld \n\n   \ncaf\xe9 au lait\n\xc3\xa9t\xc3\xa9\n")
    records, stats = read_all(path, format="text")
    assert records == [("Hello world", None), ("caf\ufffd au lait", None), ("\u00e9t\u00e9", None)]
    assert stats["bad_bytes_replaced"] == 1 and stats["empty"] == 2


def test_empty_file_and_paragraph_mode_and_gzip(tmp_path):
    (tmp_path / "empty.txt").write_bytes(b"")
    assert read_all(tmp_path / "empty.txt", format="text")[0] == []
    with gzip.open(tmp_path / "p.txt.gz", "wb") as fh:
        fh.write(b"first para\nline two\n\nsecond\n\n\nthird\n")
    records, _ = read_all(tmp_path / "p.txt.gz", format="text", text_split="paragraph")
    assert [r[0] for r in records] == ["first para line two", "second", "third"]


def test_very_long_line_is_cut_not_lost(tmp_path):
    words = [f"w{i}" for i in range(200_000)]
    (tmp_path / "long.txt").write_text(" ".join(words) + "\nshort\n")
    records, _ = read_all(tmp_path / "long.txt", format="text")
    assert len(records) == 2 and records[1][0] == "short"
    pieces = chunk_text(records[0][0], 20_000)
    assert all(len(p) <= 20_000 for p in pieces)
    assert " ".join(pieces).split() == words


def test_byte_ranges_cover_each_line_exactly_once(tmp_path):
    lines = [f"line number {i} " + "x" * (i % 37) for i in range(3000)]
    path = tmp_path / "big.txt"
    path.write_text("\n".join(lines) + "\n")
    cfg = source_cfg(paths=f"[{path}]", format="text")
    units = plan_units([str(path)], cfg, chunk_bytes=4096)
    assert len(units) > 10
    stats = Counter()
    got = [r[0] for unit in units for r in read_unit(unit, cfg, stats)]
    assert got == [line.strip() for line in lines]


def test_jsonl_fields_and_malformed_records(tmp_path):
    path = tmp_path / "d.jsonl"
    rows = [
        json.dumps({"text": "one", "de": "eins"}),
        "{not json",
        json.dumps({"other": 1}),
        json.dumps({"text": "two", "de": "zwei"}),
    ]
    path.write_text("\n".join(rows) + "\n")
    records, stats = read_all(path, format="jsonl")
    assert records == [("one", None), ("two", None)] and stats["malformed_records"] == 2
    assert (
        stats["lines"] == 4
        and stats["malformed_not_json"] == 1
        and stats["malformed_no_text_field"] == 1
    )
    records, _ = read_all(path, format="jsonl", target_field="de")
    assert records == [("one", "eins"), ("two", "zwei")]


def test_tsv_pairs(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_bytes(b"a\tA\nonly-one-column\n\nb\tB\textra\n")
    records, stats = read_all(path, format="tsv")
    # A line of 3 columns is not read in part (tests/pipeline/test_input_edges.py).
    assert (
        records == [("a", "A")]
        and stats["malformed_records"] == 2
        and stats["malformed_1_columns"] == 1
        and stats["malformed_3_columns"] == 1
    )


PO = r"""
msgid ""
msgstr ""
"Content-Type: text/plain; charset=UTF-8\n"
"Plural-Forms: nplurals=2; plural=(n != 1);\n"

msgid "Open file"
msgstr "Datei öffnen"

msgctxt "menu"
msgid "Quit"
msgstr "Beenden"

msgid "Untranslated"
msgstr ""

#, fuzzy
msgid "Maybe"
msgstr "Vielleicht"

msgid "%d file"
msgid_plural "%d files"
msgstr[0] "%d Datei"
msgstr[1] "%d Dateien"

msgid "Multi"
"line"
msgstr "Mehr"
"zeilig\n"

#~ msgid "Old"
#~ msgstr "Alt"
"""

EXPECTED = {
    ("Open file", "Datei öffnen"),
    ("Quit", "Beenden"),
    ("%d file", "%d Datei"),
    ("%d files", "%d Dateien"),
    ("Multiline", "Mehrzeilig"),
}


def test_po_skips_header_fuzzy_untranslated_obsolete_and_handles_plurals(tmp_path):
    stats = Counter()
    pairs = {(s, t.strip()) for s, t in read_po(PO.encode(), stats)}
    assert pairs == EXPECTED
    assert stats["fuzzy"] == 1 and stats["untranslated"] == 1


def test_mo_written_by_polib_reads_back(tmp_path):
    catalog = polib.pofile(PO)
    catalog.save_as_mofile(str(tmp_path / "x.mo"))
    records, stats = read_all(tmp_path / "x.mo", format="gettext")
    # A compiled catalog has no fuzzy entries (msgfmt and polib leave them out).
    assert set(records) == EXPECTED
    stats2 = Counter()
    with pytest.raises(ValueError):
        list(read_mo(b"\x00" * 40, stats2))


def test_corrupt_mo_is_counted_not_fatal(tmp_path):
    (tmp_path / "bad.mo").write_bytes(b"this is not a catalog at all")
    records, stats = read_all(tmp_path / "bad.mo", format="gettext")
    assert records == [] and stats["unreadable_files"] == 1


def test_mo_reader_agrees_with_python_gettext_on_system_catalogs():
    catalogs = sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo"))[:15]
    if not catalogs:
        pytest.skip("no system catalogs on this machine")
    for path in catalogs:
        with open(path, "rb") as fh:
            reference = gettext.GNUTranslations(fh)._catalog
        expected, plural_firsts, plural_seconds = set(), set(), Counter()
        for key, value in reference.items():
            if isinstance(key, tuple):
                # A plural entry: Python keeps (msgid, n) -> form n and drops msgid_plural. Ours
                # gives (msgid, form 0) and (msgid_plural, form 1).
                msgid, n = key
                if n == 0 and value:
                    plural_firsts.add((msgid.split("\x04")[-1], value))
                elif n == 1 and value:
                    plural_seconds[value] += 1
            elif key and value:
                expected.add((key.split("\x04")[-1], value))
        stats = Counter()
        with open(path, "rb") as fh:
            ours = set(read_mo(fh.read(), stats))
        assert expected | plural_firsts <= ours, path
        # Nothing else: every other pair of ours is a plural entry's (msgid_plural, form 1), at
        # most one per such entry.
        others = Counter(target for _, target in ours - expected - plural_firsts)
        assert not others - plural_seconds, (path, others - plural_seconds)


def test_missing_inputs_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="file not found"):
        expand_paths(source_cfg(paths=f"[{tmp_path}/nope.txt]", format="text"))
    with pytest.raises(UserError, match="no file matches"):
        expand_paths(source_cfg(paths=f"[{tmp_path}/*.nope]", format="text"))
    with pytest.raises(UserError, match="source.format"):
        expand_paths(source_cfg(format="csv"))


def _tree(root):
    """Three text files, one of them also reached through `alias -> sub` (a link, not a loop)."""
    (root / "sub" / "deeper").mkdir(parents=True)
    for name in ("a.txt", "sub/b.txt", "sub/deeper/c.txt"):
        (root / name).write_text(f"{name}\n")
    return sorted(str(root / name) for name in ("a.txt", "sub/b.txt", "sub/deeper/c.txt"))


def test_a_glob_through_a_symlink_loop_lists_each_file_once_and_says_so(tmp_path, caplog):
    files = _tree(tmp_path)
    (tmp_path / "loop").symlink_to(
        "."
    )  # glob's ** followed it until the kernel's ELOOP: hundreds of paths
    with caplog.at_level(logging.WARNING, logger="pipeline.prepare.sources"):
        found = expand_paths(source_cfg(paths=f"[{tmp_path}/**/*.txt]", format="text"))
    assert found == files
    (warning,) = caplog.messages
    assert "symlink loop" in warning and f"{tmp_path}/loop" in warning and "not followed" in warning


def test_a_file_under_several_names_is_listed_once_and_the_others_counted(tmp_path, caplog):
    files = _tree(tmp_path)
    (tmp_path / "alias").symlink_to("sub")  # sub's two files again, under alias/
    (tmp_path / "link.txt").symlink_to("a.txt")
    with caplog.at_level(logging.WARNING, logger="pipeline.prepare.sources"):
        found = expand_paths(
            source_cfg(paths=f"[{tmp_path}/**/*.txt,{tmp_path}/sub/b.txt]", format="text")
        )
    assert found == files
    (warning,) = caplog.messages  # one line: the count and an example
    assert "3 paths" in warning and "read once" in warning
    assert f"{tmp_path}/alias/b.txt is {tmp_path}/sub/b.txt" in warning


def test_a_path_that_is_not_a_regular_file_is_named_as_such(tmp_path):
    os.mkfifo(tmp_path / "pipe.txt")
    (tmp_path / "catalog.mo").mkdir()
    for name, what in (("pipe.txt", "a FIFO"), ("catalog.mo", "a directory")):
        with pytest.raises(
            UserError, match=f"^source.paths: not a regular file: {tmp_path / name} is {what}"
        ):
            expand_paths(source_cfg(paths=f"[{tmp_path / name}]", format="gettext"))
    (tmp_path / "dangling.txt").symlink_to("nowhere.txt")
    with pytest.raises(
        UserError,
        match=f"file not found: {tmp_path}/dangling.txt is a symbolic link to nowhere.txt",
    ):
        expand_paths(source_cfg(paths=f"[{tmp_path}/dangling.txt]", format="text"))


# ---------------------------------------------------------------- inputs that yield nothing: the
# cause, in words


def check(path, **overrides):
    """read_all, then the check prepare makes after scanning; returns the UserError's message or ''."""
    records, stats = read_all(path, **overrides)
    cfg = source_cfg(paths=f"[{path}]", **overrides)
    try:
        check_usable(stats, cfg, 1, Counter({str(path): stats["undecodable_dropped"]}))
    except UserError as err:
        return str(err)
    return ""


def test_jsonl_lines_that_all_lack_the_field(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"body": f"text {i}"}) + "\n" for i in range(500)))
    message = check(path, format="jsonl")
    assert (
        message
        == "no usable records in 1 file of source.paths: jsonl: 500 of 500 lines lack the field 'text'"
    )
    path.write_text(
        "".join(json.dumps({"text": f"one {i}", "de": i}) + "\n" for i in range(20)) + "[1, 2]\n"
    )
    assert check(path, format="jsonl", target_field="de").endswith(
        "jsonl: 1 of 21 lines are JSON but not objects, 20 of 21 lines have a non-string 'de'"
    )


def test_one_column_tsv(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("".join(f"just one column {i}\n" for i in range(300)))
    assert check(path, format="tsv").endswith(
        "tsv: 300 of 300 lines have 1 column (source_column=0 and target_column=1 need 2)"
    )
    path.write_text("a\tb\n" * 5 + "a\n" * 3)
    assert check(path, format="tsv", target_column=2).endswith(
        "tsv: 8 of 8 lines have fewer than 3 columns (3 with 1, 5 with 2) (source_column=0 and target_column=2 need 3)"
    )


def test_random_bytes_as_jsonl_are_not_json(tmp_path):
    path = tmp_path / "random.jsonl"
    data = random.Random(1).randbytes(20_000)
    path.write_bytes(data)
    lines = sum(1 for line in data.split(b"\n") if line.strip())
    assert check(path, format="jsonl").endswith(f"jsonl: {lines} of {lines} lines are not JSON")


def test_random_bytes_as_text_are_dropped_as_undecodable(tmp_path):
    path = tmp_path / "random.txt"
    path.write_bytes(random.Random(0).randbytes(200_000))
    records, stats = read_all(path, format="text")
    # Short lines can decode cleanly by chance; all the others are dropped.
    assert stats["undecodable_dropped"] > 10 * len(records)
    assert all(r[0].count("\ufffd") <= 0.1 * len(r[0]) for r in records)
    message = check(path, format="text")
    assert message.startswith(
        f"source is mostly undecodable (binary, or not UTF-8): {stats['undecodable_dropped']} of "
    )
    assert (
        f"have more than 10% undecodable characters (source.max_replaced_fraction=0.1), {stats['undecodable_dropped']} of them in {path}"
        in message
    )
    # 1.0 keeps everything, as before the threshold existed.
    records, stats = read_all(path, format="text", max_replaced_fraction=1.0)
    assert stats["undecodable_dropped"] == 0 and stats["records"] == len(records) > 500


def test_replaced_fraction_threshold_per_text(tmp_path):
    path = tmp_path / "a.txt"
    # 1 of 10 characters replaced (kept at 0.1), 2 of 10 (dropped), clean text.
    path.write_bytes(b"abcd\xffefghi\nabcd\xff\xfeefgh\nclean text\n")
    records, stats = read_all(path, format="text")
    assert [r[0] for r in records] == ["abcd\ufffdefghi", "clean text"]
    assert stats["undecodable_dropped"] == 1 and stats["bad_bytes_replaced"] == 3
    # A pair goes when either side is undecodable.
    path = tmp_path / "p.tsv"
    path.write_bytes(b"fine\t\xff\xfe\xfd\nfine\tgut\n")
    records, stats = read_all(path, format="tsv")
    assert records == [("fine", "gut")] and stats["undecodable_dropped"] == 1
    assert describe_skipped(stats, source_cfg(format="tsv")) == (
        "tsv: 1 of 2 pairs have more than 10% undecodable characters (source.max_replaced_fraction=0.1)"
    )


def test_good_input_has_nothing_to_describe(tmp_path):
    path = tmp_path / "p.tsv"
    path.write_text("a\tA\nb\tB\n")
    records, stats = read_all(path, format="tsv")
    assert (
        len(records) == 2
        and describe_skipped(stats, source_cfg(format="tsv")) == ""
        and check(path, format="tsv") == ""
    )
    (tmp_path / "empty.txt").write_text("\n\n")
    assert (
        check(tmp_path / "empty.txt", format="text")
        == "no usable records in 1 file of source.paths: text: 2 empty"
    )


# ---------------------------------------------------------------- parquet, .gz and .zst, several
# sources


def _mono_texts(n, seed=1):
    rng = random.Random(seed)
    return [
        f"line {i} "
        + " ".join(
            rng.choice(["alpha", "beta", "gamma", "delta"]) for _ in range(rng.randint(1, 9))
        )
        for i in range(n)
    ]


def test_parquet_read_in_row_groups_equals_the_same_rows_as_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    texts, targets = _mono_texts(500), _mono_texts(500, seed=2)
    texts[7], targets[9] = "  ", None  # an empty text and a missing target are skipped like jsonl's
    pq.write_table(
        pa.table({"body": texts, "de": targets, "other": list(range(500))}),
        tmp_path / "a.parquet",
        row_group_size=64,
    )
    jsonl = tmp_path / "a.jsonl"
    jsonl.write_text(
        "".join(json.dumps({"body": t, "de": g}) + "\n" for t, g in zip(texts, targets))
    )
    for target in ("''", "de"):
        cfg = source_cfg(
            paths=f"[{tmp_path / 'a.parquet'}]",
            format="parquet",
            text_field="body",
            target_field=target,
        )
        # Units of whole row groups: a small chunk size gives several, covering every group once.
        units = plan_units(expand_paths(cfg), cfg, 4000)
        assert len(units) > 2 and [u.start for u in units][0] == 0 and units[-1].end == 8
        assert all(a.end == b.start for a, b in zip(units, units[1:]))
        stats = Counter()
        from_parquet = [r for unit in units for r in read_unit(unit, cfg, stats)]
        from_jsonl, _ = read_all(jsonl, format="jsonl", text_field="body", target_field=target)
        assert from_parquet == from_jsonl and len(from_parquet) == (498 if target == "de" else 499)


def test_parquet_schema_problems_are_one_line_errors(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["a b c"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(
        UserError, match=r"source.text_field: .* has no column 'body' \(columns: text, n\)"
    ):
        read_all(tmp_path / "a.parquet", format="parquet", text_field="body")
    with pytest.raises(
        UserError, match=r"source.target_field: column 'n' .* holds int64, not strings"
    ):
        read_all(tmp_path / "a.parquet", format="parquet", target_field="n")
    (tmp_path / "b.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(UserError, match="not a readable parquet file"):
        read_all(tmp_path / "b.parquet", format="parquet")


@pytest.mark.parametrize("fmt", ["jsonl", "text"])
def test_gz_and_zst_give_the_same_records_as_plain(tmp_path, fmt):
    import zstandard

    texts = _mono_texts(300) + ["caf\u00e9 \u00fcber", "   "]
    data = (
        "".join(json.dumps({"text": t}) + "\n" for t in texts)
        if fmt == "jsonl"
        else "\n".join(texts) + "\n"
    ).encode()
    (tmp_path / "a").write_bytes(data)
    (tmp_path / "a.gz").write_bytes(gzip.compress(data))
    (tmp_path / "a.zst").write_bytes(zstandard.ZstdCompressor().compress(data))
    plain, plain_stats = read_all(tmp_path / "a", format=fmt)
    assert len(plain) == 301
    for name in ("a.gz", "a.zst"):
        records, stats = read_all(tmp_path / name, format=fmt)
        assert records == plain and stats == plain_stats, name
    # A compressed file is one unit even when large (it cannot be entered mid-stream), marked
    # for the driver to stream in chunks when larger than a unit.
    cfg = source_cfg(paths=f"[{tmp_path / 'a.zst'}]", format=fmt)
    assert plan_units(expand_paths(cfg), cfg, 100) == [Unit(str(tmp_path / "a.zst"), stream=True)]
    assert plan_units(expand_paths(cfg), cfg, 1 << 20) == [Unit(str(tmp_path / "a.zst"))]
    paragraphs = source_cfg(paths=f"[{tmp_path / 'a.zst'}]", format="text", text_split="paragraph")
    assert plan_units(expand_paths(paragraphs), paragraphs, 100) == [Unit(str(tmp_path / "a.zst"))]
    (tmp_path / "bad.zst").write_bytes(b"\x28\xb5\x2f\xfd garbage")
    with pytest.raises(UserError, match="cannot read .*bad.zst"):
        read_all(tmp_path / "bad.zst", format=fmt)


@pytest.mark.parametrize("fmt, suffix", [("jsonl", ".zst"), ("tsv", ".gz"), ("text", ".zst")])
def test_stream_chunks_cut_at_newlines_and_give_the_whole_files_records(tmp_path, fmt, suffix):
    """The driver's chunks of a compressed file: cut at newlines only, together exactly the
    decompressed bytes, and their records and counts those of reading the file whole, bad
    bytes, malformed lines, a line longer than a chunk and a last line without newline included."""
    import zstandard

    texts = _mono_texts(2000) + ["caf\u00e9 \u00fcber " * 600]
    rng = random.Random(5)
    rng.shuffle(texts)
    if fmt == "jsonl":
        lines = [json.dumps({"text": t}, ensure_ascii=False).encode() for t in texts] + [
            b"{broken",
            b"\xff\xfe",
        ]
    elif fmt == "tsv":
        lines = [f"{t}\t{t.upper()}".encode() for t in texts] + [
            b"one column",
            b"bad \xc3( byte\tx",
        ]
    else:
        lines = [t.encode() for t in texts] + [b"", b"bad \xc3( byte"]
    data = b"\n".join(lines)  # no newline after the last line
    path = tmp_path / f"a.{fmt}{suffix}"
    path.write_bytes(
        gzip.compress(data) if suffix == ".gz" else zstandard.ZstdCompressor().compress(data)
    )
    cfg = source_cfg(paths=f"[{path}]", format=fmt)
    (unit,) = plan_units([str(path)], cfg, 4096)
    assert unit.stream
    chunks = list(stream_chunks(unit, 4096))
    assert len(chunks) > 20 and b"".join(c.data for c in chunks) == data
    assert all(c.data.endswith(b"\n") for c in chunks[:-1])
    assert all(len(c.data) <= 4096 or max(map(len, c.data.split(b"\n"))) >= 4096 for c in chunks)
    assert [c.start for c in chunks[1:]] == [c.end for c in chunks[:-1]] and chunks[-1].end == len(
        data
    )
    assert any(len(c.data) > 4096 for c in chunks)  # the long line: one chunk of its own
    whole_stats, chunk_stats = Counter(), Counter()
    whole = list(read_unit(unit, cfg, whole_stats))
    assert [r for c in chunks for r in read_unit(c, cfg, chunk_stats)] == whole
    assert chunk_stats == whole_stats and whole_stats["bad_bytes_replaced"] > 0
    assert len(whole) == len(texts) + (fmt != "jsonl")  # the line with a bad byte is kept, replaced


def test_decompressed_size_from_zstd_header_gzip_trailer_or_assumed(tmp_path):
    import zstandard

    data = ("".join(f"line {i} of some text\n" for i in range(5000))).encode()
    (tmp_path / "a.txt").write_bytes(data)
    (tmp_path / "a.txt.gz").write_bytes(gzip.compress(data))
    (tmp_path / "a.txt.zst").write_bytes(
        zstandard.ZstdCompressor().compress(data)
    )  # declares its size
    streamed = zstandard.ZstdCompressor().compressobj()  # a streaming writer does not know it
    (tmp_path / "s.txt.zst").write_bytes(streamed.compress(data) + streamed.flush())
    assert decompressed_size(str(tmp_path / "a.txt")) == len(data)
    assert decompressed_size(str(tmp_path / "a.txt.gz")) == len(data)
    assert decompressed_size(str(tmp_path / "a.txt.zst")) == len(data)
    assert (
        decompressed_size(str(tmp_path / "s.txt.zst"))
        == ASSUMED_RATIO * (tmp_path / "s.txt.zst").stat().st_size
    )
    # Two gzip members: the trailer gives the last one's size, less than the file's: assumed.
    (tmp_path / "m.txt.gz").write_bytes(gzip.compress(data) + gzip.compress(b"tail\n"))
    assert (
        decompressed_size(str(tmp_path / "m.txt.gz"))
        == ASSUMED_RATIO * (tmp_path / "m.txt.gz").stat().st_size
    )


def prepare_cfg(*overrides):
    return load_config(PrepareConfig, None, list(overrides))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["sources=[{name: a, format: csv, paths: [x]}]"],
            r"^sources\[0\] \(a\)\.format: 'csv' is not one of",
        ),
        (
            ["sources=[{name: a, format: text, paths: [x]}, {name: a, format: jsonl, paths: [y]}]"],
            r"^sources: the name 'a' is given to 2 sources",
        ),
        (
            ["source.format=text", "sources=[{name: a, format: text, paths: [x]}]"],
            r"^source and sources: both given",
        ),
        (
            ["sources=[{name: 'a/b', format: text, paths: [x]}]"],
            r"^sources\[0\] \(a/b\)\.name: 'a/b' is not a name",
        ),
        (
            ["sources=[{name: a, format: text, paths: [x], tokenizer_share: 0}]"],
            r"^sources\[0\] \(a\)\.tokenizer_share: must be",
        ),
        (
            ["sources=[{name: a, format: text, paths: []}]"],
            r"^sources\[0\] \(a\)\.paths: no input files given",
        ),
        (
            ["sources=[{name: a, format: text, paths: [/no/such/file]}]"],
            r"^sources\[0\] \(a\)\.paths: file not found",
        ),
        (
            ["sources=[{name: a, format: text, paths: [x]}]", "tasks=[translation]"],
            r"^tasks: translation needs a parallel source",
        ),
    ],
)
def test_bad_source_configs_are_one_line_errors(tmp_path, overrides, message):
    from pipeline.prepare.job import prepare

    overrides = [
        o.replace("[x]", f"[{tmp_path / 'x'}]").replace("[y]", f"[{tmp_path / 'x'}]")
        for o in overrides
    ]
    (tmp_path / "x").write_text("some text\n")
    with pytest.raises(UserError, match=message) as err:
        prepare(prepare_cfg(f"output_dir={tmp_path / 'out'}", "tasks=[causal_lm]", *overrides))
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_legacy_source_is_a_list_of_one_named_default():
    from pipeline.prepare.sources import source_list

    cfg = prepare_cfg("source.format=text")
    assert [s.format for s in source_list(cfg)] == ["text"] and source_list(cfg)[
        0
    ].name == "default"


def test_units_shrink_for_small_inputs_and_the_last_scan_tasks_are_small(tmp_path):
    from pipeline.prepare.scheduling import scan_batches
    from pipeline.prepare.sources import MIN_UNIT_BYTES, UNITS_WANTED, planned_unit_bytes

    mib = 1 << 20
    assert planned_unit_bytes(64 * mib, 1000 * mib) == -(-1000 * mib // UNITS_WANTED)
    assert planned_unit_bytes(64 * mib, 100 * mib) == MIN_UNIT_BYTES
    assert planned_unit_bytes(64 * mib, 100_000 * mib) == 64 * mib
    assert planned_unit_bytes(4096, 1000 * mib) == 4096  # the given size is the most
    path = tmp_path / "big.jsonl"
    path.write_bytes(b'{"text": "x"}\n' * 4000)  # 64,000 bytes
    units = plan_units([str(path)], source_cfg(paths=f"[{path}]", format="jsonl"), 1000)
    assert len(units) > 40
    batches = list(scan_batches(units, 2, 1000))
    sizes = [len(batch) for batch in batches]
    assert [i for batch in batches for i, _ in batch] == list(range(len(units)))  # each once
    # a quarter of a worker's share first, then smaller and smaller, one unit at the end
    assert sizes[0] >= len(units) // 8 and sizes == sorted(sizes, reverse=True)
    assert sizes[-3:] == [1, 1, 1]
