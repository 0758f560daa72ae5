"""`pipeline.prepare` with a real local Ray, and `pipeline.validate`."""

import json
import subprocess
import sys

import numpy as np
import webdataset as wds

from pipeline.format import MANIFEST, decode_array, file_sha256
from pipeline.sources import normalize_key
from pipeline.tokenizer import load_tokenizer

from conftest import ROOT, prepare_args, run_prepare, synthetic_pairs


def read_dataset(data_dir, name, split):
    manifest = json.loads((data_dir / MANIFEST).read_text())
    samples = []
    for shard in manifest["datasets"][name]["splits"][split]["shards"]:
        for sample in wds.WebDataset(str(data_dir / shard["path"]), shardshuffle=False, empty_check=False):
            samples.append({k[:-4]: decode_array(v) for k, v in sample.items() if k.endswith(".npy")})
    return samples


def test_shards_identical_with_1_and_2_ray_workers(tiny_corpus, tiny_dataset, tmp_path):
    one = tmp_path / "one"
    run = run_prepare(prepare_args(tiny_corpus, one, **{"ray.num_workers": 1}))
    assert run.returncode == 0, run.stderr[-2000:]
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tiny_dataset) for p in tiny_dataset.rglob("*") if p.is_file())
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
            assert sum(int(a.size) for s in samples for a in s.values()) == entry["tokens"]
            for shard in entry["shards"]:
                assert shard["sha256"] == file_sha256(tiny_dataset / shard["path"])
                assert shard["bytes"] == (tiny_dataset / shard["path"]).stat().st_size
    # 630 input lines of which 30 are exact duplicates.
    assert manifest["sources"]["records"] == 630
    assert manifest["datasets"]["translation"]["stats"]["duplicates_dropped"] == 30
    translation = manifest["datasets"]["translation"]
    kept = sum(e["samples"] for e in translation["splits"].values())
    filtered = translation["stats"].get("pairs_filtered_length", 0) + translation["stats"].get("pairs_filtered_ratio", 0)
    assert kept + filtered == 600
    assert all(s["samples"] <= 40 for e in translation["splits"].values() for s in e["shards"])


def test_packed_blocks_are_documents_joined_by_eos(tiny_dataset):
    sp = load_tokenizer(tiny_dataset / "tokenizer.model")
    manifest = json.loads((tiny_dataset / MANIFEST).read_text())
    vocabulary = {w for pair in synthetic_pairs(600) for text in pair for w in text.split()}
    by_bucket = {}
    for shard in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        bucket = shard["path"].split("/")[-1].split("-")[0]
        for sample in wds.WebDataset(str(tiny_dataset / shard["path"]), shardshuffle=False, empty_check=False):
            by_bucket.setdefault(bucket, []).append(decode_array(sample["input_ids.npy"]))
    assert len(by_bucket) == 3
    for blocks in by_bucket.values():
        assert all(b.shape == (32,) for b in blocks)
        stream = np.concatenate(blocks).astype(np.int64)
        # A bucket's blocks start at a document start; the piece after the last </s> is a cut tail.
        docs = [sp.decode(piece.tolist()) for piece in np.split(stream, np.where(stream == 3)[0] + 1)[:-1]]
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
    ok = subprocess.run([sys.executable, "-m", "pipeline.validate", str(tiny_dataset)], cwd=ROOT, capture_output=True, text=True)
    assert ok.returncode == 0 and "0 problem(s)" in ok.stdout
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(tiny_dataset, broken)
    shard = next(broken.rglob("*.tar"))
    shard.write_bytes(shard.read_bytes()[:700])
    bad = subprocess.run([sys.executable, "-m", "pipeline.validate", str(broken)], cwd=ROOT, capture_output=True, text=True)
    assert bad.returncode == 1 and "FAIL" in bad.stdout and shard.name in bad.stdout


def test_existing_dataset_is_not_overwritten_and_failures_leave_nothing_complete(tiny_corpus, tiny_dataset, tmp_path):
    before = (tiny_dataset / MANIFEST).read_bytes()
    run = run_prepare(prepare_args(tiny_corpus, tiny_dataset))
    assert run.returncode == 2 and "overwrite=true" in run.stderr
    assert (tiny_dataset / MANIFEST).read_bytes() == before
    # A failure mid-way (a parallel task needs pairs; text has none) leaves no dataset behind.
    text = tmp_path / "mono.txt"
    text.write_text("just some text\n")
    out = tmp_path / "never"
    run = run_prepare(prepare_args(text, out, **{"source.format": "text"}))
    assert run.returncode == 2 and "translation needs a parallel source" in run.stderr
    assert not (out / MANIFEST).exists()


def test_non_utf8_input_is_replaced_and_counted(tmp_path):
    corpus = tmp_path / "bad.tsv"
    lines = [f"{en}\t{de}\n".encode() for en, de in synthetic_pairs(200)]
    lines[5] = b"caf\xe9 \xff\tKaffee\n"
    corpus.write_bytes(b"".join(lines))
    out = tmp_path / "out"
    run = run_prepare(prepare_args(corpus, out, **{"tasks": "[translation]", "ray.num_workers": 1}))
    assert run.returncode == 0, run.stderr[-2000:]
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["sources"]["bad_bytes_replaced"] == 2
    assert list(manifest["datasets"]) == ["translation"]
