"""What the curation stages drop, counted by rule and split, with a small sample of the dropped
texts per rule (so a user audits a threshold by reading ten of them).

A sample is the k texts with the smallest salted hashes (bottom-k, as the tokenizer's sample):
merging tallies in any order gives the same sample, so it does not depend on how the corpus was
cut into tasks or how many workers ran them.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter

SAMPLE_CHARS = 4000  # a sampled text is cut to this many characters (a web page can be long)


def _key(rule: str, text: str) -> int:
    digest = hashlib.blake2b(text.encode("utf-8"), digest_size=8, person=rule.encode()[:16])
    return int.from_bytes(digest.digest(), "little")


class Tally:
    """Counts `(rule, split) -> n` and, per rule, the bottom-k sample of what it dropped."""

    def __init__(self, k: int = 20):
        self.k = k
        self.counts: Counter = Counter()
        self._samples: dict[str, list[tuple[int, dict]]] = {}  # rule -> max-heap by -key

    def count(self, rule: str, split: str, n: int = 1) -> None:
        if n:
            self.counts[(rule, split)] += n

    def drop(self, rule: str, split: str, text: str, detail: str = "", **extra) -> None:
        """Count one dropped (or changed) text and offer it to the rule's sample."""
        self.counts[(rule, split)] += 1
        self.offer(
            rule,
            _key(rule, text),
            {"split": split, "detail": detail, **extra, "text": text[:SAMPLE_CHARS]},
        )

    def offer(self, rule: str, key: int, record: dict) -> None:
        if self.k <= 0:
            return
        heap = self._samples.setdefault(rule, [])
        if any(-neg == key for neg, _ in heap):
            return
        if len(heap) < self.k:
            heapq.heappush(heap, (-key, record))
        elif key < -heap[0][0]:
            heapq.heapreplace(heap, (-key, record))

    def samples(self, rule: str) -> list[dict]:
        """The rule's sample, in hash order (the same whatever order texts came in)."""
        return [
            record
            for _, record in sorted(
                ((-neg, record) for neg, record in self._samples.get(rule, [])), key=lambda x: x[0]
            )
        ]

    def rules(self) -> list[str]:
        return sorted({rule for rule, _ in self.counts} | set(self._samples))

    def to_dict(self) -> dict:
        """A plain form for a Ray task's result."""
        return {
            "counts": [[rule, split, n] for (rule, split), n in sorted(self.counts.items())],
            "samples": {
                rule: [[-neg, record] for neg, record in heap]
                for rule, heap in self._samples.items()
            },
        }

    def merge(self, other: dict | "Tally") -> None:
        if isinstance(other, Tally):
            other = other.to_dict()
        for rule, split, n in other["counts"]:
            self.counts[(rule, split)] += n
        for rule, items in other["samples"].items():
            for key, record in items:
                self.offer(rule, key, record)

    def nested(self) -> dict:
        """`{stage: {rule: {split: n}}}` for the manifest, a rule `stage.name` split at its first
        dot."""
        out: dict = {}
        for (rule, split), n in sorted(self.counts.items()):
            stage, _, name = rule.partition(".")
            out.setdefault(stage, {}).setdefault(name or stage, {})[split] = n
        return out
