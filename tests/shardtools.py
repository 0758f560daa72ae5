"""Tiny prepared datasets for tests: real shards written with `pipeline.shard_tar.write_shard`.

Packed samples carry their id in the first token (`FIRST_ID + id`), so a test can tell which
samples a batch holds; the rest are random non-special ids with an `</s>` now and then, as in
real packed blocks. Translation pairs carry their id in the first source token.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from pipeline.format import FORMAT_VERSION, MANIFEST, sample_key, shard_name
from pipeline.shard_tar import write_shard
from pipeline.specials import sentencepiece_specials

SP = sentencepiece_specials()  # the project's SentencePiece layout

FIRST_ID = 100  # ids below it are never sample ids, so the reserved ids stay free
VOCAB_SIZE = 4096
# tokenizer.model: a stand-in (nothing here encodes text), recorded with its own sha256, which
# training checks the file against
TOKENIZER_BYTES = b"a stand-in for the dataset's SentencePiece model"
TOKENIZER_SHA256 = hashlib.sha256(TOKENIZER_BYTES).hexdigest()


def _packed_sample(uid: int, seq_len: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    ids = rng.integers(FIRST_ID, VOCAB_SIZE, size=seq_len)
    ids[rng.random(seq_len) < 0.1] = SP.eos
    ids[0] = FIRST_ID + uid
    return {"input_ids": ids.astype(np.uint16)}


def _translation_sample(uid: int, rng: np.random.Generator) -> dict[str, np.ndarray]:
    src = rng.integers(FIRST_ID, VOCAB_SIZE, size=int(rng.integers(1, 9)))
    src[0] = FIRST_ID + uid
    tgt = rng.integers(FIRST_ID, VOCAB_SIZE, size=int(rng.integers(1, 9)))
    return {"src_ids": src.astype(np.uint16), "tgt_ids": tgt.astype(np.uint16)}


def make_dataset(
    data_dir: str | Path,
    *,
    packed: list[int] = (),
    translation: list[int] = (),
    seq_len: int = 8,
    split: str = "train",
    seed: int = 0,
) -> dict:
    """Write shards of the given sizes and a manifest; returns the manifest, whose shard records
    also carry `ids` (the sample ids in the shard) for tests."""
    data_dir = Path(data_dir)
    rng = np.random.default_rng(seed)
    datasets = {}
    uid = 0
    for dataset, sizes in (("packed", packed), ("translation", translation)):
        if not sizes:
            continue
        records = []
        for part, size in enumerate(sizes):
            rel = shard_name(dataset, split, 0, part)
            samples = [
                _packed_sample(uid + i, seq_len, rng)
                if dataset == "packed"
                else _translation_sample(uid + i, rng)
                for i in range(size)
            ]
            record = write_shard(
                data_dir / rel, [sample_key(0, uid + i) for i in range(size)], samples
            )
            record["path"] = rel
            records.append(record)
            uid += size
        datasets[dataset] = {"splits": {split: {"shards": records}}}
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / "tokenizer.model").write_bytes(TOKENIZER_BYTES)
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            "file": "tokenizer.model",
            "sha256": TOKENIZER_SHA256,
            "vocab_size": VOCAB_SIZE,
            "special_ids": [0, 1, 2, 3, 4, 5],
        },
        "datasets": datasets,
    }
    save_manifest(data_dir, manifest)
    return manifest


def save_manifest(data_dir: str | Path, manifest: dict) -> None:
    (Path(data_dir) / MANIFEST).write_text(json.dumps(manifest, indent=1))


def shard_ids(manifest: dict, dataset: str = "packed", split: str = "train") -> dict[str, set[int]]:
    """Relative shard path -> the sample ids written to it (ids are assigned in shard order)."""
    out, uid = {}, 0
    for record in manifest["datasets"][dataset]["splits"][split]["shards"]:
        out[record["path"]] = set(range(uid, uid + record["samples"]))
        uid += record["samples"]
    return out


def batch_ids(batch: dict) -> list[int]:
    """Sample ids of a batch's rows, also through MLM masking (original_ids keep the masked originals)."""
    if "src_ids" in batch:
        first = batch["src_ids"][:, 0]
    else:
        first = batch.get("original_ids", batch["input_ids"])[:, 0]
    return [int(x) - FIRST_ID for x in first]
