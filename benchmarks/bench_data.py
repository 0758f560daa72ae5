"""Throughput of the data pipeline against the bare libraries it is built on; prints figures, asserts nothing.

    python benchmarks/bench_data.py [--data DIR] [--repeats N] [--prepare-repeats N] [--quick]
                                    [--scale 1,10,20] [--skip-loader]
                                    [--tokenizer-kinds sentencepiece,hf]
    python benchmarks/bench_data.py --big-file 100 [--unit-mb 16] [--prepare-repeats N]

1. Loader: `pipeline.load.loader.ShardLoader` (causal_lm, train split, micro batch 32) against a bare
   `webdataset.WebDataset` read of the same shards (np.load of `input_ids.npy`, stacked into a
   (B, T) int64 batch, no shuffle, no checks), both through a torch DataLoader with the same
   `num_workers`. One run is one epoch of the train split, timed from `iter()` to the last batch
   (worker start-up included: ShardLoader starts fresh workers every epoch). The runs alternate
   ours, bare, ours, bare... after one untimed warm-up of each; the table gives medians. Target:
   ours >= 0.9x bare.
2. Prepare: `pipeline.prepare.job.prepare(cfg)` with the dataset's own resolved config
   (`DIR/config.yaml`), `ray.num_workers=1` and `=2`, `progress=false`, output to a temporary
   directory and `tokenizer.path=DIR/tokenizer.model`, so no tokenizer is trained and the
   shards must come out byte-identical to DIR's (checked). Stage times come from wrapping
   `pipeline.prepare.ray_runner.ray_session` / `run_tasks` for the run, not from editing the pipeline.
   One more run trains the tokenizer as shipped (2 workers) to show what training adds. The
   baseline is one process encoding the same texts the encode stage encodes (found with the
   pipeline's own scan and dedup functions) with `sp.encode(texts, num_threads=1)`, timed in
   the same run. Printed: the encode stage's tokens/s per Ray worker (tokens / (stage seconds x
   workers)) and its ratio to that baseline (target >= 0.4, and >= 1.0 M tokens/s), and the
   2-worker / 1-worker speed-up of the whole encode stage (target >= 1.8x); Ray's start and stop
   are timed apart from the stages.
   `--tokenizer-kinds sentencepiece,hf` (the default) does the same with the `hf` kind: a
   byte-level BPE of the dataset's vocabulary size trained once by the tokenizers library on
   the same text through prepare itself (`tokenizer.kind=hf`), then given; its baseline is the
   tokenizers library's own `encode_batch` of the same texts on one thread
   (TOKENIZERS_PARALLELISM=false, as the Ray workers run it) and on its thread pool; target:
   tokens/s per worker >= 0.8 of the one-thread figure. The 1- and 2-worker shards must be the
   same bytes. Each library's one-thread figure is taken two ways, one call for all the texts
   and calls of ENCODE_CHUNK texts as prepare makes them (the tokenizers library can run faster
   so), alternating with the prepare runs; the ratio is given against each, the target is
   against the faster. The all-threads baselines are measured before and after the prepare
   runs; the faster of the two is used.
3. Scale (`--scale 1,10,20`): a synthetic parallel corpus (jsonl with a text and a target field)
   drawn from the default corpus's pairs by a seeded sampler, each record two random pairs
   joined, so it is not de-duplicated away; 1x is 28,000 records (about as many tokens as the
   default corpus's encode stage), 20x about 50 M tokens. Each size is prepared once with the
   largest worker count and the dataset's tokenizer; printed: tokens, wall time, tokens/s, the
   scan and encode stage times and the peak RSS of a Ray worker in each stage (the largest
   over its tasks of the task's own peak: VmHWM, reset as each task starts), so that a user
   can extrapolate to a corpus of their size. Generated
   in a temporary directory, deleted afterwards.

4. One large compressed file (`--big-file MB`, run instead of 1-3): one jsonl.zst of about MB
   megabytes compressed (monolingual web-like documents: words drawn from a Zipf law over
   50,000 made-up words, a few per cent of documents repeated), generated in a temporary
   directory, prepared (causal_lm, a tokenizer trained once beforehand on 20,000 of its
   documents and then fixed) with `ray.num_workers=1` and `=2`, alternating, `--prepare-repeats`
   times each. The driver streams the file and hands its chunks of `--unit-mb` decompressed
   megabytes to the scan tasks. Printed: the scan and encode stage times, their sum, the
   2-worker / 1-worker speed-up over scan + encode (target >= 1.7x), the number of units, and
   whether the shards of every run are identical. Needs no prepared dataset.

Data: DIR defaults to data/gettext-en-de. The script does not prepare it (a benchmark should not
write into data/ behind your back): without DIR/manifest.json it prints how to make it and
exits 2. `--quick` is a smoke run: two repeats, num_workers 0 and 1, 40 batches per loader run,
prepare on the first 8 catalogs only, no tokenizer-training run, and with `--scale` 2,000
records per 1x.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import json
import os
import platform
import random
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# Run as a plain script from any directory: the project is imported from the checkout, not
# installed.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from pipeline.prepare.encode import ENCODE_CHUNK  # noqa: E402

DEFAULT_DATA = ROOT / "data" / "gettext-en-de"
MICRO_BATCH = 32
TASK, SPLIT = "causal_lm", "train"


# ---------------------------------------------------------------- loader


def _decode_input_ids(sample: dict) -> np.ndarray:
    return np.load(io.BytesIO(sample["input_ids.npy"]), allow_pickle=False)


def _stack(arrays: list[np.ndarray]) -> torch.Tensor:
    return torch.from_numpy(
        np.stack(arrays).astype(np.int64)
    )  # (B, T), the dtype ShardLoader hands out


def bare_loader(urls: list[str], num_workers: int) -> DataLoader:
    """The plain WebDataset recipe: shards split over workers, decode, batch; nothing else."""
    import webdataset as wds

    dataset = (
        # Its default workersplitter hands each DataLoader worker whole shards: no shard is read
        # twice.
        wds.WebDataset(urls, shardshuffle=False)
        .map(_decode_input_ids)
        .batched(MICRO_BATCH, collation_fn=_stack, partial=False)
    )
    return DataLoader(dataset, batch_size=None, num_workers=num_workers)


def our_loader(data_dir: Path, num_workers: int):
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    return ShardLoader(
        LoaderPlan(
            str(data_dir),
            TASK,
            SPLIT,
            micro_batch_size=MICRO_BATCH,
            num_workers=num_workers,
            seed=0,
        )
    )


def time_epoch(loader, max_batches: int | None) -> dict:
    """Tokens/s of one pass (worker start-up included) and the time to the first batch."""
    tokens = batches = 0
    started = time.perf_counter()
    first = None
    for batch in loader:
        ids = batch["input_ids"] if isinstance(batch, dict) else batch
        tokens += ids.numel()
        batches += 1
        if first is None:
            first = time.perf_counter() - started
        if max_batches is not None and batches >= max_batches:
            break
    seconds = time.perf_counter() - started
    return {
        "tokens": tokens,
        "batches": batches,
        "seconds": seconds,
        "first_batch_s": first,
        "tokens_per_s": tokens / seconds,
    }


def bench_loader(
    data_dir: Path, workers: list[int], repeats: int, max_batches: int | None
) -> list[dict]:
    from pipeline.format import read_manifest, shard_entries

    entries = shard_entries(read_manifest(data_dir), TASK, SPLIT)
    urls = [str(data_dir / entry["path"]) for entry in entries if entry["samples"] > 0]
    rows = []
    for num_workers in workers:
        makers = {
            "ours": lambda: our_loader(data_dir, num_workers),
            "bare": lambda: bare_loader(urls, num_workers),
        }
        for make in makers.values():  # warm-up: page cache, lazy imports
            time_epoch(make(), max_batches)
        runs: dict[str, list[dict]] = {name: [] for name in makers}
        for _ in range(repeats):
            for name, make in makers.items():  # alternate, so drift in machine load hits both alike
                runs[name].append(time_epoch(make(), max_batches))
        row = {"num_workers": num_workers, "shards": len(urls)}
        for name, results in runs.items():
            row[name] = statistics.median(r["tokens_per_s"] for r in results)
            row[f"{name}_first_ms"] = 1000 * statistics.median(r["first_batch_s"] for r in results)
            row[f"{name}_epoch_s"] = statistics.median(r["seconds"] for r in results)
            row[f"{name}_tokens"] = results[0]["tokens"]
            row[f"{name}_spread"] = (
                min(r["tokens_per_s"] for r in results),
                max(r["tokens_per_s"] for r in results),
            )
        row["ratio"] = row["ours"] / row["bare"]
        # Best against best: on a shared machine the fastest run is the one least disturbed by
        # others.
        row["ratio_best"] = row["ours_spread"][1] / row["bare_spread"][1]
        rows.append(row)
        print(
            f"loader num_workers={num_workers}: ours {row['ours'] / 1e6:.3f} M tok/s "
            f"(min {row['ours_spread'][0] / 1e6:.3f}, max {row['ours_spread'][1] / 1e6:.3f}), "
            f"bare {row['bare'] / 1e6:.3f} M tok/s (min {row['bare_spread'][0] / 1e6:.3f}, "
            f"max {row['bare_spread'][1] / 1e6:.3f}), ours/bare {row['ratio']:.2f}",
            flush=True,
        )
    return rows


# ---------------------------------------------------------------- prepare


def prepare_config(
    data_dir: Path,
    output_dir: Path,
    num_workers: int,
    fixed_tokenizer: bool | Path,
    source_paths: list[str] | None,
    extra: tuple[str, ...] = (),
):
    from common.configure import load_config
    from pipeline.prepare.config import PrepareConfig

    overrides = [
        f"output_dir={output_dir}",
        "overwrite=true",
        "progress=false",
        f"ray.num_workers={num_workers}",
    ]
    if fixed_tokenizer:
        given = data_dir / "tokenizer.model" if fixed_tokenizer is True else fixed_tokenizer
        overrides.append(f"tokenizer.path={given}")
    overrides.extend(extra)
    if source_paths is not None:
        overrides.append("source.paths=[" + ",".join(f"'{p}'" for p in source_paths) + "]")
    return load_config(PrepareConfig, data_dir / "config.yaml", overrides)


@contextlib.contextmanager
def stage_timer(timings: dict):
    """Time Ray start/stop and each `run_tasks` stage of one prepare run by wrapping, not editing, the runner."""
    from pipeline.prepare import ray_runner

    session, run_tasks = ray_runner.ray_session, ray_runner.run_tasks

    @contextlib.contextmanager
    def timed_session(cfg):
        started = time.perf_counter()
        with session(cfg):
            timings["ray_start"] = time.perf_counter() - started
            yield
            stopping = time.perf_counter()
        timings["ray_stop"] = time.perf_counter() - stopping

    def timed_run_tasks(fn, arguments, **kwargs):
        started = time.perf_counter()
        desc = kwargs.get("desc", fn.__name__)
        try:
            results = run_tasks(fn, arguments, **kwargs)
        finally:
            timings[desc] = time.perf_counter() - started
        # The tasks report their worker's peak RSS (the process's maximum so far); kept aside, not a
        # stage time.
        flat = [r for result in results for r in (result if isinstance(result, list) else [result])]
        timings.setdefault("_rss", {})[desc] = max(
            (r.get("peak_rss_mb", 0.0) for r in flat), default=0.0
        )
        # CPU seconds of the stage's tasks, per worker process: the busiest worker's is the stage's
        # length on a machine where nothing else runs.
        per_worker: Counter = Counter()
        for r in flat:
            per_worker[r.get("worker_pid", 0)] += r.get("task_cpu_s", 0.0)
        timings.setdefault("_cpu", {})[desc] = dict(per_worker)
        return results

    # prepare() imports these names from the module at call time, so patching the module suffices.
    ray_runner.ray_session, ray_runner.run_tasks = timed_session, timed_run_tasks
    try:
        yield timings
    finally:
        ray_runner.ray_session, ray_runner.run_tasks = session, run_tasks


def shard_digests(manifest: dict) -> dict[str, str]:
    return {
        shard["path"]: shard["sha256"]
        for dataset in manifest["datasets"].values()
        for split in dataset["splits"].values()
        for shard in split["shards"]
    }


def run_prepare(cfg) -> dict:
    from pipeline.prepare.job import prepare

    timings: dict = {}
    with stage_timer(timings):
        started = time.perf_counter()
        manifest = prepare(cfg)
        timings["wall"] = time.perf_counter() - started
    shutil.rmtree(cfg.output_dir, ignore_errors=True)
    return {"timings": timings, "manifest": manifest}


def encode_work_texts(cfg, work_dir: Path) -> list[str]:
    """Exactly the texts `encode_bucket` hands to SentencePiece, gathered with the pipeline's own functions."""
    from pipeline.format import DATASET_FOR_TASK, SPLITS
    from pipeline.prepare.encode import unique_chunks
    from pipeline.prepare.scan import MONO, PAIRS, scan_unit
    from pipeline.prepare.sources import expand_paths, plan_units, source_list
    from pipeline.prepare.units import stream_chunks

    units = [
        chunk
        for index, source in enumerate(source_list(cfg))
        for unit in plan_units(expand_paths(source), source, cfg.unit_bytes, index)
        for chunk in (stream_chunks(unit, cfg.unit_bytes) if unit.stream else [unit])
    ]
    for index, unit in enumerate(units):
        scan_unit(index, unit, cfg, str(work_dir))
    unit_sources = [unit.source for unit in units]
    stats = [Counter() for _ in source_list(cfg)]
    texts: list[str] = []
    for dataset in sorted({DATASET_FOR_TASK[task] for task in cfg.tasks}):
        for split in SPLITS:
            for bucket in range(cfg.shard.buckets):
                family = MONO if dataset == "packed" else PAIRS
                lines = [
                    text
                    for _, chunk in unique_chunks(
                        str(work_dir), unit_sources, family, split, bucket, stats
                    )
                    for text in chunk
                ]
                if dataset == "packed":
                    texts.extend(lines)
                else:
                    pairs = [line.split("\t", 1) for line in lines]
                    texts.extend(source for source, _ in pairs)
                    texts.extend(target for _, target in pairs)
    return texts


def bench_encode(
    texts: list[str], model_path: Path, num_threads: int, repeats: int, chunk: int = 0
) -> dict:
    """The tokenizer's own library on `texts` in one process: SentencePiece's `encode` of the list
    (`num_threads` threads, -1 its default), or for a Hugging Face tokenizer.json the tokenizers
    library's `encode_batch` (on one thread with num_threads=1: TOKENIZERS_PARALLELISM=false, as
    prepare's Ray workers run it; on its default thread pool otherwise). `chunk`: in calls of
    that many texts, as prepare makes them (0: one call for all)."""
    if model_path.suffix == ".json":
        from tokenizers import Tokenizer

        backend = Tokenizer.from_file(str(model_path))
        os.environ["TOKENIZERS_PARALLELISM"] = "false" if num_threads == 1 else "true"

        def encode(batch):
            return [e.ids for e in backend.encode_batch(batch, add_special_tokens=False)]
    else:
        from pipeline.tokenizer import load_tokenizer

        processor = load_tokenizer(model_path).processor  # the SentencePiece library itself

        def encode(batch):
            return processor.encode(batch, num_threads=num_threads)

    encode(texts[:1000])  # warm-up
    size = chunk or len(texts)
    seconds = []
    tokens = 0
    for _ in range(repeats):
        started = time.perf_counter()
        ids = [
            one
            for start in range(0, len(texts), size)
            for one in encode(texts[start : start + size])
        ]
        seconds.append(time.perf_counter() - started)
        tokens = sum(len(piece_ids) for piece_ids in ids)
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return {
        "seconds": statistics.median(seconds),
        "samples": seconds,
        "tokens": tokens,
        "texts": len(texts),
    }


def hf_tokenizer(data_dir: Path, source_paths: list[str] | None, tmp: Path) -> Path:
    """The hf kind's tokenizer for the same text: a byte-level BPE of the dataset's vocabulary
    size trained by the tokenizers library through prepare itself (`tokenizer.kind=hf`)."""
    from pipeline.format import read_manifest

    vocab = read_manifest(data_dir)["tokenizer"]["vocab_size"]
    out = tmp / "hf-tokenizer"
    cfg = prepare_config(
        data_dir,
        out,
        2,
        False,
        source_paths,
        ("tokenizer.kind=hf", "tokenizer.model_type=bpe", f"tokenizer.vocab_size={vocab}"),
    )
    from pipeline.prepare.job import prepare

    prepare(cfg)
    kept = tmp / "hf-tokenizer.json"
    shutil.copy(out / "tokenizer.json", kept)
    shutil.rmtree(out, ignore_errors=True)
    return kept


def bench_prepare(
    data_dir: Path,
    workers: list[int],
    repeats: int,
    train_run: bool,
    source_paths: list[str] | None,
    tmp: Path,
    kind: str = "sentencepiece",
) -> dict:
    """Prepare with a fixed tokenizer of `kind` (sentencepiece: the dataset's; hf: a byte-level
    BPE trained once on the same text) at each worker count, against the tokenizer's own
    library on the texts of the encode stage, measured before and after the runs."""
    from pipeline.format import read_manifest

    reference_manifest = read_manifest(data_dir)
    reference = shard_digests(reference_manifest)
    tokenizer = data_dir / "tokenizer.model" if kind == "sentencepiece" else None
    if tokenizer is None:
        tokenizer = hf_tokenizer(data_dir, source_paths, tmp)
        reference = None  # the runs are compared with each other
    base_cfg = prepare_config(data_dir, tmp / "texts", 1, tokenizer, source_paths)
    texts = encode_work_texts(base_cfg, tmp / "scan")
    shutil.rmtree(tmp / "scan", ignore_errors=True)
    library = "sp.encode" if kind == "sentencepiece" else "tokenizers encode_batch"

    def baselines() -> tuple[dict, dict, dict]:
        one = bench_encode(texts, tokenizer, 1, max(repeats, 3))
        chunked = bench_encode(texts, tokenizer, 1, max(repeats, 3), ENCODE_CHUNK)
        every = bench_encode(texts, tokenizer, -1, max(repeats, 3))
        print(
            f"{library} of the encode stage's {len(texts):,} texts ({one['tokens']:,} tokens): "
            f"1 thread {one['seconds']:.2f} s in one call, {chunked['seconds']:.2f} s in calls of "
            f"{ENCODE_CHUNK:,}; library default threads {every['seconds']:.2f} s",
            flush=True,
        )
        return one, every, chunked

    before = baselines()
    # One more 1-thread timing of the library (both ways) before each repeat's runs, so that the
    # library and the prepare runs are timed alternately through the machine's changes of load;
    # the ratio is of medians on both sides (a best-of on one side alone would favour it).
    one_thread, in_chunks = list(before[0]["samples"]), list(before[2]["samples"])
    runs: dict[str, list[dict]] = {}
    for repeat in range(repeats):
        one_thread += bench_encode(texts, tokenizer, 1, 1)["samples"]
        in_chunks += bench_encode(texts, tokenizer, 1, 1, ENCODE_CHUNK)["samples"]
        for num_workers in workers:  # alternate worker counts, like the loader runs
            cfg = prepare_config(
                data_dir, tmp / f"out-{num_workers}", num_workers, tokenizer, source_paths
            )
            result = run_prepare(cfg)
            # A --quick subset cannot match the full dataset: None means not checked.
            digests = shard_digests(result["manifest"])
            if reference is None and source_paths is None:
                reference = digests  # the hf kind: the first run is the others' reference
            result["identical"] = None if source_paths is not None else digests == reference
            result["digests"] = shard_digests(result["manifest"])
            runs.setdefault(f"{num_workers}", []).append(result)
            timings = result["timings"]
            print(
                f"prepare ray.num_workers={num_workers} (fixed tokenizer), repeat {repeat + 1}: "
                f"wall {timings['wall']:.1f} s, "
                + ", ".join(
                    f"{k} {v:.1f} s"
                    for k, v in timings.items()
                    if k != "wall" and not k.startswith("_")
                )
                + ("; SHARDS DIFFER from the reference's" if result["identical"] is False else ""),
                flush=True,
            )
    after = baselines()
    one_thread += after[0]["samples"]
    in_chunks += after[2]["samples"]
    baseline = {**before[0], "seconds": statistics.median(one_thread), "samples": one_thread}
    chunked = {**before[2], "seconds": statistics.median(in_chunks), "samples": in_chunks}
    baseline_all = min(before[1], after[1], key=lambda b: b["seconds"])
    trained = None
    if train_run and kind == "sentencepiece":
        cfg = prepare_config(data_dir, tmp / "out-trained", workers[-1], False, source_paths)
        trained = run_prepare(cfg)
        trained["identical"] = shard_digests(trained["manifest"]) == reference
        print(
            f"prepare ray.num_workers={workers[-1]} (tokenizer trained): wall {trained['timings']['wall']:.1f} s",
            flush=True,
        )
    return {
        "kind": kind,
        "library": library,
        "texts": len(texts),
        "baseline": baseline,
        "baseline_chunked": chunked,
        "baseline_all_threads": baseline_all,
        "runs": runs,
        "trained": trained,
        "trained_workers": workers[-1],
        "source_change": source_change(
            reference_manifest, next(iter(runs.values()))[0]["manifest"]
        ),
    }


def source_change(reference: dict, run: dict) -> str:
    """Why a run's shards can differ from the dataset's though the code is the same: other input."""
    counts = [
        (key, reference["sources"].get(key), run["sources"].get(key))
        for key in ("files", "records")
    ]
    changed = [f"{key} {then:,} -> {now:,}" for key, then, now in counts if then != now]
    if changed:
        return (
            "the source files changed since the dataset was prepared (" + ", ".join(changed) + ")"
        )
    return "same source files and records: the dataset was prepared by other code (e.g. before doc_starts existed)"


# ---------------------------------------------------------------- scale


SCALE_RECORDS = (
    28_000  # records per 1x: about the default corpus's encode-stage tokens (20x: about 46 M)
)
RECORDS_PER_FILE = 5_000  # several files, so the scan stage has units to share out


def corpus_pairs(cfg) -> list[tuple[str, str]]:
    """The distinct cleaned (source, target) pairs of the dataset's source, with the pipeline's readers."""
    from pipeline.prepare.readers import read_unit
    from pipeline.prepare.sources import expand_paths, plan_units

    pairs: dict[tuple[str, str], None] = {}
    for unit in plan_units(expand_paths(cfg.source), cfg.source, cfg.unit_bytes):
        for source, target in read_unit(unit, cfg.source, Counter()):
            pairs[(source, target or source)] = None
    return list(pairs)


def synthetic_corpus(
    pairs: list[tuple[str, str]], records: int, directory: Path, seed: int = 0
) -> list[str]:
    """`records` jsonl records, each two pairs drawn by a seeded sampler and joined; written in files of RECORDS_PER_FILE."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for start in range(0, records, RECORDS_PER_FILE):
        path = directory / f"part-{start // RECORDS_PER_FILE:05d}.jsonl"
        with open(path, "w", encoding="utf-8") as fh:
            for _ in range(min(RECORDS_PER_FILE, records - start)):
                (s1, t1), (s2, t2) = rng.choice(pairs), rng.choice(pairs)
                fh.write(
                    json.dumps({"text": f"{s1} {s2}", "target": f"{t1} {t2}"}, ensure_ascii=False)
                    + "\n"
                )
        paths.append(str(path))
    return paths


def bench_scale(
    data_dir: Path, scales: list[int], per_x: int, num_workers: int, tmp: Path
) -> list[dict]:
    base = prepare_config(data_dir, tmp / "scale-out", num_workers, True, None)
    pairs = corpus_pairs(base)
    rows = []
    for scale in scales:
        corpus = tmp / f"scale-{scale}x"
        paths = synthetic_corpus(pairs, per_x * scale, corpus)
        cfg = prepare_config(data_dir, tmp / "scale-out", num_workers, True, paths)
        cfg.source.format, cfg.source.text_field, cfg.source.target_field = (
            "jsonl",
            "text",
            "target",
        )
        result = run_prepare(cfg)
        shutil.rmtree(corpus, ignore_errors=True)
        manifest, timings = result["manifest"], result["timings"]
        tokens = sum(d["stats"].get("tokens", 0) for d in manifest["datasets"].values())
        row = {
            "scale": scale,
            "records": per_x * scale,
            "tokens": tokens,
            "wall": timings["wall"],
            "scan": timings.get("scan", 0.0),
            "encode": timings.get("encode", 0.0),
            "ray": timings.get("ray_start", 0.0) + timings.get("ray_stop", 0.0),
            "rss": timings.get("_rss", {}),
        }
        rows.append(row)
        print(
            f"scale {scale}x: {row['records']:,} records, {tokens:,} tokens written, wall {row['wall']:.1f} s "
            f"(scan {row['scan']:.1f}, encode {row['encode']:.1f}, Ray start+stop {row['ray']:.1f}), peak RSS per worker "
            f"scan {row['rss'].get('scan', 0):.0f} MB, encode {row['rss'].get('encode', 0):.0f} MB",
            flush=True,
        )
    return rows


def scale_table(rows: list[dict], num_workers: int) -> str:
    lines = [
        f"Scale: synthetic jsonl pairs from the default corpus, {num_workers} Ray workers, fixed tokenizer; "
        "tokens = tokens written to shards (packed + translation); tokens/s over the scan + encode stages "
        "(Ray start/stop excluded) and over the wall",
        "",
        "| size | records | tokens | wall s | scan s | encode s | tokens/s, stages | tokens/s, wall | "
        "peak RSS per worker, scan / encode (MB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        stages = row["scan"] + row["encode"]
        lines.append(
            f"| {row['scale']}x | {row['records']:,} | {row['tokens']:,} | {row['wall']:.1f} | {row['scan']:.1f} | "
            f"{row['encode']:.1f} | {_rate(row['tokens'] / stages)} | {_rate(row['tokens'] / row['wall'])} | "
            f"{row['rss'].get('scan', 0):.0f} / {row['rss'].get('encode', 0):.0f} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- one large compressed file


BIG_WORDS = 50_000  # made-up words of the big file's vocabulary
BIG_REPEATS = 0.03  # fraction of documents that are a copy of an earlier one (de-duplicated away)


def big_jsonl_zst(path: Path, compressed_mb: float, seed: int = 0) -> dict:
    """One jsonl.zst of about `compressed_mb` MB, written as a stream (its header does not
    declare the size, as with `zstd < in > out`); documents of 20-400 words from a Zipf law."""
    import zstandard

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = [
        "".join(rng.choice(letters) for _ in range(rng.randint(1, 10))) for _ in range(BIG_WORDS)
    ]
    cumulative = list(itertools.accumulate(1 / (rank + 1) for rank in range(BIG_WORDS)))
    target = compressed_mb * 1e6
    documents = raw = 0
    earlier: list[str] = []
    with (
        open(path, "wb") as fh,
        zstandard.ZstdCompressor(level=3).stream_writer(fh, closefd=False) as out,
    ):
        while fh.tell() < target:
            batch = []
            for _ in range(2000):
                if earlier and rng.random() < BIG_REPEATS:
                    line = rng.choice(earlier)
                else:
                    text = (
                        " ".join(
                            rng.choices(words, cum_weights=cumulative, k=rng.randint(20, 400))
                        ).capitalize()
                        + "."
                    )
                    line = json.dumps({"text": text, "url": f"https://example.org/{documents}"})
                    if len(earlier) < 5000:
                        earlier.append(line)
                batch.append(line)
                documents += 1
            data = ("\n".join(batch) + "\n").encode()
            raw += len(data)
            out.write(data)
            out.flush(zstandard.FLUSH_BLOCK)  # so that fh.tell() follows the compressed size
    return {"documents": documents, "decompressed": raw, "compressed": path.stat().st_size}


def bench_big_file(compressed_mb: float, unit_mb: float, repeats: int, tmp: Path) -> dict:
    from common.configure import load_config
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.readers import read_unit
    from pipeline.prepare.sources import source_list
    from pipeline.prepare.train_tokenizer import train_tokenizer
    from pipeline.prepare.units import Unit

    path = tmp / "web.jsonl.zst"
    started = time.perf_counter()
    corpus = big_jsonl_zst(path, compressed_mb)
    print(
        f"big file: {corpus['documents']:,} documents, {corpus['decompressed'] / 1e6:.0f} MB, "
        f"{corpus['compressed'] / 1e6:.1f} MB as jsonl.zst, generated in {time.perf_counter() - started:.0f} s",
        flush=True,
    )

    def config(output: Path, workers: int, model: str = ""):
        overrides = [
            f"output_dir={output}",
            "overwrite=true",
            "progress=false",
            "tasks=[causal_lm]",
            "source.format=jsonl",
            f"source.paths=[{path}]",
            "seq_len=1024",
            f"ray.num_workers={workers}",
            f"unit_bytes={int(unit_mb * (1 << 20))}",
            "tokenizer.vocab_size=8000",
            "shard.buckets=8",
            "split.valid=0.005",
            "split.test=0.005",
        ]
        return load_config(
            PrepareConfig, None, overrides + ([f"tokenizer.path={model}"] if model else [])
        )

    sample_cfg = config(tmp / "unused", 1)
    texts = []
    for text, _ in read_unit(Unit(str(path)), source_list(sample_cfg)[0], Counter()):
        texts.append(text)
        if len(texts) >= 20_000:
            break
    model = tmp / "tokenizer.model"
    model.write_bytes(train_tokenizer(texts, sample_cfg.tokenizer))
    runs: dict[int, list[dict]] = {1: [], 2: []}
    for repeat in range(repeats):
        for workers in (1, 2):
            result = run_prepare(config(tmp / f"big-out-{workers}", workers, str(model)))
            result["digests"] = shard_digests(result["manifest"])
            runs[workers].append(result)
            timings = result["timings"]
            print(
                f"big file, ray.num_workers={workers}, repeat {repeat + 1}: scan {timings['scan']:.1f} s, "
                f"encode {timings['encode']:.1f} s, wall {timings['wall']:.1f} s, "
                f"{result['manifest']['sources']['units']} units",
                flush=True,
            )
    return {**corpus, "unit_mb": unit_mb, "runs": runs}


def big_file_table(result: dict, repeats: int) -> str:
    one = result["runs"][1]
    stages = {
        workers: statistics.median(r["timings"]["scan"] + r["timings"]["encode"] for r in runs)
        for workers, runs in result["runs"].items()
    }
    tokens = one[0]["manifest"]["datasets"]["packed"]["stats"]["tokens"]
    lines = [
        f"One jsonl.zst of {result['compressed'] / 1e6:.1f} MB ({result['decompressed'] / 1e6:.0f} MB decompressed, "
        f"{result['documents']:,} documents), causal_lm, seq_len 1024, fixed tokenizer of 8,000 pieces, "
        f"chunks of {result['unit_mb']:g} MiB decompressed ({one[0]['manifest']['sources']['units']} units); "
        f"median of {repeats}; {tokens:,} tokens",
        "",
        "| Ray workers | scan s | encode s | scan + encode s | speed-up, scan + encode | wall s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for workers, runs in result["runs"].items():
        lines.append(
            f"| {workers} | {_median_timing(runs, 'scan'):.1f} | {_median_timing(runs, 'encode'):.1f} | "
            f"{stages[workers]:.1f} | {stages[1] / stages[workers]:.2f}x | {_median_timing(runs, 'wall'):.1f} |"
        )
    digests = [r["digests"] for runs in result["runs"].values() for r in runs]
    lines.append(
        f"(target: 2 workers >= 1.7x one over scan + encode; shards of every run identical: "
        f"{'yes' if all(d == digests[0] for d in digests) else 'NO'})"
    )
    # The same stages in CPU seconds of the tasks: what each worker did, whatever else ran on the
    # machine.
    lines += [
        "",
        "| Ray workers | scan: task CPU s per worker | encode: task CPU s per worker | "
        "busiest worker, scan + encode | speed-up by busiest worker's CPU s |",
        "|---:|---:|---:|---:|---:|",
    ]
    busiest = {}
    for workers, runs in result["runs"].items():
        cpu = runs[0]["timings"]["_cpu"]
        busiest[workers] = max(cpu["scan"].values()) + max(cpu["encode"].values())
        lines.append(
            f"| {workers} | {', '.join(f'{v:.1f}' for v in sorted(cpu['scan'].values(), reverse=True))} | "
            f"{', '.join(f'{v:.1f}' for v in sorted(cpu['encode'].values(), reverse=True))} | "
            f"{busiest[workers]:.1f} | {busiest[1] / busiest[workers]:.2f}x |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------- report


def _rate(per_second: float) -> str:
    return f"{per_second / 1e6:.2f} M" if per_second >= 1e6 else f"{per_second / 1e3:.0f} k"


def _stage_keys(timings: dict) -> list[str]:
    return [k for k in timings if k != "wall" and not k.startswith("_")]


def _median_timing(results: list[dict], key: str) -> float:
    return statistics.median(r["timings"].get(key, 0.0) for r in results)


def loader_table(rows: list[dict], repeats: int) -> str:
    lines = [
        f"Loader: {TASK}/{SPLIT}, micro batch {MICRO_BATCH}, {rows[0]['shards']} shards, one epoch per run, "
        f"median of {repeats} alternating runs (M tokens/s; first batch in ms; target ours/bare >= 0.9)",
        "",
        "| num_workers | ShardLoader | bare WebDataset | ours / bare | ours / bare, best runs | first batch ours | first batch bare |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['num_workers']} | {row['ours'] / 1e6:.3f} | {row['bare'] / 1e6:.3f} | "
            f"{row['ratio']:.2f}x | {row['ratio_best']:.2f}x | {row['ours_first_ms']:.0f} | {row['bare_first_ms']:.0f} |"
        )
    return "\n".join(lines)


def prepare_table(result: dict, repeats: int) -> str:
    tokens = result["baseline"]["tokens"]
    lib = result["library"]
    lines = [
        f"Prepare, {result['kind']} tokenizer: {result['texts']:,} texts, {tokens:,} tokens through "
        f"{lib}; wall = whole prepare() "
        f"(Ray start and stop included), median of {repeats}; encode stage = Ray tasks that read the buckets, "
        "tokenize, pack and write the shards",
        "",
        "| run | wall s | encode stage s | tokens/s, wall | tokens/s, encode stage |",
        "|---|---:|---:|---:|---:|",
    ]
    for workers, runs in result["runs"].items():
        wall, encode = _median_timing(runs, "wall"), _median_timing(runs, "encode")
        lines.append(
            f"| prepare, {workers} Ray worker{'s' if workers != '1' else ''}, fixed tokenizer | {wall:.1f} | "
            f"{encode:.1f} | {_rate(tokens / wall)} | {_rate(tokens / encode)} |"
        )
    if result["trained"] is not None:
        wall = result["trained"]["timings"]["wall"]
        encode = result["trained"]["timings"].get("encode", 0.0)
        lines.append(
            f"| prepare, {result['trained_workers']} Ray workers, tokenizer trained (as shipped) | "
            f"{wall:.1f} | {encode:.1f} | {_rate(tokens / wall)} | {_rate(tokens / encode)} |"
        )
    for label, baseline in (
        (
            f"{lib}, 1 process, 1 thread (median of {len(result['baseline']['samples'])}, "
            f"{min(result['baseline']['samples']):.2f}-{max(result['baseline']['samples']):.2f} s)",
            result["baseline"],
        ),
        (
            f"{lib}, 1 process, 1 thread, in calls of {ENCODE_CHUNK:,} texts as prepare makes them "
            f"(median of {len(result['baseline_chunked']['samples'])}, "
            f"{min(result['baseline_chunked']['samples']):.2f}-"
            f"{max(result['baseline_chunked']['samples']):.2f} s)",
            result["baseline_chunked"],
        ),
        (f"{lib}, 1 process, library default threads", result["baseline_all_threads"]),
    ):
        lines.append(
            f"| {label} | | {baseline['seconds']:.2f} | | {_rate(tokens / baseline['seconds'])} |"
        )
    sp_rate = tokens / result["baseline"]["seconds"]
    chunk_rate = tokens / result["baseline_chunked"]["seconds"]
    lines += [
        "",
        f"| Ray workers | encode stage s | tokens/s per worker | / {lib} 1 thread | "
        f"/ the same in calls of {ENCODE_CHUNK:,} | "
        "speed-up over 1 worker | Ray start s | Ray stop s | peak RSS per worker, scan / encode (MB) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    one = _median_timing(result["runs"]["1"], "encode") if "1" in result["runs"] else None
    for workers, runs in result["runs"].items():
        encode = _median_timing(runs, "encode")
        per_worker = tokens / (encode * int(workers))
        rss = runs[0]["timings"].get("_rss", {})
        lines.append(
            f"| {workers} | {encode:.2f} | {_rate(per_worker)} | {per_worker / sp_rate:.2f} | "
            f"{per_worker / chunk_rate:.2f} | "
            f"{(one / encode) if one else float('nan'):.2f}x | {_median_timing(runs, 'ray_start'):.2f} | "
            f"{_median_timing(runs, 'ray_stop'):.2f} | {rss.get('scan', 0):.0f} / {rss.get('encode', 0):.0f} |"
        )
    lines.append(
        "(targets: >= 1.0 M tokens/s per worker, >= 0.40 of sp.encode on 1 thread, 2 workers >= 1.8x one)"
        if result["kind"] == "sentencepiece"
        else "(target: >= 0.80 of tokenizers' encode_batch on 1 thread per worker, against the "
        "faster of its two uses)"
    )
    return "\n".join(lines)


def stage_breakdown(result: dict) -> str:
    parts = []
    reference = "dataset's" if result["kind"] == "sentencepiece" else "first run's"
    for workers, runs in result["runs"].items():
        keys = _stage_keys(runs[0]["timings"])
        other = statistics.median(
            r["timings"]["wall"] - sum(r["timings"][k] for k in keys) for r in runs
        )
        detail = ", ".join(f"{k} {_median_timing(runs, k):.1f}" for k in keys)
        checks = {r["identical"] for r in runs}
        identical = (
            "not checked (--quick subset)"
            if checks == {None}
            else ("yes" if checks == {True} else "NO")
        )
        parts.append(
            f"  {workers} worker(s): {detail}, other (plan, manifest, publish) {other:.1f} s; "
            f"shards identical to the {reference}: {identical}"
        )
    if result["trained"] is not None:
        timings = result["trained"]["timings"]
        between = timings["wall"] - sum(timings[k] for k in _stage_keys(timings))
        parts.append(
            f"  trained tokenizer: outside the Ray stages (tokenizer training, manifest) {between:.1f} s; "
            f"shards identical to the dataset's: {'yes' if result['trained']['identical'] else 'NO'}"
        )
    digests = [r["digests"] for runs in result["runs"].values() for r in runs]
    parts.append(
        f"  shards of every run identical to each other (1 and 2 workers, all repeats): "
        f"{'yes' if all(d == digests[0] for d in digests) else 'NO'}"
    )
    if any(r["identical"] is False for runs in result["runs"].values() for r in runs):
        parts.append(
            f"  why the dataset's shards differ: {result['source_change']}; prepare it again to compare"
        )
    return "Prepare stage medians (s):\n" + "\n".join(parts)


def machine_line() -> str:
    import ray
    import sentencepiece
    import webdataset

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    load = os.getloadavg()[0]
    return (
        f"{cpus}-core machine (load average {load:.2f} at start), {platform.processor() or platform.machine()}; "
        f"Python {platform.python_version()}, torch {torch.__version__}, webdataset {webdataset.__version__}, "
        f"ray {ray.__version__}, sentencepiece {sentencepiece.__version__}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="a prepared dataset (default: %(default)s)"
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="timed loader runs per setting (default 7; 2 with --quick)",
    )
    parser.add_argument(
        "--prepare-repeats",
        type=int,
        default=None,
        help="prepare runs per worker count (default 3; 1 with --quick)",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes for a smoke run")
    parser.add_argument(
        "--scale", default="", help="synthetic corpus sizes, e.g. 1,10,20 (x the default corpus)"
    )
    parser.add_argument("--skip-loader", action="store_true", help="prepare figures only")
    parser.add_argument(
        "--tokenizer-kinds",
        default="sentencepiece,hf",
        help="prepare with each: the dataset's SentencePiece model, and a byte-level BPE of the "
        "tokenizers library trained on the same text (default: %(default)s)",
    )
    parser.add_argument(
        "--big-file",
        type=float,
        default=0.0,
        help="instead: one generated jsonl.zst of this many MB compressed, 1 vs 2 workers",
    )
    parser.add_argument(
        "--unit-mb",
        type=float,
        default=16.0,
        help="with --big-file: unit_bytes in MiB, the decompressed chunks (default %(default)s)",
    )
    args = parser.parse_args(argv)
    if args.big_file:
        command = "python " + " ".join(
            shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]
        )
        header = machine_line()
        print(header, flush=True)
        repeats = args.prepare_repeats or 1
        with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
            result = bench_big_file(args.big_file, args.unit_mb, repeats, Path(tmp))
        print(f"\nFigures from a {header}; load average {os.getloadavg()[0]:.2f} at the end.\n")
        print(big_file_table(result, repeats))
        print(f"\nCommand: `{command}`")
        return 0
    scales = [int(x) for x in args.scale.split(",") if x.strip()]
    repeats = args.repeats or (2 if args.quick else 7)
    prepare_repeats = args.prepare_repeats or (1 if args.quick else 3)
    data_dir = args.data.resolve()
    if not (data_dir / "manifest.json").is_file():
        print(
            f"bench_data: no prepared dataset at {data_dir} (no manifest.json); make it with: "
            "python -m pipeline.prepare configs/prepare_gettext_en_de.yaml",
            file=sys.stderr,
        )
        return 2
    if not (data_dir / "config.yaml").is_file() or not (data_dir / "tokenizer.model").is_file():
        print(
            f"bench_data: {data_dir} lacks config.yaml or tokenizer.model; prepare it again",
            file=sys.stderr,
        )
        return 2

    command = "python " + " ".join(
        shlex.quote(a) for a in [os.path.relpath(__file__, os.getcwd()), *sys.argv[1:]]
    )
    header = machine_line()
    print(header, flush=True)
    started = time.perf_counter()

    loader_rows = (
        None
        if args.skip_loader
        else bench_loader(
            data_dir, [0, 1] if args.quick else [0, 1, 2], repeats, 40 if args.quick else None
        )
    )

    source_paths = None
    if args.quick:
        from pipeline.prepare.sources import expand_paths

        source_paths = expand_paths(prepare_config(data_dir, data_dir, 1, True, None).source)[:8]
    with tempfile.TemporaryDirectory(prefix="bench_data-") as tmp:
        prepare_results = [
            bench_prepare(
                data_dir, [1, 2], prepare_repeats, not args.quick, source_paths, Path(tmp), kind
            )
            for kind in args.tokenizer_kinds.split(",")
        ]
        scale_rows = (
            bench_scale(data_dir, scales, 2_000 if args.quick else SCALE_RECORDS, 2, Path(tmp))
            if scales
            else None
        )

    total = time.perf_counter() - started
    print()
    print(f"Figures from a {header}; load average {os.getloadavg()[0]:.2f} at the end.")
    print()
    if loader_rows:
        print(loader_table(loader_rows, repeats))
        print()
    for prepare_result in prepare_results:
        print(prepare_table(prepare_result, prepare_repeats))
        print()
        print(stage_breakdown(prepare_result))
        print()
    if scale_rows:
        print(scale_table(scale_rows, 2))
        print()
    print(
        f"Benchmark wall time {total:.0f} s. Command: `{command}`"
        + (" (quick: smoke sizes)" if args.quick else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
