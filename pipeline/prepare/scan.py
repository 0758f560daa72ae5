"""The scan, stage 1 of `pipeline.prepare` as one Ray task runs it: a unit's texts read, each
given its split and hash bucket and appended to that bucket's file under the run's `_work`; the
tokenizer's bottom-k sample kept. Pure functions of their arguments.

The design and its reasons: docs/design.md#pipelinepreparescanpy-and-encodepy.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import numpy as np

from pipeline.format import shard_sets
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate.documents import DocumentStages
from pipeline.prepare.curate.neardup import Signer
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.readers import chunk_text, is_parallel, read_unit
from pipeline.prepare.rss import cpu_noted, peak_rss_mb, reset_peak_rss
from pipeline.prepare.sources import source_list
from pipeline.prepare.train_tokenizer import BottomKSample, sample_pieces
from pipeline.prepare.units import Unit, clean_text, text_hash

MONO, PAIRS = "mono", "pairs"  # the bucket files' two families: texts, and source TAB target


def assign_split(key: int, valid: float, test: float) -> str:
    """Map a 64-bit hash to a split: [0, valid) valid, [valid, valid+test) test, the rest train."""
    position = key / 2**64
    if position < valid:
        return "valid"
    if position < valid + test:
        return "test"
    return "train"


def bucket_file(
    work_dir: str | Path, unit_index: int, family: str, split: str, bucket: int
) -> Path:
    return Path(work_dir) / f"u{unit_index:06d}" / f"{family}-{split}-{bucket:04d}.txt"


def ids_file(bucket_path: Path) -> Path:
    """Beside a bucket file, when near-duplicates are removed: each line's document id (uint64,
    `document_id`), in line order."""
    return bucket_path.with_suffix(".ids")


def document_id(unit_index: int, number: int) -> int:
    """A monolingual text's id: its unit and its place there, so that ids sort in corpus order
    (the order that decides which of two copies is kept), whatever the workers."""
    return (unit_index << 32) | number


class _BucketWriters:
    """Lazily opened append-only bucket files of one unit (and their ids files, `with_ids`)."""

    def __init__(self, work_dir: str | Path, unit_index: int, with_ids: bool = False):
        self.work_dir, self.unit_index, self.with_ids = work_dir, unit_index, with_ids
        self.handles: dict[tuple[str, str, int], object] = {}
        self.ids: dict[tuple[str, str, int], list[int]] = {}

    def write(self, family: str, split: str, bucket: int, record: str, doc: int = -1) -> None:
        key = (family, split, bucket)
        if key not in self.handles:
            path = bucket_file(self.work_dir, self.unit_index, family, split, bucket)
            path.parent.mkdir(parents=True, exist_ok=True)
            self.handles[key] = open(path, "w", encoding="utf-8", newline="\n")
        self.handles[key].write(record + "\n")
        if self.with_ids and family == MONO:
            self.ids.setdefault(key, []).append(doc)

    def close(self) -> None:
        for handle in self.handles.values():
            handle.close()
        for key, ids in self.ids.items():
            path = ids_file(bucket_file(self.work_dir, self.unit_index, *key))
            np.asarray(ids, dtype=np.uint64).tofile(path)


def scan_unit(unit_index: int, unit: Unit, cfg: PrepareConfig, work_dir: str) -> dict:
    """Stage 1 for one unit: returns its statistics and its tokenizer-sample candidates."""
    stats: Counter = Counter()
    sample = BottomKSample(cfg.tokenizer.sample_texts)
    # A given tokenizer (tokenizer.path) needs no training sample: no hashing, no memory for it.
    sampling = not cfg.tokenizer.path and cfg.tokenizer.sample_texts > 0
    source_cfg = source_list(cfg)[unit.source]
    want_mono = "packed" in shard_sets(cfg.tasks)
    want_pairs = "translation" in cfg.tasks
    parallel = is_parallel(source_cfg)
    salt, buckets = cfg.split.salt, cfg.shard.buckets
    tally = Tally(cfg.dropped_samples)
    stages = DocumentStages(source_cfg, tally)
    signer = (
        Signer(cfg.near_dedup, work_dir, unit_index, tally)
        if want_mono and cfg.near_dedup.enabled
        else None
    )
    signing = signer is not None and source_cfg.near_dedup
    writers = _BucketWriters(work_dir, unit_index, with_ids=signer is not None)
    number = 0  # the unit's monolingual texts so far: their ids
    try:
        for source, target, raw_source, raw_target in read_unit(unit, source_cfg, stats, raw=True):
            source_key = text_hash(source, salt)
            split = assign_split(source_key, cfg.split.valid, cfg.split.test)
            stats[f"split_{split}"] += 1
            if stages.active:
                kept = stages.apply(
                    [raw_source] if target is None else [raw_source, raw_target], split
                )
                if kept is None:
                    continue
                source = clean_text(kept[0])
                target = clean_text(kept[1]) if target is not None else None
                if not source or (parallel and not target):
                    stats["empty_after_curation"] += 1
                    continue
            if want_pairs and parallel:
                pair_bucket = text_hash(source + "\t" + target, salt) % buckets
                writers.write(PAIRS, split, pair_bucket, source + "\t" + target)
            texts = [source, target] if parallel else [source]
            for text in texts:
                pieces = chunk_text(text, source_cfg.max_doc_chars)
                stats["long_texts_cut"] += len(pieces) > 1
                for piece in pieces:
                    if sampling and split == "train":
                        parts = sample_pieces(piece, cfg.tokenizer.max_sentence_length)
                        stats["tokenizer_texts_cut"] += len(parts) > 1
                        for part in parts:
                            sample.add(text_hash(part, salt + "tok"), part, len(parts) > 1)
                    if want_mono:
                        key = source_key if piece is source else text_hash(piece, salt)
                        doc = document_id(unit_index, number)
                        number += 1
                        writers.write(MONO, split, key % buckets, piece, doc)
                        if signing:
                            signer.add(doc, piece, split)
        if signer is not None:
            signer.finish()
    finally:
        writers.close()
    return {
        "stats": dict(stats),
        "curation": tally.to_dict(),
        "languages": [[side, code, n] for (side, code), n in sorted(stages.languages.items())],
        # seconds per curation stage, for the benchmarks (not the manifest)
        "stage_seconds": {
            **stages.seconds,
            **({"near_dedup.sign": signer.seconds} if signer is not None else {}),
        },
        "sample": sample.items(),
        "sample_cut": sample.cut_keys(),
        "peak_rss_mb": peak_rss_mb(),
    }


def scan_units(batch: list[tuple[int, Unit]], cfg: PrepareConfig, work_dir: str) -> list[dict]:
    """`scan_unit` for a run of units in one Ray task: catalogs are many small files, and a
    task costs tens of milliseconds of scheduling. Each unit keeps its own bucket files, so the
    output does not depend on how units are batched."""
    reset_peak_rss()
    cpu = time.process_time()
    results = []
    samples: dict[int, BottomKSample] = {}
    for unit_index, unit in batch:
        result = scan_unit(unit_index, unit, cfg, work_dir)
        # Merged as they come (bottom-k merging is order-free), so the task holds one sample of
        # `sample_texts` texts per source, not one per unit: memory bounded by the sample size.
        samples.setdefault(unit.source, BottomKSample(cfg.tokenizer.sample_texts)).merge(
            result.pop("sample"), result.pop("sample_cut")
        )
        result["sample"], result["sample_cut"] = [], []
        results.append(result)
    last = {unit.source: position for position, (_, unit) in enumerate(batch)}
    for source, position in last.items():
        results[position]["sample"] = samples[source].items()
        results[position]["sample_cut"] = samples[source].cut_keys()
    for result in results:
        result["peak_rss_mb"] = peak_rss_mb()
    return cpu_noted(results, cpu)
