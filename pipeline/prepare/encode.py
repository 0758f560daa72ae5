"""The encode, stage 2 of `pipeline.prepare` as one Ray task runs it: one (dataset, split,
bucket) read from every unit's bucket file in unit order, exact duplicates dropped, tokenized,
packed into blocks (`packed`) or filtered as pairs (`translation`), and written as WebDataset
shards, one shard sequence per source. Pure functions of their arguments.

The design and its reasons: docs/design.md#pipelinepreparescanpy-and-encodepy.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from pipeline.format import SPLITS, sample_key, shard_name, token_dtype
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate.decisions import Curation, NearDuplicates, decontaminated
from pipeline.prepare.curate.tally import Tally
from pipeline.prepare.rss import cpu_noted, peak_rss_mb, reset_peak_rss
from pipeline.prepare.scan import MONO, PAIRS, bucket_file, ids_file
from pipeline.prepare.sources import source_list
from pipeline.shard_tar import ShardWriter
from pipeline.tokenizer import Tokenizer, tokenizer_from_files

ENCODE_CHUNK = 2048  # texts per SentencePiece batch call


def unique_chunks(
    work_dir: str,
    unit_sources: list[int],
    family: str,
    split: str,
    bucket: int,
    stats: list[Counter],
    size: int = ENCODE_CHUNK,
    near: NearDuplicates | None = None,
) -> Iterator[tuple[int, list[str]]]:
    """The distinct records of one bucket, in unit order, as (source index, texts): runs of at
    most `size` consecutive records of one source, each record's first occurrence only; a
    duplicate is counted for the source that loses it. Records are told apart by a 64-bit hash
    (a collision, about n**2 / 2**65 for n records, would drop a record as a duplicate, the same
    one in every run). Read a megabyte of lines at a time and decoded a run at a time: per-line
    Python work is the encode stage's cost beside the tokenizer's. `near`: a first occurrence
    whose id the near-duplicate stage removed is dropped too (its exact copies stay counted as
    duplicates), counted as `near_duplicates_dropped`."""
    seen: set[bytes] = set()
    blake2b = hashlib.blake2b
    current, kept = -1, []  # the source of the run being gathered, its lines
    for unit_index, source in enumerate(unit_sources):
        path = bucket_file(work_dir, unit_index, family, split, bucket)
        if not path.is_file():
            continue
        if source != current:
            if kept:
                yield current, _texts(kept)
            current, kept = source, []
        dropped, near_dropped = 0, 0
        ids = np.fromfile(ids_file(path), dtype=np.uint64) if near is not None else None
        line_number = 0
        with open(path, "rb") as fh:
            while lines := fh.readlines(1 << 20):
                digests = [blake2b(line, digest_size=8).digest() for line in lines]
                if ids is not None:
                    these = ids[line_number : line_number + len(lines)]
                    line_number += len(lines)
                    gone = np.isin(these, near.removed)
                    for at in np.flatnonzero(np.isin(these, near.wanted)).tolist():
                        near.found[int(these[at])] = [split, lines[at][:-1].decode("utf-8")]
                else:
                    gone = None
                for at, (line, digest) in enumerate(zip(lines, digests)):
                    if digest in seen:
                        dropped += 1
                        continue
                    seen.add(digest)
                    if gone is not None and gone[at]:
                        near_dropped += 1
                        continue
                    kept.append(line)
                while len(kept) >= size:
                    yield source, _texts(kept[:size])
                    del kept[:size]
        if dropped:
            stats[source]["duplicates_dropped"] += dropped
        if near_dropped:
            stats[source]["near_duplicates_dropped"] += near_dropped
    if kept:
        yield current, _texts(kept)


def _texts(lines: list[bytes]) -> list[str]:
    """Newline-ended UTF-8 record lines as texts, decoded in one call."""
    return b"".join(lines)[:-1].decode("utf-8").split("\n")


class _ShardSequence:
    """The shards of one (dataset, split, bucket, source): samples keyed in order, a new shard
    every `max_samples`."""

    def __init__(
        self,
        out_dir: str,
        dataset: str,
        split: str,
        bucket: int,
        source: str | None,
        max_samples: int,
    ):
        self.out_dir, self.dataset, self.split, self.bucket = out_dir, dataset, split, bucket
        self.source, self.max_samples = source, max_samples
        self.records: list[dict] = []
        self.writer: ShardWriter | None = None
        self.relative = ""
        self.index = 0

    def write(self, columns: dict[str, list[np.ndarray]]) -> None:
        """Samples given field by field (as `ShardWriter.write_many`), in order."""
        count = len(next(iter(columns.values()), ()))
        done = 0
        while done < count:
            if self.writer is None:
                self.relative = shard_name(
                    self.dataset, self.split, self.bucket, len(self.records), self.source
                )
                self.writer = ShardWriter(Path(self.out_dir) / self.relative)
            take = min(count - done, self.max_samples - self.writer.samples)
            keys = [
                sample_key(self.bucket, index) for index in range(self.index, self.index + take)
            ]
            self.writer.write_many(
                keys, {name: column[done : done + take] for name, column in columns.items()}
            )
            self.index += take
            done += take
            if self.writer.samples >= self.max_samples:
                self._close()

    def _close(self) -> None:
        record = self.writer.close()
        record["path"] = self.relative
        self.records.append(record)
        self.writer = None

    def finish(self) -> list[dict]:
        if self.writer is not None:
            self._close()
        return self.records

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


_TOKENIZERS: dict[str, Tokenizer] = {}


def _tokenizer(files: dict[str, bytes], lang_tags: tuple[str, ...]) -> Tokenizer:
    """The tokenizer, loaded once per worker process rather than once per task (tens of ms each);
    a prepare's one or two (a translation target's own) are kept."""
    key = hashlib.sha256(b"".join(files[name] for name in sorted(files))).hexdigest()
    if key not in _TOKENIZERS:
        if len(_TOKENIZERS) >= 2:
            _TOKENIZERS.clear()
        _TOKENIZERS[key] = tokenizer_from_files(files, lang_tags=lang_tags)
    return _TOKENIZERS[key]


def encode_bucket(
    dataset: str,
    split: str,
    bucket: int,
    unit_sources: list[int],
    work_dir: str,
    out_dir: str,
    tokenizer_files: dict[str, bytes],
    cfg: PrepareConfig,
    target_files: dict[str, bytes] | None = None,
    curation: Curation | None = None,
) -> dict:
    """Stage 2 for one (dataset, split, bucket): returns its shard records and statistics, per
    source. `target_files`: translation targets' own tokenizer (None: the one tokenizer's);
    `curation`: what the near-duplicate and decontamination stages drop here."""
    started = time.perf_counter()
    tokenizer = _tokenizer(tokenizer_files, tuple(cfg.tokenizer.lang_tags))
    target = _tokenizer(target_files, ()) if target_files else tokenizer
    dtype = token_dtype(max(tokenizer.vocab_size, target.vocab_size))
    names = [source.name for source in source_list(cfg)]
    several = len(names) > 1
    stats = [Counter() for _ in names]
    sequences = [
        _ShardSequence(
            out_dir, dataset, split, bucket, name if several else None, cfg.shard.max_samples
        )
        for name in names
    ]
    family = MONO if dataset == "packed" else PAIRS
    curation = curation or Curation()
    near = curation.near_duplicates() if family == MONO else None
    tallies = [Tally(cfg.dropped_samples) for _ in names]
    checked = [
        split == "train" and bool(curation.eval_keys) and source.decontaminate
        for source in source_list(cfg)
    ]
    chunks = unique_chunks(
        work_dir, unit_sources, family, split, bucket, stats, size=ENCODE_CHUNK, near=near
    )
    checking = 0.0  # seconds spent on decontamination, for the benchmarks
    try:
        if dataset == "packed":
            packers = [
                _Packer(cfg.seq_len, dtype, sequence.write, tokenizer.specials.document)
                for sequence in sequences
            ]
            for source, texts in chunks:
                if checked[source]:
                    started_check = time.perf_counter()
                    texts = decontaminated(texts, curation, tallies[source], split)
                    checking += time.perf_counter() - started_check
                    if not texts:
                        continue
                stats[source]["documents"] += len(texts)
                packers[source].add(tokenizer.encode_batch(texts), stats[source])
            for packer, source_stats in zip(packers, stats):
                packer.finish(source_stats)
        else:
            for source, texts in chunks:
                if checked[source]:
                    started_check = time.perf_counter()
                    texts = decontaminated(texts, curation, tallies[source], split, pairs=True)
                    checking += time.perf_counter() - started_check
                    if not texts:
                        continue
                pairs = [text.split("\t", 1) for text in texts]
                columns = _filter_pairs(pairs, (tokenizer, target), cfg, dtype, stats[source])
                sequences[source].write(columns)
        shards = []
        for name, sequence in zip(names, sequences):
            for record in sequence.finish():
                shards.append({**record, "source": name})
    except BaseException:
        for sequence in sequences:
            sequence.abort()
        raise
    total: Counter = Counter()
    for source_stats, tally in zip(stats, tallies):
        total.update(source_stats)
        tally.count(
            "near_dedup.near_duplicate", split, source_stats.get("near_duplicates_dropped", 0)
        )
    return {
        "dataset": dataset,
        "split": split,
        "bucket": bucket,
        "shards": shards,
        "stats": dict(total),
        "source_stats": {name: dict(s) for name, s in zip(names, stats)},
        "curation": {name: tally.to_dict() for name, tally in zip(names, tallies)},
        "near_found": near.found if near is not None else {},
        "seconds": time.perf_counter() - started,
        "decontamination_seconds": checking,
        "peak_rss_mb": peak_rss_mb(),
    }


def encode_splits(
    dataset: str,
    bucket: int,
    unit_sources: list[int],
    work_dir: str,
    out_dir: str,
    tokenizer_files: dict[str, bytes],
    cfg: PrepareConfig,
    target_files: dict[str, bytes] | None = None,
    curation: Curation | None = None,
) -> list[dict]:
    """`encode_bucket` for every split of one (dataset, bucket), in SPLITS order: one Ray task
    rather than three, since valid and test buckets are small and a task costs milliseconds."""
    reset_peak_rss()
    cpu = time.process_time()
    return cpu_noted(
        [
            encode_bucket(
                dataset,
                split,
                bucket,
                unit_sources,
                work_dir,
                out_dir,
                tokenizer_files,
                cfg,
                target_files,
                curation,
            )
            for split in SPLITS
        ],
        cpu,
    )


class _Packer:
    """Documents framed as the tokenizer frames one (`Specials.document`: ours `text </s>`, GPT-2's
    `text <|endoftext|>`, Llama's `<s> text </s>`, BERT's `[CLS] text [SEP]`), joined and cut into
    blocks of exactly `seq_len` tokens, streamed: `add` takes documents in order and emits the
    blocks they complete, each with the positions where a document (or the rest of one) starts
    (as shard columns: `_ShardSequence.write`);
    `finish` drops (and counts) the short tail. The blocks are the same however the documents
    are chunked."""

    def __init__(
        self,
        seq_len: int,
        dtype: np.dtype,
        emit: Callable[[dict], None],
        frame: tuple[tuple[int, ...], tuple[int, ...]],
    ):
        self.seq_len, self.dtype, self.emit = seq_len, dtype, emit
        self.before, self.after = list(frame[0]), list(frame[1])
        self.carry = np.empty(0, dtype=np.int64)
        self.carry_starts = np.empty(0, dtype=np.int64)  # where documents start in `carry`

    def add(self, documents: list[list[int]], stats: Counter) -> None:
        framed = self._framed(documents)
        stats["tokens"] += len(framed[0])
        stream = np.concatenate((self.carry, framed[0]))
        # ascending: the carried documents' starts, then this call's
        starts = np.concatenate((self.carry_starts, framed[1] + len(self.carry)))
        n_blocks = len(stream) // self.seq_len
        cut = n_blocks * self.seq_len
        blocks = stream[:cut].reshape(n_blocks, self.seq_len).astype(self.dtype)
        self.carry = stream[cut:]
        self.carry_starts = starts[np.searchsorted(starts, cut, side="left") :] - cut
        # Each block's document starts strictly inside it (its own first position is always
        # one): found by bisection, not by a scan of every start for every block.
        firsts = np.arange(n_blocks, dtype=np.int64) * self.seq_len
        lows = np.searchsorted(starts, firsts, side="right")
        highs = np.searchsorted(starts, firsts + self.seq_len, side="left")
        zero = np.zeros(1, dtype=np.int64)
        self.emit(
            {
                "input_ids": list(blocks),
                "doc_starts": [
                    np.concatenate((zero, starts[low:high] - first)).astype(self.dtype)
                    for first, low, high in zip(firsts.tolist(), lows.tolist(), highs.tolist())
                ],
            }
        )

    def _framed(self, documents: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
        """The documents, each between the frame's tokens, as one array, and where each starts:
        built by numpy from the lengths rather than by a list extended per document."""
        ids, offsets = _flat(documents, np.int64)
        lengths = np.diff(offsets)
        before, after = len(self.before), len(self.after)
        ends = np.cumsum(lengths + (before + after))
        starts = ends - (lengths + (before + after))
        stream = np.empty(int(ends[-1]) if len(ends) else 0, dtype=np.int64)
        inside = np.ones(len(stream), dtype=bool)
        for offset, token in enumerate(self.before):
            stream[starts + offset] = token
            inside[starts + offset] = False
        for offset, token in enumerate(self.after):
            stream[ends - after + offset] = token
            inside[ends - after + offset] = False
        stream[inside] = ids
        return stream, starts

    def finish(self, stats: Counter) -> None:
        stats["tail_tokens_dropped"] += len(self.carry)
        self.carry = self.carry[:0]
        self.carry_starts = self.carry_starts[:0]


def _filter_pairs(
    pairs: list[list[str]],
    tokenizers: tuple[Tokenizer, Tokenizer],
    cfg: PrepareConfig,
    dtype: np.dtype,
    stats: Counter,
) -> dict[str, list[np.ndarray]]:
    """The kept pairs' source and target ids as shard columns, each side encoded by its own
    tokenizer (the source side's and the target side's, after `translation.reverse` has chosen
    the direction); the others counted by why they were dropped."""
    limits = cfg.translation
    source_side, target_side = (1, 0) if limits.reverse else (0, 1)
    sources = tokenizers[0].encode_batch([p[source_side] for p in pairs])
    targets = tokenizers[1].encode_batch([p[target_side] for p in pairs])
    # Decided for the whole chunk at once: per-pair Python is this stage's cost beside the
    # tokenizer's.
    source_ids, source_ends = _flat(sources, dtype)
    target_ids, target_ends = _flat(targets, dtype)
    source_lengths = np.diff(source_ends)
    target_lengths = np.diff(target_ends)
    shorter = np.minimum(source_lengths, target_lengths)
    longer = np.maximum(source_lengths, target_lengths)
    bad_length = (shorter < limits.min_tokens) | (longer > limits.max_tokens)
    bad_ratio = ~bad_length & (longer > limits.max_ratio * shorter)
    kept = np.flatnonzero(~(bad_length | bad_ratio))
    counts = {
        "pairs_filtered_length": int(bad_length.sum()),
        "pairs_filtered_ratio": int(bad_ratio.sum()),
        "pairs": len(kept),
        "tokens": int(source_lengths[kept].sum() + target_lengths[kept].sum()),
    }
    stats.update({name: count for name, count in counts.items() if count})  # no zero entries
    return {
        "src_ids": _pieces(source_ids, source_ends, kept),
        "tgt_ids": _pieces(target_ids, target_ends, kept),
    }


def _pieces(ids: np.ndarray, ends: np.ndarray, kept: np.ndarray) -> list[np.ndarray]:
    """The kept sequences of a `_flat` array, as views."""
    starts, stops = ends[kept].tolist(), ends[kept + 1].tolist()
    return [ids[start:stop] for start, stop in zip(starts, stops)]


def _flat(sequences: list[list[int]], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The sequences end to end as one array, and where each starts (one offset more: the end)."""
    ends = np.zeros(len(sequences) + 1, dtype=np.int64)
    np.cumsum(np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences)), out=ends[1:])
    ids = np.fromiter(itertools.chain.from_iterable(sequences), dtype=dtype, count=int(ends[-1]))
    return ids, ends
