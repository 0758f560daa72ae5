"""Document signatures for near-duplicate removal: MinHash over word n-grams, and the sketches
that verify a candidate pair (`lsh` groups the signatures into candidate pairs and clusters).

Text normalization: casefold, every run of characters that are not letters or digits (punctuation,
'_', whitespace) becomes one space, words split on spaces. Shingles are word n-grams hashed with a
deterministic 64-bit hash (a polynomial over the UTF-8 bytes mixed with the MurmurHash3
finalizer): the same text gives the same signature in any process, on any machine.
"""

from __future__ import annotations

import re
from typing import Callable, Sequence

import numpy as np

from pipeline.prepare.curate.near_dedup_config import MAX_NGRAM, NearDedupConfig

_NONWORD = re.compile(r"[\W_]+")
_MASK64 = (1 << 64) - 1
_POLY = 0x100000001B3  # odd: invertible modulo 2**64
_POLY_INV = pow(_POLY, -1, 1 << 64)
_U64 = np.uint64
_EMPTY = np.uint32(0xFFFFFFFF)  # the signature value of a document with no shingle
# Odd multipliers of the word hashes inside an n-gram (position-dependent, so order matters).
NGRAM_MULT = np.array(
    [
        (0x9E3779B97F4A7C15 * (2 * k + 1) + 0x632BE59BD9B4E019 * k) & _MASK64 | 1
        for k in range(MAX_NGRAM)
    ],
    dtype=np.uint64,
)
# Values a text keeps for verification: the smallest of its shingle hashes' top 32 bits (a
# bottom-k sketch; the whole set when it has fewer shingles). A pair's Jaccard is exact when both
# are whole, else estimated with a standard deviation near sqrt(J(1-J)/SKETCH): 0.011 at 0.85,
# where 256 signature values would give 0.022.
SKETCH = 1024
# Shingles hashed per block of the min-hash (a block's (shingles, K) uint64 array: ~8 MiB at K 256).
BLOCK_SHINGLES = 4096


def fmix64(x: np.ndarray) -> np.ndarray:
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
    return fmix64(h), offsets


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
        term = padded[first + k] * NGRAM_MULT[k]
        if short:
            term[span <= k] = 0
        acc += term
    return fmix64(acc), offsets, words


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
