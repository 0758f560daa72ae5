"""The `manpage` source format: roff man pages to paragraphs of running text (pipeline.prepare.manpage),
read through the source readers, and prepared beside a parallel source."""

import gzip
import json
import os
import random
import subprocess
import sys
from collections import Counter

import pytest
import webdataset as wds
from corpora import prepare_args, synthetic_pairs, write_tsv
from repo import ROOT

from common.configure import UserError, load_config
from pipeline.format import MANIFEST, decode_array
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.manpage import man_paragraphs
from pipeline.prepare.readers import check_usable, read_unit
from pipeline.prepare.sources import expand_paths, plan_units
from pipeline.prepare.units import decode_counting, normalize_key
from pipeline.tokenizer import load_tokenizer


def read_pages(paths, **overrides):
    """The records of a manpage source of `paths` (files or globs), its files and its reader statistics."""
    keys = {"format": "manpage", "paths": "[" + ",".join(str(p) for p in paths) + "]", **overrides}
    cfg = load_config(PrepareConfig, None, [f"source.{k}={v}" for k, v in keys.items()]).source
    stats = Counter()
    files = expand_paths(cfg)
    records = [r for unit in plan_units(files, cfg, 1 << 20) for r in read_unit(unit, cfg, stats)]
    return records, files, stats


# Every construct the converter handles; EXPECTED is what a reader of the formatted page sees as
# prose.
PAGE = rb""".\" A page with every construct the converter knows.
'\" t
.TH DEMO 1 "2026-11-24" "demo 1.0" "User Commands"
.de Vb \" begin verbatim, as pod2man defines it
.ft CW
.nf
.ne \\$1
..
.de Ve
.ft R
.fi
..
.de Sp
.if n .sp
..
.ie \n(.g .ds Aq \(aq
.el       .ds Aq '
.ie n \{\
.    ds L" ""
.    ds R" ""
'br\}
.el\{\
.    ds L" ``
.    ds R" ''
'br\}
.tr \(*W-
.ds -- \(*W-
.nr X 1
.SH NAME
demo \- show every construct of a manual page
.SH SYNOPSIS
.B demo
[\fB\-v\fR] [\fIfile\fR ...] with enough words to be a paragraph
.SH DESCRIPTION
.B demo
reads each \fIfile\fP and writes it \(em unchanged \(en to the
standard output.   \" a comment after the text
Its name is \f(CWdemo\fR, its \f[CB]manual\f[] page is re\fBad\fRme.
.PP
Fonts: the
.BR demo (1)
page and
.I "the quoted words"
and
.IR file .
.RB [ \-v ]
.RI < name >
.BI \-o " file"
.IB x y
.SM "small text"
.SB "small bold"
.br
.sp
.ad l
.na
.hy
.nh
.ll 70
.ft B
.ps 10
.vs 12
.ti 2
.in +4
.ta 8
.ne 3
.so other.1
.P
Quotes: \(lqdouble\(rq, \*(lqstrings\*(rq, \*[lq]bracketed\*[rq], \(aqsingle\(aq and \(dqplain\(dq; \
a continued line \(bu a bullet.
.LP
Escapes: back\eslash, no\&thing\:at\/all\,here\|or\^there, non\~breaking and\ space, \(co 2026,
Demo\*R and Demo\*(Tm, caf\[u00E9], \[em] dash, \*(Aq pod \*(L"quoted\*(R" and \*(-- dash,
unknown \[xyzzy]glyph and \qescape, size \s-2small\s0 and \s+2big\s0, cafLATIN1 Latin-1.
.TP
.B \-v
Be verbose: print each file name before its text.
.TP 8
\fB\-o\fR \fIfile\fR
Write to \fIfile\fR instead of the standard output.
.IP \(bu 2
A bulleted item with enough words in it.
.IP "\fB\-\-long\fR" 4
A tagged item that explains the long option.
.HP
A hanging paragraph with enough words here.
.SS "An example"
.nf
code that is dropped
  and more code
.fi
.EX
$ demo file | less \" example, dropped
.EE
.Vb 2
\&    verbatim perl code
\&    also dropped
.Ve
.Sp
.TS
tab(;);
l l.
cell one;cell two
.TE
.EQ
x sup 2
.EN
Text after the blocks is kept, see
.UR https://example.org/demo
the demo home page
.UE .
Mail
.MT demo@example.org
the author
.ME ,
please.
\&.dot at the start of a text line is kept here.
Join\c
ed words with \c
.B bold
continuation works.

Too short.
.PP
$ demo \-v file with a prompt is an example
.SH "SEE ALSO"
.BR cat (1),
.BR less (1)
and the other pages of the package, for more.
""".replace(b"LATIN1", b"\xe9")  # caf\xe9: Latin-1, not UTF-8

EXPECTED = [
    "demo - show every construct of a manual page",
    "demo reads each file and writes it \u2014 unchanged \u2013 to the standard output. Its name is demo, "
    "its manual page is readme.",
    "Fonts: the demo(1) page and the quoted words and file. [-v] <name> -o file xy small text small bold",
    "Quotes: \u201cdouble\u201d, \u201cstrings\u201d, \u201cbracketed\u201d, 'single' and \"plain\"; a continued line \u2022 a bullet.",
    "Escapes: back\\slash, nothingatallhereorthere, non breaking and space, (c) 2026, Demo\u00ae and Demo\u2122, caf\u00e9, "
    '\u2014 dash, \' pod "quoted" and -- dash, unknown glyph and escape, size small and big, caf\ufffd Latin-1.',
    "Be verbose: print each file name before its text.",
    "Write to file instead of the standard output.",
    "A bulleted item with enough words in it.",
    "A tagged item that explains the long option.",
    "A hanging paragraph with enough words here.",
    "Text after the blocks is kept, see the demo home page. Mail the author, please. .dot at the start of a text "
    "line is kept here. Joined words with bold continuation works.",
    "cat(1), less(1) and the other pages of the package, for more.",
]


def test_every_construct_gives_exactly_the_prose(tmp_path):
    (tmp_path / "demo.1").write_bytes(PAGE)
    records, _, stats = read_pages([tmp_path / "demo.1"])
    assert [text for text, _ in records] == EXPECTED
    assert all(target is None for _, target in records)
    # The Latin-1 byte is replaced and counted; the tags, headings and "Too short." are too short;
    # "$ demo -v file ..." is a command, not prose.
    assert stats["bad_bytes_replaced"] == 1 and stats["records"] == len(EXPECTED)
    assert stats["pages"] == 1 and stats["short_paragraphs"] == 5 and stats["command_examples"] == 1


def test_gz_page_so_redirect_mdoc_page_and_links(tmp_path):
    """A .gz page reads as the plain one; a `.so` page and an mdoc page give nothing and are
    counted; a page reached through a symbolic link is read once."""
    man1 = tmp_path / "man1"
    man1.mkdir()
    with gzip.open(man1 / "demo.1.gz", "wb") as fh:
        fh.write(PAGE)
    (man1 / "alias.1").write_bytes(b'.\\" redirect\n.so man1/demo.1\n')
    (man1 / "bsd.1").write_bytes(
        b".Dd November 24, 2026\n.Dt BSD 1\n.Sh NAME\n.Nm bsd\n.Nd a page in mdoc that is skipped\n"
    )
    os.symlink("demo.1.gz", man1 / "same.1.gz")
    records, files, stats = read_pages([man1 / "*"])
    assert [os.path.basename(f) for f in files] == ["alias.1", "bsd.1", "demo.1.gz"]
    assert [text for text, _ in records] == EXPECTED
    assert stats["pages"] == 1 and stats["so_redirects"] == 1 and stats["mdoc_pages_skipped"] == 1
    assert stats["bad_bytes_replaced"] == 1


def test_a_source_of_redirects_only_says_so(tmp_path):
    (tmp_path / "a.1").write_bytes(b".so man1/b.1\n")
    records, files, stats = read_pages([tmp_path / "a.1"])
    cfg = load_config(PrepareConfig, None, ["source.format=manpage"]).source
    with pytest.raises(
        UserError, match="no usable records in 1 file of source.paths: manpage: 1 so_redirects"
    ):
        check_usable(stats, cfg, len(files), Counter())


def test_declared_encoding_and_min_words(tmp_path):
    page = tmp_path / "latin.1"
    page.write_bytes(
        b'.\\" -*- coding: latin-1 -*-\n.TH X 1\n.SH BESCHREIBUNG\nDer Caf\xe9 ist heute offen.\n.TP\n.B \\-v\nKurz.\n'
    )
    records, _, stats = read_pages([page])
    assert records == [("Der Café ist heute offen.", None)] and stats["bad_bytes_replaced"] == 0
    records, _, _ = read_pages([page], min_words=1)
    assert [text for text, _ in records] == ["Der Café ist heute offen.", "-v", "Kurz."]


@pytest.mark.parametrize(
    "text",
    [
        "\\",
        "\\(",
        "\\[unterminated",
        "\\*[",
        "\\f",
        "\\s",
        "\\h'1i",
        ".if",
        ".ie",
        ".el",
        ".el \\{\\",
        ".if t \\{\\",
        ".de",
        ".de X",
        ".TS",
        ".ds",
        ".tr \\(",
        ".SH",
        ".TP",
        ".IP",
        ".BR",
        ".UE x",
        ".MR",
        ".so",
        "\\N'99999999'",
        "\\[u110000]",
        "\\[uD800]",
        "\\N'55296'",
        "\\[u0000]",
        "\\[uZZ]",
        "\\[char999]",
        ".ds A \\*A\n\\*A",
        "'\\\"",
        "\\c",
        "\\\\\\",
    ],
)
def test_broken_input_never_crashes(text):
    page = f".TH X 1\n.SH DESCRIPTION\nSome words before the broken part.\n{text}\nand some words after it.\n"
    for cut in range(len(page) + 1):
        "\n".join(man_paragraphs(page[:cut], 5, Counter())).encode("utf-8")  # no surrogates either


def test_random_bytes_never_crash():
    rng = random.Random(0)
    alphabet = b".\\'\"(*[]{}fsBIRPnhv-ec &\n abcTSEH"
    for _ in range(200):
        data = bytes(rng.choice(alphabet) for _ in range(rng.randrange(1, 400)))
        man_paragraphs(decode_counting(data)[0], 1, Counter())


WORDS = (
    "the option file reads writes each page output input default value when with from into system user "
    "command prints shows every line name mode list error status"
).split()


def write_pages(folder, n_pages=4, paragraphs=25, seed=0):
    """Man pages of random prose in roff (fonts, escapes, tags), one of them compressed, and a
    `.so` page; returns the paragraphs a reader should find."""
    rng = random.Random(seed)
    folder.mkdir()
    expected = []
    for page in range(n_pages):
        lines = [
            f".TH PAGE{page} 1",
            ".SH NAME",
            f"page{page} \\- a generated page number {page} of the test",
            ".SH DESCRIPTION",
        ]
        expected.append(f"page{page} - a generated page number {page} of the test")
        for i in range(paragraphs):
            words = [rng.choice(WORDS) for _ in range(rng.randrange(6, 30))] + [f"p{page}x{i}"]
            lines += [".TP", f"\\fB\\-{i}\\fR", f"\\fI{words[0]}\\fP " + " ".join(words[1:]) + "."]
            expected.append(" ".join(words) + ".")
        data = ("\n".join(lines) + "\n").encode()
        if page == 0:
            with gzip.open(folder / f"page{page}.1.gz", "wb") as fh:
                fh.write(data)
        else:
            (folder / f"page{page}.1").write_bytes(data)
    (folder / "alias.1").write_bytes(b".so man1/page1.1\n")
    return expected


def test_prepare_with_a_manpage_source_adds_packed_text_only(tmp_path):
    """A TSV source of pairs and a manpage source: the pages' paragraphs land in the packed
    (monolingual) shards of their own source, counted per source in the manifest, and the
    translation shards are byte for byte those of the pairs prepared alone (same tokenizer)."""
    write_tsv(tmp_path / "pairs.tsv", synthetic_pairs(300))
    expected = write_pages(tmp_path / "man1")
    pairs = f"  - {{name: pairs, format: tsv, paths: ['{tmp_path / 'pairs.tsv'}']}}\n"
    man = f"  - {{name: man, format: manpage, paths: ['{tmp_path / 'man1' / '*'}'], tokenizer_share: 0.5}}\n"
    settings = [
        a
        for a in prepare_args(tmp_path / "unused", tmp_path / "x", **{"ray.num_workers": 2})
        if not a.startswith(("source.", "output_dir"))
    ]

    def prepare(name, sources, *extra):
        config = tmp_path / f"{name}.yaml"
        config.write_text("sources:\n" + sources)
        out = tmp_path / name
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.prepare",
                str(config),
                f"output_dir={out}",
                *settings,
                *extra,
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        return out, json.loads((out / MANIFEST).read_text()), run.stdout

    alone, alone_manifest, _ = prepare("alone", pairs)
    both, manifest, summary = prepare(
        "both", pairs + man, f"tokenizer.path={alone / 'tokenizer.model'}"
    )

    by_source = manifest["sources"]["by_source"]["man"]
    assert by_source["format"] == "manpage" and by_source["files"] == 5
    assert (
        by_source["pages"] == 4
        and by_source["so_redirects"] == 1
        and by_source["records"] == len(expected)
    )
    assert "source man (manpage): 5 files" in summary
    # Every paragraph was packed as the man source's, token for token (less each bucket's short
    # tail, which packing drops and counts).
    sp = load_tokenizer(both / "tokenizer.model")
    packed = manifest["datasets"]["packed"]
    man_stats = packed["stats_by_source"]["man"]
    assert man_stats["documents"] == len(set(expected))
    assert man_stats["tokens"] == sum(
        len(ids) + 1 for ids in sp.encode_batch(sorted(set(expected)))
    )
    in_shards = sum(entry["sources"]["man"]["tokens"] for entry in packed["splits"].values())
    assert (
        in_shards == man_stats["tokens"] - man_stats["tail_tokens_dropped"]
        and packed["splits"]["train"]["sources"]["man"]["tokens"] > 0
    )

    # The pages' text is in the man source's packed shards and nowhere in translation.

    def texts(out, name, source, fields):
        """The source's samples decoded, each field's ids of a split run together (a document goes on across blocks)."""
        found = []
        for entry in json.loads((out / MANIFEST).read_text())["datasets"][name]["splits"].values():
            ids = {field: [] for field in fields}
            for shard in entry["shards"]:
                if shard["source"] != source:
                    continue
                for sample in wds.WebDataset(
                    str(out / shard["path"]), shardshuffle=False, empty_check=False
                ):
                    for field in fields:
                        ids[field] += decode_array(sample[field + ".npy"]).tolist()
            found += [normalize_key(sp.decode(field_ids)) for field_ids in ids.values()]
        return " ".join(found)

    packed_man = texts(both, "packed", "man", ["input_ids"])
    found = sum(normalize_key(text) in packed_man for text in expected)
    # the rest ends in a dropped tail or runs on into the next bucket
    assert found >= 0.9 * len(expected)
    assert {
        shard["source"]
        for entry in manifest["datasets"]["translation"]["splits"].values()
        for shard in entry["shards"]
    } == {"pairs"}
    translated = texts(both, "translation", "pairs", ["src_ids", "tgt_ids"])
    assert not any(f"p{page}x" in translated for page in range(4))

    # The translation data is unchanged by the pages: the same shards (a lone source's lie one
    # folder up).
    for split, entry in manifest["datasets"]["translation"]["splits"].items():
        alone_entry = alone_manifest["datasets"]["translation"]["splits"][split]
        assert (entry["samples"], entry["tokens"]) == (
            alone_entry["samples"],
            alone_entry["tokens"],
        ) and entry["samples"] > 0
        assert len(entry["shards"]) == len(alone_entry["shards"])
        for shard, alone_shard in zip(entry["shards"], alone_entry["shards"]):
            assert shard["path"].replace("/pairs/", "/") == alone_shard["path"]
            assert {k: v for k, v in shard.items() if k not in ("path", "source")} == {
                k: v for k, v in alone_shard.items() if k not in ("path", "source")
            }
            assert (both / shard["path"]).read_bytes() == (
                alone / alone_shard["path"]
            ).read_bytes(), shard["path"]
