"""A near-duplicate test corpus from real text on this machine, with planted near-copies.

    python benchmarks/near_dup_corpus.py OUT_DIR [--docs 20000] [--seed 0]

Base documents are groups of consecutive paragraphs (100-1,000 words) of the system's man pages
(/usr/share/man/man[1-8], rendered by the project's roff reader, pipeline.prepare.manpage), then of
/usr/share/common-licenses, /usr/share/doc/*/copyright and the docstrings of
/usr/lib/python3*/ modules when the pages run out; a paragraph seen
before is skipped, so bases are not copies of each other (a page installed under two names).
A third of the documents (more when the machine has too little text for the bases) are planted copies of a base (1-3 per base) at a target Jaccard
similarity drawn from [0.5, 0.95], made by one edit kind each:

    insert   words from the corpus inserted at random places
    delete   words deleted
    replace  words replaced by others
    reorder  the paragraphs shuffled, then words replaced to the target
    boiler   a header and/or footer paragraph added (or the base's first/last swapped for one),
             then words replaced to the target

The number of word edits is found by bisection on the exact Jaccard. The documents are written in
a shuffled order to OUT_DIR/corpus.jsonl ({"id", "text"}, ids 0..N-1 = the corpus order) and
OUT_DIR/truth.json lists every planted copy: its base, kind, target and its EXACT Jaccard with the
base over 5-word shingles under minhash.py's normalization.
"""

from __future__ import annotations

import argparse
import ast
import glob
import gzip
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pipeline.prepare.curate.minhash import normalize  # noqa: E402
from pipeline.prepare.manpage import man_paragraphs, page_encoding  # noqa: E402

NGRAM = 5
DOCSTRING_OWNERS = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def shingles(text: str, n: int = NGRAM) -> set:
    """The word n-gram set under minhash.py's normalization (fewer words: one shingle of all)."""
    w = normalize(text).split()
    if not w:
        return set()
    return {tuple(w[i : i + n]) for i in range(max(len(w) - n + 1, 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def source_paragraphs():
    """Paragraph lists, one per source file: man pages, then licenses and copyright files."""
    stats: Counter = Counter()
    for path in sorted(glob.glob("/usr/share/man/man[1-8]/*")):
        try:
            raw = gzip.open(path).read() if path.endswith(".gz") else open(path, "rb").read()
        except OSError:
            continue
        text = raw.decode(page_encoding(raw[:300]), "replace")
        yield man_paragraphs(text, 5, stats)
    extra = sorted(glob.glob("/usr/share/common-licenses/*")) + sorted(
        glob.glob("/usr/share/doc/*/copyright")
    )
    for path in extra:
        try:
            text = open(path, encoding="utf-8", errors="replace").read()
        except OSError:
            continue
        yield [" ".join(p.split()) for p in text.split("\n\n") if len(p.split()) >= 5]
    for path in sorted(glob.glob("/usr/lib/python3*/**/*.py", recursive=True)):
        try:
            tree = ast.parse(open(path, encoding="utf-8", errors="replace").read())
        except (OSError, SyntaxError, ValueError):
            continue
        paras = []
        for node in ast.walk(tree):
            if isinstance(node, DOCSTRING_OWNERS) and (doc := ast.get_docstring(node)):
                paras += [" ".join(p.split()) for p in doc.split("\n\n") if len(p.split()) >= 5]
        yield paras


def base_documents(count: int, rng: random.Random) -> list[list[str]]:
    """`count` documents, each a list of paragraphs of 100-1,000 words in all."""
    seen: set = set()
    docs: list[list[str]] = []
    for paras in source_paragraphs():
        want = rng.randint(100, 1000)
        cur: list[str] = []
        words = 0
        for p in paras:
            key = normalize(p)
            if key in seen:
                continue
            seen.add(key)
            n = len(p.split())
            if words + n > 1000 and words >= 100:
                docs.append(cur)
                cur, words, want = [], 0, rng.randint(100, 1000)
            if n > 1000:
                continue
            cur.append(p)
            words += n
            if words >= want:
                docs.append(cur)
                cur, words, want = [], 0, rng.randint(100, 1000)
        if words >= 100:
            docs.append(cur)
        if len(docs) >= count:
            break
    if len(docs) < count:
        print(f"only {len(docs)} base documents on this machine", file=sys.stderr)
    return docs[:count]


def edit_words(paras: list[str], kind: str, m: int, rng: random.Random, vocab: list[str]):
    """The paragraphs after `m` word edits of `kind`, drawn from `rng` (same rng state, same edits
    for every m: the first m of one sequence)."""
    words = [p.split() for p in paras]
    flat = [(i, j) for i, p in enumerate(words) for j in range(len(p))]
    picks = rng.sample(range(len(flat)), min(m, len(flat)))
    fills = [rng.choice(vocab) for _ in picks]
    out = [list(p) for p in words]
    if kind == "delete":
        drop = {flat[k] for k in picks}
        out = [[w for j, w in enumerate(p) if (i, j) not in drop] for i, p in enumerate(words)]
    elif kind == "insert":
        add: dict = {}
        for k, f in zip(picks, fills):
            add.setdefault(flat[k], []).append(f)
        out = [
            [x for j, w in enumerate(p) for x in (add.get((i, j), []) + [w])]
            for i, p in enumerate(words)
        ]
    else:
        for k, f in zip(picks, fills):
            i, j = flat[k]
            out[i][j] = f
    return [" ".join(p) for p in out if p]


def plant(base: list[str], kind: str, target: float, rng: random.Random, vocab, boiler):
    """A copy of `base` at about `target` Jaccard (exact value returned)."""
    paras = list(base)
    if kind == "reorder" and len(paras) > 1:
        rng.shuffle(paras)
    elif kind == "boiler":
        head, foot = rng.sample(boiler, 2)
        choice = rng.randrange(3)
        if choice == 0:
            paras = [head] + paras + [foot]
        elif choice == 1 and len(paras) > 2:
            paras = [head] + paras[1:]
        else:
            paras = paras[:-1] + [foot] if len(paras) > 2 else paras + [foot]
    word_kind = kind if kind in ("insert", "delete", "replace") else "replace"
    ref = shingles("\n\n".join(base))
    seed = rng.random()
    total = sum(len(p.split()) for p in paras)

    def at(m):
        text = "\n\n".join(edit_words(paras, word_kind, m, random.Random(seed), vocab))
        return text, jaccard(ref, shingles(text))

    text, j = at(0)
    if j <= target:
        return text, j
    lo, hi = 0, max(1, total // 2)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if at(mid)[1] > target:
            lo = mid
        else:
            hi = mid
    (t_lo, j_lo), (t_hi, j_hi) = at(lo), at(hi)
    return (t_lo, j_lo) if abs(j_lo - target) <= abs(j_hi - target) else (t_hi, j_hi)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--docs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    t0 = time.time()
    bases = base_documents(args.docs - args.docs // 3, rng)
    n_planted = args.docs - len(bases)  # more than a third when the machine has few bases
    vocab = sorted({w for b in bases[:2000] for p in b for w in p.split() if w.isalpha()})
    boiler = [p for b in bases[-500:] for p in b if 20 <= len(p.split()) <= 80][:300]
    boiler = (
        boiler or ["This page is part of a collection; see the project home page for more."] * 2
    )
    docs = [("\n\n".join(b), None) for b in bases]
    planted = []
    kinds = ["insert", "delete", "replace", "reorder", "boiler"]
    while len(planted) < n_planted:
        bi = rng.randrange(len(bases))
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            if len(planted) >= n_planted:
                break
            kind = rng.choice(kinds)
            target = rng.uniform(0.5, 0.95)
            text, j = plant(bases[bi], kind, target, rng, vocab, boiler)
            planted.append(len(docs))
            docs.append((text, (bi, kind, target, j)))
    order = list(range(len(docs)))
    rng.shuffle(order)
    new_id = {old: new for new, old in enumerate(order)}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with open(args.out_dir / "corpus.jsonl", "w") as f:
        for old in order:
            f.write(json.dumps({"id": new_id[old], "text": docs[old][0]}) + "\n")
    truth = [
        {
            "id": new_id[old],
            "base": new_id[docs[old][1][0]],
            "kind": docs[old][1][1],
            "target": round(docs[old][1][2], 4),
            "jaccard": docs[old][1][3],
        }
        for old in planted
    ]
    truth.sort(key=lambda t: t["id"])
    meta = {"docs": len(docs), "bases": len(bases), "ngram": NGRAM, "planted": truth}
    (args.out_dir / "truth.json").write_text(json.dumps(meta, indent=0))
    hist = Counter(round(t["jaccard"], 1) for t in truth)
    print(
        f"{len(docs)} documents ({len(bases)} bases, {len(truth)} planted) in {args.out_dir}, "
        f"{time.time() - t0:.0f} s; planted Jaccard (rounded): {dict(sorted(hist.items()))}"
    )


if __name__ == "__main__":
    main()
