"""`python -m pipeline.prepare CONFIG [key=value ...]`: raw text to tokenizer and WebDataset shards.

plan (files -> work units) -> Ray: scan units into hash buckets -> train SentencePiece on a
bottom-k sample -> Ray: encode buckets into shards -> manifest.json, each stage a function of
`_build`. See `pipeline.prepare.scan` and `pipeline.prepare.encode` for what each task does,
`pipeline.prepare.checks` for what is checked before the start and `pipeline.format` for what is
written. Several sources (`sources:`) go through the same two stages together, unit order being
source order; the manifest keeps each source's statistics (`sources.by_source`,
`datasets[...].stats_by_source`) and each split's per-source counts (`splits[...].sources`).

Everything is built in a staging directory of the run's own beside the output,
`OUTPUT_DIR.partial-TOKEN`, and moved into place only when complete (`common.outputs`), so an
interrupted run never leaves a directory that looks prepared. An existing dataset is replaced
only with `overwrite=true`; a directory holding anything prepare did not write, or holding the
run's own sources or tokenizer, is never replaced. A run that fails or is interrupted (Ctrl-C,
SIGTERM, SIGHUP) removes its staging directory (`keep_partial=true` keeps it to debug) and stops
the local Ray it started. `OUTPUT_DIR.lock` (`common.lock`) is held for the whole run, so a second
prepare of the same output fails at once, naming the first. Before it takes the lock, prepare
says how much scratch space the scan's bucket files need (`checks.scratch_need`) and stops in one
line if the output's file system has less free.
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

from common.configure import UserError, config_to_dict, parse_cli, save_config
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
from pipeline.format import (
    FORMAT_VERSION,
    MANIFEST,
    PREPARE_CONFIG,
    SPLITS,
    TARGET_DIR,
    foreign_to_dataset,
    shard_sets,
)
from pipeline.prepare import curation, report, resume
from pipeline.prepare.checks import (
    check_config,
    check_memory,
    check_scratch,
    check_tokenizer,
    given_tokenizer,
    prepare_inputs,
    scratch_need,
    target_tokenizer,
)
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate.decisions import Curation
from pipeline.prepare.encode import encode_splits
from pipeline.prepare.memory import estimate_worker_memory
from pipeline.prepare.readers import check_usable
from pipeline.prepare.scan import scan_units
from pipeline.prepare.scheduling import encode_jobs, scan_batches
from pipeline.prepare.sources import (
    decompressed_size,
    expand_paths,
    plan_units,
    planned_unit_bytes,
    source_list,
    source_where,
)
from pipeline.prepare.tokenizer_sample import sample_facts, tokenizer_sample
from pipeline.prepare.train_tokenizer import train
from pipeline.prepare.units import Unit
from pipeline.tokenizer import Tokenizer, tokenizer_from_files

USAGE = "usage: python -m pipeline.prepare CONFIG.yaml [key.sub=value ...]"
LOCK_SUFFIX = ".lock"  # OUTPUT_DIR.lock: held for the run, so that one output has one writer


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
    print(report.summary(manifest))
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


def _say_peak_memory(manifest: dict, estimate: int, log) -> None:
    peaks = manifest["memory"]
    log(
        f"prepare: peak memory of a Ray worker: scan {peaks['scan_peak_mb']:,.0f} MiB, encode "
        f"{peaks['encode_peak_mb']:,.0f} MiB (estimated before the start: {byte_size(estimate)})"
    )


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
    returns its manifest. `cfg` is what the tasks run with (`curation.partitions_sized`),
    `user_cfg` what the manifest records; `print_` its fingerprint, which a resumed scan must
    have."""
    from pipeline.prepare.ray_runner import ray_session

    given, target = given_tokenizers
    work_dir = staging / "_work"
    with ray_session(cfg.ray):
        units, scanned = _scan(cfg, units, work_dir, print_, log)
        scan_peak = max((result.get("peak_rss_mb", 0.0) for result in scanned), default=0.0)
        by_source = _usable_sources(cfg, files, units, scanned)
        scan_tallies, languages = curation.scan_curation(cfg, units, scanned)
        decisions, near_facts, eval_facts = _curation_decisions(cfg, len(units), work_dir, log)
        tokenizer, sample = _tokenizer(cfg, units, scanned, given, log)
        del scanned
        tokenizer.save(staging)
        if target is not None:
            (staging / TARGET_DIR).mkdir()
            target.save(staging / TARGET_DIR)
        encoded = _encode(cfg, units, (tokenizer, target), decisions, work_dir, staging)

    encode_tallies, near_found = report.encode_curation(cfg, encoded)
    curated = curation.curation_record(
        cfg,
        scan_tallies,
        encode_tallies,
        languages,
        near_facts,
        near_found,
        [unit.source for unit in units],
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
        "sources": report.sources_entry(cfg, files, units, by_source),
        "curation": curated,
        "datasets": {},
        "seconds": round(time.time() - started, 1),
    }
    manifest["datasets"] = report.dataset_entries(cfg, encoded)

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


def _scan(
    cfg: PrepareConfig, units: list[Unit], work_dir: Path, print_: str, log
) -> tuple[list[Unit], list[dict]]:
    """Stage 1: every unit's texts into hash buckets under `work_dir` (`scan.scan_units`, a task
    per batch of units), or a stopped run's scan of the same fingerprint taken as it is. Returns
    the units as scanned, each streamed file replaced by its chunks, and one result per unit."""
    from pipeline.prepare.ray_runner import run_tasks

    done = resume.load_scan(work_dir, print_) if work_dir.is_dir() else None
    if done is not None:
        units, scanned = done
        log(f"prepare: scan: resumed, {len(units)} units scanned by the stopped run")
        return units, scanned
    scanned_units: list[Unit] = []  # `units`, each streamed file replaced by its chunks
    scanned = run_tasks(
        scan_units,
        (
            (batch,)
            for batch in scan_batches(units, cfg.ray.num_workers, cfg.unit_bytes, scanned_units)
        ),
        num_workers=cfg.ray.num_workers,
        desc="scan",
        progress=cfg.progress,
        shared={"cfg": cfg, "work_dir": str(work_dir)},
    )
    # one per unit, in unit order
    scanned = [result for results in scanned for result in results]
    work_dir.mkdir(exist_ok=True)
    resume.save_scan(work_dir, print_, scanned_units, scanned)
    return scanned_units, scanned


def _usable_sources(
    cfg: PrepareConfig, files: list[list[str]], units: list[Unit], scanned: list[dict]
) -> list[dict]:
    """Each source's scan statistics, merged over its units; a source that yielded nothing
    usable stops the run in one line (`readers.check_usable`), naming the source when several."""
    by_source = []
    for index, source in enumerate(source_list(cfg)):
        results = [result for unit, result in zip(units, scanned) if unit.source == index]
        stats = report.merge_stats(results)
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
    return by_source


def _curation_decisions(
    cfg: PrepareConfig, n_units: int, work_dir: Path, log
) -> tuple[Curation, dict | None, dict | None]:
    """The corpus-wide curation decisions, between the scan and the encode: the near-duplicates
    to drop and the evaluation texts' keys (`pipeline.prepare.curation`), with their facts for
    the manifest (None: the stage is off)."""
    from pipeline.prepare.ray_runner import run_tasks

    decisions, near_facts, eval_facts = Curation(ngram=cfg.decontamination.ngram), None, None
    if cfg.near_dedup.enabled and "packed" in shard_sets(cfg.tasks):
        decisions, near_facts = curation.near_duplicates(cfg, n_units, work_dir, run_tasks, log)
        decisions.ngram = cfg.decontamination.ngram
    if cfg.decontamination.enabled:
        decisions.eval_keys, eval_facts = curation.evaluation_keys(
            cfg, n_units, work_dir, run_tasks, log
        )
    return decisions, near_facts, eval_facts


def _tokenizer(
    cfg: PrepareConfig, units: list[Unit], scanned: list[dict], given: Tokenizer | None, log
) -> tuple[Tokenizer, dict | None]:
    """The source side's tokenizer: `given`, or trained on the scan's bottom-k sample and checked
    against what the tasks need; returns it and the sample's figures (None when given)."""
    if given is not None:
        return given, None
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
    tokenizer = tokenizer_from_files(train(texts, cfg.tokenizer), lang_tags=cfg.tokenizer.lang_tags)
    check_tokenizer(tokenizer, cfg, "the trained tokenizer")
    return tokenizer, sample


def _encode(
    cfg: PrepareConfig,
    units: list[Unit],
    tokenizers: tuple[Tokenizer, Tokenizer | None],
    decisions: Curation,
    work_dir: Path,
    staging: Path,
) -> list[dict]:
    """Stage 2: the buckets encoded into shards in `staging` (`encode.encode_splits`, a task per
    (dataset, bucket), the largest first); returns one result per (dataset, split, bucket), in
    that order, as shards are listed."""
    from pipeline.prepare.ray_runner import run_tasks

    tokenizer, target = tokenizers
    datasets = sorted(shard_sets(cfg.tasks))
    encoded = run_tasks(
        encode_splits,
        encode_jobs(work_dir, [unit.source for unit in units], datasets, cfg.shard.buckets),
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
    # One task per (dataset, bucket) made all its splits.
    return sorted(
        (r for results in encoded for r in results),
        key=lambda r: (r["dataset"], SPLITS.index(r["split"]), r["bucket"]),
    )
