"""The driver's side of the curation stages (the per-record ones run in the scan,
`curate.documents`): between the scan and the encode, the corpus-wide decisions — the
near-duplicate clusters (a shuffle of band records through Ray, `curate.neardup`) and the
evaluation texts that training texts must not overlap (`curate.decontaminate`); after the
encode, the counts per source, stage, rule and split, and the sample files under `dropped/`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from collections import Counter
from pathlib import Path
from typing import Callable

import numpy as np

from common.storage import byte_size
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate import lsh
from pipeline.prepare.curate.decisions import Curation
from pipeline.prepare.curate.decontaminate import (
    EvalKeys,
    origin_name,
    read_eval_file,
)
from pipeline.prepare.curate.neardup import SketchStore, shuffle_partition
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.rss import peak_rss_mb, reset_peak_rss
from pipeline.prepare.scan import MONO, PAIRS, bucket_file
from pipeline.prepare.sources import source_list
from pipeline.prepare.units import Unit

DROPPED_DIR = "dropped"  # DATASET/dropped/SOURCE/RULE.jsonl: samples of what each rule dropped
# a near-duplicate band record is 16 bytes on disk; the shuffle holds about three copies of its
# partition's (read, sorted, grouped)
BAND_RECORD_BYTES = 16


def partitions_sized(cfg: PrepareConfig, input_bytes: int) -> PrepareConfig:
    """The config the tasks run with: `near_dedup.partitions` chosen from the input size when 0
    (the output never depends on it)."""
    near = cfg.near_dedup
    if not near.enabled or near.partitions > 0:
        return cfg
    records = near.bands * max(1, input_bytes // 200)  # a text of about 200 bytes at the least
    partitions = lsh.choose_partitions(records)
    return dataclasses.replace(cfg, near_dedup=dataclasses.replace(near, partitions=partitions))


def near_duplicates(
    cfg: PrepareConfig, n_units: int, work_dir: Path, run_tasks: Callable, log
) -> tuple[Curation, dict]:
    """The shuffle and the clusters: ids to drop, and the facts for the manifest."""
    near = cfg.near_dedup
    log(f"prepare: near-duplicates: {lsh.describe(near)}; {near.partitions} partitions")
    results = run_tasks(
        shuffle_partition,
        [(p,) for p in range(near.partitions)],
        num_workers=cfg.ray.num_workers,
        desc="near-dup shuffle",
        progress=cfg.progress,
        shared={"n_units": n_units, "work_dir": str(work_dir), "cfg": near},
    )
    edges = [r["edges"] for r in results if len(r["edges"])]
    edges = np.unique(np.concatenate(edges), axis=0) if edges else np.empty((0, 2), np.uint64)
    # a text joined only through a chain is removed only beside a kept text it is itself like
    store = SketchStore(str(work_dir))
    removed, partners = lsh.clusters(edges, store.similarity, near)
    order = np.argsort(removed)
    removed, partners = removed[order], partners[order]
    facts = {
        "parameters": lsh.describe(near),
        "candidate_pairs": sum(r["candidates"] for r in results),
        "verified_pairs": int(len(edges)),
        "removed": int(len(removed)),
    }
    log(
        f"prepare: near-duplicates: {facts['candidate_pairs']:,} candidate pairs, "
        f"{facts['verified_pairs']:,} verified, {facts['removed']:,} texts to drop; shuffle peak "
        f"{max((r['peak_rss_mb'] for r in results), default=0.0):,.0f} MiB a task"
    )
    # The sample: the removed texts of smallest salted id hash (and the copies kept in their
    # place), whose texts the encode tasks pick up as they read them.
    chosen = _sample_positions(removed, cfg.dropped_samples * len(source_list(cfg)))
    wanted = np.unique(np.concatenate((removed[chosen], partners[chosen])))
    curation = Curation(removed=removed, wanted=wanted)
    return curation, {**facts, "_sample": (removed[chosen], partners[chosen])}


def _sample_positions(removed: np.ndarray, count: int) -> np.ndarray:
    """Positions in `removed` of the `count` ids of smallest mixed hash: a sample that depends
    on the ids alone."""
    if count <= 0 or not len(removed):
        return np.empty(0, dtype=np.int64)
    with np.errstate(over="ignore"):
        keys = (removed * np.uint64(0x9E3779B97F4A7C15)) ^ (removed >> np.uint64(29))
    return np.sort(np.argsort(keys, kind="stable")[:count])


def evaluation_keys(
    cfg: PrepareConfig, n_units: int, work_dir: Path, run_tasks: Callable, log
) -> tuple[list[EvalKeys], dict]:
    """The evaluation texts' keys, in match order: valid, test, then the evaluation files."""
    deco = cfg.decontamination
    keys: list[EvalKeys] = []
    if deco.own_splits:
        jobs = [
            (split, bucket) for split in ("valid", "test") for bucket in range(cfg.shard.buckets)
        ]
        parts = run_tasks(
            split_keys,
            jobs,
            num_workers=cfg.ray.num_workers,
            desc="decontamination keys",
            progress=cfg.progress,
            shared={"n_units": n_units, "work_dir": str(work_dir), "ngram": deco.ngram},
        )
        for split in ("valid", "test"):
            mine = [p["keys"] for (s, _), p in zip(jobs, parts) if s == split]
            keys.append(EvalKeys.merged(mine))
    for index, spec in enumerate(deco.eval_files):
        texts = read_eval_file(spec, f"decontamination.eval_files[{index}]")
        keys.append(EvalKeys.from_texts(origin_name(spec), texts, deco.ngram))
    facts = {key.origin: {"texts": key.texts, "keys": int(len(key.grams))} for key in keys}
    log(
        "prepare: decontamination against "
        + ", ".join(f"{k.origin} ({k.texts:,} texts)" for k in keys)
        + f"; {deco.ngram}-grams, {byte_size(sum(k.grams.nbytes for k in keys))}"
    )
    return keys, facts


def split_keys(split: str, bucket: int, n_units: int, work_dir: str, ngram: int) -> dict:
    """The keys of one (split, bucket)'s texts, both families (monolingual texts and pairs), as
    `keys`, beside the task's CPU seconds and memory for the benchmarks."""
    reset_peak_rss()
    cpu = time.process_time()
    texts: list[str] = []
    for unit in range(n_units):
        for family in (MONO, PAIRS):
            path = bucket_file(work_dir, unit, family, split, bucket)
            if path.is_file():
                for line in path.read_text(encoding="utf-8").splitlines():
                    texts.extend(line.split("\t") if family == PAIRS else [line])
    return {
        "keys": EvalKeys.from_texts(split, texts, ngram),
        "peak_rss_mb": peak_rss_mb(),
        "task_cpu_s": time.process_time() - cpu,
        "worker_pid": os.getpid(),
    }


# ---------------------------------------------------------------- counts and samples


def scan_curation(
    cfg: PrepareConfig, units: list[Unit], scanned: list[dict]
) -> tuple[list[Tally], list[dict]]:
    """The scan's curation counts and samples, and the detected languages, per source."""
    sources = source_list(cfg)
    tallies = [Tally(cfg.dropped_samples) for _ in sources]
    languages: list[Counter] = [Counter() for _ in sources]
    for unit, result in zip(units, scanned):
        tallies[unit.source].merge(result["curation"])
        for side, code, n in result["languages"]:
            languages[unit.source][(side, code)] += n
    nested = []
    for counts in languages:
        by_side: dict = {}
        for (side, code), n in sorted(counts.items()):
            by_side.setdefault(side, {})[code] = n
        nested.append(by_side)
    return tallies, nested


_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def curation_record(
    cfg: PrepareConfig,
    scan_tallies: list[Tally],
    encode_tallies: list[Tally],
    languages: list[dict],
    near: dict | None,
    near_found: dict[int, list[str]],
    unit_sources: list[int],
    eval_facts: dict | None,
    staging: Path,
) -> dict:
    """The manifest's `curation` section; writes the sample files into `staging/dropped/`."""
    sources = source_list(cfg)
    record: dict = {"by_source": {}, "languages": {}, "sample_files": []}
    for index, source in enumerate(sources):
        tally = Tally(cfg.dropped_samples)
        tally.merge(scan_tallies[index])
        tally.merge(encode_tallies[index])
        record["by_source"][source.name] = tally.nested()
        if languages[index]:
            record["languages"][source.name] = languages[index]
        for rule in tally.rules():
            samples = tally.samples(rule)
            if samples:
                record["sample_files"].append(_write(staging, source.name, rule, samples))
    if near is not None:
        sample = near.pop("_sample")
        record["near_dedup"] = near
        pairs = _near_samples(cfg, sample, near_found, unit_sources)
        for name, samples in pairs.items():
            record["sample_files"].append(
                _write(staging, name, "near_dedup.near_duplicate", samples)
            )
    if eval_facts is not None:
        record["decontamination"] = eval_facts
    record["sample_files"].sort()
    return record


def _near_samples(
    cfg: PrepareConfig, sample: tuple, found: dict[int, list[str]], unit_sources: list[int]
) -> dict:
    """Per source, up to `dropped_samples` removed texts beside the copy kept in their place."""
    names = [source.name for source in source_list(cfg)]
    out: dict[str, list[dict]] = {}
    for removed, kept in zip(*(part.tolist() for part in sample)):
        name = names[unit_sources[removed >> 32]]
        if removed not in found or len(out.setdefault(name, [])) >= cfg.dropped_samples:
            continue
        split, text = found[removed]
        out[name].append({"split": split, "text": text, "kept": found.get(kept, ["", ""])[1]})
    return {name: samples for name, samples in out.items() if samples}


def _write(staging: Path, source: str, rule: str, samples: list[dict]) -> str:
    relative = f"{DROPPED_DIR}/{_SAFE.sub('_', source)}/{_SAFE.sub('_', rule)}.jsonl"
    path = staging / relative
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as fh:
        for sample in samples:
            fh.write(json.dumps(sample, ensure_ascii=False) + "\n")
    return relative
