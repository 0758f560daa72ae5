"""`pipeline.prepare` with a real Ray, and `pipeline.validate`. Most prepares here join one running
Ray cluster (`ray_head`, as on a SLURM job); those about Ray's own start and stop start theirs."""

import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
import webdataset as wds
from corpora import RayHead, prepare_args, prepare_command, run_prepare, synthetic_pairs, write_tsv
from repo import ROOT

from common.hashing import file_sha256
from pipeline.format import MANIFEST, decode_array
from pipeline.prepare.units import normalize_key
from pipeline.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def ray_head():
    """The Ray cluster this file's prepares join (conftest.RayHead), 3 CPUs: the most workers a
    test here asks for. Stopped, with its processes, after the file's last test."""
    head = RayHead(num_cpus=3)
    yield head
    head.stop()


def read_dataset(data_dir, name, split):
    manifest = json.loads((data_dir / MANIFEST).read_text())
    samples = []
    for shard in manifest["datasets"][name]["splits"][split]["shards"]:
        for sample in wds.WebDataset(
            str(data_dir / shard["path"]), shardshuffle=False, empty_check=False
        ):
            samples.append(
                {k[:-4]: decode_array(v) for k, v in sample.items() if k.endswith(".npy")}
            )
    return samples


def test_shards_identical_with_1_and_2_ray_workers(tiny_corpus, tiny_dataset, tmp_path, ray_head):
    one = tmp_path / "one"
    run = run_prepare(prepare_args(tiny_corpus, one, **{"ray.num_workers": 1}), ray=ray_head)
    assert run.returncode == 0, run.stderr[-2000:]
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(
        p.relative_to(tiny_dataset) for p in tiny_dataset.rglob("*") if p.is_file()
    )
    tars = [f for f in files if f.suffix == ".tar"]
    assert len(tars) > 6
    for relative in tars + [type(files[0])("tokenizer.model")]:
        assert (one / relative).read_bytes() == (tiny_dataset / relative).read_bytes(), relative


def test_manifest_counts_equal_the_data(tiny_dataset):
    manifest = json.loads((tiny_dataset / MANIFEST).read_text())
    assert manifest["tokenizer"]["sha256"] == file_sha256(tiny_dataset / "tokenizer.model")
    for name, dataset in manifest["datasets"].items():
        for split, entry in dataset["splits"].items():
            samples = read_dataset(tiny_dataset, name, split)
            assert len(samples) == entry["samples"]
            # doc_starts holds positions, not tokens
            assert (
                sum(int(a.size) for s in samples for k, a in s.items() if k.endswith("_ids"))
                == entry["tokens"]
            )
            for shard in entry["shards"]:
                assert shard["sha256"] == file_sha256(tiny_dataset / shard["path"])
                assert shard["bytes"] == (tiny_dataset / shard["path"]).stat().st_size
    # 630 input lines of which 30 are exact duplicates.
    assert manifest["sources"]["records"] == 630
    assert manifest["datasets"]["translation"]["stats"]["duplicates_dropped"] == 30
    translation = manifest["datasets"]["translation"]
    kept = sum(e["samples"] for e in translation["splits"].values())
    filtered = translation["stats"].get("pairs_filtered_length", 0) + translation["stats"].get(
        "pairs_filtered_ratio", 0
    )
    assert kept + filtered == 600
    assert all(s["samples"] <= 40 for e in translation["splits"].values() for s in e["shards"])


def test_packed_blocks_are_documents_joined_by_eos(tiny_dataset):
    sp = load_tokenizer(tiny_dataset / "tokenizer.model")
    manifest = json.loads((tiny_dataset / MANIFEST).read_text())
    vocabulary = {w for pair in synthetic_pairs(600) for text in pair for w in text.split()}
    by_bucket = {}
    for shard in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        bucket = shard["path"].split("/")[-1].split("-")[0]
        for sample in wds.WebDataset(
            str(tiny_dataset / shard["path"]), shardshuffle=False, empty_check=False
        ):
            block = decode_array(sample["input_ids.npy"])
            # doc_starts: 0, then every position right after an </s> inside the block (never
            # seq_len)
            expected = [0] + [i + 1 for i in range(len(block) - 1) if block[i] == 3]
            starts = decode_array(sample["doc_starts.npy"])
            assert starts.dtype == block.dtype and starts.tolist() == expected
            by_bucket.setdefault(bucket, []).append(block)
    assert len(by_bucket) == 3
    for blocks in by_bucket.values():
        assert all(b.shape == (32,) for b in blocks)
        stream = np.concatenate(blocks).astype(np.int64)
        # A bucket's blocks start at a document start; the piece after the last </s> is a cut tail.
        docs = [
            sp.decode(piece.tolist())
            for piece in np.split(stream, np.where(stream == 3)[0] + 1)[:-1]
        ]
        assert docs and all(doc and set(doc.split()) <= vocabulary for doc in docs)


def test_a_pair_never_lands_in_two_splits(tiny_dataset):
    sp = load_tokenizer(tiny_dataset / "tokenizer.model")
    seen = {}
    for split in ("train", "valid", "test"):
        for sample in read_dataset(tiny_dataset, "translation", split):
            source = normalize_key(sp.decode(sample["src_ids"].tolist()))
            assert seen.setdefault(source, split) == split
    assert set(seen.values()) == {"train", "valid", "test"}


def test_validate_passes_then_catches_corruption(tiny_dataset, tmp_path):
    ok = subprocess.run(
        [sys.executable, "-m", "pipeline.validate", f"data_dir={tiny_dataset}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert ok.returncode == 0 and "0 problem(s)" in ok.stdout
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    shard = next(broken.rglob("*.tar"))
    shard.write_bytes(shard.read_bytes()[:700])
    bad = subprocess.run(
        [sys.executable, "-m", "pipeline.validate", f"data_dir={broken}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 1 and "FAIL" in bad.stdout and shard.name in bad.stdout


def test_validate_names_a_shard_listed_twice_or_with_a_count_below_one(tiny_dataset, tmp_path):
    import shutil

    def validate_with(change):
        data = tmp_path / f"copy{len(list(tmp_path.iterdir()))}"
        shutil.copytree(tiny_dataset, data)
        manifest = json.loads((data / MANIFEST).read_text())
        split = manifest["datasets"]["packed"]["splits"]["train"]
        change(split)
        (data / MANIFEST).write_text(json.dumps(manifest))
        run = subprocess.run(
            [sys.executable, "-m", "pipeline.validate", f"data_dir={data}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        return (
            run.returncode,
            [line for line in run.stdout.splitlines() if line.startswith("FAIL ")],
            split["shards"][0],
        )

    def repeat(split):  # the split's totals follow, so that nothing but the repeat is wrong
        split["shards"].append(dict(split["shards"][0]))
        split["samples"] += split["shards"][0]["samples"]
        split["tokens"] += split["shards"][0]["tokens"]

    code, fails, shard = validate_with(repeat)
    assert code == 1 and fails == [
        f"FAIL {shard['path']}: listed 2 times in packed/train (read 2 times an epoch)"
    ]
    code, fails, shard = validate_with(lambda split: split["shards"][0].update(samples=-3))
    assert (
        code == 1
        and f"FAIL {shard['path']}: samples -3 in the manifest, not a positive integer" in fails
    ), fails


def test_existing_dataset_is_not_overwritten_and_failures_leave_nothing_complete(
    tiny_corpus, tiny_dataset, tmp_path, ray_head
):
    before = (tiny_dataset / MANIFEST).read_bytes()
    run = run_prepare(prepare_args(tiny_corpus, tiny_dataset), ray=ray_head)
    assert run.returncode == 2 and "overwrite=true" in run.stderr
    assert (tiny_dataset / MANIFEST).read_bytes() == before
    # A failure mid-way (a parallel task needs pairs; text has none) leaves no dataset behind.
    text = tmp_path / "mono.txt"
    text.write_text("just some text\n")
    out = tmp_path / "never"
    run = run_prepare(prepare_args(text, out, **{"source.format": "text"}), ray=ray_head)
    assert run.returncode == 2 and "translation needs a parallel source" in run.stderr
    assert not (out / MANIFEST).exists()


def test_non_utf8_input_is_replaced_and_counted(tmp_path, ray_head):
    corpus = tmp_path / "bad.tsv"
    lines = [f"{en}\t{de}\n".encode() for en, de in synthetic_pairs(200)]
    lines[5] = b"caf\xe9 \xff\tKaffee\n"
    corpus.write_bytes(b"".join(lines))
    out = tmp_path / "out"
    run = run_prepare(
        prepare_args(corpus, out, **{"tasks": "[translation]", "ray.num_workers": 1}), ray=ray_head
    )
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["sources"]["bad_bytes_replaced"] == 2
    assert list(manifest["datasets"]) == ["translation"]


# ---------------------------------------------------------------- reliability: lock, staging,
# interruption


def error_lines(stderr):
    """The `error: ...` lines of a run's stderr (Ray prints a warning of its own at start-up)."""
    return [line for line in stderr.splitlines() if line.startswith("error: ")]


def session_processes(sid):
    """Processes of a session (a prepare started with start_new_session=True: itself, its local Ray)."""
    listing = subprocess.run(
        ["ps", "-s", str(sid), "-o", "pid=,comm="], capture_output=True, text=True
    ).stdout
    return [line.split(None, 1) for line in listing.splitlines() if line.strip()]


@pytest.fixture(scope="module")
def slow_corpus(tmp_path_factory):
    """400 small files: 400 scan tasks, several seconds of work once Ray is up, to interrupt mid-way."""
    directory = tmp_path_factory.mktemp("slow")
    for i in range(400):
        write_tsv(directory / f"p{i:03d}.tsv", synthetic_pairs(20, seed=i))
    return directory


def start_prepare(corpus_glob, out, **overrides):
    return subprocess.Popen(
        prepare_command(prepare_args(corpus_glob, out, **overrides)),
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def wait_for_scan(process, out):
    """Until the first scan task has written into the staging directory (Ray is up, work under way)."""
    deadline = time.monotonic() + 120
    while not list(out.parent.glob(f"{out.name}.partial-*/_work")):
        assert process.poll() is None, process.communicate()[1][-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_second_prepare_on_one_output_fails_at_once_naming_the_holder(slow_corpus, tmp_path):
    out = tmp_path / "data"
    first = start_prepare(f"{slow_corpus}/*.tsv", out)
    try:
        wait_for_scan(first, out)
        started = time.monotonic()
        second = run_prepare(prepare_args(f"{slow_corpus}/*.tsv", out, overwrite="true"))
        elapsed = time.monotonic() - started
        message = second.stderr.strip().splitlines()
        assert (
            second.returncode == 2 and len(message) == 1 and error_lines(second.stderr) == message
        ), second.stderr[-2000:]
        assert (
            str(out) in message[0]
            and f"prepare pid {first.pid} on host {socket.gethostname()}" in message[0]
        )
        assert elapsed < 15  # it never started Ray
        assert first.poll() is None  # and the first one carries on
    finally:
        first.send_signal(signal.SIGINT)
        first.communicate(timeout=120)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_interruption_removes_the_staging_directory_and_stops_its_ray(
    slow_corpus, tmp_path, signum
):
    out = tmp_path / "data"
    process = start_prepare(f"{slow_corpus}/*.tsv", out)
    wait_for_scan(process, out)
    assert any(name == "raylet" for _, name in session_processes(process.pid))
    process.send_signal(signum)
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 130 and "interrupted" in stderr
    assert (
        session_processes(process.pid) == []
    )  # ray.shutdown waited for the raylet, GCS and workers
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no data, data.partial or data.lock


def test_a_failing_task_leaves_no_staging_directory_unless_keep_partial(tmp_path, ray_head):
    broken = tmp_path / "broken.txt.gz"
    broken.write_bytes(b"this is not gzip data")
    out = tmp_path / "data"
    run = run_prepare(
        prepare_args(broken, out, **{"source.format": "text", "tasks": "[causal_lm]"}), ray=ray_head
    )
    assert run.returncode == 2 and "cannot read" in run.stderr, run.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken.txt.gz"]
    run = run_prepare(
        prepare_args(
            broken, out, **{"source.format": "text", "tasks": "[causal_lm]", "keep_partial": "true"}
        ),
        ray=ray_head,
    )
    assert run.returncode == 2 and "cannot read" in run.stderr, run.stderr[-2000:]
    (kept,) = tmp_path.glob("data.partial-*")
    assert kept.is_dir() and f"kept {kept} (keep_partial=true)" in run.stderr


# ---------------------------------------------------------------- reliability: inputs that yield
# nothing


def test_jsonl_lines_without_the_text_field_are_named_as_the_cause(tmp_path, ray_head):
    corpus = tmp_path / "d.jsonl"
    corpus.write_text("".join(json.dumps({"body": en}) + "\n" for en, _ in synthetic_pairs(500)))
    out = tmp_path / "data"
    run = run_prepare(
        prepare_args(corpus, out, **{"source.format": "jsonl", "tasks": "[causal_lm]"}),
        ray=ray_head,
    )
    assert run.returncode == 2
    message = error_lines(run.stderr)
    assert len(message) == 1 and run.stderr.endswith(message[0] + "\n")
    assert "jsonl: 500 of 500 lines lack the field 'text'" in message[0]
    assert not list(tmp_path.glob("data.partial*"))


def test_skipped_lines_are_counted_by_reason_in_manifest_and_summary(tmp_path, ray_head):
    lines = [json.dumps({"text": en}).encode() for en, _ in synthetic_pairs(300)]
    lines += [b"{not json"] * 20 + [json.dumps({"body": "x"}).encode()] * 10
    # Valid JSON whose text is nothing but undecodable bytes: dropped as undecodable, not as
    # malformed.
    lines += [b'{"text": "' + bytes(range(0x80, 0xC0)) + b'"}'] * 5
    corpus = tmp_path / "d.jsonl"
    corpus.write_bytes(b"\n".join(lines) + b"\n")
    out = tmp_path / "data"
    run = run_prepare(
        prepare_args(corpus, out, **{"source.format": "jsonl", "tasks": "[causal_lm]"}),
        ray=ray_head,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    sources = json.loads((out / MANIFEST).read_text())["sources"]
    assert sources["records"] == 300 and sources["lines"] == 335
    assert (
        sources["malformed_not_json"] == 20
        and sources["malformed_no_text_field"] == 10
        and sources["malformed_records"] == 30
    )
    assert sources["undecodable_dropped"] == 5
    assert (
        "skipped: jsonl: 20 of 335 lines are not JSON, 10 of 335 lines lack the field 'text', "
        "5 of 305 texts have more than 10% undecodable characters (source.max_replaced_fraction=0.1)"
    ) in run.stdout


def test_random_bytes_as_text_fail_as_mostly_undecodable(tmp_path, ray_head):
    corpus = tmp_path / "random.txt"
    corpus.write_bytes(random.Random(0).randbytes(200_000))
    out = tmp_path / "data"
    run = run_prepare(
        prepare_args(corpus, out, **{"source.format": "text", "tasks": "[causal_lm]"}), ray=ray_head
    )
    assert run.returncode == 2
    message = error_lines(run.stderr)
    assert (
        len(message) == 1
        and run.stderr.endswith(message[0] + "\n")
        and "mostly undecodable" in message[0]
        and str(corpus) in message[0]
    ), run.stderr[-2000:]
    assert not out.exists() and not list(tmp_path.glob("data.partial*"))


# ---------------------------------------------------------------- reliability: inputs read twice or
# not files


def test_a_glob_through_a_symlink_loop_prepares_each_file_once(tmp_path, ray_head):
    """`**` over a directory holding `loop -> .`: each file read once (glob followed the loop to
    the kernel's limit of 40 links, reading every file about 40 times), and one warning line."""
    corpus = tmp_path / "corpus"
    (corpus / "more").mkdir(parents=True)
    texts = [en for en, _ in synthetic_pairs(300)]
    for i, name in enumerate(("a.txt", "more/b.txt", "more/c.txt")):
        (corpus / name).write_text("".join(f"{text}\n" for text in texts[i::3]))
    (corpus / "loop").symlink_to(".")
    out = tmp_path / "data"
    run = run_prepare(
        prepare_args(
            f"{corpus}/**/*.txt",
            out,
            **{"source.format": "text", "tasks": "[causal_lm]", "ray.num_workers": 1},
        ),
        ray=ray_head,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    sources = json.loads((out / MANIFEST).read_text())["sources"]
    assert (sources["files"], sources["units"], sources["records"]) == (3, 3, 300)
    (warning,) = [line for line in run.stderr.splitlines() if "symlink loop" in line]
    assert warning.startswith(
        "warning: source.paths: 1 symlink loop not followed"
    ) and warning.endswith(f"e.g. {corpus}/loop -> {corpus}")


def test_a_fifo_or_a_directory_given_as_an_input_file_is_named_for_what_it_is(tmp_path):
    os.mkfifo(tmp_path / "pairs.tsv")
    (tmp_path / "catalog.mo").mkdir()
    for path, what in (
        (tmp_path / "pairs.tsv", "a FIFO (named pipe)"),
        (tmp_path / "catalog.mo", "a directory"),
    ):
        run = run_prepare(prepare_args(path, tmp_path / "data"))
        assert run.returncode == 2 and len(error_lines(run.stderr)) == 1, run.stderr[-2000:]
        assert error_lines(run.stderr)[0].startswith(
            f"error: source.paths: not a regular file: {path} is {what}"
        )


def test_two_sources_keep_their_own_shards_and_counts_identical_for_1_and_2_workers(
    tmp_path, ray_head
):
    """A TSV source of pairs and a parquet source of monolingual text, 50 of whose texts are the
    English side of a pair: per-source shards and counts, global dedup (the first source keeps
    a shared text), translation pairs from the parallel source only, the same bytes with 1 and 2 workers."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    pairs = synthetic_pairs(300)
    write_tsv(tmp_path / "pairs.tsv", pairs)
    rng = random.Random(3)
    mono = [
        f"{rng.choice(['a', 'the'])} note {i} "
        + " ".join(rng.choice(["red", "blue", "cat"]) for _ in range(6))
        for i in range(250)
    ] + [en for en, _ in pairs[:50]]
    pq.write_table(pa.table({"body": mono}), tmp_path / "docs.parquet", row_group_size=64)
    config = tmp_path / "two.yaml"
    config.write_text(
        "sources:\n"
        f"  - {{name: pairs, format: tsv, paths: ['{tmp_path / 'pairs.tsv'}']}}\n"
        f"  - {{name: docs, format: parquet, paths: ['{tmp_path / 'docs.parquet'}'], text_field: body, tokenizer_share: 0.5}}\n"
    )
    settings = [
        a
        for a in prepare_args(tmp_path / "unused", tmp_path / "x")
        if not a.startswith(("source.", "output_dir"))
    ]
    outs = {}
    for workers in (1, 2):
        out = tmp_path / f"out{workers}"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "pipeline.prepare",
                str(config),
                f"output_dir={out}",
                *settings,
                f"ray.num_workers={workers}",
                f"ray.address={ray_head.address}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env=ray_head.env,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        outs[workers] = out
    files = sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs[2]) for p in outs[2].rglob("*") if p.is_file())
    for relative in files:
        if relative.suffix in (".tar", ".model"):
            assert (outs[1] / relative).read_bytes() == (outs[2] / relative).read_bytes(), relative

    out = outs[2]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["sources"]["by_source"]["pairs"]["records"] == 300
    assert manifest["sources"]["by_source"]["docs"]["records"] == 300
    # The 50 shared texts were kept by the first source and dropped from the second.
    assert manifest["datasets"]["packed"]["stats_by_source"]["docs"]["duplicates_dropped"] == 50
    assert manifest["datasets"]["packed"]["stats_by_source"]["docs"]["documents"] == 250
    for name, dataset in manifest["datasets"].items():
        for split, entry in dataset["splits"].items():
            by_source = {"pairs": [0, 0], "docs": [0, 0]}
            for shard in entry["shards"]:
                assert shard["path"].startswith(f"{name}/{split}/{shard['source']}/")
                samples = [
                    {k[:-4]: decode_array(v) for k, v in s.items() if k.endswith(".npy")}
                    for s in wds.WebDataset(
                        str(out / shard["path"]), shardshuffle=False, empty_check=False
                    )
                ]
                by_source[shard["source"]][0] += len(samples)
                by_source[shard["source"]][1] += sum(
                    a.size for s in samples for k, a in s.items() if k.endswith("_ids")
                )
            assert {
                k: [v["samples"], v["tokens"]] for k, v in entry["sources"].items()
            } == by_source
            assert entry["samples"] == sum(v[0] for v in by_source.values())
        if name == "translation":
            assert all(
                s["source"] == "pairs" for e in dataset["splits"].values() for s in e["shards"]
            )
    assert manifest["datasets"]["packed"]["splits"]["train"]["sources"]["docs"]["samples"] > 0
    # A text's split never depends on its source: no English side of a test pair is in docs'
    # training blocks.
    sp = load_tokenizer(out / "tokenizer.model")
    test_sources = {
        normalize_key(sp.decode(s["src_ids"].tolist()))
        for s in read_dataset(out, "translation", "test")
    }
    train_docs = [
        shard
        for shard in manifest["datasets"]["packed"]["splits"]["train"]["shards"]
        if shard["source"] == "docs"
    ]
    text = " ".join(
        sp.decode(decode_array(s["input_ids.npy"]).tolist())
        for shard in train_docs
        for s in wds.WebDataset(str(out / shard["path"]), shardshuffle=False, empty_check=False)
    )
    assert test_sources and not any(source in normalize_key(text) for source in test_sources)


def test_shard_writer_writes_what_webdataset_tarwriter_writes_and_scan_tar_vouches_for_it(tmp_path):
    """The direct tar writer against the reference it replaced: the same bytes as
    webdataset.TarWriter (fixed mtime, owner, mode) with np.save members, for packed and
    translation samples and an empty shard; the sha256 taken while writing is the file's."""
    import io

    from pipeline.format import encode_array
    from pipeline.load.shards import scan_tar
    from pipeline.shard_tar import write_shard

    rng = np.random.default_rng(0)
    packed = [
        {
            "input_ids": rng.integers(0, 8000, 32).astype(np.uint16),
            "doc_starts": np.array([0, 5, 17][: 1 + i % 3], np.uint16),
        }
        for i in range(37)
    ]
    pairs = [
        {
            "src_ids": rng.integers(0, 70000, 1 + i % 9).astype(np.int32),
            "tgt_ids": rng.integers(0, 70000, 2 + i % 5).astype(np.int32),
        }
        for i in range(23)
    ]
    for name, samples in (("packed", packed), ("pairs", pairs), ("empty", [])):
        keys = [f"0003_{i:08d}" for i in range(len(samples))]
        record = write_shard(tmp_path / f"{name}.tar", keys, samples)
        reference = io.BytesIO()
        writer = wds.TarWriter(reference, encoder=False, mtime=0, user="", group="", mode=0o444)
        for key, sample in zip(keys, samples):
            writer.write(
                {"__key__": key, **{f"{field}.npy": encode_array(a) for field, a in sample.items()}}
            )
        writer.close()
        data = (tmp_path / f"{name}.tar").read_bytes()
        assert data == reference.getvalue(), name
        assert record["bytes"] == len(data) and record["sha256"] == file_sha256(
            tmp_path / f"{name}.tar"
        )
        assert record["samples"] == len(samples)
        assert record["tokens"] == sum(
            a.size for s in samples for k, a in s.items() if k.endswith("_ids")
        )
        if samples:
            assert scan_tar(data, tuple(sorted(samples[0]))) is not None, name
    assert not list(tmp_path.glob("*.partial*"))


def test_encode_output_does_not_depend_on_how_texts_are_chunked(tiny_corpus, tmp_path, monkeypatch):
    """The streamed encode stage (dedup, encode, pack and write ENCODE_CHUNK texts at a time)
    gives the same shards whatever the chunk size: here 7 texts against 100,000 (all at once)."""
    from common.configure import load_config
    from pipeline.prepare import encode, scan
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.sources import expand_paths, plan_units
    from pipeline.prepare.train_tokenizer import train_tokenizer

    cfg = load_config(PrepareConfig, None, prepare_args(tiny_corpus, tmp_path / "unused"))
    units = plan_units(expand_paths(cfg.source), cfg.source, 1 << 20)
    results = [scan.scan_unit(i, unit, cfg, str(tmp_path / "work")) for i, unit in enumerate(units)]
    model = {
        "tokenizer.model": train_tokenizer(
            [text for result in results for _, text in result["sample"]], cfg.tokenizer
        )
    }
    outputs = {}
    for chunk in (7, 100_000):
        monkeypatch.setattr(encode, "ENCODE_CHUNK", chunk)
        out = tmp_path / f"out{chunk}"
        outputs[chunk] = [
            encode.encode_splits(
                dataset, bucket, [0] * len(units), str(tmp_path / "work"), str(out), model, cfg
            )
            for dataset in ("packed", "translation")
            for bucket in range(cfg.shard.buckets)
        ]
    for small, large in zip(outputs[7], outputs[100_000]):
        for a, b in zip(small, large):
            assert a["shards"] == b["shards"] and a["stats"] == b["stats"]
    tars = sorted(p.relative_to(tmp_path / "out7") for p in (tmp_path / "out7").rglob("*.tar"))
    assert len(tars) > 6
    assert all(
        (tmp_path / "out7" / t).read_bytes() == (tmp_path / "out100000" / t).read_bytes()
        for t in tars
    )


def test_tokenizer_sample_shares():
    """Slots divided by tokenizer_share; a source short of texts gives what it has and the rest go to the others."""
    from common.configure import load_config
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.tokenizer_sample import tokenizer_sample
    from pipeline.prepare.units import Unit

    def cfg(k, shares):
        listed = ", ".join(
            f"{{name: s{i}, format: text, paths: [x], tokenizer_share: {w}}}"
            for i, w in enumerate(shares)
        )
        return load_config(
            PrepareConfig, None, [f"tokenizer.sample_texts={k}", f"sources=[{listed}]"]
        )

    texts = {
        0: [(i * 2, f"a{i}") for i in range(100)],
        1: [(i * 2 + 1, f"b{i}") for i in range(100)],
        2: [(1000 + i, f"c{i}") for i in range(5)],
    }
    units = [Unit("x", source=0), Unit("y", source=1), Unit("z", source=2)]
    scanned = [{"sample": texts[0]}, {"sample": texts[1]}, {"sample": texts[2]}]
    got, cut = tokenizer_sample(cfg(40, [3, 1, 1]), units, scanned)
    assert cut == [False] * len(got)
    # 40 slots at 3:1:1 -> 24, 8, 8; source 2 has 5: its 3 left over go 3:1 -> 2.25, 0.75 -> 2, 1
    # (largest remainder).
    counts = [sum(t.startswith(p) for t in got) for p in "abc"]
    assert counts == [26, 9, 5] and len(got) == 40
    assert got == sorted(
        got, key=lambda t: dict((text, key) for s in texts.values() for key, text in s)[t]
    )
    # Each source's share is its bottom-k: the texts with the smallest hashes.
    assert {t for t in got if t.startswith("a")} == {f"a{i}" for i in range(26)}


WEB_EXAMPLE = ROOT / "configs" / "prepare_web_example.yaml"


def write_web_corpus(root, n_docs=3000, n_pairs=1500, seed=0):
    """The layout configs/prepare_web_example.yaml reads, under `root`: web documents as one
    jsonl.zst (with some exact duplicates and a malformed line) and pairs as one tsv.gz."""
    import gzip

    import zstandard

    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghiklmnoprstuvwyz") for _ in range(rng.randint(2, 9)))
        for _ in range(400)
    ]
    docs = [
        " ".join(rng.choice(words) for _ in range(rng.randint(5, 120))) + f" {i}."
        for i in range(n_docs)
    ]
    docs += docs[:100]
    lines = [
        json.dumps({"text": d, "url": f"https://example.org/{i}"}) for i, d in enumerate(docs)
    ] + ["{cut off"]
    (root / "data/web/docs").mkdir(parents=True)
    (root / "data/web/pairs").mkdir(parents=True)
    (root / "data/web/docs/part-0.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress("\n".join(lines).encode())
    )
    pairs = "".join(f"{en}\t{de}\n" for en, de in synthetic_pairs(n_pairs, seed=seed))
    (root / "data/web/pairs/en-de.tsv.gz").write_bytes(gzip.compress(pairs.encode()))


def run_web_example(cwd, *overrides, ray: RayHead | None = None):
    """prepare on configs/prepare_web_example.yaml from `cwd`, whose relative paths it reads; with
    `ray`, joining that cluster."""
    env = {
        **(ray.env if ray else os.environ),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    joined = [f"ray.address={ray.address}"] if ray else []
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.prepare",
            str(WEB_EXAMPLE),
            "progress=false",
            *overrides,
            *joined,
        ],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
    )


def test_the_web_example_config_prepares_small_generated_files(tmp_path):
    """configs/prepare_web_example.yaml as written (seq_len 1024, its tokenizer and filters), on
    small files in its layout; only the Ray workers (this machine's 2) and the buckets (64
    would each drop a tail of up to 1023 tokens, all of this corpus) are changed."""
    write_web_corpus(tmp_path)
    run = run_web_example(tmp_path, "ray.num_workers=2", "shard.buckets=4")
    assert run.returncode == 0, run.stderr[-3000:]
    out = tmp_path / "data/web-prepared"
    manifest = json.loads((out / MANIFEST).read_text())
    by_source = manifest["sources"]["by_source"]
    assert (by_source["web"]["format"], by_source["pairs"]["format"]) == ("jsonl", "tsv")
    assert by_source["web"]["records"] == 3100 and by_source["web"]["malformed_not_json"] == 1
    assert by_source["pairs"]["records"] == 1500
    packed = manifest["datasets"]["packed"]
    assert (
        packed["seq_len"] == 1024 and packed["stats_by_source"]["web"]["duplicates_dropped"] == 100
    )
    assert packed["splits"]["train"]["sources"]["web"]["samples"] > 20
    blocks = read_dataset(out, "packed", "train")
    assert all(b["input_ids"].shape == (1024,) for b in blocks)
    translation = manifest["datasets"]["translation"]
    assert translation["splits"]["train"]["sources"] == {
        "web": {"samples": 0, "tokens": 0},
        "pairs": translation["splits"]["train"]["sources"]["pairs"],
    }
    assert translation["splits"]["train"]["samples"] > 1000
    # Fewer pieces than the 32,000 asked: this corpus has 400 distinct words (and German pairs).
    assert manifest["tokenizer"]["trained"] and 400 < manifest["tokenizer"]["vocab_size"] < 32000


@pytest.mark.slow
def test_a_large_compressed_file_is_scanned_in_chunks_with_the_same_shards_for_1_2_3_workers(
    tmp_path,
):
    """A jsonl.zst and a tsv.gz each larger than `unit_bytes` are cut by the driver into chunks
    that Ray tasks scan in parallel; the shards and the tokenizer are byte for byte those of
    reading each file whole in one task (a `unit_bytes` above the file sizes: the code path of
    before the split), with 1, 2 and 3 workers."""
    write_web_corpus(tmp_path, n_docs=1500, n_pairs=1500)
    small = [
        "seq_len=64",
        "tokenizer.vocab_size=600",
        "tokenizer.sample_texts=2000",
        "shard.buckets=3",
        "shard.max_samples=40",
        "split.valid=0.05",
        "split.test=0.05",
    ]
    runs = {"whole": ("unit_bytes=1073741824", "ray.num_workers=2")}
    runs.update(
        {workers: ("unit_bytes=16384", f"ray.num_workers={workers}") for workers in (1, 2, 3)}
    )
    outs = {}
    # The four prepares join one Ray cluster whose workers read the config's relative paths from
    # tmp_path.
    head = RayHead(num_cpus=3, cwd=tmp_path)
    try:
        for name, settings in runs.items():
            outs[name] = tmp_path / f"out-{name}"
            run = run_web_example(tmp_path, f"output_dir={outs[name]}", *small, *settings, ray=head)
            assert run.returncode == 0, run.stderr[-3000:]
    finally:
        head.stop()
    manifests = {name: json.loads((out / MANIFEST).read_text()) for name, out in outs.items()}
    assert manifests["whole"]["sources"]["units"] == 2
    for workers in (1, 2, 3):
        assert manifests[workers]["sources"]["by_source"]["web"]["units"] > 10
        assert manifests[workers]["sources"]["by_source"]["pairs"]["units"] > 3
    files = sorted(p.relative_to(outs["whole"]) for p in outs["whole"].rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".tar"]) > 10
    for name in (1, 2, 3):
        assert files == sorted(
            p.relative_to(outs[name]) for p in outs[name].rglob("*") if p.is_file()
        )
        for relative in files:
            if relative.suffix in (".tar", ".model"):
                assert (outs[name] / relative).read_bytes() == (
                    outs["whole"] / relative
                ).read_bytes(), (name, relative)
        assert manifests[name]["datasets"] == manifests["whole"]["datasets"]
        kept = ("units", "by_source")
        assert {k: v for k, v in manifests[name]["sources"].items() if k not in kept} == {
            k: v for k, v in manifests["whole"]["sources"].items() if k not in kept
        }


def test_prepare_refuses_in_one_line_when_the_scratch_space_is_short(tmp_path):
    """A (sparse) text file larger than the free space of the file system the output goes on:
    refused before anything is read or written, in one line that says what _work needs and
    what is free."""
    stats = os.statvfs(tmp_path)
    free = stats.f_bavail * stats.f_frsize
    big = tmp_path / "big.txt"
    with open(big, "wb") as fh:
        fh.truncate(free + (1 << 30))  # takes no blocks: a hole
    out = tmp_path / "out"
    run = run_prepare(prepare_args(big, out, **{"source.format": "text", "tasks": "[causal_lm]"}))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert (
        line.startswith(f"error: {out}.partial-*/_work needs about ")
        and f"but {tmp_path} has " in line
    )
    assert "free" in line and not out.exists() and not list(tmp_path.glob("out.partial*"))
    assert not (tmp_path / "out.lock").exists()


def test_the_scratch_estimate_counts_each_text_once_per_bucket_family(tmp_path, monkeypatch):
    """Monolingual web text goes to the packed buckets only; the pairs to the packed buckets (both
    sides) and the translation buckets; a .zst counts at its declared decompressed size, a .gz
    at its trailer's."""
    import gzip

    import zstandard

    from common.configure import load_config
    from common.storage import byte_size
    from pipeline.prepare.checks import scratch_need
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.sources import expand_paths, source_list

    write_web_corpus(tmp_path, n_docs=200, n_pairs=100)
    docs, pairs = (
        tmp_path / "data/web/docs/part-0.jsonl.zst",
        tmp_path / "data/web/pairs/en-de.tsv.gz",
    )
    web_bytes = len(zstandard.ZstdDecompressor().decompress(docs.read_bytes()))
    pair_bytes = len(gzip.decompress(pairs.read_bytes()))
    monkeypatch.chdir(tmp_path)  # the example's paths are relative
    for tasks, expected, twice in (
        ("[causal_lm, mlm, translation]", web_bytes + 2 * pair_bytes, True),
        ("[causal_lm]", web_bytes + pair_bytes, False),
        ("[translation]", pair_bytes, False),
    ):
        cfg = load_config(PrepareConfig, WEB_EXAMPLE, [f"tasks={tasks}"])
        need, why = scratch_need(cfg, [expand_paths(source) for source in source_list(cfg)])
        assert need == expected, tasks
        assert why == f"{byte_size(web_bytes + pair_bytes)} of decompressed input" + (
            ", pairs twice: as texts and as pairs" if twice else ""
        )


def test_long_documents_reach_the_tokenizer_in_pieces(tmp_path, ray_head):
    """Documents over SentencePiece's `max_sentence_length` bytes (it skips such a text whole) are
    cut into pieces for the tokenizer's sample: words that only long documents hold become pieces
    of the vocabulary, and the manifest says how much of the sample came from long texts."""
    from pipeline.prepare.train_tokenizer import sample_pieces

    rng = random.Random(0)
    short_words = ["".join(rng.choice("abcdefgh") for _ in range(5)) for _ in range(60)]
    long_words = ["".join(rng.choice("pqrstuvw") for _ in range(7)) for _ in range(12)]
    docs = [" ".join(rng.choice(short_words) for _ in range(40)) for _ in range(600)]
    # 30 documents of 12,000-15,000 characters, in words that no short document has
    docs += [
        " ".join(rng.choice(long_words) for _ in range(rng.randint(1500, 1875))) for _ in range(30)
    ]
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(docs) + "\n")
    out = tmp_path / "out"
    run = run_prepare(
        prepare_args(
            corpus,
            out,
            **{
                "source.format": "text",
                "tasks": "[causal_lm]",
                "source.max_doc_chars": 20000,
                "tokenizer.vocab_size": 300,
            },
        ),
        ray=ray_head,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = json.loads((out / MANIFEST).read_text())
    sample = manifest["tokenizer"]["sample"]
    long_train = manifest["sources"]["tokenizer_texts_cut"]
    assert 20 <= long_train <= 30  # the long documents of the train split
    assert sample["pieces_of_long_texts"] >= 3 * long_train  # each 12-15 kB in 4,192-byte pieces
    assert 0.5 < sample["bytes_of_long_texts"] / sample["bytes"] < 0.8
    tokenizer = load_tokenizer(out / manifest["tokenizer"]["file"])
    for word in long_words:
        assert len(tokenizer.encode(word)) == 1, word  # learnt: "▁word" is one piece
    # The cut itself: within the limit, at spaces, every character kept once.
    text = "ab " * 5000 + "é" * 3000
    pieces = sample_pieces(text, 4192)
    assert all(len(piece.encode()) <= 4192 for piece in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace(" ", "")
    assert all(piece.endswith("ab") for piece in pieces[:3])
    assert sample_pieces("short text", 4192) == ["short text"]


def test_prepare_says_a_workers_memory_first_and_refuses_more_than_a_worker_has(
    tiny_corpus, tmp_path, ray_head
):
    """Before any work, prepare says how much memory one Ray worker will need at its peak, from
    the plan; at the end, what the workers' peaks were. A local Ray whose workers would each
    have less than that is refused in one line, before anything is written."""
    import psutil

    out = tmp_path / "out"
    run = run_prepare(prepare_args(tiny_corpus, out, progress="true"), ray=ray_head)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stderr.splitlines()
    (said,) = [line for line in lines if line.startswith("prepare: each Ray worker needs about ")]
    assert "at its peak (encode: ~" in said and "de-duplication set" in said
    assert said.endswith(f"not checked here: the workers run on the nodes of {ray_head.address}")
    (work,) = [line for line in lines if re.match(r"prepare: \d+ files in \d+ units", line)]
    assert lines.index(said) < lines.index(work)  # said before the scan starts
    (peaks,) = [line for line in lines if line.startswith("prepare: peak memory of a Ray worker")]
    scan, encode = map(float, re.findall(r"(?:scan|encode) ([\d,.]+) MiB", peaks))
    assert scan > 50 and encode > 50
    assert "memory" not in json.loads((out / MANIFEST).read_text())  # the run's, not the data's

    # Under 64 MiB a worker: less than a worker's own size, whatever the data.
    workers = psutil.virtual_memory().available // (64 << 20) + 1
    big = tmp_path / "big"
    run = run_prepare(prepare_args(tiny_corpus, big, **{"ray.num_workers": workers}))
    assert run.returncode == 2
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("error: each Ray worker needs about ") and " at its peak (" in line
    assert f"available for ray.num_workers={workers} (" in line and "lower ray.num_workers" in line
    assert not any(tmp_path.glob("big*"))
