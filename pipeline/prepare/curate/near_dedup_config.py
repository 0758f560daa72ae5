"""The schema of near-duplicate removal (`near_dedup`): shingles, LSH bands x rows, the
verification threshold, the shuffle's partitions. `minhash` signs with it, `lsh` groups with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from common.configure import UserError

# Longest shingle, in words: the hashing has one multiplier per word position of a shingle
# (`minhash.NGRAM_MULT`).
MAX_NGRAM = 64


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
        if self.ngram > MAX_NGRAM:
            raise bad("ngram", f"{self.ngram} is above {MAX_NGRAM}")
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
