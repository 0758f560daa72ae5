"""Near-duplicate removal: pipeline.prepare.curate (minhash, lsh) against datatrove's MinHash.

    python benchmarks/near_dup_corpus.py /tmp/ndc --docs 20000
    python benchmarks/bench_near_dup.py /tmp/ndc [--datatrove-python /tmp/dtvenv/bin/python]
        [--bands 32 --rows 8 --ngram 5 --threshold 0.8 --partitions 8 --unit-docs 2000]

Both run every stage in one process on the same corpus (CORPUS_DIR/corpus.jsonl, read and the
kept documents written back as JSONL by both):

  ours       read -> sign + band_keys + write_band_records per unit of --unit-docs documents
             (--partitions files) -> candidate_pairs per partition -> verify -> clusters -> write
  datatrove  MinhashDedupSignature -> MinhashDedupBuckets -> MinhashDedupCluster ->
             MinhashDedupFilter, each a LocalPipelineExecutor with workers=1 (tasks=1; the buckets stage
             requires one task per bucket, run one after another in the same process), the same n-gram,
             num_buckets = bands, hashes_per_bucket = rows. It runs in its own interpreter
             (--datatrove-python, a venv with `pip install datatrove numpy xxhash regex`); the
             project never imports it. Its word tokenizer is a whitespace split after its own
             text normalization (its English default needs spaCy, slower still).

Quality, from CORPUS_DIR/truth.json (the planted copies and their EXACT Jaccard with their base):
  precision  share of removed documents that have a kept document at exact Jaccard >= 0.7 among
             the kept members of their cluster, their planted base and their planted siblings
  recall     truth clusters join documents at exact Jaccard >= 0.85 (copy-base pairs from the
             truth file, copy-copy pairs of one base computed here); the share of the documents
             beyond one per truth cluster that were removed
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.prepare.curate import lsh  # noqa: E402
from pipeline.prepare.curate import minhash as mh  # noqa: E402
from pipeline.prepare.curate.near_dedup_config import NearDedupConfig  # noqa: E402

DATATROVE_RUNNER = textwrap.dedent(
    """
    import json, os, struct, sys, time
    from pathlib import Path
    args = json.loads(sys.argv[1])
    t0 = time.perf_counter()
    from datatrove.executor import LocalPipelineExecutor
    from datatrove.pipeline.dedup.minhash import (MinhashConfig, MinhashDedupBuckets,
        MinhashDedupCluster, MinhashDedupFilter, MinhashDedupSignature)
    from datatrove.pipeline.readers import JsonlReader
    from datatrove.pipeline.writers.jsonl import JsonlWriter
    from datatrove.utils.word_tokenizers import WordTokenizer

    class Whitespace(WordTokenizer):
        def word_tokenize(self, text):
            return text.split()
        def sent_tokenize(self, text):
            return [text]
        def span_tokenize(self, text):
            return [(0, len(text))]

    work = Path(args["work"])
    cfg = MinhashConfig(n_grams=args["ngram"], num_buckets=args["bands"],
                        hashes_per_bucket=args["rows"], seed=args["seed"])
    reader = lambda: JsonlReader(args["corpus"], glob_pattern="corpus.jsonl", id_key="id")
    times = {}
    def run(name, steps, tasks=1):
        t = time.perf_counter()
        LocalPipelineExecutor(pipeline=steps, tasks=tasks, workers=1,
                              logging_dir=str(work / "logs" / name)).run()
        times[name] = time.perf_counter() - t
    run("signature", [reader(), MinhashDedupSignature(output_folder=str(work / "sigs"),
                                                    config=cfg, language=Whitespace("en"))])
    run("buckets", [MinhashDedupBuckets(input_folder=str(work / "sigs"),
                                        output_folder=str(work / "buckets"), config=cfg)],
        tasks=cfg.num_buckets)  # one task per bucket (it requires that), run one after another
    run("cluster", [MinhashDedupCluster(input_folder=str(work / "buckets"),
                                        output_folder=str(work / "remove"), config=cfg,
                                        save_cluster_id=True)])
    run("filter", [reader(), MinhashDedupFilter(input_folder=str(work / "remove")),
                   JsonlWriter(str(work / "out"))])
    seconds = time.perf_counter() - t0
    def u32(path):
        return list(struct.unpack(f"<{os.path.getsize(path) // 4}I", open(path, "rb").read())) if path.exists() else []
    removed = u32(work / "remove" / "000000.remove")
    cl = u32(work / "remove" / "000000.clusters")
    print(json.dumps({"seconds": seconds, "stages": times, "removed": removed,
                      "cluster_of": dict(zip(map(str, cl[0::2]), cl[1::2]))}))
    """
)


def shingle_set(text: str, n: int) -> set:
    w = mh.normalize(text).split()
    if not w:
        return set()
    return {tuple(w[i : i + n]) for i in range(max(len(w) - n + 1, 1))}


class Exact:
    """Exact shingle Jaccard between corpus documents (sets built on demand, cached)."""

    def __init__(self, texts: list[str], n: int):
        self.texts, self.n, self.sets = texts, n, {}

    def __call__(self, a: int, b: int) -> float:
        for d in (a, b):
            if d not in self.sets:
                self.sets[d] = shingle_set(self.texts[d], self.n)
        x, y = self.sets[a], self.sets[b]
        return len(x & y) / len(x | y) if x or y else 1.0


def find(parent: dict, x: int) -> int:
    while parent.setdefault(x, x) != x:
        parent[x] = parent[parent[x]]
        x = parent[x]
    return x


def truth_clusters(truth: dict, exact: Exact, at: float = 0.85) -> list[list[int]]:
    """Documents joined at exact Jaccard >= `at`: copy-base pairs and copy-copy pairs of a base."""
    parent: dict = {}
    copies = defaultdict(list)
    for t in truth["planted"]:
        copies[t["base"]].append(t["id"])
        if t["jaccard"] >= at:
            parent[find(parent, t["id"])] = find(parent, t["base"])
    for sib in copies.values():
        for i in range(len(sib)):
            for j in range(i + 1, len(sib)):
                if exact(sib[i], sib[j]) >= at:
                    parent[find(parent, sib[i])] = find(parent, sib[j])
    groups = defaultdict(list)
    for x in list(parent):
        groups[find(parent, x)].append(x)
    return [g for g in groups.values() if len(g) > 1]


def quality(removed: set, cluster_of: dict, truth: dict, exact: Exact, tclusters) -> dict:
    """Precision and recall as the module docstring defines them."""
    members = defaultdict(list)
    for d, c in cluster_of.items():
        members[c].append(d)
    base_of = {t["id"]: t["base"] for t in truth["planted"]}
    copies = defaultdict(list)
    for t in truth["planted"]:
        copies[t["base"]].append(t["id"])
    good = 0
    for r in removed:
        cand = {d for d in members.get(cluster_of.get(r), []) if d not in removed}
        if r in base_of:
            b = base_of[r]
            cand |= {b, *copies[b]}
        cand |= set(copies.get(r, []))
        cand = {d for d in cand if d not in removed and d != r}
        if any(exact(r, d) >= 0.7 for d in cand):
            good += 1
    beyond = sum(len(g) - 1 for g in tclusters)
    hit = sum(min(len(g) - 1, sum(d in removed for d in g)) for g in tclusters)
    return {
        "precision": good / len(removed) if removed else 1.0,
        "recall": hit / beyond if beyond else 1.0,
        "truth_beyond_one": beyond,
    }


def run_ours(corpus: Path, cfg: NearDedupConfig, partitions: int, unit_docs: int, out: Path):
    t0 = time.perf_counter()
    with open(corpus / "corpus.jsonl") as f:
        rows = [json.loads(line) for line in f]
    texts = [r["text"] for r in rows]
    ids = np.array([r["id"] for r in rows], dtype=np.uint64)
    work = Path(tempfile.mkdtemp(prefix="ours_", dir=out))
    units = max(1, -(-len(texts) // unit_docs))
    removed, kept, skipped = lsh.near_duplicates_local(
        texts, cfg, work / "bands", partitions=partitions, ids=ids, units=units
    )
    gone = set(removed.tolist())
    with open(work / "kept.jsonl", "w") as f:
        for r in rows:
            if r["id"] not in gone:
                f.write(json.dumps(r) + "\n")
    seconds = time.perf_counter() - t0
    cluster_of = {int(r): int(k) for r, k in zip(removed, kept)}
    cluster_of.update({int(k): int(k) for k in set(kept.tolist())})
    return {"seconds": seconds, "removed": removed.tolist(), "cluster_of": cluster_of}


def run_datatrove(python: str, corpus: Path, cfg: NearDedupConfig, out: Path):
    work = Path(tempfile.mkdtemp(prefix="datatrove_", dir=out))
    script = work / "runner.py"
    script.write_text(DATATROVE_RUNNER)
    args = {
        "work": str(work),
        "corpus": str(corpus),
        "ngram": cfg.ngram,
        "bands": cfg.bands,
        "rows": cfg.rows,
        "seed": cfg.seed,
    }
    env = {**os.environ, "DATATROVE_COLORIZE_LOGS": "0", "PYTHONPATH": ""}
    proc = subprocess.run(
        [python, str(script), json.dumps(args)], capture_output=True, text=True, env=env
    )
    if proc.returncode != 0:
        sys.exit(f"datatrove failed:\n{proc.stderr[-3000:]}")
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["cluster_of"] = {int(k): v for k, v in res["cluster_of"].items()}
    return res


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("corpus", type=Path)
    ap.add_argument("--datatrove-python", default="")
    ap.add_argument("--bands", type=int, default=NearDedupConfig.bands)
    ap.add_argument("--rows", type=int, default=NearDedupConfig.rows)
    ap.add_argument("--ngram", type=int, default=NearDedupConfig.ngram)
    ap.add_argument("--threshold", type=float, default=NearDedupConfig.threshold)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--unit-docs", type=int, default=2000)
    ap.add_argument(
        "--datatrove-also",
        default="14x8,16x16",
        help="more datatrove runs at these bands x rows: its default (14x8) and the 256 "
        "permutations whose LSH threshold is nearest 0.8 on their own (16x16: 0.841)",
    )
    args = ap.parse_args()
    cfg = NearDedupConfig(
        enabled=True,
        ngram=args.ngram,
        bands=args.bands,
        rows=args.rows,
        threshold=args.threshold,
        partitions=args.partitions,
    )
    cfg.check("bench")
    truth = json.loads((args.corpus / "truth.json").read_text())
    texts = [json.loads(line)["text"] for line in open(args.corpus / "corpus.jsonl")]
    exact = Exact(texts, cfg.ngram)
    tclusters = truth_clusters(truth, exact)
    print(lsh.describe(cfg))
    out = Path(tempfile.mkdtemp(prefix="bench_near_dup_"))
    results = []
    try:
        ours = run_ours(args.corpus, cfg, args.partitions, args.unit_docs, out)
        results.append(("ours", f"{cfg.ngram}ng {cfg.bands}x{cfg.rows} t={cfg.threshold:g}", ours))
        if args.datatrove_python:
            dt = run_datatrove(args.datatrove_python, args.corpus, cfg, out)
            results.append(("datatrove", f"{cfg.ngram}ng {cfg.bands}x{cfg.rows} LSH only", dt))
            print(
                "datatrove stages (s): " + " ".join(f"{k} {v:.1f}" for k, v in dt["stages"].items())
            )
            for setting in filter(None, args.datatrove_also.split(",")):
                bands, rows = (int(x) for x in setting.split("x"))
                other = dataclasses.replace(cfg, bands=bands, rows=rows)
                dt = run_datatrove(args.datatrove_python, args.corpus, other, out)
                results.append(("datatrove", f"{cfg.ngram}ng {bands}x{rows} LSH only", dt))
    finally:
        shutil.rmtree(out, ignore_errors=True)
    n = len(texts)
    print(
        f"\ncorpus {args.corpus}: {n} docs, {len(truth['planted'])} planted; truth clusters at J>=0.85: {len(tclusters)}; CPU: {cpu_name()} ({os.cpu_count()} cores), one process per tool"
    )
    head = f"{'tool':<10} {'params':<20} {'docs':>6} {'removed':>7} {'precision':>9} {'recall':>7} {'docs/s':>8} {'seconds':>8}"
    print(head)
    print("-" * len(head))
    for tool, params, res in results:
        q = quality(set(res["removed"]), res["cluster_of"], truth, exact, tclusters)
        print(
            f"{tool:<10} {params:<20} {n:>6} {len(res['removed']):>7} {q['precision']:>9.4f} "
            f"{q['recall']:>7.4f} {n / res['seconds']:>8.0f} {res['seconds']:>8.2f}"
        )


if __name__ == "__main__":
    main()
