"""The tokenizer's training sample, drawn from the scan's results: each source's bottom-k texts
(`train_tokenizer.BottomKSample`), their slots divided by `tokenizer_share`, and the sample's
figures for the log and the manifest.
"""

from __future__ import annotations

from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.sources import source_list
from pipeline.prepare.train_tokenizer import BottomKSample
from pipeline.prepare.units import Unit


def tokenizer_sample(
    cfg: PrepareConfig, units: list[Unit], scanned: list[dict]
) -> tuple[list[str], list[bool]]:
    """The tokenizer's training texts: each source's bottom-k texts, `tokenizer.sample_texts`
    slots divided by `tokenizer_share` (a source short of texts leaves its slots to the others,
    in proportion), then all ordered by hash. With one source: its bottom-k, as ever. Beside
    them, whether each is a piece of a text too long for SentencePiece (`sample_pieces`)."""
    sources = source_list(cfg)
    samples = [BottomKSample(cfg.tokenizer.sample_texts) for _ in sources]
    cut: set[int] = set()
    for unit, result in zip(units, scanned):
        samples[unit.source].merge(result["sample"], result.get("sample_cut", ()))
    for sample in samples:
        cut.update(sample.cut_keys())
    items = [sample.items() for sample in samples]
    quota = [0] * len(sources)
    open_sources, slots = list(range(len(sources))), cfg.tokenizer.sample_texts
    # water-filling: the shares of the sources that still have texts
    while open_sources and slots > 0:
        total = sum(sources[i].tokenizer_share for i in open_sources)
        exact = {i: slots * sources[i].tokenizer_share / total for i in open_sources}
        offer = {i: int(exact[i]) for i in open_sources}
        # The slots rounding left over go to the largest remainders (ties: source order).
        by_remainder = sorted(open_sources, key=lambda i: (offer[i] - exact[i], i))
        for i in by_remainder[: slots - sum(offer.values())]:
            offer[i] += 1
        for i in open_sources:
            quota[i] += min(offer[i], len(items[i]) - quota[i])
        slots = cfg.tokenizer.sample_texts - sum(quota)
        open_sources = [i for i in open_sources if quota[i] < len(items[i])]
    chosen: dict[int, str] = {}
    for i in range(len(sources)):
        for key, text in items[i][: quota[i]]:
            chosen.setdefault(key, text)  # a text two sources share is one training text
    keys = sorted(chosen)
    return [chosen[key] for key in keys], [key in cut for key in keys]


def sample_facts(texts: list[str], cut: list[bool]) -> dict:
    """The training sample in figures, for the log and the manifest: its texts and bytes, and how
    many of them are pieces of longer texts (cut to SentencePiece's `max_sentence_length`)."""
    sizes = [len(text.encode("utf-8")) for text in texts]
    return {
        "texts": len(texts),
        "bytes": sum(sizes),
        "pieces_of_long_texts": sum(cut),
        "bytes_of_long_texts": sum(size for size, piece in zip(sizes, cut) if piece),
    }
