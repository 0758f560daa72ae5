"""What the corpus-wide curation stages decided, as the encode tasks apply it: the ids the
near-duplicate stage removed, and the evaluation texts' keys that training texts must not share
(`curation.py` decides them between the scan and the encode; `encode.encode_bucket` applies them).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipeline.prepare.curate.decontaminate import contaminated
from pipeline.prepare.curate.tally import Tally


@dataclass
class NearDuplicates:
    """What the near-duplicate stage decided, for the encode tasks: the ids of the texts to
    drop (sorted), and those whose texts the driver wants for the sample (dropped ones and the
    copies kept in their place), found as the lines are read."""

    removed: np.ndarray
    wanted: np.ndarray
    found: dict[int, list[str]] = field(default_factory=dict)  # id -> [split, text]


@dataclass
class Curation:
    """The corpus-wide decisions the encode tasks apply (one object in Ray's store): the
    evaluation texts' keys (decontamination) and the near-duplicate stage's removed ids."""

    eval_keys: list = field(default_factory=list)  # decontaminate.EvalKeys, in match order
    ngram: int = 13
    removed: np.ndarray | None = None
    wanted: np.ndarray | None = None

    def near_duplicates(self) -> NearDuplicates | None:
        if self.removed is None:
            return None
        return NearDuplicates(self.removed, self.wanted)


def decontaminated(
    texts: list[str], curation: Curation, tally: Tally, split: str, pairs: bool = False
) -> list[str]:
    """The texts that overlap no evaluation text; each dropped one counted under the origin it
    overlaps first (`decontamination.valid`, `.test`, or an evaluation file's name; a
    translation pair's, `..._pairs`: either side overlapping drops it)."""
    sides = [text.split("\t", 1) for text in texts] if pairs else [[text] for text in texts]
    hits = [("", "")] * len(texts)
    for side in range(2 if pairs else 1):
        found = contaminated([s[side] for s in sides], curation.eval_keys, curation.ngram)
        hits = [old if old[0] else new for old, new in zip(hits, found)]
    kept = []
    for text, (origin, match) in zip(texts, hits):
        if origin:
            rule = f"decontamination.{origin}" + ("_pairs" if pairs else "")
            tally.drop(rule, split, text.replace("\t", " | "), match)
        else:
            kept.append(text)
    return kept
