"""Near-duplicate removal (pipeline.prepare.curate.minhash, .lsh): signatures, LSH band keys, the
partitioned shuffle, verification and clusters, on texts made here."""

import json
import math
import random
import subprocess
import sys

import numpy as np
import pytest
from repo import ROOT

from common.configure import UserError
from pipeline.prepare.curate import lsh
from pipeline.prepare.curate import minhash as mh
from pipeline.prepare.curate.near_dedup_config import NearDedupConfig


def words(n, rng):
    vocab = [f"w{i}" for i in range(3000)]
    return [rng.choice(vocab) for _ in range(n)]


def shingle_set(text, n=5):
    w = mh.normalize(text).split()
    return {tuple(w[i : i + n]) for i in range(max(len(w) - n + 1, 1))}


def exact_jaccard(a, b):
    x, y = shingle_set(a), shingle_set(b)
    return len(x & y) / len(x | y)


def test_signatures_same_in_another_process():
    texts = ["The quick, brown fox: jumps over the lazy dog!", "Straße naïve café — ünïcode", "a b"]
    cfg = NearDedupConfig()
    here = mh.signatures(texts, cfg)
    code = (
        "import json, sys; from pipeline.prepare.curate import minhash as mh; "
        "from pipeline.prepare.curate.near_dedup_config import NearDedupConfig; "
        "s = mh.signatures(json.loads(sys.argv[1]), NearDedupConfig()); "
        "print(json.dumps(s.tolist()))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(texts)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
    )
    assert here.dtype == np.uint32 and here.shape == (3, 256)
    assert np.array_equal(here, np.array(json.loads(out.stdout), dtype=np.uint32))


def test_normalization_and_short_documents():
    cfg = NearDedupConfig()
    sig = mh.signatures(["Hello,   WORLD!!", "hello world", "hello-world", "", "world hello"], cfg)
    assert np.array_equal(sig[0], sig[1]) and np.array_equal(sig[0], sig[2])
    assert (sig[3] == 0xFFFFFFFF).all()  # no word, no shingle
    assert not np.array_equal(sig[0], sig[4])  # the one shingle keeps the word order
    _, offsets, n_words = mh.shingle_hashes(["a b c", "a b c d e f g", ""], 5)
    assert np.diff(offsets).tolist() == [1, 3, 0] and n_words.tolist() == [3, 7, 0]
    _, signed = mh.sign(["one two three", " ".join(["x"] * 12)], cfg)
    assert signed.tolist() == [False, True]


def test_estimated_similarity_matches_exact_jaccard():
    rng = random.Random(1)
    cfg = NearDedupConfig()
    k = cfg.permutations
    for frac in (0.02, 0.05, 0.1):
        base = words(800, rng)
        copy = [rng.choice(["zz1", "zz2", "zz3"]) if rng.random() < frac else w for w in base]
        a, b = " ".join(base), " ".join(copy)
        j = exact_jaccard(a, b)
        est = float(mh.similarity(*mh.signatures([a, b], cfg)))
        sd = math.sqrt(j * (1 - j) / k)
        assert abs(est - j) <= 4 * sd + 1e-9, (frac, j, est)


def test_band_keys_equal_for_identical_texts_and_differ_by_band():
    cfg = NearDedupConfig()
    rng = random.Random(2)
    a = " ".join(words(200, rng))
    keys = lsh.band_keys(mh.signatures([a, a.upper(), a + " tail words here now"], cfg), cfg)
    assert keys.dtype == np.uint64 and keys.shape == (3, cfg.bands)
    assert np.array_equal(keys[0], keys[1])
    assert len(set(keys[0].tolist())) == cfg.bands  # the band index is mixed in
    assert (keys[0] == keys[2]).sum() > 0


def corpus(rng):
    """Ids 0..9: 0, 3, 7 near-copies (each ~0.5% of words replaced); 2 and 8 an exact pair;
    5 and 9 a pair at Jaccard ~0.55; the rest unrelated."""
    base1, base2, base3 = words(400, rng), words(300, rng), words(300, rng)

    def edit(ws, frac, seed):
        r = random.Random(seed)
        return " ".join("zz" + str(r.randrange(9)) if r.random() < frac else w for w in ws)

    texts = {
        0: edit(base1, 0.005, 10),
        3: edit(base1, 0.005, 11),
        7: edit(base1, 0.005, 12),
        2: " ".join(base2),
        8: " ".join(base2),
        5: " ".join(base3),
        9: edit(base3, 0.09, 13),
    }
    for i in (1, 4, 6):
        texts[i] = " ".join(words(300, rng))
    return [texts[i] for i in range(10)]


def run(texts, cfg, tmp_path, partitions, units=1):
    removed, kept, _ = lsh.near_duplicates_local(
        texts, cfg, tmp_path / f"p{partitions}u{units}", partitions=partitions, units=units
    )
    return removed.tolist(), kept.tolist()


def test_candidates_and_clusters_by_hand(tmp_path):
    texts = corpus(random.Random(3))
    cfg = NearDedupConfig(enabled=True)
    assert exact_jaccard(texts[5], texts[9]) < 0.7
    assert run(texts, cfg, tmp_path, partitions=1) == ([3, 7, 8], [0, 0, 2])


def test_result_independent_of_partitions_and_units(tmp_path):
    texts = corpus(random.Random(4))
    cfg = NearDedupConfig(enabled=True)
    want = run(texts, cfg, tmp_path, partitions=1)
    for partitions, units in ((3, 1), (7, 3), (16, 10)):
        assert run(texts, cfg, tmp_path, partitions, units) == want


def test_candidate_pairs_from_partition_files(tmp_path):
    keys = np.array([[5, 9], [5, 1], [7, 9], [5, 9]], dtype=np.uint64)
    ids = np.array([40, 10, 30, 20], dtype=np.uint64)
    lsh.write_band_records(lambda p: tmp_path / f"a{p}.bin", keys[:2], ids[:2], 2)
    lsh.write_band_records(lambda p: tmp_path / f"b{p}.bin", keys[2:], ids[2:], 2)
    edges = [lsh.candidate_pairs(sorted(tmp_path.glob(f"?{p}.bin"))) for p in range(2)]
    got = np.concatenate(edges).tolist()
    # key 5: 10, 20, 40 and key 9: 20, 30, 40, every pair of each (small buckets)
    assert sorted(map(tuple, got)) == [(10, 20), (10, 40), (20, 30), (20, 40), (30, 40)]
    # the most joined text is kept (20 and 40 have three partners: the first of them)
    removed, kept = lsh.clusters(np.array(got, dtype=np.uint64))
    assert removed.tolist() == [10, 30, 40] and kept.tolist() == [20, 20, 20]


def test_a_big_bucket_is_joined_as_a_star(tmp_path):
    n = lsh.SMALL_BUCKET + 3
    ids = np.arange(100, 100 + n, dtype=np.uint64)
    lsh.write_band_records(lambda p: tmp_path / "a.bin", np.full((n, 1), 7, np.uint64), ids, 1)
    got = lsh.candidate_pairs([tmp_path / "a.bin"]).tolist()
    assert got == [[100, int(i)] for i in ids[1:]]


def test_verify_drops_low_similarity_candidate():
    cfg = NearDedupConfig()
    rng = random.Random(5)
    a = words(300, rng)
    near = " ".join(w if i % 60 else "zz" for i, w in enumerate(a))
    far = " ".join(w if i % 4 else "zz" for i, w in enumerate(a))
    store = sketched([" ".join(a), near, far], cfg)
    edges = np.array([[0, 1], [0, 2]], dtype=np.uint64)
    assert lsh.verify(edges, store.similarity, cfg).tolist() == [[0, 1]]


def sketched(texts, cfg):
    hashes, offsets, _ = mh.shingle_hashes(texts, cfg.ngram)
    return mh.Sketches(np.arange(len(texts), dtype=np.uint64), *mh.sketches(hashes, offsets))


def test_sketch_similarity_exact_when_whole_and_close_when_cut():
    cfg = NearDedupConfig()
    rng = random.Random(8)
    for n, frac in ((300, 0.03), (900, 0.05), (5000, 0.03), (5000, 0.06)):
        base = words(n, rng)
        copy = [rng.choice(["zz1", "zz2", "zz3"]) if rng.random() < frac else w for w in base]
        a, b = " ".join(base), " ".join(copy)
        j = exact_jaccard(a, b)
        store = sketched([a, b], cfg)
        got = float(store.similarity(np.array([0]), np.array([1]))[0])
        if n - cfg.ngram + 1 <= mh.SKETCH:  # both sets whole: exact (no 32-bit collision here)
            assert got == pytest.approx(j, abs=1e-12), (n, j, got)
        else:
            assert len(store.get(0)) == mh.SKETCH
            assert abs(got - j) <= 4 * math.sqrt(j * (1 - j) / mh.SKETCH), (n, j, got)


def test_sizing_helpers_and_describe():
    assert lsh.choose_partitions(0) == 1
    assert lsh.choose_partitions(10_000_000 * 32, 256 << 20) == 77
    assert lsh.memory_per_task(1000, 10, skew=1.0) == 100 * lsh.TASK_BYTES_PER_RECORD
    line = lsh.describe(NearDedupConfig())
    assert "0.648" in line and "0.85:1.000" in line and "\n" not in line


@pytest.mark.parametrize(
    "key,value",
    [
        ("threshold", 1.0),
        ("threshold", 0.0),
        ("ngram", 0),
        ("bands", 0),
        ("rows", 0),
        ("partitions", -1),
        ("min_words", 0),
    ],
)
def test_check_refuses(key, value):
    cfg = NearDedupConfig(**{key: value})
    with pytest.raises(UserError, match=rf"^near_dedup\.{key}: "):
        cfg.check()
    NearDedupConfig().check()


def test_clusters_keep_a_document_joined_only_through_a_chain():
    cfg = NearDedupConfig()
    # a path 0 - 1 - 2 - 3: 1 and 2 have two partners each, so 1 (the first) is kept; 0 and 2 are
    # like it, 3 only through 2
    sims = {(0, 1): 0.84, (1, 2): 0.84, (2, 3): 0.84, (0, 2): 0.7, (1, 3): 0.69, (0, 3): 0.5}

    def similarity(a, b):
        return np.array([sims[tuple(sorted((int(x), int(y))))] for x, y in zip(a, b)])

    edges = np.array([[0, 1], [1, 2], [2, 3]], dtype=np.uint64)
    removed, kept = lsh.clusters(edges)
    assert removed.tolist() == [0, 2, 3] and kept.tolist() == [1, 1, 1]
    removed, kept = lsh.clusters(edges, similarity, cfg)
    assert removed.tolist() == [0, 2] and kept.tolist() == [1, 1]
    sims[(1, 3)] = 0.75  # within CHAIN_MARGIN of the threshold: removed beside 1
    removed, kept = lsh.clusters(edges, similarity, cfg)
    assert removed.tolist() == [0, 2, 3] and kept.tolist() == [1, 1, 1]
