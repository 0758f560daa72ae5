"""Near-duplicate removal across a whole corpus: MinHash over word n-grams, LSH bands, verification.

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
Text normalization: casefold, every run of characters that are not letters or digits (punctuation,
'_', whitespace) becomes one space, words split on spaces. Shingles are word n-grams hashed with a
deterministic 64-bit hash (a polynomial over the UTF-8 bytes mixed with the MurmurHash3
finalizer): the same text gives the same signature in any process, on any machine.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from common.configure import UserError

# Bytes the shuffle task holds per band record at its peak: the 16-byte records as read, the
# sort's index (8) and the sorted keys and ids (16), plus the edges' working arrays.
RECORD_BYTES = 16
# A text removed through a chain of near-duplicates needs a kept text at least threshold - this
# alike (estimated): two copies of one original, each 0.85 from it, are about 0.74 from each
# other, and removing the second beside the first is what a user of the threshold expects.
CHAIN_MARGIN = 0.07
TASK_BYTES_PER_RECORD = 64

_NONWORD = re.compile(r"[\W_]+")
_MASK64 = (1 << 64) - 1
_POLY = 0x100000001B3  # odd: invertible modulo 2**64
_POLY_INV = pow(_POLY, -1, 1 << 64)
_U64 = np.uint64
_EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a document with no shingle
# Odd multipliers of the word hashes inside an n-gram (position-dependent, so order matters).
_NGRAM_MULT = np.array(
    [(0x9E3779B97F4A7C15 * (2 * k + 1) + 0x632BE59BD9B4E019 * k) & _MASK64 | 1 for k in range(64)],
    dtype=np.uint64,
)
# Values a text keeps for verification: the smallest of its shingle hashes' top 32 bits (a
# bottom-k sketch; the whole set when it has fewer shingles). A pair's Jaccard is exact when both
# are whole, else estimated with a standard deviation near sqrt(J(1-J)/SKETCH): 0.011 at 0.85,
# where 256 signature values would give 0.022.
SKETCH = 1024
# A band bucket of at most this many documents is paired all with all, a bigger one as a star.
SMALL_BUCKET = 8
# Candidate pairs verified at a time (their sketches held together).
VERIFY_CHUNK = 4096
# Shingles hashed per block of the min-hash (a block's (shingles, K) uint64 array: ~8 MiB at K 256).
BLOCK_SHINGLES = 4096


@dataclass
class NearDedupConfig:
    # Remove near-duplicate documents across the whole corpus (MinHash over word n-grams, LSH
    # bands, every candidate pair verified by the Jaccard of the two texts' sketches).
    enabled: bool = False
    # Words per shingle. A document with fewer words has one shingle of all its words.
    ngram: int = 5
    # LSH bands: two documents become a candidate pair when all `rows` values of one band agree.
    # The signature has bands x rows permutations.
    bands: int = 32
    # Signature values per band. With 32 x 8 a pair at Jaccard 0.7 becomes a candidate with
    # probability 0.85, at 0.8 0.997, at 0.85 and above > 0.9999.
    rows: int = 8
    # Jaccard similarity (of the documents' n-gram sets) from which two documents are
    # near-duplicates: a candidate pair is kept when its texts' Jaccard reaches it (exact for texts
    # of up to 1,024 shingles, estimated from 1,024 values of each above).
    threshold: float = 0.8
    # Seed of the hash permutations: the same on every worker and every run that is compared.
    seed: int = 1234
    # Shuffle partitions of the band records (one task each); 0 = chosen from the input size so
    # that a task holds about 256 MiB (`choose_partitions`).
    partitions: int = 0
    # Documents with fewer words are not signed: never removed, never a reason to remove another,
    # counted as skipped.
    min_words: int = 10

    def check(self, where: str = "near_dedup") -> None:
        """Refuse a value that cannot work, with one line naming the key."""

        def bad(key: str, why: str) -> UserError:
            return UserError(f"{where}.{key}: {why}")

        if not 0.0 < self.threshold < 1.0:
            raise bad("threshold", f"{self.threshold} is not in (0, 1)")
        if self.ngram < 1:
            raise bad("ngram", f"{self.ngram} is below 1")
        if self.ngram > len(_NGRAM_MULT):
            raise bad("ngram", f"{self.ngram} is above {len(_NGRAM_MULT)}")
        if self.bands < 1:
            raise bad("bands", f"{self.bands} is below 1")
        if self.rows < 1:
            raise bad("rows", f"{self.rows} is below 1")
        if self.bands * self.rows > 4096:
            raise bad(
                "bands", f"bands x rows = {self.bands * self.rows} is above 4096 permutations"
            )
        if self.partitions < 0:
            raise bad("partitions", f"{self.partitions} is negative (0 = from the input size)")
        if self.min_words < 1:
            raise bad("min_words", f"{self.min_words} is below 1 (a document with no word)")
        if not 0 <= self.seed < 1 << 63:
            raise bad("seed", f"{self.seed} is not in [0, 2**63)")

    @property
    def permutations(self) -> int:
        return self.bands * self.rows


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


# ---------------------------------------------------------------------------- hashing


def _fmix64(x: np.ndarray) -> np.ndarray:
    """MurmurHash3's 64-bit finalizer, in place on a uint64 array (returned)."""
    x ^= x >> _U64(33)
    x *= _U64(0xFF51AFD7ED558CCD)
    x ^= x >> _U64(33)
    x *= _U64(0xC4CEB9FE1A85EC53)
    x ^= x >> _U64(33)
    return x


_powers_cache: dict[int, np.ndarray] = {}


def _powers(base: int, n: int) -> np.ndarray:
    """base**j mod 2**64 for j < n (cached, grown by doubling)."""
    have = _powers_cache.get(base)
    if have is None or len(have) < n:
        size = max(n, 2 * len(have) if have is not None else 1 << 16)
        filled = np.full(size, base, dtype=np.uint64)
        filled[0] = 1
        have = np.cumprod(filled, dtype=np.uint64)  # wraps modulo 2**64
        _powers_cache[base] = have
    return have[:n]


def normalize(text: str) -> str:
    """Casefold; every run of non-letters/digits (punctuation, '_', whitespace) -> one space."""
    return _NONWORD.sub(" ", text.casefold()).strip()


def _word_hashes(texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """The 64-bit hash of every word of `texts` in order, and each text's word offsets (N+1).

    All texts are normalized and joined with one space into a byte array; a word's hash is the
    polynomial sum b[j] * P**(end-1-j) modulo 2**64 over its UTF-8 bytes (from a prefix sum of
    b[j] * P**-j), its length mixed in, through the MurmurHash3 finalizer."""
    parts = [normalize(t) for t in texts]
    joined = " ".join(parts).encode("utf-8")
    n = len(texts)
    if not joined.strip():
        return np.zeros(0, dtype=np.uint64), np.zeros(n + 1, dtype=np.int64)
    raw = np.frombuffer(joined, dtype=np.uint8)
    is_word = raw != 0x20
    edges = np.diff(is_word.astype(np.int8), prepend=np.int8(0), append=np.int8(0))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)  # exclusive
    # Each text's start in the joined bytes -> its first word (texts are joined with one space).
    text_len = np.fromiter((len(p.encode("utf-8")) for p in parts), dtype=np.int64, count=n)
    text_start = np.concatenate(([0], np.cumsum(text_len + 1)[:-1]))
    offsets = np.empty(n + 1, dtype=np.int64)
    offsets[:n] = np.searchsorted(starts, text_start)
    offsets[n] = len(starts)

    length = len(raw)
    prefix = np.zeros(length + 1, dtype=np.uint64)
    np.cumsum(raw.astype(np.uint64) * _powers(_POLY_INV, length), out=prefix[1:])
    h = (prefix[ends] - prefix[starts]) * _powers(_POLY, length)[ends - 1]
    h += (ends - starts).astype(np.uint64) * _U64(0x9E3779B97F4A7C15)
    return _fmix64(h), offsets


def shingle_hashes(texts: Sequence[str], ngram: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The hashed word n-grams of `texts`, all in one array.

    Returns (hashes uint64 (S,), offsets int64 (N+1,): text i's shingles are
    hashes[offsets[i]:offsets[i+1]], words int64 (N,): each text's word count). A text with fewer
    words than `ngram` (but at least one) has one shingle of all its words; one with none has none.
    """
    words_h, word_off = _word_hashes(texts)
    words = np.diff(word_off)
    counts = np.where(words > 0, np.maximum(words - ngram + 1, 1), 0)
    offsets = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    total = int(offsets[-1])
    if total == 0:
        return np.zeros(0, dtype=np.uint64), offsets, words
    doc = np.repeat(np.arange(len(texts)), counts)
    first = np.arange(total, dtype=np.int64) - offsets[doc] + word_off[doc]  # shingle's 1st word
    span = np.minimum(words[doc], ngram)  # words in each shingle
    padded = np.concatenate((words_h, np.zeros(ngram, dtype=np.uint64)))
    acc = np.full(total, _U64(0x27D4EB2F165667C5)) + span.astype(np.uint64)
    short = bool((words[words > 0] < ngram).any())
    for k in range(ngram):
        term = padded[first + k] * _NGRAM_MULT[k]
        if short:
            term[span <= k] = 0
        acc += term
    return _fmix64(acc), offsets, words


def _permutation_params(cfg: NearDedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """The multiply-shift family: h_p(x) = (a_p * x + b_p) mod 2**64, top 32 bits; a_p odd."""
    rng = np.random.Generator(np.random.PCG64(cfg.seed))
    k = cfg.permutations
    a = rng.integers(0, 1 << 64, size=k, dtype=np.uint64, endpoint=False) | _U64(1)
    b = rng.integers(0, 1 << 64, size=k, dtype=np.uint64, endpoint=False)
    return a, b


def minhash(hashes: np.ndarray, offsets: np.ndarray, cfg: NearDedupConfig) -> np.ndarray:
    """(N, bands x rows) uint32 signatures of the shingle sets hashes[offsets[i]:offsets[i+1]].

    Value p of a row is min over the set of the top 32 bits of a_p * x + b_p (mod 2**64); a text
    without shingles has all values 0xFFFFFFFF."""
    a, b = _permutation_params(cfg)
    n = len(offsets) - 1
    out = np.full((n, len(a)), _EMPTY, dtype=np.uint32)
    counts = np.diff(offsets)
    nonempty = np.flatnonzero(counts > 0)
    i = 0
    while i < len(nonempty):
        # A block of whole documents of about BLOCK_SHINGLES shingles (one long one alone).
        lo = offsets[nonempty[i]]
        j = int(np.searchsorted(offsets[nonempty + 1], lo + BLOCK_SHINGLES, side="right"))
        j = max(j, i + 1)
        docs = nonempty[i:j]
        hi = offsets[docs[-1] + 1]
        # (K, shingles): numpy's reduceat is fast along the contiguous axis only.
        block = np.multiply.outer(a, hashes[lo:hi])
        block += b[:, None]
        mins = np.minimum.reduceat(block, offsets[docs] - lo, axis=1)
        out[docs] = (mins.T >> _U64(32)).astype(np.uint32)
        i = j
    return out


def signatures(texts: Sequence[str], cfg: NearDedupConfig) -> np.ndarray:
    """(N, bands x rows) uint32 MinHash signatures of `texts` (every text, however short)."""
    hashes, offsets, _ = shingle_hashes(texts, cfg.ngram)
    return minhash(hashes, offsets, cfg)


def sign(texts: Sequence[str], cfg: NearDedupConfig) -> tuple[np.ndarray, np.ndarray]:
    """(signatures of every text, boolean mask of the texts signed: at least `min_words` words).

    Only the signed texts' band records are written; the others are skipped (counted)."""
    hashes, offsets, words = shingle_hashes(texts, cfg.ngram)
    return minhash(hashes, offsets, cfg), words >= cfg.min_words


def similarity(sig_a: np.ndarray, sig_b: np.ndarray) -> np.ndarray:
    """Estimated Jaccard similarity: the fraction of equal values of paired signature rows."""
    return (np.asarray(sig_a) == np.asarray(sig_b)).mean(axis=-1)


def sketches(hashes: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each text's bottom-SKETCH sketch: its shingle hashes' distinct top 32 bits, ascending, the
    SKETCH smallest. Returns (values uint32, all texts' in one array; ends int64 (N,): text i's are
    values[ends[i-1]:ends[i]])."""
    n = len(offsets) - 1
    doc = np.repeat(np.arange(n), np.diff(offsets))
    top = (hashes >> _U64(32)).astype(np.uint32)
    order = np.lexsort((top, doc))
    doc, top = doc[order], top[order]
    fresh = np.ones(len(top), dtype=bool)
    fresh[1:] = (doc[1:] != doc[:-1]) | (top[1:] != top[:-1])
    doc, top = doc[fresh], top[fresh]
    rank = np.arange(len(doc)) - np.searchsorted(doc, np.arange(n))[doc]
    doc, top = doc[rank < SKETCH], top[rank < SKETCH]
    return top, np.cumsum(np.bincount(doc, minlength=n)).astype(np.int64)


def sketch_similarity(a: np.ndarray, b: np.ndarray) -> float:
    """Jaccard similarity of two texts from their sketches: below the largest value of a full
    (possibly cut) sketch both are whole, so the share of shared values among the union's there is
    a uniform sample's (the whole sets' when neither was cut)."""
    cut = min(
        int(a[-1]) if len(a) >= SKETCH else 1 << 32, int(b[-1]) if len(b) >= SKETCH else 1 << 32
    )
    a = a[: np.searchsorted(a, cut, side="right")]
    b = b[: np.searchsorted(b, cut, side="right")]
    if len(a) + len(b) == 0:
        return 0.0
    shared = len(np.intersect1d(a, b, assume_unique=True))
    return shared / (len(a) + len(b) - shared)


class Sketches:
    """Sketches of texts held in memory, by the caller's id (`near_duplicates_local`, tests)."""

    def __init__(self, ids: np.ndarray, values: np.ndarray, ends: np.ndarray):
        order = np.argsort(ids, kind="stable")
        self.ids, self.order, self.values = np.asarray(ids)[order], order, values
        self.starts = np.concatenate(([0], ends[:-1]))
        self.ends = ends

    def get(self, doc: int) -> np.ndarray:
        row = self.order[np.searchsorted(self.ids, doc)]
        return self.values[self.starts[row] : self.ends[row]]

    def similarity(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return pair_similarity(a, b, self.get)


def pair_similarity(a: np.ndarray, b: np.ndarray, get: Callable[[int], np.ndarray]) -> np.ndarray:
    """`sketch_similarity` of each pair (a[i], b[i]) of ids, sketches fetched by `get(id)`."""
    return np.array(
        [sketch_similarity(get(x), get(y)) for x, y in zip(a.tolist(), b.tolist())], dtype=float
    )


# ---------------------------------------------------------------------------- LSH and shuffle


def band_keys(sigs: np.ndarray, cfg: NearDedupConfig) -> np.ndarray:
    """(N, bands) uint64: a hash of each band's `rows` values with the band index mixed in, so a
    key of one band never meets a key of another in the shared shuffle."""
    n, k = sigs.shape
    if k != cfg.permutations:
        raise ValueError(f"signatures have {k} values, the config {cfg.permutations}")
    s = sigs.reshape(n, cfg.bands, cfg.rows).astype(np.uint64)
    band = np.arange(cfg.bands, dtype=np.uint64)
    acc = _fmix64(band * _U64(0xD6E8FEB86659FD93) + _U64(cfg.rows))[None, :].repeat(n, axis=0)
    for j in range(cfg.rows):
        acc += s[:, :, j] * _NGRAM_MULT[j]
    return _fmix64(acc)


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
