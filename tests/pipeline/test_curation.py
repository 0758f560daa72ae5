"""The curation stages in real prepares (joining one Ray head): language identification, the
quality rules, PII, near-duplicates and decontamination each drop what was planted for them
(tests/curated.py), count it per source, rule and split, and keep samples; the shards are the
same bytes for 1 and 2 workers and two unit sizes, and after a stop in the near-duplicate
shuffle (SIGTERM, SIGKILL) a second run resumes from the scan and writes them again; bad
settings are one line each."""

from __future__ import annotations

import hashlib
import io
import json
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
from corpora import RayHead
from curated import write_corpus
from errorlines import assert_one_error_line
from repo import ROOT

from common.configure import run_main
from pipeline.format import MANIFEST, foreign_to_dataset, read_manifest
from pipeline.prepare.curate.decontaminate import normalized
from pipeline.tokenizer import load_tokenizer

pytestmark = pytest.mark.slow

CONFIG = """\
tasks: [causal_lm, translation]
seq_len: 64
sources:
  - name: web
    format: jsonl
    paths: [{corpus}/web.jsonl]
    source_lang: en
    target_lang: en
    language: {{enabled: true}}
    quality: {{enabled: true}}
  - name: pairs
    format: tsv
    paths: [{corpus}/pairs.tsv]
    language: {{enabled: true}}
    near_dedup: false
split: {{valid: 0.1, test: 0.1}}
tokenizer: {{vocab_size: 600, sample_texts: 5000}}
shard: {{max_samples: 50, buckets: 3}}
near_dedup: {{enabled: true}}
decontamination:
  enabled: true
  eval_files: [{{path: {corpus}/eval.txt}}]
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("curated")
    planted = write_corpus(root)
    (root / "prepare.yaml").write_text(CONFIG.format(corpus=root))
    return root, planted


def command(corpus: Path, out: Path, ray: RayHead, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pipeline.prepare",
        str(corpus / "prepare.yaml"),
        f"output_dir={out}",
        f"ray.address={ray.address}",
        *overrides,
    ]


def prepare(
    corpus: Path, out: Path, ray: RayHead, *overrides: str, said: list | None = None
) -> Path:
    """A prepare joining `ray`; its stderr appended to `said`."""
    run = subprocess.run(
        command(corpus, out, ray, "progress=false", *overrides),
        cwd=ROOT,
        env=ray.env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    if said is not None:
        said.append(run.stderr)
    return out


@pytest.fixture(scope="module")
def curated(corpus, ray_head, tmp_path_factory):
    root, _ = corpus
    return prepare(root, tmp_path_factory.mktemp("out") / "data", ray_head, "ray.num_workers=2")


def files(directory: Path) -> dict[str, str]:
    return {
        str(path.relative_to(directory)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(directory.rglob("*"))
        if path.is_file() and path.name not in (MANIFEST, "config.yaml")
    }


def comparable(manifest: dict) -> dict:
    """The manifest less what names the run: its time, its config's workers and unit size, and
    how many units that size made."""
    manifest = json.loads(json.dumps(manifest))
    manifest.pop("seconds")
    for key in ("unit_bytes", "output_dir"):
        manifest["config"].pop(key)
    manifest["config"]["ray"].pop("num_workers")
    manifest["sources"].pop("units")
    for entry in manifest["sources"]["by_source"].values():
        entry.pop("units")
    return manifest


def totals(manifest: dict, source: str) -> dict[str, int]:
    """`stage.rule` -> count over the splits."""
    return {
        f"{stage}.{rule}": sum(counts.values())
        for stage, rules in manifest["curation"]["by_source"][source].items()
        for rule, counts in rules.items()
    }


def shard_arrays(data: Path, manifest: dict, dataset: str, split: str) -> list[dict]:
    samples = []
    for shard in manifest["datasets"][dataset]["splits"][split]["shards"]:
        with tarfile.open(data / shard["path"]) as tar:
            members: dict[str, dict] = {}
            for member in tar.getmembers():
                key, _, field = member.name.partition(".")
                data_bytes = tar.extractfile(member).read()
                members.setdefault(key, {})[field] = np.load(io.BytesIO(data_bytes))
        samples += [members[key] for key in sorted(members)]
    return samples


def test_every_stage_drops_what_was_planted_and_counts_it(curated, corpus, capsys):
    root, planted = corpus
    manifest = read_manifest(curated)
    web = totals(manifest, "web")
    # six German documents under an English source; two navigation pages of 13 words (< 50);
    # one page with a lorem ipsum line; every planted near-copy (all in the training split)
    assert web["language.wrong_language"] == planted["german"], web
    assert web["gopher_quality.word_count"] == 2, web
    assert web["c4.lorem_ipsum"] == 1, web
    assert manifest["curation"]["by_source"]["web"]["near_dedup"]["near_duplicate"] == {
        "train": len(planted["copies"])
    }
    assert web["pii.email"] == 1 and web["pii.ip"] == 1, web
    assert manifest["curation"]["languages"]["web"]["source"]["de"] == planted["german"]

    # the samples: each near-copy beside its original, the one first in the corpus kept
    near = [
        json.loads(line)
        for line in (curated / "dropped/web/near_dedup.near_duplicate.jsonl").open()
    ]
    clean = {
        " ".join(copy.split()): " ".join(original.split()) for original, copy in planted["copies"]
    }
    assert {sample["text"]: sample["kept"] for sample in near} == clean
    for name in manifest["curation"]["sample_files"]:
        assert (curated / name).is_file(), name
    assert foreign_to_dataset(curated) == []  # what prepare wrote, all accounted for

    # what training reads: PII replaced; no text of the evaluation file
    tokenizer = load_tokenizer(curated)
    packed = shard_arrays(curated, manifest, "packed", "train")
    text = tokenizer.decode(np.concatenate([s["input_ids.npy"] for s in packed]).tolist())
    assert "email@example.com" in text and "192.0.2.1" in text
    assert "jane.doe" not in text and "8.8.8.8" not in text
    assert " ".join(normalized(planted["eval_doc"]).split()[:13]) not in normalized(text)

    # no training pair has a side whose normalized form is a valid or test pair's side's
    def forms(split: str) -> set[str]:
        return {
            normalized(tokenizer.decode(s[field].tolist()))
            for s in shard_arrays(curated, manifest, "translation", split)
            for field in ("src_ids.npy", "tgt_ids.npy")
        }

    assert not forms("train") & (forms("valid") | forms("test"))
    decontaminated = totals(manifest, "pairs")
    assert (
        decontaminated["decontamination.test_pairs"] + decontaminated["decontamination.valid_pairs"]
        > 0
    )

    # pipeline.inspect: the table and where the samples are
    with pytest.raises(SystemExit) as stop:
        run_main(lambda: __import__("pipeline.inspect").inspect.main([str(curated)]))
    assert stop.value.code == 0
    report = capsys.readouterr().out
    assert "web    near_dedup.near_duplicate" in report.replace("  ", " ") or (
        "near_dedup.near_duplicate" in report
    )
    assert "dropped/web/language.wrong_language.jsonl" in report


def test_the_same_bytes_for_one_worker_and_a_small_unit_size(curated, corpus, ray_head, tmp_path):
    root, _ = corpus
    other = prepare(root, tmp_path / "data", ray_head, "ray.num_workers=1", "unit_bytes=4096")
    assert files(other) == files(curated)
    assert comparable(read_manifest(other)) == comparable(read_manifest(curated))


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_prepare_stopped_in_the_near_duplicate_shuffle_resumes_and_writes_the_same_bytes(
    stop, curated, corpus, ray_head, tmp_path
):
    """Stopped once the shuffle has started (its log line; 600 partitions make it last a few
    seconds), then run again with the same command: it goes on from the stopped run's scan and
    writes the dataset of an uninterrupted run."""
    root, _ = corpus
    out = tmp_path / "data"
    args = command(root, out, ray_head, "near_dedup.partitions=600", "ray.num_workers=2")
    process = subprocess.Popen(
        args,
        cwd=ROOT,
        env=ray_head.env,
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
    )
    seen = []
    for line in process.stderr:
        seen.append(line)
        if "prepare: near-duplicates:" in line and "partitions" in line:
            time.sleep(0.5)
            process.send_signal(stop)
            break
    rest = process.communicate(timeout=120)[1]
    assert process.returncode != 0, "".join(seen[-20:])
    assert "texts to drop" not in rest  # the shuffle's end: stopped before it
    assert not (out / MANIFEST).exists()
    (kept,) = tmp_path.glob("data.partial-*")  # the scan's work, for the next run
    said: list[str] = []
    again = prepare(root, out, ray_head, "near_dedup.partitions=600", said=said)
    assert f"resuming from {kept}" in said[0], said[0][-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert files(again) == files(curated)
    assert (
        comparable(read_manifest(again))["datasets"]
        == comparable(read_manifest(curated))["datasets"]
    )


@pytest.mark.parametrize(
    "old, new, fragments",
    [
        (
            "quality: {enabled: true}",
            "quality: {enabled: true, disabled_rules: [gopher_quality.no_such_rule]}",
            ["sources[0] (web).quality.disabled_rules", "gopher_quality.no_such_rule"],
        ),
        (
            "near_dedup: {enabled: true}",
            "near_dedup: {enabled: true, threshold: 1.5}",
            ["near_dedup.threshold", "1.5"],
        ),
        (
            "CORPUS/eval.txt",
            "/no/such/file.txt",
            ["decontamination.eval_files[0].path", "/no/such/file.txt"],
        ),
        (
            "CORPUS/eval.txt",
            "EMPTY",
            ["decontamination.eval_files[0].path", "holds no evaluation text"],
        ),
        (
            "format: tsv",
            "format: tsv\n    source_lang: xx",
            ["sources[1] (pairs).source_lang", "'xx'"],
        ),
        (
            "quality: {enabled: true}",
            "quality: {enabled: true, gopher_quality: {no_such_key: 3}}",
            ["no_such_key"],
        ),
    ],
    ids=["unknown rule", "threshold", "missing eval file", "empty eval file", "language", "key"],
)
def test_a_bad_curation_setting_is_one_error_line_and_nothing_is_written(
    old, new, fragments, corpus, tmp_path, capsys
):
    from pipeline.prepare.job import main

    root, _ = corpus
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")
    config = CONFIG.format(corpus="CORPUS")
    assert old in config
    config = config.replace(old, new).replace("EMPTY", str(empty)).replace("CORPUS", str(root))
    (tmp_path / "bad.yaml").write_text(config)
    argv = [str(tmp_path / "bad.yaml"), f"output_dir={tmp_path / 'data'}"]
    with pytest.raises(SystemExit) as stop:
        run_main(lambda: main(argv))
    assert_one_error_line(stop.value.code, capsys.readouterr().err.splitlines(), *fragments)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml", "empty.txt"]
