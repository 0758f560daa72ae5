"""The work one Ray task does during `pipeline.prepare`, as pure functions of their arguments.

Two map stages around a hash partition (a MapReduce shuffle), so that de-duplication is
global and the output never depends on how many workers ran it:

1. `scan_unit`: read one work unit, assign each text its split (hash of the normalized
   source) and its bucket (hash of the normalized text), append it to that bucket's file,
   and keep this unit's bottom-k tokenizer sample.
2. `encode_bucket`: read one (split, bucket) from every unit in unit order, drop exact
   duplicates, tokenize, then pack blocks (`packed`) or filter pairs (`translation`), and
   write WebDataset shards.

Nothing here imports Ray; `pipeline.ray_runner` runs these functions as tasks.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Iterator

import numpy as np

from pipeline.config import PrepareConfig
from pipeline.format import EOS_ID, sample_key, shard_name, token_dtype, write_shard
from pipeline.sources import Unit, chunk_text, is_parallel, read_unit, text_hash
from pipeline.tokenizer import BottomKSample, processor_from_bytes

MONO, PAIRS = "mono", "pairs"
ENCODE_CHUNK = 2048  # texts per SentencePiece batch call


def assign_split(key: int, valid: float, test: float) -> str:
    """Map a 64-bit hash to a split: [0, valid) valid, [valid, valid+test) test, the rest train."""
    position = key / 2**64
    if position < valid:
        return "valid"
    if position < valid + test:
        return "test"
    return "train"


def bucket_file(work_dir: str | Path, unit_index: int, family: str, split: str, bucket: int) -> Path:
    return Path(work_dir) / f"u{unit_index:06d}" / f"{family}-{split}-{bucket:04d}.jsonl"


class _BucketWriters:
    """Lazily opened append-only bucket files of one unit."""

    def __init__(self, work_dir: str | Path, unit_index: int):
        self.work_dir, self.unit_index = work_dir, unit_index
        self.handles: dict[tuple[str, str, int], object] = {}

    def write(self, family: str, split: str, bucket: int, record: list) -> None:
        key = (family, split, bucket)
        if key not in self.handles:
            path = bucket_file(self.work_dir, self.unit_index, family, split, bucket)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handles[key] = open(path, "w", encoding="utf-8")
        self.handles[key].write(json.dumps(record, ensure_ascii=False) + "\n")

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()


def scan_unit(unit_index: int, unit: Unit, cfg: PrepareConfig, work_dir: str) -> dict:
    """Stage 1 for one unit: returns its statistics and its tokenizer-sample candidates."""
    stats: Counter = Counter()
    sample = BottomKSample(cfg.tokenizer.sample_texts)
    want_mono = any(task in cfg.tasks for task in ("causal_lm", "mlm"))
    want_pairs = "translation" in cfg.tasks
    parallel = is_parallel(cfg.source)
    salt, buckets = cfg.split.salt, cfg.shard.buckets
    writers = _BucketWriters(work_dir, unit_index)
    try:
        for source, target in read_unit(unit, cfg.source, stats):
            source_key = text_hash(source, salt)
            split = assign_split(source_key, cfg.split.valid, cfg.split.test)
            stats[f"split_{split}"] += 1
            if want_pairs and parallel:
                pair_bucket = text_hash(source + "\t" + target, salt) % buckets
                writers.write(PAIRS, split, pair_bucket, [source, target])
            texts = [source, target] if parallel else [source]
            for text in texts:
                pieces = chunk_text(text, cfg.source.max_doc_chars)
                stats["long_texts_cut"] += len(pieces) > 1
                for piece in pieces:
                    if split == "train":
                        sample.add(text_hash(piece, salt + "tok"), piece)
                    if want_mono:
                        key = source_key if piece is source else text_hash(piece, salt)
                        writers.write(MONO, split, key % buckets, [piece])
    finally:
        writers.close()
    return {"stats": dict(stats), "sample": sample.items()}


def _bucket_records(work_dir: str, n_units: int, family: str, split: str, bucket: int) -> Iterator[list]:
    for unit_index in range(n_units):
        path = bucket_file(work_dir, unit_index, family, split, bucket)
        if path.is_file():
            with open(path, encoding="utf-8") as fh:
                for line in fh:
                    yield json.loads(line)


def _unique(records: Iterator[list], stats: Counter) -> list[tuple]:
    seen: set[tuple] = set()
    unique = []
    for record in records:
        record = tuple(record)
        if record in seen:
            stats["duplicates_dropped"] += 1
            continue
        seen.add(record)
        unique.append(record)
    return unique


def _encode(processor, texts: list[str]) -> list[list[int]]:
    ids: list[list[int]] = []
    for start in range(0, len(texts), ENCODE_CHUNK):
        ids.extend(processor.encode(texts[start : start + ENCODE_CHUNK]))
    return ids


def _write_shards(out_dir: str, dataset: str, split: str, bucket: int, samples: list[dict], max_samples: int) -> list[dict]:
    records = []
    for part, start in enumerate(range(0, len(samples), max_samples)):
        chunk = samples[start : start + max_samples]
        relative = shard_name(dataset, split, bucket, part)
        keys = [sample_key(bucket, start + i) for i in range(len(chunk))]
        record = write_shard(Path(out_dir) / relative, keys, chunk)
        record["path"] = relative
        records.append(record)
    return records


def encode_bucket(
    dataset: str, split: str, bucket: int, n_units: int, work_dir: str, out_dir: str, tokenizer_model: bytes, cfg: PrepareConfig
) -> dict:
    """Stage 2 for one (dataset, split, bucket): returns its shard records and statistics."""
    stats: Counter = Counter()
    processor = processor_from_bytes(tokenizer_model)
    dtype = token_dtype(processor.get_piece_size())
    if dataset == "packed":
        texts = [record[0] for record in _unique(_bucket_records(work_dir, n_units, MONO, split, bucket), stats)]
        samples = _pack(_encode(processor, texts), cfg.seq_len, dtype, stats)
        stats["documents"] += len(texts)
    else:
        pairs = _unique(_bucket_records(work_dir, n_units, PAIRS, split, bucket), stats)
        samples = _filter_pairs(pairs, processor, cfg, dtype, stats)
    shards = _write_shards(out_dir, dataset, split, bucket, samples, cfg.shard.max_samples)
    return {"dataset": dataset, "split": split, "bucket": bucket, "shards": shards, "stats": dict(stats)}


def _pack(documents: list[list[int]], seq_len: int, dtype: np.dtype, stats: Counter) -> list[dict]:
    """Documents joined with </s> and cut into blocks of exactly `seq_len` tokens; the short tail is dropped and counted."""
    stream = np.fromiter((t for doc in documents for t in (*doc, EOS_ID)), dtype=np.int64)
    n_blocks = len(stream) // seq_len
    stats["tokens"] += len(stream)
    stats["tail_tokens_dropped"] += len(stream) - n_blocks * seq_len
    blocks = stream[: n_blocks * seq_len].reshape(n_blocks, seq_len).astype(dtype)
    return [{"input_ids": block, "doc_starts": doc_starts(block)} for block in blocks]


def doc_starts(block: np.ndarray) -> np.ndarray:
    """The in-block positions where a document (or the rest of one) starts: 0, then each position after an </s>."""
    after_eos = np.flatnonzero(block[:-1] == EOS_ID) + 1
    return np.concatenate(([0], after_eos)).astype(block.dtype)


def _filter_pairs(pairs: list[tuple], processor, cfg: PrepareConfig, dtype: np.dtype, stats: Counter) -> list[dict]:
    limits = cfg.translation
    sources = _encode(processor, [p[0] for p in pairs])
    targets = _encode(processor, [p[1] for p in pairs])
    if limits.reverse:
        sources, targets = targets, sources
    samples = []
    for src, tgt in zip(sources, targets):
        shorter, longer = sorted((len(src), len(tgt)))
        if shorter < limits.min_tokens or longer > limits.max_tokens:
            stats["pairs_filtered_length"] += 1
            continue
        if longer > limits.max_ratio * shorter:
            stats["pairs_filtered_ratio"] += 1
            continue
        stats["pairs"] += 1
        stats["tokens"] += len(src) + len(tgt)
        samples.append({"src_ids": np.asarray(src, dtype=dtype), "tgt_ids": np.asarray(tgt, dtype=dtype)})
    return samples
