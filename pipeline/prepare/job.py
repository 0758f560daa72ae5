"""`python -m pipeline.prepare CONFIG [key=value ...]`: raw text to tokenizer and WebDataset shards.

plan (files -> work units) -> Ray: scan units into hash buckets -> train SentencePiece on a
bottom-k sample -> Ray: encode buckets into shards -> manifest.json. See `pipeline.prepare.work`
for what each task does and `pipeline.format` for what is written. Several sources
(`sources:`) go through the same two stages together, unit order being source order; the
manifest keeps each source's statistics (`sources.by_source`, `datasets[...].stats_by_source`)
and each split's per-source counts (`splits[...].sources`).

Everything is built in a staging directory of the run's own beside the output,
`OUTPUT_DIR.partial-TOKEN`, and moved into place only when complete (`common.outputs`), so an
interrupted run never leaves a directory that looks prepared. An existing dataset is replaced
only with `overwrite=true`; a directory holding anything prepare did not write, or holding the
run's own sources or tokenizer, is never replaced. A run that fails or is interrupted (Ctrl-C,
SIGTERM, SIGHUP) removes its staging directory (`keep_partial=true` keeps it to debug) and stops
the local Ray it started. `OUTPUT_DIR.lock` (`common.lock`) is held for the whole run, so a second
prepare of the same output fails at once, naming the first. Before it takes the lock, prepare
says how much scratch space the scan's bucket files need (`scratch_need`) and stops in one line
if the output's file system has less free.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Iterator

from common.configure import (
    UserError,
    config_from_dict,
    config_to_dict,
    parse_cli,
    save_config,
)
from common.lock import dir_lock
from common.outputs import (
    adopt,
    check_inputs_outside,
    check_replaceable,
    clear_leftovers,
    discard,
    new_staging,
    publish,
    real_output,
)
from common.storage import byte_size, existing_ancestor, free_space, storage_errors
from common.terminal import leave_terminal
from pipeline import remote
from pipeline.format import (
    DATASET_FOR_TASK,
    FIELDS,
    FORMAT_VERSION,
    MANIFEST,
    PREPARE_CONFIG,
    SPLITS,
    TARGET_DIR,
    TASKS,
    foreign_to_dataset,
    shard_sets,
)
from pipeline.inspect import curation_table
from pipeline.prepare import curation, resume
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate import minhash
from pipeline.prepare.curate.documents import check_curation
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.memory import (
    BASE_MB,
    BYTES_PER_WORD,
    MB,
    available_bytes,
    estimate_worker_memory,
)
from pipeline.prepare.readers import check_usable, describe_skipped, is_parallel
from pipeline.prepare.sources import (
    check_sources,
    decompressed_size,
    expand_paths,
    plan_units,
    planned_unit_bytes,
    source_list,
    source_where,
)
from pipeline.prepare.train_tokenizer import BottomKSample, train
from pipeline.prepare.units import Unit, stream_chunks
from pipeline.tokenizer import (
    Tokenizer,
    load_tokenizer,
    tokenizer_from_files,
)
from pipeline.tokenizer_identity import difference

USAGE = "usage: python -m pipeline.prepare CONFIG.yaml [key.sub=value ...]"
LOCK_SUFFIX = ".lock"  # OUTPUT_DIR.lock: held for the run, so that one output has one writer


def prepare(cfg: PrepareConfig) -> dict:
    """Run the whole preparation; returns the manifest."""
    check_config(cfg)
    started = time.time()
    output = real_output(cfg.output_dir, "output_dir")
    sources = source_list(cfg)
    files = [expand_paths(source, source_where(cfg, i)) for i, source in enumerate(sources)]
    total_bytes = sum(decompressed_size(p) for paths in files for p in paths)
    unit_bytes = planned_unit_bytes(cfg.unit_bytes, total_bytes)
    units = []
    # Source by source: unit order is source order (the first source keeps a shared text).
    for index, (source, source_files) in enumerate(zip(sources, files)):
        units.extend(plan_units(source_files, source, unit_bytes, index, source_where(cfg, index)))
    check_inputs_outside(output, "output_dir", prepare_inputs(cfg, files))
    check_replaceable(output, "output_dir", "prepare", foreign_to_dataset, cfg.overwrite)
    given, target = given_tokenizer(cfg), target_tokenizer(cfg)
    log = (
        (lambda msg: print(msg, file=sys.stderr, flush=True))
        if cfg.progress
        else (lambda msg: None)
    )
    # what the tasks run with: near_dedup.partitions chosen from the input size when 0, the unit
    # size planned
    run_cfg = dataclasses.replace(
        curation.partitions_sized(cfg, total_bytes), unit_bytes=unit_bytes
    )
    where = existing_ancestor(output.absolute().parent)
    free = free_space(where)
    # Checked before the memory estimate reads a byte of the input, and again with the texts it
    # counts when the near-duplicate stage adds its signatures.
    check_scratch(output, *scratch_need(run_cfg, files), where, free, log)
    estimate = estimate_worker_memory(run_cfg, files, units)
    if run_cfg.near_dedup.enabled:
        check_scratch(output, *scratch_need(run_cfg, files, estimate.texts), where, free, log)
    memory = check_memory(run_cfg, estimate, log)
    # The lock file lies beside the output rather than in it or in its staging directory:
    # both are deleted and renamed during a run, and a lock must stay one file for as long as
    # anyone may contend for it. Taken before the staging directory is touched, since a
    # second run would otherwise delete the first one's work as "left by an interrupted run".
    with dir_lock(output, what="prepare", lock_file=output.with_name(output.name + LOCK_SUFFIX)):
        # a stopped run's staging directory whose scan is done, to go on from
        print_ = resume.fingerprint(run_cfg, files)
        previous = resume.resumable(output, print_) if cfg.resume else None
        # what a run killed outright left; then the output as it is now, no other prepare at it
        clear_leftovers(output, lambda msg: log(f"prepare: {msg}"), spare=previous)
        check_replaceable(output, "output_dir", "prepare", foreign_to_dataset, cfg.overwrite)
        if previous is not None:
            staging = adopt(previous, output, "prepare")
            resume.clear_after_scan(staging)
            # said whatever `progress` says: a run that skips its scan must say why
            print(
                f"prepare: resuming from {staging}: a stopped run of this config on these inputs "
                "had done its scan",
                file=sys.stderr,
                flush=True,
            )
        else:
            staging = new_staging(output, "prepare")
        try:
            streamed = sum(unit.stream for unit in units)
            log(
                f"prepare: {sum(map(len, files))} files in {len(units)} units"
                + (
                    f" ({streamed} compressed, to be cut into chunks as they are read)"
                    if streamed
                    else ""
                )
                + f" -> {output} ({cfg.ray.num_workers} Ray workers)"
            )
            manifest = _build(
                run_cfg, files, units, (given, target), staging, started, log, cfg, print_
            )
            _say_peak_memory(manifest, memory, log)
            publish(staging, output, "prepare")
        except BaseException as err:  # KeyboardInterrupt too: Ctrl-C, and SIGTERM (see main)
            _discard(staging, cfg.keep_partial, err, log, cfg.resume)
            raise
    return manifest


def scratch_need(cfg: PrepareConfig, files: list[list[str]], texts: float = 0.0) -> tuple[int, str]:
    """About how many bytes the scan's bucket files (`OUTPUT_DIR.partial/_work`) take at their
    largest, and how that was counted: each text once per family of buckets it goes to (the
    monolingual texts, and `source TAB target` for translation), at most the input's
    decompressed size each (the scan drops markup and keys, never adds). The shards come on
    top, once the scan is done, while the buckets are still there."""
    need, text, twice = 0, 0, False
    for source, paths in zip(source_list(cfg), files):
        size = sum(decompressed_size(path) for path in paths)
        copies = int("packed" in shard_sets(cfg.tasks)) + int(
            "translation" in cfg.tasks and is_parallel(source)
        )
        text += size
        need += copies * size
        twice = twice or copies == 2
    why = f"{byte_size(text)} of decompressed input" + (
        ", pairs twice: as texts and as pairs" if twice else ""
    )
    near = cfg.near_dedup
    if near.enabled and "packed" in shard_sets(cfg.tasks):
        # each signed text's band records (16 bytes a band) and sketch: 4 bytes a shingle (about a
        # word of BYTES_PER_WORD bytes), at most minhash.SKETCH, + 16 of id and end
        sketch = min(text / BYTES_PER_WORD * 4, texts * minhash.SKETCH * 4) + texts * 16
        signed = int(texts * near.bands * 16 + sketch)
        need += signed
        why += (
            f", + {byte_size(signed)} of near-duplicate band records and sketches for "
            f"~{texts:,.0f} texts"
        )
    return need, why


def check_scratch(output: Path, need: int, why: str, where: Path, free: int, log) -> None:
    """Say how much scratch space the scan needs, and stop in one line when there is less."""
    log(
        f"prepare: {output}.partial-*/_work needs about {byte_size(need)} ({why}); "
        f"{byte_size(free)} free on {where}"
    )
    if need > free:
        raise UserError(
            f"{output}.partial-*/_work needs about {byte_size(need)} ({why}), but {where} has "
            f"{byte_size(free)} free; free some space or choose an output_dir on a larger file "
            "system"
        )


def check_memory(cfg: PrepareConfig, estimate, log) -> int:
    """Say how much memory a Ray worker will need at its peak (`pipeline.prepare.memory`), and
    stop in one line when a local Ray's workers would not have it; returns the estimate."""
    need = (
        f"each Ray worker needs about {byte_size(estimate.peak_bytes)} at its peak ({estimate.why})"
    )
    if cfg.ray.address:
        log(f"prepare: {need}; not checked here: the workers run on the nodes of {cfg.ray.address}")
        return estimate.peak_bytes
    available = available_bytes()
    # the driver and Ray's own processes first; the workers share the rest
    rest = max(0, available - estimate.head_bytes)
    each = rest // cfg.ray.num_workers if cfg.ray.num_workers > 0 else rest
    head = f"{byte_size(estimate.head_bytes)} of it for the driver and Ray's own processes"
    if estimate.peak_bytes > each:
        raise UserError(
            f"{need}, but this machine has {byte_size(available)} available for "
            f"ray.num_workers={cfg.ray.num_workers} ({head}, {byte_size(each)} for each worker); "
            f"{estimate.remedy}, or lower ray.num_workers"
        )
    # between the scan and the encode the driver trains the tokenizer beside idle workers
    training = estimate.head_bytes + estimate.train_bytes + cfg.ray.num_workers * BASE_MB * MB
    if estimate.train_bytes and training > available:
        raise UserError(
            f"training the tokenizer on its sample needs about {byte_size(estimate.train_bytes)} "
            f"in the driver, beside Ray's processes and {cfg.ray.num_workers} idle workers: "
            f"{byte_size(training)} in all, but this machine has {byte_size(available)} "
            "available; lower tokenizer.sample_texts, or give tokenizer.path"
        )
    log(
        f"prepare: {need}; {byte_size(available)} available, {head}, {byte_size(each)} for each "
        f"of {cfg.ray.num_workers}"
    )
    return estimate.peak_bytes


def _say_peak_memory(manifest: dict, estimate: int, log) -> None:
    peaks = manifest["memory"]
    log(
        f"prepare: peak memory of a Ray worker: scan {peaks['scan_peak_mb']:,.0f} MiB, encode "
        f"{peaks['encode_peak_mb']:,.0f} MiB (estimated before the start: {byte_size(estimate)})"
    )


def check_config(cfg: PrepareConfig) -> None:
    unknown = [k for k in cfg.tasks if k not in TASKS]
    if unknown or not cfg.tasks:
        raise UserError(f"tasks: {unknown or cfg.tasks} not valid; choose from {', '.join(TASKS)}")
    check_sources(cfg)
    sources = source_list(cfg)
    check_curation(cfg, sources, [source_where(cfg, i) for i in range(len(sources))])
    if "translation" in cfg.tasks and not any(is_parallel(source) for source in source_list(cfg)):
        formats = ", ".join(source.format for source in source_list(cfg))
        raise UserError(
            "tasks: translation needs a parallel source (tsv, gettext, or jsonl/parquet with "
            f"target_field), not {formats}"
        )
    if cfg.seq_len < 2:
        raise UserError(f"seq_len: must be at least 2, got {cfg.seq_len}")
    if not (0 <= cfg.split.valid and 0 <= cfg.split.test and cfg.split.valid + cfg.split.test < 1):
        raise UserError(
            "split.valid and split.test: fractions in [0, 1) that leave some training data"
        )
    if cfg.shard.buckets < 1 or cfg.shard.max_samples < 1:
        raise UserError("shard.buckets and shard.max_samples: must be at least 1")


def given_tokenizer(cfg: PrepareConfig) -> Tokenizer | None:
    """`tokenizer.path`'s tokenizer, checked against what the tasks need; None: one is trained."""
    if not cfg.tokenizer.path:
        return None
    try:
        tokenizer = load_tokenizer(cfg.tokenizer.path, cfg.tokenizer.lang_tags)
    except UserError as err:
        raise UserError(f"tokenizer.path: {err}") from None
    check_tokenizer(tokenizer, cfg, f"tokenizer.path {cfg.tokenizer.path}")
    return tokenizer


def target_tokenizer(cfg: PrepareConfig) -> Tokenizer | None:
    """`tokenizer.target_path`'s tokenizer for translation targets; None: the targets use the
    source side's. It must end a sentence (an eos) and start the decoder (a bos, or the eos)."""
    if not cfg.tokenizer.target_path:
        return None
    if not cfg.tokenizer.path:
        raise UserError(
            "tokenizer.target_path: a target tokenizer of its own needs the source side's given "
            "too (tokenizer.path)"
        )
    if "translation" not in cfg.tasks:
        raise UserError(
            "tokenizer.target_path: only translation has a target side; add translation to tasks "
            "or drop the key"
        )
    try:
        tokenizer = load_tokenizer(cfg.tokenizer.target_path)
    except UserError as err:
        raise UserError(f"tokenizer.target_path: {err}") from None
    if tokenizer.specials.eos is None:
        raise UserError(
            f"tokenizer.target_path {cfg.tokenizer.target_path}: translation ends each target with "
            "an eos token, and this tokenizer has none"
        )
    # The source side's tokenizer by the ids it gives (the same file, or one transformers saved
    # again): one tokenizer.
    if difference(load_tokenizer(cfg.tokenizer.path), tokenizer) is None:
        return None
    return tokenizer


def check_tokenizer(tokenizer: Tokenizer, cfg: PrepareConfig, where: str) -> None:
    """Refuse, in one line, a tokenizer that lacks a special token the tasks need."""
    specials = tokenizer.specials
    if "mlm" in cfg.tasks and specials.mask is None:
        raise UserError(
            f"tasks: mlm replaces tokens by a mask token, and {where} has none "
            "(drop mlm from tasks, or give a tokenizer with one)"
        )
    if "translation" in cfg.tasks and specials.eos is None:
        raise UserError(
            f"tasks: translation ends each sentence with an eos token, and {where} has none"
        )
    if "packed" in shard_sets(cfg.tasks) and not specials.document[1]:
        raise UserError(
            f"tasks: packed documents need a token between them, and {where} has no eos token "
            "and adds none after a text"
        )


def prepare_inputs(cfg: PrepareConfig, files: list[list[str]]) -> list[tuple[str, str]]:
    """The local files this run reads, each with the key that names it: what its output must not
    hold."""
    inputs = [
        (f"{source_where(cfg, index)}.paths", path)
        for index, paths in enumerate(files)
        for path in paths
        if not remote.is_url(path)
    ]
    for key in ("path", "target_path"):
        path = getattr(cfg.tokenizer, key)
        if path and not remote.is_url(path):
            inputs.append((f"tokenizer.{key}", path))
    return inputs


def _discard(staging: Path, keep: bool, err: BaseException, log, resumes: bool = False) -> None:
    """After a failure: remove the staging directory, so that failed runs do not pile up; after
    a stop once the scan was done (and `resume`), keep it for the next run to go on from."""
    why = "interrupted" if isinstance(err, KeyboardInterrupt) else "failed"
    if resumes and why == "interrupted" and (staging / "_work" / resume.SCAN_RECORD).is_file():
        print(
            f"prepare: interrupted after the scan; kept {staging}: the same command goes on from "
            "it (resume=false starts afresh)",
            file=sys.stderr,
            flush=True,
        )
        return
    if keep:
        # Printed whatever `progress` says: the user asked for it and needs to know where it is.
        print(f"prepare: {why}; kept {staging} (keep_partial=true)", file=sys.stderr, flush=True)
        return
    discard(staging)
    log(f"prepare: {why}; removed {staging}")


def _build(
    cfg: PrepareConfig,
    files: list[list[str]],
    units: list[Unit],
    given_tokenizers: tuple[Tokenizer | None, Tokenizer | None],
    staging: Path,
    started: float,
    log,
    user_cfg: PrepareConfig,
    print_: str,
) -> dict:
    """Scan, train the tokenizer (unless given: `given_tokenizers`, the source side's and a
    translation target's own), encode, and write the dataset into `staging`;
    returns its manifest. `cfg` is what the tasks run with (`curation.resolved`), `user_cfg` what
    the manifest records; `print_` its fingerprint, which a resumed scan must have."""
    from pipeline.prepare.curate.decisions import Curation
    from pipeline.prepare.ray_runner import ray_session, run_tasks
    from pipeline.prepare.work import encode_splits, scan_units

    given, target = given_tokenizers

    work_dir = staging / "_work"
    with ray_session(cfg.ray):
        done = resume.load_scan(work_dir, print_) if work_dir.is_dir() else None
        if done is not None:
            units, scanned = done
            log(f"prepare: scan: resumed, {len(units)} units scanned by the stopped run")
        else:
            scanned_units: list[Unit] = []  # `units`, each streamed file replaced by its chunks
            scanned = run_tasks(
                scan_units,
                (
                    (batch,)
                    for batch in scan_batches(
                        units, cfg.ray.num_workers, cfg.unit_bytes, scanned_units
                    )
                ),
                num_workers=cfg.ray.num_workers,
                desc="scan",
                progress=cfg.progress,
                shared={"cfg": cfg, "work_dir": str(work_dir)},
            )
            # one per unit, in unit order
            scanned = [result for results in scanned for result in results]
            units = scanned_units
            work_dir.mkdir(exist_ok=True)
            resume.save_scan(work_dir, print_, units, scanned)
        scan_peak = max((result.get("peak_rss_mb", 0.0) for result in scanned), default=0.0)
        sources = source_list(cfg)
        by_source = []
        for index, source in enumerate(sources):
            results = [result for unit, result in zip(units, scanned) if unit.source == index]
            stats = _merge_stats(results)
            undecodable_by_file: Counter = Counter()
            for unit, result in zip(units, scanned):
                if unit.source == index:
                    undecodable_by_file[unit.path] += result["stats"].get("undecodable_dropped", 0)
            try:
                check_usable(stats, source, len(files[index]), undecodable_by_file)
            except UserError as err:
                raise UserError(
                    f"{source_where(cfg, index)}: {err}" if cfg.sources else str(err)
                ) from err
            by_source.append(stats)
        source_stats = _merge_stats([{"stats": stats} for stats in by_source])
        scan_tallies, languages = curation.scan_curation(cfg, units, scanned)
        decisions, near_facts, eval_facts = Curation(ngram=cfg.decontamination.ngram), None, None
        if cfg.near_dedup.enabled and "packed" in shard_sets(cfg.tasks):
            decisions, near_facts = curation.near_duplicates(
                cfg, len(units), work_dir, run_tasks, log
            )
            decisions.ngram = cfg.decontamination.ngram
        if cfg.decontamination.enabled:
            decisions.eval_keys, eval_facts = curation.evaluation_keys(
                cfg, len(units), work_dir, run_tasks, log
            )
        sample = None
        if given is None:
            texts, cut = tokenizer_sample(cfg, units, scanned)
            sample = sample_facts(texts, cut)
            share = sample["bytes_of_long_texts"] / max(sample["bytes"], 1)
            log(
                f"prepare: training the tokenizer on {sample['texts']:,} texts "
                f"({byte_size(sample['bytes'])}; {sample['pieces_of_long_texts']:,} of them "
                "pieces of "
                f"texts over tokenizer.max_sentence_length={cfg.tokenizer.max_sentence_length} "
                f"bytes, {share:.1%} of the bytes)"
            )
            tokenizer = tokenizer_from_files(
                train(texts, cfg.tokenizer), lang_tags=cfg.tokenizer.lang_tags
            )
            check_tokenizer(tokenizer, cfg, "the trained tokenizer")
            del texts, cut
        else:
            tokenizer = given
        del scanned
        tokenizer.save(staging)
        if target is not None:
            (staging / TARGET_DIR).mkdir()
            target.save(staging / TARGET_DIR)

        datasets = sorted(shard_sets(cfg.tasks))
        unit_sources = [unit.source for unit in units]
        jobs = [(d, b, unit_sources) for d in datasets for b in range(cfg.shard.buckets)]
        # Largest first (by bucket-file bytes), so that no worker is left with a big task at the
        # end while the others idle; results are put back in order below, so output is unchanged.
        jobs.sort(key=lambda job: -_job_bytes(work_dir, len(units), job[0], job[1]))
        encoded = run_tasks(
            encode_splits,
            jobs,
            num_workers=cfg.ray.num_workers,
            desc="encode",
            progress=cfg.progress,
            shared={
                "work_dir": str(work_dir),
                "out_dir": str(staging),
                "tokenizer_files": tokenizer.files,
                "target_files": target.files if target is not None else None,
                "cfg": cfg,
                "curation": decisions,
            },
        )
        # One task per (dataset, bucket) made all its splits; in (dataset, split, bucket) order, as
        # shards are listed.
        encoded = sorted(
            (r for results in encoded for r in results),
            key=lambda r: (r["dataset"], SPLITS.index(r["split"]), r["bucket"]),
        )

    encode_tallies = [Tally(cfg.dropped_samples) for _ in sources]
    near_found: dict = {}
    for result in encoded:
        for index, source in enumerate(sources):
            encode_tallies[index].merge(result["curation"][source.name])
        near_found.update(result.get("near_found", {}))
    curated = curation.curation_record(
        cfg,
        scan_tallies,
        encode_tallies,
        languages,
        near_facts,
        near_found,
        unit_sources,
        eval_facts,
        staging,
    )
    manifest = {
        "format_version": FORMAT_VERSION,
        "tokenizer": {
            **tokenizer.info(),
            "trained": given is None,
            **({"sample": sample} if sample else {}),
        },
        **({"target_tokenizer": {**target.info(), "trained": False}} if target is not None else {}),
        "config": config_to_dict(user_cfg),
        "sources": {
            "files": sum(map(len, files)),
            "units": len(units),
            **source_stats,
            "by_source": {
                source.name: {
                    "format": source.format,
                    "files": len(files[index]),
                    "units": sum(unit.source == index for unit in units),
                    **by_source[index],
                }
                for index, source in enumerate(sources)
            },
        },
        "curation": curated,
        "datasets": {},
        "seconds": round(time.time() - started, 1),
    }
    for name in datasets:
        results = [r for r in encoded if r["dataset"] == name]
        entry = {
            "tasks": [k for k in TASKS if DATASET_FOR_TASK[k] == name],
            "fields": list(FIELDS[name]),
            "splits": {},
            "stats": _merge_stats(results),
            "stats_by_source": {
                source.name: _merge_stats(
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
        manifest["datasets"][name] = entry

    shutil.rmtree(work_dir, ignore_errors=True)
    save_config(user_cfg, staging / PREPARE_CONFIG)
    # Written last: a directory with a manifest is a complete dataset.
    (staging / MANIFEST).write_text(json.dumps(manifest, indent=1, ensure_ascii=False) + "\n")
    # A worker's peak resident memory in each stage, for the log: this machine's and this run's,
    # so not in manifest.json, whose bytes do not depend on the run.
    manifest["memory"] = {
        "scan_peak_mb": round(scan_peak, 1),
        "encode_peak_mb": round(max((r["peak_rss_mb"] for r in encoded), default=0.0), 1),
    }
    return manifest


SCAN_TASKS_PER_WORKER = 4  # small units are batched into about this many scan tasks per worker


def scan_batches(
    units: list[Unit], num_workers: int, unit_bytes: int, numbered: list[Unit] | None = None
) -> Iterator[list[tuple[int, Unit]]]:
    """Consecutive units grouped into scan tasks: about total / (SCAN_TASKS_PER_WORKER x workers)
    bytes each at first, then a share of what is left (remaining / (2 x workers), down to one
    unit), so the last tasks are small and the workers finish together; few enough tasks that
    scheduling does not dominate small files. A `stream` unit is decompressed here, as its tasks
    are wanted, into chunks of `unit_bytes`, a task each; units are numbered as they come, and
    appended to `numbered` without their data."""
    sizes = [_unit_bytes(unit) for unit in units]
    workers = max(1, num_workers)
    remaining = sum(sizes)
    most = remaining / (SCAN_TASKS_PER_WORKER * workers)
    current: list[tuple[int, Unit]] = []
    load, index = 0, 0
    numbered = [] if numbered is None else numbered
    for unit, size in zip(units, sizes):
        if unit.stream:
            if current:
                yield current
                current, load = [], 0
            for chunk in stream_chunks(unit, unit_bytes):
                numbered.append(dataclasses.replace(chunk, data=None))
                yield [(index, chunk)]
                index += 1
            remaining -= size
            continue
        if not current:
            target = min(most, remaining / (2 * workers))
        current.append((index, unit))
        numbered.append(unit)
        index += 1
        load += size
        remaining -= size
        if load >= target:
            yield current
            current, load = [], 0
    if current:
        yield current


def _job_bytes(work_dir: Path, n_units: int, dataset: str, bucket: int) -> int:
    from pipeline.prepare.work import MONO, PAIRS, bucket_file

    family = MONO if dataset == "packed" else PAIRS
    paths = (
        bucket_file(work_dir, u, family, split, bucket) for u in range(n_units) for split in SPLITS
    )
    return sum(path.stat().st_size for path in paths if path.is_file())


def _unit_bytes(unit: Unit) -> int:
    if unit.end >= 0 and not unit.path.endswith(".parquet"):
        return unit.end - unit.start
    try:
        return Path(unit.path).stat().st_size
    except OSError:
        return 0


def tokenizer_sample(
    cfg: PrepareConfig, units: list[Unit], scanned: list[dict]
) -> tuple[list[str], list[bool]]:
    """The tokenizer's training texts: each source's bottom-k texts, `tokenizer.sample_texts`
    slots divided by `tokenizer_share` (a source short of texts leaves its slots to the others,
    in proportion), then all ordered by hash. With one source: its bottom-k, as ever. Beside
    them, whether each is a piece of a text too long for SentencePiece (`sample_pieces`)."""
    sources = source_list(cfg)
    samples = [BottomKSample(cfg.tokenizer.sample_texts) for _ in sources]
    cut: set[int] = set()
    for unit, result in zip(units, scanned):
        samples[unit.source].merge(result["sample"], result.get("sample_cut", ()))
    for sample in samples:
        cut.update(sample.cut_keys())
    items = [sample.items() for sample in samples]
    quota = [0] * len(sources)
    open_sources, slots = list(range(len(sources))), cfg.tokenizer.sample_texts
    # water-filling: the shares of the sources that still have texts
    while open_sources and slots > 0:
        total = sum(sources[i].tokenizer_share for i in open_sources)
        exact = {i: slots * sources[i].tokenizer_share / total for i in open_sources}
        offer = {i: int(exact[i]) for i in open_sources}
        # The slots rounding left over go to the largest remainders (ties: source order).
        by_remainder = sorted(open_sources, key=lambda i: (offer[i] - exact[i], i))
        for i in by_remainder[: slots - sum(offer.values())]:
            offer[i] += 1
        for i in open_sources:
            quota[i] += min(offer[i], len(items[i]) - quota[i])
        slots = cfg.tokenizer.sample_texts - sum(quota)
        open_sources = [i for i in open_sources if quota[i] < len(items[i])]
    chosen: dict[int, str] = {}
    for i in range(len(sources)):
        for key, text in items[i][: quota[i]]:
            chosen.setdefault(key, text)  # a text two sources share is one training text
    keys = sorted(chosen)
    return [chosen[key] for key in keys], [key in cut for key in keys]


def sample_facts(texts: list[str], cut: list[bool]) -> dict:
    """The training sample in figures, for the log and the manifest: its texts and bytes, and how
    many of them are pieces of longer texts (cut to SentencePiece's `max_sentence_length`)."""
    sizes = [len(text.encode("utf-8")) for text in texts]
    return {
        "texts": len(texts),
        "bytes": sum(sizes),
        "pieces_of_long_texts": sum(cut),
        "bytes_of_long_texts": sum(size for size, piece in zip(sizes, cut) if piece),
    }


def _merge_stats(results: list[dict]) -> dict:
    total: Counter = Counter()
    for result in results:
        total.update(result["stats"])
    return dict(sorted(total.items()))


def summary(manifest: dict) -> str:
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


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(PrepareConfig, argv, usage=USAGE)
    # SIGTERM (kill, scancel, a time limit) and SIGHUP (the terminal closed) unwind like Ctrl-C,
    # through the cleanup in `prepare`; Python's default would die on the spot and leave the
    # staging directory.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGHUP, _interrupt)
    # the same, and noted for the task loop (ray_runner.INTERRUPTED)
    signal.signal(signal.SIGINT, _interrupt)
    with output_storage(Path(cfg.output_dir)):
        manifest = prepare(cfg)
    print(summary(manifest))
    print(f"wrote {cfg.output_dir}/{MANIFEST}")
    return 0


def output_storage(output: Path):
    """A full or unwritable output file system (ENOSPC, EDQUOT, EFBIG, EROFS, EACCES), met by
    the driver or by a Ray task (`ray_runner.run_tasks` raises a task's as its OSError), as one
    line naming the path and what to do; by then `prepare` has removed its staging directory,
    and an existing dataset at `output` is as it was."""
    return storage_errors(
        f"output_dir={output}",
        output,  # and beside it: its staging directory, its lock file
        space="free some space there, or choose an output_dir on another file system",
        access="choose an output_dir this user can write",
    )


def _interrupt(signum: int, frame) -> None:
    # no Ray import: ray_runner imports it lazily
    from pipeline.prepare.ray_runner import INTERRUPTED

    INTERRUPTED.set()
    if signum == signal.SIGHUP:
        leave_terminal()  # gone: a line written to it would fail before the cleanup
    raise KeyboardInterrupt(signal.Signals(signum).name)
