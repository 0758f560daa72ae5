"""Near-duplicate removal across a whole corpus: LSH bands over MinHash signatures (`minhash`), a
shuffle of band records into candidate pairs, verification, clusters.

The stages, each a pure function the integrator runs as Ray tasks (one per unit of input, one per
shuffle partition), with an output that does not depend on how the work was split:

1. per unit: `sign` (or `signatures`) -> one (N, K) uint32 signature row per document, K =
   bands x rows; `band_keys` -> one uint64 key per document and band; `write_band_records`
   appends (key, id) records to one file per shuffle partition (`partition_of`). The unit's
   signatures are stored too (a .npy file) for step 3.
2. per partition: `candidate_pairs` reads every unit's file of that partition and joins the
   documents that share a band key (every pair of a small bucket, a star in a big one). Such a task
   holds its partition's records only: `choose_partitions` and `memory_per_task` size that.
3. `verify` keeps the candidate edges whose similarity estimated from the full signatures (the
   fraction of equal values) reaches `threshold`: LSH is permissive (recall), verification gives
   the precision. `clusters` takes the connected components of the verified edges and keeps the
   member with the most edges of each (ties: the smallest id, the first in corpus order); the
   others are removed, except a member that is itself unlike every kept member (joined only
   through a chain), which is kept.

Document ids are the caller's global uint64 ids, whose numeric order is the corpus order.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from pipeline.prepare.curate.minhash import (
    NGRAM_MULT,
    SKETCH,
    Sketches,
    fmix64,
    minhash,
    shingle_hashes,
    sketches,
)
from pipeline.prepare.curate.near_dedup_config import NearDedupConfig

RECORD_BYTES = 16  # a band record on disk: its key and its document's id, uint64 each
# Bytes the shuffle task holds per band record at its peak: the 16-byte records as read, the
# sort's index (8) and the sorted keys and ids (16), plus the edges' working arrays.
TASK_BYTES_PER_RECORD = 64
# A text removed through a chain of near-duplicates needs a kept text at least threshold - this
# alike (estimated): two copies of one original, each 0.85 from it, are about 0.74 from each
# other, and removing the second beside the first is what a user of the threshold expects.
CHAIN_MARGIN = 0.07
# A band bucket of at most this many documents is paired all with all, a bigger one as a star.
SMALL_BUCKET = 8
# Candidate pairs verified at a time (their sketches held together).
VERIFY_CHUNK = 4096

_U64 = np.uint64


def candidate_probability(similarity: float, bands: int, rows: int) -> float:
    """P(two documents at Jaccard `similarity` share at least one band key) = 1-(1-s^r)^b."""
    return 1.0 - (1.0 - similarity**rows) ** bands


def describe(cfg: NearDedupConfig) -> str:
    """One line: the parameters, the LSH threshold (1/b)^(1/r) and P(candidate) at some Jaccards."""
    b, r = cfg.bands, cfg.rows
    probs = " ".join(
        f"{s:g}:{candidate_probability(s, b, r):.3f}" for s in (0.5, 0.7, 0.8, 0.85, 0.9)
    )
    return (
        f"near-dedup: {cfg.ngram}-word shingles, {b} bands x {r} rows = {b * r} permutations, "
        f"LSH threshold (1/b)^(1/r) = {(1 / b) ** (1 / r):.3f}, P(candidate) at Jaccard {probs}; "
        f"pairs verified at Jaccard >= {cfg.threshold:g} of their texts' {SKETCH}-value sketches"
    )


# ---------------------------------------------------------------------------- bands and shuffle


def band_keys(sigs: np.ndarray, cfg: NearDedupConfig) -> np.ndarray:
    """(N, bands) uint64: a hash of each band's `rows` values with the band index mixed in, so a
    key of one band never meets a key of another in the shared shuffle."""
    n, k = sigs.shape
    if k != cfg.permutations:
        raise ValueError(f"signatures have {k} values, the config {cfg.permutations}")
    s = sigs.reshape(n, cfg.bands, cfg.rows).astype(np.uint64)
    band = np.arange(cfg.bands, dtype=np.uint64)
    acc = fmix64(band * _U64(0xD6E8FEB86659FD93) + _U64(cfg.rows))[None, :].repeat(n, axis=0)
    for j in range(cfg.rows):
        acc += s[:, :, j] * NGRAM_MULT[j]
    return fmix64(acc)


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    """The shuffle partition (int64) of each band key: its top 32 bits modulo `partitions`."""
    return ((np.asarray(keys, dtype=np.uint64) >> _U64(32)) % _U64(partitions)).astype(np.int64)


_RECORD = np.dtype([("key", "<u8"), ("id", "<u8")])


def write_band_records(
    path_for_partition: Callable[[int], Path], keys: np.ndarray, ids: np.ndarray, partitions: int
) -> np.ndarray:
    """Append the (key uint64, id uint64) records of every document and band to the file of its
    partition (`path_for_partition(p)`, created when missing). `keys` is (N, bands) from
    `band_keys`, `ids` the N documents' global ids. Returns the records written per partition."""
    keys = np.asarray(keys, dtype=np.uint64)
    ids = np.asarray(ids, dtype=np.uint64)
    rec = np.empty(keys.size, dtype=_RECORD)
    rec["key"] = keys.reshape(-1)
    rec["id"] = np.repeat(ids, keys.shape[1] if keys.ndim == 2 else 1)
    part = partition_of(rec["key"], partitions)
    order = np.argsort(part, kind="stable")
    rec, part = rec[order], part[order]
    counts = np.bincount(part, minlength=partitions)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    for p in np.flatnonzero(counts):
        path = Path(path_for_partition(int(p)))
        with open(path, "ab") as f:
            rec[bounds[p] : bounds[p + 1]].tofile(f)
    return counts


def read_band_records(paths: Sequence[Path]) -> np.ndarray:
    """(keys, ids) records of the given files, concatenated (a structured array)."""
    parts = [np.fromfile(p, dtype=_RECORD) for p in paths if Path(p).exists()]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=_RECORD)


def _unique_edges(edges: np.ndarray) -> np.ndarray:
    if len(edges) == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    edges = np.ascontiguousarray(edges, dtype=np.uint64)
    order = np.lexsort((edges[:, 1], edges[:, 0]))
    edges = edges[order]
    keep = np.ones(len(edges), dtype=bool)
    keep[1:] = (edges[1:] != edges[:-1]).any(axis=1)
    return edges[keep]


def candidate_pairs(paths: Sequence[Path]) -> np.ndarray:
    """The shuffle task of one partition: (E, 2) uint64 candidate edges (smaller id, larger id),
    unique and sorted.

    Reads every unit's record file of the partition, sorts the records by (key, id) and, for each
    key that more than one document has, pairs every two of its documents when they are at most
    SMALL_BUCKET (a cluster's copies: verification cuts some pairs, so each must be tried), else
    joins its first (smallest) id to each of the others (star edges, linear in a big bucket of
    copies of one text). The task holds this partition's records only, about
    TASK_BYTES_PER_RECORD bytes each at its peak (`memory_per_task`)."""
    rec = read_band_records(paths)
    if len(rec) == 0:
        return np.zeros((0, 2), dtype=np.uint64)
    order = np.lexsort((rec["id"], rec["key"]))
    keys, ids = rec["key"][order], rec["id"][order]
    del rec, order
    new = np.ones(len(keys), dtype=bool)
    new[1:] = keys[1:] != keys[:-1]
    group = np.cumsum(new) - 1
    first = ids[new][group]
    pick = ~new & (ids != first)
    edges = [np.stack((first[pick], ids[pick]), axis=1)]
    size = np.bincount(group)[group]
    small = np.flatnonzero((size > 2) & (size <= SMALL_BUCKET))
    for step in range(1, SMALL_BUCKET):
        small = small[small + step < len(ids)]
        small = small[group[small + step] == group[small]]
        if len(small) == 0:
            break
        pair = np.stack((ids[small], ids[small + step]), axis=1)
        edges.append(pair[pair[:, 0] != pair[:, 1]])
    return _unique_edges(np.concatenate(edges))


Similarity = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (ids, ids) -> Jaccard of each pair


def verify(
    edges: np.ndarray, similarity: Similarity, cfg: NearDedupConfig, chunk: int = VERIFY_CHUNK
) -> np.ndarray:
    """The edges whose similarity (`similarity(first ids, second ids)`: the texts' sketches', or
    any other measure) is >= threshold."""
    edges = np.asarray(edges, dtype=np.uint64).reshape(-1, 2)
    keep = np.zeros(len(edges), dtype=bool)
    for lo in range(0, len(edges), chunk):
        part = edges[lo : lo + chunk]
        keep[lo : lo + chunk] = similarity(part[:, 0], part[:, 1]) >= cfg.threshold - 1e-12
    return edges[keep]


def clusters(
    edges: np.ndarray, similarity: Similarity | None = None, cfg: NearDedupConfig | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Connected components of `edges`; in each one member is kept, every other removed. Returns
    (removed ids ascending, the kept partner of each), both uint64.

    The kept member is the one with the most distinct edges (the text the cluster is built around:
    an original beside its copies), ties to the smallest id (the first in corpus order), so that
    most members are removed beside a text they are themselves like. With `similarity` and `cfg`,
    a member whose own similarity with the kept one is below `threshold` - CHAIN_MARGIN (joined
    only through a chain: A~B, B~C, A kept, C far from A) is reconsidered in id order: it is
    removed with the first kept member of its component it is itself that similar to, or else
    kept (a chain must not remove a document unlike every kept one). The result depends on the
    edges only, not on how the work was split."""
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    edges = np.asarray(edges, dtype=np.uint64).reshape(-1, 2)
    edges = edges[edges[:, 0] != edges[:, 1]]
    if len(edges) == 0:
        return np.zeros(0, dtype=np.uint64), np.zeros(0, dtype=np.uint64)
    # One row per pair whatever partitions or bands found it, so degrees count distinct partners.
    edges = np.unique(np.sort(edges, axis=1), axis=0)
    nodes, inverse = np.unique(edges, return_inverse=True)
    inverse = inverse.reshape(-1, 2)
    n = len(nodes)
    graph = coo_matrix(
        (np.ones(len(inverse), dtype=np.int8), (inverse[:, 0], inverse[:, 1])), shape=(n, n)
    ).tocsr()
    _, labels = connected_components(graph, directed=False)
    degree = np.bincount(inverse.ravel(), minlength=n)
    # Per component, the node of highest degree; nodes is ascending, so ties go to the smallest id.
    order = np.lexsort((np.arange(n), -degree, labels))
    first = np.ones(n, dtype=bool)
    first[1:] = labels[order][1:] != labels[order][:-1]
    root_of_label = np.empty(labels.max() + 1, dtype=np.int64)
    root_of_label[labels[order][first]] = order[first]
    root = root_of_label[labels]
    removed = np.flatnonzero(root != np.arange(n))
    removed_ids, partner = nodes[removed], nodes[root[removed]]
    if similarity is None or cfg is None or len(removed) == 0:
        return removed_ids, partner
    floor = cfg.threshold - CHAIN_MARGIN - 1e-12
    direct = similarity(removed_ids, partner) >= floor
    keep = np.ones(len(removed), dtype=bool)
    kept_of: dict[int, list[int]] = {}
    for i in np.flatnonzero(~direct):  # ascending ids
        doc = removed_ids[i : i + 1]
        kept = kept_of.setdefault(int(labels[removed[i]]), [int(partner[i])])
        sims = similarity(np.repeat(doc, len(kept)), np.array(kept, dtype=np.uint64))
        hit = np.flatnonzero(sims >= floor)
        if len(hit):
            partner[i] = kept[hit[0]]
        else:
            keep[i] = False
            kept.append(int(doc[0]))
    return removed_ids[keep], partner[keep]


# ---------------------------------------------------------------------------- sizing


def choose_partitions(records_estimate: int, bytes_per_task: int = 256 << 20) -> int:
    """Shuffle partitions so that one `candidate_pairs` task holds about `bytes_per_task`:
    records_estimate (documents x bands) x TASK_BYTES_PER_RECORD / bytes_per_task, at least 1."""
    need = records_estimate * TASK_BYTES_PER_RECORD
    return max(1, -(-need // max(1, bytes_per_task)))


def memory_per_task(records_estimate: int, partitions: int, skew: float = 1.1) -> int:
    """Bytes one `candidate_pairs` task holds at its peak with `partitions` partitions: its share
    of the records (partition_of spreads the keys evenly, `skew` for the spread) at
    TASK_BYTES_PER_RECORD each."""
    share = math.ceil(records_estimate / max(1, partitions) * skew)
    return share * TASK_BYTES_PER_RECORD


# ---------------------------------------------------------------------------- one process


def near_duplicates_local(
    texts: Sequence[str],
    cfg: NearDedupConfig,
    workdir: Path,
    partitions: int | None = None,
    ids: np.ndarray | None = None,
    units: int = 1,
) -> tuple[np.ndarray, np.ndarray, int]:
    """Every stage in this process, as the distributed run would do them (a reference for tests
    and benchmarks): `texts` split into `units` units, band records shuffled through `partitions`
    files under `workdir`. Returns (removed ids, kept partner of each, documents skipped)."""
    n = len(texts)
    ids = np.arange(n, dtype=np.uint64) if ids is None else np.asarray(ids, dtype=np.uint64)
    if partitions is None:
        partitions = cfg.partitions or choose_partitions(n * cfg.bands)
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    skipped = 0
    values, ends, done = [], [], 0
    bounds = np.linspace(0, n, units + 1).astype(int)
    for u in range(units):
        lo, hi = bounds[u], bounds[u + 1]
        hashes, offsets, words = shingle_hashes(texts[lo:hi], cfg.ngram)
        sigs, signed = minhash(hashes, offsets, cfg), words >= cfg.min_words
        unit_values, unit_ends = sketches(hashes, offsets)
        values.append(unit_values)
        ends.append(unit_ends + done)
        done += len(unit_values)
        skipped += int((~signed).sum())
        keys = band_keys(sigs[signed], cfg)
        write_band_records(
            lambda p: workdir / f"part{p:05d}.u{u:05d}.bin", keys, ids[lo:hi][signed], partitions
        )
    edges = [
        candidate_pairs(sorted(workdir.glob(f"part{p:05d}.u*.bin"))) for p in range(partitions)
    ]
    all_edges = _unique_edges(np.concatenate(edges)) if edges else np.zeros((0, 2), np.uint64)
    store = Sketches(ids, np.concatenate(values), np.concatenate(ends))
    removed, kept = clusters(verify(all_edges, store.similarity, cfg), store.similarity, cfg)
    return removed, kept, skipped
