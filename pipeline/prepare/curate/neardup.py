"""The near-duplicate stage's work files and tasks (`minhash` holds the arithmetic):

scan (per unit): each monolingual text signed, its band keys appended to one file per partition
(`lsh-PPPP.bin`) and its signature to `sig.bin` -> shuffle (a Ray task per partition): the
records of one partition from every unit, grouped by key into candidate pairs, each verified by
the similarity its signatures estimate -> driver: clusters joined, the first text of each (in
corpus order) kept -> encode: the others dropped as their lines are read.

A text's band keys carry its split, so clusters never cross splits: a training text close to a
test text is decontamination's to drop, and the test split keeps its own.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np

from pipeline.format import SPLITS
from pipeline.prepare.curate import minhash
from pipeline.prepare.curate.minhash import NearDedupConfig
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.rss import peak_rss_mb, reset_peak_rss

FLUSH_TEXTS = 2048  # texts signed per numpy batch in the scan


def unit_dir(work_dir: str | Path, unit_index: int) -> Path:
    return Path(work_dir) / f"u{unit_index:06d}"


def partition_file(work_dir: str | Path, unit_index: int, partition: int) -> Path:
    return unit_dir(work_dir, unit_index) / f"lsh-{partition:04d}.bin"


def signature_files(work_dir: str | Path, unit_index: int) -> tuple[Path, Path]:
    """A unit's signatures (rows of uint32, in the order signed) and their text ids (uint64)."""
    folder = unit_dir(work_dir, unit_index)
    return folder / "sig.bin", folder / "sig-ids.bin"


_SPLIT_SALT = [np.uint64(0x9E3779B97F4A7C15 * (i + 1) % 2**64) for i in range(len(SPLITS))]


class Signer:
    """One scan unit's signing: texts gathered and signed a batch at a time."""

    def __init__(self, cfg: NearDedupConfig, work_dir: str, unit_index: int, tally: Tally):
        self.cfg, self.work_dir, self.unit_index, self.tally = cfg, work_dir, unit_index, tally
        self.partitions = cfg.partitions
        self.pending: list[tuple[int, str, str]] = []
        self.seconds = 0.0  # spent signing and writing, for the benchmarks

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
        signatures = minhash.signatures([text for _, text, _ in self.pending], self.cfg)
        keys = minhash.band_keys(signatures, self.cfg)  # (N, bands)
        with np.errstate(over="ignore"):
            salt = np.array(_SPLIT_SALT, dtype=np.uint64)[splits]
            keys = keys ^ salt[:, None]
        folder = unit_dir(self.work_dir, self.unit_index)
        folder.mkdir(parents=True, exist_ok=True)
        minhash.write_band_records(
            lambda p: partition_file(self.work_dir, self.unit_index, p), keys, ids, self.partitions
        )
        sig_path, ids_path = signature_files(self.work_dir, self.unit_index)
        with open(sig_path, "ab") as fh:
            np.ascontiguousarray(signatures).tofile(fh)
        with open(ids_path, "ab") as fh:
            ids.tofile(fh)
        self.pending = []
        self.seconds += time.perf_counter() - started


class SignatureStore:
    """Signature rows by text id, read from the units' `sig.bin` as a shuffle task needs them:
    row by row with pread, not through a memory map, whose touched pages would count in the
    task's resident memory (a map of every unit's signatures is the size of the corpus's)."""

    def __init__(self, work_dir: str, permutations: int, dtype):
        self.work_dir, self.permutations = work_dir, permutations
        self.dtype = np.dtype(dtype)
        self.row_bytes = permutations * self.dtype.itemsize
        self._ids: dict[int, np.ndarray] = {}

    def _unit_ids(self, unit_index: int) -> np.ndarray:
        if unit_index not in self._ids:
            self._ids[unit_index] = np.fromfile(
                signature_files(self.work_dir, unit_index)[1], dtype=np.uint64
            )
        return self._ids[unit_index]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        out = np.empty((len(ids), self.permutations), dtype=self.dtype)
        units = (ids >> np.uint64(32)).astype(np.int64)
        for unit_index in np.unique(units).tolist():
            at = np.flatnonzero(units == unit_index)
            rows = np.searchsorted(self._unit_ids(unit_index), ids[at])
            wanted, where = np.unique(rows, return_inverse=True)
            block = np.empty((len(wanted), self.permutations), dtype=self.dtype)
            fd = os.open(signature_files(self.work_dir, unit_index)[0], os.O_RDONLY)
            try:
                for position, row in enumerate(wanted.tolist()):
                    data = os.pread(fd, self.row_bytes, row * self.row_bytes)
                    block[position] = np.frombuffer(data, dtype=self.dtype)
            finally:
                os.close(fd)
            out[at] = block[where]
        return out


def shuffle_partition(partition: int, n_units: int, work_dir: str, cfg: NearDedupConfig) -> dict:
    """One partition's verified candidate pairs, (E, 2) uint64 ids, from every unit's records of
    it: the memory of one partition's records, never the corpus's."""
    reset_peak_rss()
    cpu = time.process_time()
    paths = [partition_file(work_dir, u, partition) for u in range(n_units)]
    candidates = minhash.candidate_pairs([p for p in paths if p.is_file()])
    store = SignatureStore(work_dir, cfg.bands * cfg.rows, np.uint32)
    verified = minhash.verify(candidates, store.lookup, cfg) if len(candidates) else candidates
    return {
        "partition": partition,
        "candidates": int(len(candidates)),
        "edges": verified,
        # for the benchmarks, which add them up per worker
        "peak_rss_mb": peak_rss_mb(),
        "task_cpu_s": time.process_time() - cpu,
        "worker_pid": os.getpid(),
    }
