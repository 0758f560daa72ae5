"""A small corpus for the curation stages, made in the test from text this machine has (the
license texts under /usr/share/common-licenses, the German side of the system's message
catalogs): good English documents, and the kinds each stage drops, planted with known counts.

    python tests/curated.py OUT   # writes OUT/web.jsonl, OUT/pairs.tsv, OUT/eval.txt
"""

from __future__ import annotations

import glob
import json
import random
import re
import sys
from pathlib import Path

from corpora import synthetic_pairs

LICENSES = Path("/usr/share/common-licenses")


def english_paragraphs(min_words: int = 60) -> list[str]:
    """Paragraphs of running English text of the license files, in file order, distinct."""
    seen, out = set(), []
    for name in ("GPL-3", "Apache-2.0", "GFDL-1.3", "MPL-2.0", "LGPL-2.1", "Artistic", "GPL-2"):
        text = (LICENSES / name).read_text(encoding="utf-8", errors="replace")
        for block in re.split(r"\n\s*\n", text):
            words = block.split()
            if len(words) >= min_words and block not in seen and "{" not in block:
                seen.add(block)
                out.append(" ".join(words))  # unwrapped, as a web page's paragraph
    return out


def german_paragraphs(count: int, seed: int = 0) -> list[str]:
    """German documents: sentences of the system's German message catalogs, joined."""
    import gettext

    sentences = []
    for path in sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo"))[:80]:
        try:
            with open(path, "rb") as fh:
                catalog = gettext.GNUTranslations(fh)
        except (OSError, UnicodeDecodeError):
            continue
        for value in catalog._catalog.values():  # noqa: SLF001  (the parsed msgstrs)
            if isinstance(value, str) and len(value.split()) >= 6 and value.endswith("."):
                sentences.append(" ".join(value.split()))
    rng = random.Random(seed)
    rng.shuffle(sentences)
    return [" ".join(sentences[i * 8 : i * 8 + 8]) for i in range(count)]


def edited(text: str, changes: int, seed: int) -> str:
    """`text` with `changes` words replaced: a near-copy."""
    rng = random.Random(seed)
    words = text.split(" ")
    for _ in range(changes):
        words[rng.randrange(len(words))] = rng.choice(["indeed", "namely", "also", "thus"])
    return " ".join(words)


BOILERPLATE = "Home\nAbout us\nContact\nShop\nLogin\nCart (0)\nFollow us\nHome\nAbout us\n"
LOREM = "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor."
PII = "Questions about this text go to jane.doe@mailhost.org or to the server at 8.8.8.8."


def split_of(text: str, valid: float, test: float, salt: str = "split-v1") -> str:
    """The split prepare gives a document (the dataset's rule: its cleaned text's salted hash)."""
    from pipeline.prepare.scan import assign_split
    from pipeline.prepare.units import clean_text, text_hash

    return assign_split(text_hash(clean_text(text), salt), valid, test)


def write_corpus(
    out: Path, valid: float = 0.1, test: float = 0.1, n_good: int = 40, near: int = 6
) -> dict:
    """OUT/web.jsonl, OUT/pairs.tsv and OUT/eval.txt; returns what was planted. The planted
    near-copies and the evaluation file's document are of training documents whose copies land
    in the training split too, so each stage's count is known."""
    out.mkdir(parents=True, exist_ok=True)
    paragraphs = english_paragraphs()
    # a document: four paragraphs on lines of their own, as a web page's text
    good = ["\n".join(paragraphs[4 * i : 4 * i + 4]) for i in range(len(paragraphs) // 4)]
    good = good[:n_good]
    german = german_paragraphs(6)
    copies, originals = [], []
    for index, doc in enumerate(good):
        copy = edited(doc, 3, index)
        if (
            len(copies) < near
            and split_of(doc, valid, test) == split_of(copy, valid, test) == "train"
        ):
            copies.append(copy)
            originals.append(doc)
    eval_doc = next(
        doc for doc in good if doc not in originals and split_of(doc, valid, test) == "train"
    )
    pii_doc = next(
        doc
        for doc in good
        if doc not in originals
        and doc != eval_doc
        and split_of(doc + "\n" + PII, valid, test) == "train"
    )
    # first: the end of a bucket's last document may fall in the tail the packer drops
    docs = [pii_doc + "\n" + PII] + [d for d in good if d != pii_doc] + copies + german
    docs += [BOILERPLATE, BOILERPLATE.replace("Shop", "Store"), good[len(good) // 2] + "\n" + LOREM]
    with open(out / "web.jsonl", "w", encoding="utf-8") as fh:
        for doc in docs:
            fh.write(json.dumps({"text": doc}, ensure_ascii=False) + "\n")
    pairs = synthetic_pairs(400)
    # near-copies of pairs: case, punctuation and a number changed
    variants = [(re.sub(r"\d+", "7", en.capitalize() + "!"), de + "!") for en, de in pairs[:80]]
    with open(out / "pairs.tsv", "w", encoding="utf-8") as fh:
        for en, de in pairs + variants:
            fh.write(f"{en}\t{de}\n")
    (out / "eval.txt").write_text(" ".join(eval_doc.split()) + "\n", encoding="utf-8")
    return {
        "copies": list(zip(originals, copies)),
        "german": len(german),
        "eval_doc": eval_doc,
        "pii_doc": pii_doc,
    }


if __name__ == "__main__":
    planted = write_corpus(Path(sys.argv[1]))
    print(f"{len(planted['copies'])} near-copies, {planted['german']} German documents")
