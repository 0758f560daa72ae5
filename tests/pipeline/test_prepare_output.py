"""What `pipeline.prepare` may replace (issue 61, items 1 and 2): never a directory that holds its
own sources, nor one holding anything prepare did not write, whatever `overwrite` says; and the
names beside the output that a user may hold (OUTPUT.old, OUTPUT.partial, OUTPUT.lock) survive a
replacement or stop it, untouched. Real prepares, joining one Ray head."""

from __future__ import annotations

import shutil
from pathlib import Path

from corpora import prepare_args, run_prepare, synthetic_pairs, write_tsv

from pipeline.format import MANIFEST


def snapshot(directory: Path) -> dict:
    """Every path under `directory` with its bytes (None for a directory)."""
    return {
        str(path.relative_to(directory)): None if path.is_dir() else path.read_bytes()
        for path in sorted(directory.rglob("*"))
    }


def one_error_line(run) -> str:
    lines = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), run.stderr[
        -2000:
    ]
    return lines[0]


def test_an_output_dir_holding_its_own_sources_is_refused_and_they_survive(tmp_path, ray_head):
    """Item 1: output_dir = the directory of the sources (source.paths=[DIR/*.tsv]) with
    overwrite=true deleted the sources and a NOTES.md, and exited 0."""
    sources = tmp_path / "corpus"
    sources.mkdir()
    write_tsv(sources / "a.tsv", synthetic_pairs(300, seed=1))
    write_tsv(sources / "b.tsv", synthetic_pairs(300, seed=2))
    (sources / "NOTES.md").write_text("where these came from\n")
    before = snapshot(tmp_path)
    run = run_prepare(
        prepare_args(f"{sources}/*.tsv", sources, overwrite="true"), ray=ray_head, timeout=300
    )
    line = one_error_line(run)
    assert f"output_dir: {sources} holds {sources}/a.tsv, an input of this run" in line, line
    assert snapshot(tmp_path) == before


def test_a_dataset_holding_a_users_files_is_not_replaced_whatever_overwrite_says(
    tmp_path, ray_head
):
    """Item 1: a dataset with the user's thesis.tex and raw/ in it went whole with
    overwrite=true. Prepare replaces its own output, and an empty directory, only."""
    corpus = write_tsv(tmp_path / "pairs.tsv", synthetic_pairs(300))
    out = tmp_path / "web"
    first = run_prepare(prepare_args(corpus, out), ray=ray_head, timeout=300)
    assert first.returncode == 0 and (out / MANIFEST).is_file(), first.stderr[-2000:]
    (out / "thesis.tex").write_text("\\chapter{One}\n")
    (out / "raw").mkdir()
    (out / "raw" / "dump.txt").write_text("the raw dump\n")
    before = snapshot(tmp_path)
    for overwrite in ("false", "true"):
        run = run_prepare(prepare_args(corpus, out, overwrite=overwrite), ray=ray_head, timeout=300)
        line = one_error_line(run)
        assert f"output_dir: {out} holds what prepare did not write (raw, thesis.tex)" in line
        assert snapshot(tmp_path) == before


def test_a_users_names_beside_the_output_survive_its_replacement(tmp_path, ray_head):
    """Item 2: OUTPUT.old (a user's `cp -r web web.old`, with a KEEP.txt) was deleted by the swap
    and OUTPUT.partial by the start of the run; a file of the user's named OUTPUT.lock was
    truncated and deleted. Now each name the run uses is its own."""
    corpus = write_tsv(tmp_path / "pairs.tsv", synthetic_pairs(300))
    out = tmp_path / "web"
    first = run_prepare(prepare_args(corpus, out), ray=ray_head, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    shutil.copytree(out, tmp_path / "web.old")
    (tmp_path / "web.old" / "KEEP.txt").write_text("keep me\n")
    (tmp_path / "web.partial").mkdir()
    (tmp_path / "web.partial" / "draft.txt").write_text("a draft\n")
    users = {name: snapshot(tmp_path / name) for name in ("web.old", "web.partial")}
    run = run_prepare(
        prepare_args(corpus, out, overwrite="true", **{"split.valid": 0.2}),
        ray=ray_head,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert {name: snapshot(tmp_path / name) for name in users} == users
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "pairs.tsv",
        "web",
        "web.old",
        "web.partial",
    ]
    assert (out / MANIFEST).read_bytes() != users["web.old"][MANIFEST]
    # a file of the user's where the lock goes: refused, nothing touched
    lock = tmp_path / "web.lock"
    lock.write_text("my notes on locking\n")
    before = snapshot(tmp_path)
    line = one_error_line(run_prepare(prepare_args(corpus, out, overwrite="true"), ray=ray_head))
    assert f"{lock} exists and is not a lock file of ours" in line, line
    assert snapshot(tmp_path) == before
