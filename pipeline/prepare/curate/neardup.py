"""The near-duplicate stage's work files and tasks (`minhash` and `lsh` hold the arithmetic):

scan (per unit): each monolingual text signed, its band keys appended to one file per partition
(`lsh-PPPP.bin`) and its sketch (`minhash.sketches`) to `sketch.bin` -> shuffle (a Ray task per
partition): the records of one partition from every unit, grouped by key into candidate pairs,
each verified by the Jaccard similarity of the two texts' sketches -> driver: clusters joined,
one text of each kept (`lsh.clusters`) -> encode: the others dropped as their lines are read.

A text's band keys carry its split, so clusters never cross splits: a training text close to a
test text is decontamination's to drop, and the test split keeps its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from pipeline.format import SPLITS
from pipeline.prepare.curate import lsh, minhash
from pipeline.prepare.curate.near_dedup_config import NearDedupConfig
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.rss import peak_rss_mb, reset_peak_rss

FLUSH_TEXTS = 2048  # texts signed per numpy batch in the scan


def unit_dir(work_dir: str | Path, unit_index: int) -> Path:
    return Path(work_dir) / f"u{unit_index:06d}"


def partition_file(work_dir: str | Path, unit_index: int, partition: int) -> Path:
    return unit_dir(work_dir, unit_index) / f"lsh-{partition:04d}.bin"


def sketch_files(work_dir: str | Path, unit_index: int) -> tuple[Path, Path, Path]:
    """A unit's sketches: their values (uint32, in the order signed), each text's id (uint64) and
    the end of its values (uint64, counted from the unit's first)."""
    folder = unit_dir(work_dir, unit_index)
    return folder / "sketch.bin", folder / "sketch-ids.bin", folder / "sketch-ends.bin"


_SPLIT_SALT = [np.uint64(0x9E3779B97F4A7C15 * (i + 1) % 2**64) for i in range(len(SPLITS))]


class Signer:
    """One scan unit's signing: texts gathered and signed a batch at a time."""

    def __init__(self, cfg: NearDedupConfig, work_dir: str, unit_index: int, tally: Tally):
        self.cfg, self.work_dir, self.unit_index, self.tally = cfg, work_dir, unit_index, tally
        self.partitions = cfg.partitions
        self.pending: list[tuple[int, str, str]] = []
        self.seconds = 0.0  # spent signing and writing, for the benchmarks
        self.values_written = 0  # sketch values in this unit's sketch.bin so far

    def add(self, doc: int, text: str, split: str) -> None:
        if len(text.split()) < self.cfg.min_words:
            self.tally.count("near_dedup.too_short_to_sign", split)
            return
        self.pending.append((doc, text, split))
        if len(self.pending) >= FLUSH_TEXTS:
            self._flush()

    def finish(self) -> None:
        self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        started = time.perf_counter()
        ids = np.array([doc for doc, _, _ in self.pending], dtype=np.uint64)
        splits = np.array([SPLITS.index(split) for _, _, split in self.pending])
        hashes, offsets, _ = minhash.shingle_hashes(
            [text for _, text, _ in self.pending], self.cfg.ngram
        )
        signatures = minhash.minhash(hashes, offsets, self.cfg)
        values, ends = minhash.sketches(hashes, offsets)
        del hashes, offsets
        keys = lsh.band_keys(signatures, self.cfg)  # (N, bands)
        with np.errstate(over="ignore"):
            salt = np.array(_SPLIT_SALT, dtype=np.uint64)[splits]
            keys = keys ^ salt[:, None]
        folder = unit_dir(self.work_dir, self.unit_index)
        folder.mkdir(parents=True, exist_ok=True)
        lsh.write_band_records(
            lambda p: partition_file(self.work_dir, self.unit_index, p), keys, ids, self.partitions
        )
        for path, array in zip(
            sketch_files(self.work_dir, self.unit_index),
            (values, ids, (ends + self.values_written).astype(np.uint64)),
        ):
            with open(path, "ab") as fh:
                np.ascontiguousarray(array).tofile(fh)
        self.values_written += len(values)
        self.pending = []
        self.seconds += time.perf_counter() - started


class SketchStore:
    """Texts' sketches by id, read from the units' `sketch.bin` as a task needs them: with pread,
    not through a memory map, whose touched pages would count in the task's resident memory."""

    def __init__(self, work_dir: str):
        self.work_dir = work_dir
        self._index: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    def _unit_index(self, unit_index: int) -> tuple[np.ndarray, np.ndarray]:
        if unit_index not in self._index:
            _, ids_path, ends_path = sketch_files(self.work_dir, unit_index)
            ends = np.fromfile(ends_path, dtype=np.uint64).astype(np.int64)
            self._index[unit_index] = (np.fromfile(ids_path, dtype=np.uint64), ends)
        return self._index[unit_index]

    def fetch(self, ids: np.ndarray) -> dict[int, np.ndarray]:
        """The sketch of each of `ids`, by id."""
        out: dict[int, np.ndarray] = {}
        ids = np.unique(np.asarray(ids, dtype=np.uint64))
        units = (ids >> np.uint64(32)).astype(np.int64)
        for unit_index in np.unique(units).tolist():
            wanted = ids[units == unit_index]
            unit_ids, ends = self._unit_index(unit_index)
            rows = np.searchsorted(unit_ids, wanted)
            fd = os.open(sketch_files(self.work_dir, unit_index)[0], os.O_RDONLY)
            try:
                for doc, row in zip(wanted.tolist(), rows.tolist()):
                    start = int(ends[row - 1]) if row else 0
                    data = os.pread(fd, 4 * (int(ends[row]) - start), 4 * start)
                    out[doc] = np.frombuffer(data, dtype=np.uint32)
            finally:
                os.close(fd)
        return out

    def similarity(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """`minhash.sketch_similarity` of each pair (a[i], b[i])."""
        held = self.fetch(np.concatenate((a, b)))
        return minhash.pair_similarity(np.asarray(a), np.asarray(b), held.__getitem__)


def shuffle_partition(partition: int, n_units: int, work_dir: str, cfg: NearDedupConfig) -> dict:
    """One partition's verified candidate pairs, (E, 2) uint64 ids, from every unit's records of
    it: the memory of one partition's records, never the corpus's."""
    reset_peak_rss()
    cpu = time.process_time()
    paths = [partition_file(work_dir, u, partition) for u in range(n_units)]
    candidates = lsh.candidate_pairs([p for p in paths if p.is_file()])
    store = SketchStore(work_dir)
    verified = lsh.verify(candidates, store.similarity, cfg) if len(candidates) else candidates
    return {
        "partition": partition,
        "candidates": int(len(candidates)),
        "edges": verified,
        # for the benchmarks, which add them up per worker
        "peak_rss_mb": peak_rss_mb(),
        "task_cpu_s": time.process_time() - cpu,
        "worker_pid": os.getpid(),
    }
