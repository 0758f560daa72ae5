"""`python -m pipeline.prepare CONFIG [key=value ...]`: raw text to tokenizer and WebDataset shards.

plan (files -> work units) -> Ray: scan units into hash buckets -> train SentencePiece on a
bottom-k sample -> Ray: encode buckets into shards -> manifest.json. See `pipeline.work`
for what each task does and `pipeline.format` for what is written.

Everything is built in `OUTPUT_DIR.partial` and moved into place only when complete, so an
interrupted run never leaves a directory that looks prepared, and an existing dataset is
replaced only with `overwrite=true`.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections import Counter
from pathlib import Path

from pipeline.config import TASKS, PrepareConfig
from pipeline.configure import UserError, config_to_dict, parse_cli, run_main, save_config
from pipeline.format import DATASET_FOR_TASK, FIELDS, FORMAT_VERSION, MANIFEST, SPLITS, TOKENIZER_FILE
from pipeline.sources import expand_paths, is_parallel, plan_units
from pipeline.tokenizer import BottomKSample, processor_from_bytes, tokenizer_info, train_tokenizer

USAGE = "usage: python -m pipeline.prepare CONFIG.yaml [key.sub=value ...]"
CHUNK_BYTES = 64 << 20  # large text files are scanned in ranges of this size


def check_config(cfg: PrepareConfig) -> None:
    unknown = [k for k in cfg.tasks if k not in TASKS]
    if unknown or not cfg.tasks:
        raise UserError(f"tasks: {unknown or cfg.tasks} not valid; choose from {', '.join(TASKS)}")
    if "translation" in cfg.tasks and not is_parallel(cfg.source):
        raise UserError(f"tasks: translation needs a parallel source (tsv, gettext, or jsonl with target_field), not {cfg.source.format}")
    if cfg.seq_len < 2:
        raise UserError(f"seq_len: must be at least 2, got {cfg.seq_len}")
    if not (0 <= cfg.split.valid and 0 <= cfg.split.test and cfg.split.valid + cfg.split.test < 1):
        raise UserError("split.valid and split.test: fractions in [0, 1) that leave some training data")
    if cfg.shard.buckets < 1 or cfg.shard.max_samples < 1:
        raise UserError("shard.buckets and shard.max_samples: must be at least 1")


def _staging_dir(output: Path, overwrite: bool) -> Path:
    if (output / MANIFEST).exists() and not overwrite:
        raise UserError(f"{output} is already a prepared dataset; pass overwrite=true to replace it")
    if output.exists() and not overwrite and any(output.iterdir()):
        raise UserError(f"{output} exists and is not empty; pass overwrite=true to replace it")
    staging = output.with_name(output.name + ".partial")
    if staging.exists():  # left by an interrupted run
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    return staging


def _publish(staging: Path, output: Path) -> None:
    """Swap the finished staging directory into place; the old output survives until then."""
    old = output.with_name(output.name + ".old")
    if output.exists():
        if old.exists():
            shutil.rmtree(old)
        output.rename(old)
    staging.rename(output)
    if old.exists():
        shutil.rmtree(old)


def _merge_stats(results: list[dict]) -> dict:
    total: Counter = Counter()
    for result in results:
        total.update(result["stats"])
    return dict(sorted(total.items()))


def prepare(cfg: PrepareConfig) -> dict:
    """Run the whole preparation; returns the manifest."""
    from pipeline.ray_runner import ray_session, run_tasks
    from pipeline.work import encode_bucket, scan_unit

    check_config(cfg)
    started = time.time()
    output = Path(cfg.output_dir)
    files = expand_paths(cfg.source)
    units = plan_units(files, cfg.source, CHUNK_BYTES)
    given_model = None
    if cfg.tokenizer.model_path:
        path = Path(cfg.tokenizer.model_path)
        if not path.is_file():
            raise UserError(f"tokenizer.model_path: file not found: {path}")
        given_model = path.read_bytes()
        processor_from_bytes(given_model, source=str(path))
    staging = _staging_dir(output, cfg.overwrite)
    work_dir = staging / "_work"
    log = (lambda msg: print(msg, file=sys.stderr, flush=True)) if cfg.progress else (lambda msg: None)
    log(f"prepare: {len(files)} files in {len(units)} units -> {output} ({cfg.ray.num_workers} Ray workers)")

    with ray_session(cfg.ray):
        scanned = run_tasks(
            scan_unit, [(i, unit) for i, unit in enumerate(units)], num_workers=cfg.ray.num_workers,
            desc="scan", progress=cfg.progress, shared={"cfg": cfg, "work_dir": str(work_dir)},
        )
        source_stats = _merge_stats(scanned)
        if given_model is None:
            sample = BottomKSample(cfg.tokenizer.sample_texts)
            for result in scanned:
                sample.merge(result["sample"])
            texts = [text for _, text in sample.items()]
            log(f"prepare: training the tokenizer on {len(texts)} texts")
            model_bytes = train_tokenizer(texts, cfg.tokenizer)
        else:
            model_bytes = given_model
        del scanned
        (staging / TOKENIZER_FILE).write_bytes(model_bytes)
        processor = processor_from_bytes(model_bytes)

        datasets = sorted({DATASET_FOR_TASK[task] for task in cfg.tasks})
        jobs = [(d, s, b, len(units)) for d in datasets for s in SPLITS for b in range(cfg.shard.buckets)]
        encoded = run_tasks(
            encode_bucket, jobs, num_workers=cfg.ray.num_workers, desc="encode", progress=cfg.progress,
            shared={"work_dir": str(work_dir), "out_dir": str(staging), "tokenizer_model": model_bytes, "cfg": cfg},
        )

    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {"file": TOKENIZER_FILE, **tokenizer_info(processor, model_bytes, list(cfg.tokenizer.lang_tags)),
                      "trained": given_model is None},
        "config": config_to_dict(cfg),
        "sources": {"files": len(files), "units": len(units), **source_stats},
        "datasets": {},
        "seconds": round(time.time() - started, 1),
    }
    for name in datasets:
        entry = {"tasks": [k for k in TASKS if DATASET_FOR_TASK[k] == name], "fields": list(FIELDS[name]),
                 "splits": {}, "stats": _merge_stats([r for r in encoded if r["dataset"] == name])}
        if name == "packed":
            entry["seq_len"] = cfg.seq_len
        for split in SPLITS:
            shards = [shard for r in encoded if r["dataset"] == name and r["split"] == split for shard in r["shards"]]
            entry["splits"][split] = {
                "samples": sum(s["samples"] for s in shards),
                "tokens": sum(s["tokens"] for s in shards),
                "shards": shards,
            }
        manifest["datasets"][name] = entry

    shutil.rmtree(work_dir, ignore_errors=True)
    save_config(cfg, staging / "config.yaml")
    # Written last: a directory with a manifest is a complete dataset.
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    _publish(staging, output)
    return manifest


def summary(manifest: dict) -> str:
    lines = [f"{'dataset':<12}{'split':<7}{'shards':>7}{'samples':>10}{'tokens':>12}"]
    for name, dataset in manifest["datasets"].items():
        for split, entry in dataset["splits"].items():
            lines.append(f"{name:<12}{split:<7}{len(entry['shards']):>7}{entry['samples']:>10}{entry['tokens']:>12}")
    sources = manifest["sources"]
    keep = ("files", "records", "empty", "bad_bytes_replaced", "untranslated", "fuzzy", "malformed_records", "unreadable_files", "long_texts_cut")
    lines.append("sources: " + ", ".join(f"{k}={sources[k]}" for k in keep if k in sources))
    for name, dataset in manifest["datasets"].items():
        lines.append(f"{name}: " + ", ".join(f"{k}={v}" for k, v in dataset["stats"].items()))
    tok = manifest["tokenizer"]
    lines.append(f"tokenizer: vocab {tok['vocab_size']}, sha256 {tok['sha256'][:16]}…; {manifest['seconds']} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(PrepareConfig, argv, usage=USAGE)
    manifest = prepare(cfg)
    print(summary(manifest))
    print(f"wrote {cfg.output_dir}/{MANIFEST}")
    return 0


if __name__ == "__main__":
    run_main(main)
