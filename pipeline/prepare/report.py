"""What a prepare reports: the scan's and the encode's statistics merged over their tasks, the
manifest's `sources` and `datasets` sections made of them, and the summary printed at the end.
"""

from __future__ import annotations

from collections import Counter

from common.configure import config_from_dict
from pipeline.format import DATASET_FOR_TASK, FIELDS, SPLITS, TASKS, shard_sets
from pipeline.inspect import curation_table
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.readers import describe_skipped
from pipeline.prepare.sources import source_list
from pipeline.prepare.units import Unit


def merge_stats(results: list[dict]) -> dict:
    """The sum of the results' `stats` counters, its keys sorted."""
    total: Counter = Counter()
    for result in results:
        total.update(result["stats"])
    return dict(sorted(total.items()))


def sources_entry(
    cfg: PrepareConfig, files: list[list[str]], units: list[Unit], by_source: list[dict]
) -> dict:
    """The manifest's `sources`: the files and units read and the scan's statistics, in all and
    per source (`by_source`: each source's merged statistics)."""
    return {
        "files": sum(map(len, files)),
        "units": len(units),
        **merge_stats([{"stats": stats} for stats in by_source]),
        "by_source": {
            source.name: {
                "format": source.format,
                "files": len(files[index]),
                "units": sum(unit.source == index for unit in units),
                **by_source[index],
            }
            for index, source in enumerate(source_list(cfg))
        },
    }


def encode_curation(cfg: PrepareConfig, encoded: list[dict]) -> tuple[list[Tally], dict]:
    """What the encode tasks dropped, merged per source, and the near-duplicates' texts they
    found for the samples of that stage (`curate.decisions.NearDuplicates.found`)."""
    sources = source_list(cfg)
    encode_tallies = [Tally(cfg.dropped_samples) for _ in sources]
    near_found: dict = {}
    for result in encoded:
        for index, source in enumerate(sources):
            encode_tallies[index].merge(result["curation"][source.name])
        near_found.update(result.get("near_found", {}))
    return encode_tallies, near_found


def dataset_entries(cfg: PrepareConfig, encoded: list[dict]) -> dict:
    """The manifest's `datasets`: each dataset's tasks, fields and statistics (in all and per
    source) and, split by split, its samples, tokens and shards; `encoded`: the encode tasks'
    results in (dataset, split, bucket) order, as shards are listed."""
    sources = source_list(cfg)
    entries = {}
    for name in sorted(shard_sets(cfg.tasks)):
        results = [r for r in encoded if r["dataset"] == name]
        entry = {
            "tasks": [k for k in TASKS if DATASET_FOR_TASK[k] == name],
            "fields": list(FIELDS[name]),
            "splits": {},
            "stats": merge_stats(results),
            "stats_by_source": {
                source.name: merge_stats(
                    [{"stats": r["source_stats"][source.name]} for r in results]
                )
                for source in sources
            },
        }
        if name == "packed":
            entry["seq_len"] = cfg.seq_len
        for split in SPLITS:
            shards = [
                shard
                for r in encoded
                if r["dataset"] == name and r["split"] == split
                for shard in r["shards"]
            ]
            entry["splits"][split] = {
                "samples": sum(s["samples"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards),
                "sources": {
                    source.name: {
                        "samples": sum(s["samples"] for s in shards if s["source"] == source.name),
                        "tokens": sum(s["tokens"] for s in shards if s["source"] == source.name),
                    }
                    for source in sources
                },
                "shards": shards,
            }
        entries[name] = entry
    return entries


def summary(manifest: dict) -> str:
    """The dataset in a few lines, from its manifest: shards, samples and tokens per split, what
    the sources held and skipped, each dataset's statistics, the curation table, the tokenizers."""
    lines = [f"{'dataset':<12}{'split':<7}{'shards':>7}{'samples':>10}{'tokens':>12}"]
    for name, dataset in manifest["datasets"].items():
        for split, entry in dataset["splits"].items():
            lines.append(
                f"{name:<12}{split:<7}{len(entry['shards']):>7}{entry['samples']:>10}{entry['tokens']:>12}"
            )
    sources = manifest["sources"]
    keep = (
        "files",
        "records",
        "empty",
        "bad_bytes_replaced",
        "untranslated",
        "fuzzy",
        "malformed_records",
        "unreadable_files",
        "long_texts_cut",
        "tokenizer_texts_cut",
    )
    lines.append("sources: " + ", ".join(f"{k}={sources[k]}" for k in keep if k in sources))
    cfg = config_from_dict(PrepareConfig, manifest["config"], "manifest")
    by_source = sources.get("by_source", {})
    for source in source_list(cfg):
        skipped = describe_skipped(by_source.get(source.name, sources), source)
        if skipped:
            lines.append(f"skipped{' in ' + source.name if cfg.sources else ''}: {skipped}")
    if cfg.sources:
        for name, entry in by_source.items():
            counts = ", ".join(
                f"{d}/{split} {e['sources'][name]['samples']}"
                for d, dataset in manifest["datasets"].items()
                for split, e in dataset["splits"].items()
            )
            lines.append(
                f"source {name} ({entry['format']}): {entry['files']} files, "
                f"{entry.get('records', 0)} records; samples {counts}"
            )
    for name, dataset in manifest["datasets"].items():
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in dataset["stats"].items()))
    if manifest["curation"]["by_source"] and any(manifest["curation"]["by_source"].values()):
        lines.append("curation (samples of each rule's drops: python -m pipeline.inspect DIR):")
        lines += ["  " + line for line in curation_table(manifest)]
    tok = manifest["tokenizer"]
    target = manifest.get("target_tokenizer")
    lines.append(
        f"tokenizer: vocab {tok['vocab_size']}, sha256 {tok['sha256'][:16]}…"
        + (
            f"; target tokenizer: vocab {target['vocab_size']}, sha256 {target['sha256'][:16]}…"
            if target
            else ""
        )
        + f"; {manifest['seconds']} s"
    )
    return "\n".join(lines)
