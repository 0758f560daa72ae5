"""How much of the tokenizer's training text comes from long documents, with the sample drawn
as prepare drew it before texts were cut (whole texts, of which SentencePiece skips every one over
`tokenizer.max_sentence_length` bytes) and as it draws it now (texts cut into pieces within that
size, `pipeline.prepare.train_tokenizer.sample_pieces`).

A generated web-like corpus: 20,000 documents of made-up words, a fifth of them 10,000-40,000
characters long, the rest 200-3,000. The sample is the train split's bottom-k by salted hash, as
`pipeline.prepare.scan.scan_unit` draws it, with the web example's `max_doc_chars`. Prints one
line per way; asserts nothing.

    python benchmarks/tokenizer_long_docs.py [--docs 20000] [--sample 200000]
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline.prepare.readers import chunk_text  # noqa: E402
from pipeline.prepare.scan import assign_split  # noqa: E402
from pipeline.prepare.train_tokenizer import BottomKSample, sample_pieces  # noqa: E402
from pipeline.prepare.units import text_hash  # noqa: E402

LIMIT, SALT, MAX_DOC_CHARS, LONG = 4192, "split-v1", 100_000, 10_000


def documents(n: int, seed: int = 1):
    rng = random.Random(seed)
    words = [
        "".join(rng.choice("abcdefghiklmnoprstuvwyz") for _ in range(rng.randint(2, 9)))
        for _ in range(20_000)
    ]
    for _ in range(n):
        size = rng.randint(10_000, 40_000) if rng.random() < 0.2 else rng.randint(200, 3_000)
        out, length = [], 0
        while length < size:
            word = rng.choice(words)
            out.append(word)
            length += len(word) + 1
        yield " ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=20_000)
    parser.add_argument("--sample", type=int, default=200_000)
    args = parser.parse_args()
    before, after = BottomKSample(args.sample), BottomKSample(args.sample)
    corpus = long_bytes = 0
    for text in documents(args.docs):
        if assign_split(text_hash(text, SALT), 0.005, 0.005) != "train":
            continue
        is_long = len(text) > LONG  # marked through the sample as a "cut" text
        corpus += len(text)
        long_bytes += len(text) * is_long
        for piece in chunk_text(text, MAX_DOC_CHARS):
            before.add(text_hash(piece, SALT + "tok"), piece, is_long)
            for part in sample_pieces(piece, LIMIT):
                after.add(text_hash(part, SALT + "tok"), part, is_long)
    print(
        f"corpus (train split): {corpus / 1e6:.1f} MB, {long_bytes / corpus:.1%} of it in documents over {LONG:,} characters"
    )
    for name, sample, skip in (("before", before, LIMIT), ("now", after, None)):
        marked = set(sample.cut_keys())
        kept = [
            (key, len(t.encode()))
            for key, t in sample.items()
            if skip is None or len(t.encode()) <= skip
        ]
        total = sum(size for _, size in kept)
        long = sum(size for key, size in kept if key in marked)
        print(
            f"{name}: sample of {len(sample.items()):,} texts, {len(marked):,} of them from long documents; "
            f"SentencePiece trains on {len(kept):,} ({total / 1e6:.1f} MB), {long / max(total, 1):.1%} of "
            "its bytes from long documents"
        )


if __name__ == "__main__":
    main()
