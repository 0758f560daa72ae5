"""Every curation stage at scale: a corpus of real text of this machine, grown to `--gb` GB, through
`pipeline.prepare` with language identification, the quality rules, PII, near-duplicates and
decontamination on, with 2 Ray workers, 1 worker, and 2 workers at another unit size; prints
figures, asserts nothing.

    python benchmarks/bench_curation.py [--gb 1.0] [--keep DIR] [--work DIR]

The corpus (`corpus.jsonl`, monolingual): documents of 3-8 paragraphs drawn at random from the
paragraphs of the system's man pages, licenses, copyright files and Python docstrings
(`near_dup_corpus.source_paragraphs`); beside them planted near-copies of earlier documents (10%,
5% of the words replaced), German documents (3%, the German message catalogs' sentences),
navigation boilerplate (2%) and documents with an e-mail and a public IP address (2%).
Decontamination runs against an evaluation file of 2,000 documents made from paragraphs the
corpus never uses (every 20th), not the corpus's own splits: the corpus reuses its paragraphs
(a machine holds a few tens of MB of distinct text), so its valid documents share 13-grams with
much of its training text, and the stage would drop most of it. A
tokenizer is trained once on a sample (the first run) and given to the others, so the runs time
the stages, not SentencePiece's training.

Printed: per stage, the input MB, the seconds its tasks spent (summed over workers) and MB/s per
worker; the peak resident memory of a worker in each stage against prepare's printed estimate;
the wall time of the Ray stages with 1 and 2 workers and their ratio (target >= 1.8); and
whether the shards of the three runs are byte-identical.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import json
import os
import random
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_data import stage_timer  # noqa: E402
from near_dup_corpus import source_paragraphs  # noqa: E402

MB = 1 << 20
BOILERPLATE = "Home\nProducts\nAbout us\nContact\nLogin\nCart (0)\nFollow us on social media\n"


def german_sentences() -> list[str]:
    import gettext

    out = []
    for path in sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)
        except (OSError, UnicodeDecodeError):
            continue
        for value in catalog._catalog.values():  # noqa: SLF001
            if isinstance(value, str) and len(value.split()) >= 6 and value.endswith("."):
                out.append(" ".join(value.split()))
    return out


def write_corpus(path: Path, gigabytes: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    # distinct paragraphs (a license's are in many copyright files), so that the held-out ones
    # below are not also the corpus's
    pool = list(
        dict.fromkeys(p for paras in source_paragraphs() for p in paras if len(p.split()) >= 12)
    )
    # every 20th paragraph is the evaluation file's, never the corpus's
    paragraphs = [p for i, p in enumerate(pool) if i % 20]
    held_out = [p for i, p in enumerate(pool) if not i % 20]
    with open(path.with_name("eval.txt"), "w", encoding="utf-8") as fh:
        for _ in range(2000):
            fh.write(" ".join(rng.sample(held_out, 3)) + "\n")
    german = german_sentences()
    vocab = [w for p in paragraphs[:2000] for w in p.split()]
    target = int(gigabytes * 1e9)
    written, counts, recent = 0, Counter(), []
    with open(path, "w", encoding="utf-8") as fh:
        while written < target:
            roll = rng.random()
            if roll < 0.10 and recent:
                words = rng.choice(recent).split(" ")
                for _ in range(max(1, len(words) // 20)):
                    words[rng.randrange(len(words))] = rng.choice(vocab)
                text, kind = " ".join(words), "near_copy"
            elif roll < 0.13:
                text, kind = " ".join(rng.sample(german, 12)), "german"
            elif roll < 0.15:
                text, kind = BOILERPLATE, "boilerplate"
            else:
                text = "\n".join(rng.sample(paragraphs, rng.randint(3, 8)))
                kind = "document"
                if roll < 0.17:
                    user = "".join(rng.choice("abcdefghij") for _ in range(6))
                    text += f"\nWrite to {user}@mail{rng.randint(1, 99)}.org or 8.{rng.randint(1, 250)}.4.4."
                    kind = "pii"
                recent.append(text)
                if len(recent) > 200:
                    recent.pop(rng.randrange(len(recent)))
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            fh.write(line)
            written += len(line.encode("utf-8"))
            counts[kind] += 1
    return {"bytes": written, **counts}


CONFIG = """\
tasks: [causal_lm]
seq_len: 512
sources:
  - name: web
    format: jsonl
    paths: [{corpus}]
    source_lang: en
    target_lang: en
    language: {{enabled: true}}
    quality: {{enabled: true}}
split: {{valid: 0.005, test: 0.005}}
tokenizer: {{vocab_size: 16000, sample_texts: 20000, num_threads: 2}}
shard: {{max_samples: 8192, buckets: 8}}
near_dedup: {{enabled: true}}
decontamination: {{enabled: true, own_splits: false, eval_files: [{{path: {eval}}}]}}
"""


def run(config: Path, out: Path, workers: int, extra: list[str]) -> dict:
    from common.configure import load_config
    from pipeline.prepare.config import PrepareConfig
    from pipeline.prepare.job import prepare
    from pipeline.prepare.memory import estimate_worker_memory
    from pipeline.prepare.sources import (
        expand_paths,
        plan_units,
        planned_unit_bytes,
        source_list,
    )

    cfg = load_config(
        PrepareConfig,
        config,
        [f"output_dir={out}", "overwrite=true", "progress=false", f"ray.num_workers={workers}"]
        + extra,
    )
    files = [expand_paths(s) for s in source_list(cfg)]
    total = sum(os.path.getsize(p) for f in files for p in f)
    unit_bytes = planned_unit_bytes(cfg.unit_bytes, total)  # as prepare plans them
    units = [
        u for i, f in enumerate(files) for u in plan_units(f, source_list(cfg)[i], unit_bytes, i)
    ]
    from pipeline.prepare import curation

    run_cfg = dataclasses.replace(curation.partitions_sized(cfg, total), unit_bytes=unit_bytes)
    estimate = estimate_worker_memory(run_cfg, files, units)
    timings: dict = {}
    stage_cpu: Counter = Counter()
    import pipeline.prepare.ray_runner as runner

    with stage_timer(timings):
        timed = runner.run_tasks  # stage_timer's, which times each stage

        def collecting(fn, arguments, **kwargs):
            results = timed(fn, arguments, **kwargs)
            for result in results:
                for r in result if isinstance(result, list) else [result]:
                    if isinstance(r, dict):
                        for stage, seconds in r.get("stage_seconds", {}).items():
                            stage_cpu[stage] += seconds
                        stage_cpu["decontamination"] += r.get("decontamination_seconds", 0.0)
            return results

        runner.run_tasks = collecting
        started = time.perf_counter()
        manifest = prepare(cfg)
        timings["wall"] = time.perf_counter() - started
    digests = {
        shard["path"]: shard["sha256"]
        for dataset in manifest["datasets"].values()
        for split in dataset["splits"].values()
        for shard in split["shards"]
    }
    return {
        "timings": timings,
        "stage_cpu": dict(stage_cpu),
        "estimate_mb": estimate.peak_bytes / MB,
        "estimate_why": estimate.why,
        "digests": digests,
        "curation": manifest["curation"],
        "tokens": manifest["datasets"]["packed"]["splits"]["train"]["tokens"],
        "partitions": run_cfg.near_dedup.partitions,
        "units": len(units),
        "unit_bytes": unit_bytes,
    }


def cpu_of(result: dict, desc: str) -> float:
    return sum(result["timings"].get("_cpu", {}).get(desc, {}).values())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=None, help="where the corpus and outputs go")
    parser.add_argument("--keep", action="store_true", help="keep the corpus and datasets")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-curation-"))
    work.mkdir(parents=True, exist_ok=True)
    corpus = work / "corpus.jsonl"
    started = time.perf_counter()
    if not corpus.exists():
        made = write_corpus(corpus, args.gb)
        print(f"corpus: {json.dumps(made)} in {time.perf_counter() - started:.0f} s", flush=True)
    size_mb = corpus.stat().st_size / MB
    config = work / "prepare.yaml"
    config.write_text(CONFIG.format(corpus=corpus, eval=work / "eval.txt"))

    two = run(config, work / "two", 2, [])
    print(f"2 workers: {two['timings']['wall']:.0f} s", flush=True)
    # the first run's tokenizer, given (it is the one the first run trained, so the encode's
    # work is the same): the Ray stages compare, the training is not timed again
    tokenizer = [f"tokenizer.path={work / 'two' / 'tokenizer.model'}"]
    one = run(config, work / "one", 1, tokenizer)
    print(f"1 worker: {one['timings']['wall']:.0f} s", flush=True)
    small = run(config, work / "small-units", 2, tokenizer + ["unit_bytes=4194304"])
    print(f"2 workers, 4 MiB units: {small['timings']['wall']:.0f} s", flush=True)

    from bench_near_dup import cpu_name

    cpu = cpu_name()
    print()
    print(
        f"machine: {os.cpu_count()} cores, {cpu}; corpus {size_mb:,.0f} MiB, {two['units']} units "
        f"({two['unit_bytes'] / MB:.1f} MiB), near_dedup.partitions {two['partitions']}"
    )
    stages = ["scan", "near-dup shuffle", "decontamination keys", "encode"]
    print(f"\n{'stage':<28}{'MiB in':>9}{'task s':>9}{'MiB/s/worker':>14}")
    for desc in stages:
        seconds = cpu_of(two, desc)
        rate = f"{size_mb / seconds:>14,.1f}" if seconds > 0 else f"{'-':>14}"
        print(f"{desc:<28}{size_mb:>9,.0f}{seconds:>9,.1f}{rate}")
    for stage, seconds in sorted(two["stage_cpu"].items()):
        print(
            f"  {stage:<26}{size_mb:>9,.0f}{seconds:>9,.1f}{size_mb / max(seconds, 1e-9):>14,.1f}"
        )
    print(
        f"\npeak memory of a worker (MiB), estimate before the start {two['estimate_mb']:,.0f} "
        f"({two['estimate_why']})"
    )
    for desc in stages:
        print(f"  {desc:<26}{two['timings'].get('_rss', {}).get(desc, 0.0):>9,.0f}")
    ray_one = sum(one["timings"].get(d, 0.0) for d in stages)
    ray_two = sum(two["timings"].get(d, 0.0) for d in stages)
    print(
        f"\nRay stages wall: 1 worker {ray_one:,.0f} s, 2 workers {ray_two:,.0f} s, "
        f"speed-up {ray_one / max(ray_two, 1e-9):.2f}x (target >= 1.8)"
    )
    print(
        f"whole prepare wall: 1 worker {one['timings']['wall']:,.0f} s, 2 workers "
        f"{two['timings']['wall']:,.0f} s (its tokenizer training included)"
    )
    same = two["digests"] == one["digests"] == small["digests"]
    digest = hashlib.sha256(json.dumps(two["digests"], sort_keys=True).encode()).hexdigest()[:16]
    print(
        f"shards identical for 2 workers, 1 worker and 4 MiB units: {same} "
        f"({len(two['digests'])} shards, digest {digest}); train tokens {two['tokens']:,}"
    )
    print("\ncuration (2 workers):")
    from pipeline.inspect import curation_table

    for line in curation_table({"curation": two["curation"]}):
        print("  " + line)
    print(f"near-duplicates: {json.dumps(two['curation'].get('near_dedup', {}))}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
