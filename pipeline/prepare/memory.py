"""How much memory one Ray worker of a prepare needs at its peak, estimated from the plan before
Ray starts, and the check against what this machine (or its cgroup, if less) can give each worker.

A worker runs one task at a time, so its peak is its own resident size plus the larger of what a
scan task and an encode task hold:

- an encode task (one dataset's bucket, split by split) keeps a set of the 8-byte digests of the
  records it has written, to drop duplicates (`encode.unique_chunks`): about SEEN_BYTES per
  distinct record of the bucket's largest split, the train split; and a chunk of ENCODE_CHUNK
  texts with their token ids as Python lists (about ENCODE_BYTES_PER_TEXT_BYTE of memory per
  byte of text);
- a scan task holds its unit's bytes (a chunk of a compressed file: `unit_bytes`) and the
  tokenizer's sample of its texts, up to `tokenizer.sample_texts` of them (SAMPLE_OVERHEAD bytes
  each beside the text); and, for a moment, the record it reads as several copies
  (`record_scan_bytes`): its raw line, the decoded and the cleaned text, the de-duplication
  key's case-folded and rejoined forms (`units.clean_text`, `units.normalize_key`), and a str
  object per word in the list `re.sub` builds while it collapses whitespace. That is nothing
  beside the sample for lines of a few hundred bytes, and the scan's peak for a long one: a
  single 50 MB line of short words takes about 0.8 GiB (16 times its size) before
  `max_doc_chars` cuts it. The longest record is the probe's (below): a longer line after the
  source's first PROBE_BYTES is not seen, and the measured peaks that prepare prints at the end
  show it.

The number of records is not known before the scan; it is estimated per source from the input's
decompressed size and the records per byte of a probe: the records of the source's first bytes
(PROBE_BYTES of them, or its first PROBE_UNITS whole units for formats read whole), read by the
readers the scan uses. The figures per record are Python's sizes, upper ends where they vary
(a set's table is 1.7-3.3 slots per element); the resident size before any task is BASE_MB.
Measured against a real run in docs/results.md#prepares-memory-per-worker.
"""

from __future__ import annotations

import itertools
import sys
from collections import Counter
from dataclasses import dataclass

from common.cgroup import memory_left
from common.configure import UserError
from pipeline.format import shard_sets
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.curate import lsh, minhash
from pipeline.prepare.curate.neardup import FLUSH_TEXTS
from pipeline.prepare.encode import ENCODE_CHUNK
from pipeline.prepare.readers import chunk_text, is_parallel, read_unit
from pipeline.prepare.scheduling import SCAN_TASKS_PER_WORKER
from pipeline.prepare.sources import decompressed_size, source_list
from pipeline.prepare.units import Unit, stream_chunks

MB = 1 << 20
BASE_MB = 180  # a worker with the prepare code, Ray, SentencePiece and numpy loaded, no task run
# Beside the workers, on the driver's machine: the driver (151 MiB of anonymous memory) and a
# local Ray's own processes (dashboard and its agents, monitors, GCS, raylet, two idle workers:
# 447 MiB), measured on a 0.2 GB prepare (docs/results.md#a-corpus-larger-than-memory); and, while
# the driver trains the tokenizer, SentencePiece's trainer: TRAIN_BYTES_PER_SAMPLE_BYTE per byte
# of its sample (575 MiB more for 20,000 texts of 1.2 KB: 23 measured).
HEAD_MB = 600
TRAIN_BYTES_PER_SAMPLE_BYTE = 26
SEEN_BYTES = 100  # a distinct record in the de-duplication set: a bytes object and its slots
ENCODE_BYTES_PER_TEXT_BYTE = 16  # the text, its ids as a list of ints, the packed stream
SAMPLE_OVERHEAD = 250  # a sample text's str, tuple, heap and set entries, hash; its copy sent back
PROBE_BYTES = 4 * MB
PROBE_UNITS = 8
# A record being read: LONG_TEXT_COPIES strs of its characters at once beside its raw bytes (the
# decoded line, the cleaned text, the key's case-folded form, its words' characters and the
# rejoined key), and WORD_BYTES for each word, a str object of its own (50-80 bytes with the
# header, in 16-byte blocks) and its two slots in re.sub's list of pieces. On single 20 MB lines
# (words of ASCII, Latin-1, CJK or emoji characters, CJK without spaces) the scan's term, the
# sample with it, is 5-24% above the scan task's measured growth; 4x on a line of one-letter
# words, whose strs Python shares (docs/results.md#prepares-memory-per-worker).
LONG_TEXT_COPIES = 5
WORD_BYTES = 96
# Near-duplicates: a batch of texts being signed holds their bytes' prefix hashes and powers and
# their shingles (numpy, 8 bytes each): 40 bytes per byte of text measured for the arrays alone,
# 80 counted with what the allocator keeps of them (a 1 GB corpus's scan tasks peaked at 397 MiB:
# docs/results.md#curation-at-scale); a shuffle task verifies VERIFY_EDGES candidate pairs at a
# time (`lsh.verify`'s chunk), holding their two texts' sketches. Decontamination hashes a
# chunk of ENCODE_CHUNK texts in the encode the same way (29
# bytes per byte measured, 64 counted).
SIGN_BYTES_PER_TEXT_BYTE = 80
DECONTAMINATE_BYTES_PER_TEXT_BYTE = 64
VERIFY_EDGES = lsh.VERIFY_CHUNK
SKETCH_OBJECT_BYTES = 200  # a numpy array's header and its place in a dict
BYTES_PER_WORD = 5  # of text, for the decontamination keys (one 8-byte n-gram hash a word)


@dataclass
class SourceProbe:
    records: float  # estimated records of the whole source
    texts_per_record: float  # monolingual texts a record gives (both sides of a pair, cut pieces)
    text_bytes: float  # mean UTF-8 bytes of one such text
    record_bytes: float = 0.0  # what reading its largest record takes at once (record_scan_bytes)


def record_scan_bytes(texts: tuple[str, ...], utf8_bytes: int) -> int:
    """The memory a scan task holds at once while it reads, cleans and hashes one record of
    these (cleaned) texts, `utf8_bytes` of them in UTF-8: see LONG_TEXT_COPIES. A str's own size
    (`sys.getsizeof`) counts its characters at 1, 2 or 4 bytes each, as its widest needs."""
    chars = sum(sys.getsizeof(text) for text in texts)
    words = sum(text.count(" ") + 1 for text in texts)
    return utf8_bytes + LONG_TEXT_COPIES * chars + WORD_BYTES * words


def probe_source(
    cfg: PrepareConfig, index: int, files: list[str], units: list[Unit]
) -> SourceProbe:
    """The source's records, estimated from its first bytes, and the size of their texts."""
    source = source_list(cfg)[index]
    total = sum(decompressed_size(path) for path in files)
    stats: Counter = Counter()
    records = texts = text_bytes = raw = largest = 0
    try:
        for unit in _probe_units(units, source):
            raw += _raw_bytes(unit)
            for first, second in read_unit(unit, source, stats):
                records += 1
                sides = (first, second) if second is not None else (first,)
                utf8 = 0
                for text in sides:
                    for piece in chunk_text(text, source.max_doc_chars):
                        texts += 1
                        utf8 += len(piece.encode("utf-8"))
                text_bytes += utf8
                largest = max(largest, record_scan_bytes(sides, utf8))
            if raw >= PROBE_BYTES:
                break
    except UserError:
        # An unreadable input is the scan's to report, where it belongs (with keep_partial's
        # staging directory and the counts of what was read); the estimate makes do without it.
        pass
    if not records:
        return SourceProbe(0.0, 1.0, 0.0)
    return SourceProbe(
        records * total / max(raw, 1), texts / records, text_bytes / texts, float(largest)
    )


def _probe_units(units: list[Unit], source) -> list[Unit]:
    """Units that hold the start of the source: the first PROBE_BYTES of a line-oriented file
    (decompressed, for a compressed one), else its first PROBE_UNITS units whole."""
    first = units[0] if units else None
    if first is None:
        return []
    line_oriented = source.format in ("text", "jsonl", "tsv") and not (
        source.format == "text" and source.text_split == "paragraph"
    )
    if line_oriented and first.path.endswith((".gz", ".zst")):
        chunks = stream_chunks(Unit(first.path, source=first.source, stream=True), PROBE_BYTES)
        try:
            return list(itertools.islice(chunks, 1))
        finally:
            chunks.close()
    if line_oriented:
        size = decompressed_size(first.path)
        return [Unit(first.path, 0, min(size, PROBE_BYTES), first.source)]
    return units[:PROBE_UNITS]


def _unit_size(unit: Unit, unit_bytes: int) -> int:
    """About the decompressed bytes a scan task reads for `unit` (a streamed file: a chunk)."""
    if unit.stream:
        return unit_bytes
    return _raw_bytes(unit)


def _raw_bytes(unit: Unit) -> int:
    if unit.data is not None:
        return len(unit.data)
    if unit.end >= 0 and not unit.path.endswith(".parquet"):
        return unit.end - unit.start
    size = decompressed_size(unit.path)
    if unit.path.endswith(".parquet"):
        import pyarrow.parquet as pq

        groups = pq.ParquetFile(unit.path).metadata.num_row_groups
        return size * (unit.end - unit.start) // max(groups, 1)
    return size


@dataclass
class MemoryEstimate:
    peak_bytes: int  # one worker at its peak
    why: str  # how it was counted, in words
    remedy: str  # what lowers it
    texts: float = 0.0  # monolingual texts estimated (the near-duplicate stage's scratch space)
    # the driver and a local Ray's own processes beside the workers, and what the driver's
    # tokenizer training adds (while the workers are idle, between the scan and the encode)
    head_bytes: int = HEAD_MB * MB
    train_bytes: int = 0


def estimate_worker_memory(
    cfg: PrepareConfig, files: list[list[str]], units: list[Unit]
) -> MemoryEstimate:
    """One Ray worker's peak resident memory for this plan (see the module's docstring)."""
    probes = [
        probe_source(cfg, index, source_files, [u for u in units if u.source == index])
        for index, source_files in enumerate(files)
    ]
    sources = source_list(cfg)
    train = 1.0 - cfg.split.valid - cfg.split.test
    buckets = cfg.shard.buckets
    mono = "packed" in shard_sets(cfg.tasks)
    pairs = "translation" in cfg.tasks
    mono_texts = sum(p.records * p.texts_per_record for p in probes) if mono else 0.0
    pair_records = (
        sum(p.records for p, s in zip(probes, sources) if is_parallel(s)) if pairs else 0.0
    )
    largest_bucket = max(mono_texts, pair_records) * train / buckets
    text_bytes = max((p.text_bytes for p in probes), default=0.0)
    seen = largest_bucket * SEEN_BYTES
    chunk = ENCODE_CHUNK * text_bytes * ENCODE_BYTES_PER_TEXT_BYTE
    encode = seen + chunk
    # A scan task reads a run of units (about total / SCAN_TASKS_PER_WORKER / workers bytes, or
    # one unit), and holds a chunk of a compressed file whole: `unit_bytes` of it.
    total = sum(decompressed_size(path) for source_files in files for path in source_files)
    largest_unit = max((_unit_size(unit, cfg.unit_bytes) for unit in units), default=0)
    task_input = min(
        total, max(largest_unit, total / (SCAN_TASKS_PER_WORKER * max(cfg.ray.num_workers, 1)))
    )
    held = cfg.unit_bytes if any(unit.stream for unit in units) else 0
    task_texts = task_input / max(text_bytes, 1.0)
    sampling = not cfg.tokenizer.path and cfg.tokenizer.sample_texts > 0
    sample = (
        min(cfg.tokenizer.sample_texts, task_texts) * (SAMPLE_OVERHEAD + text_bytes)
        if sampling
        else 0.0
    )
    # The sample may be full when the task's largest record comes: the two add up.
    record = max((p.record_bytes for p in probes), default=0.0)
    scan = held + sample + record
    records = sum(p.records for p in probes)
    near = cfg.near_dedup
    shuffle = signing = 0.0
    if near.enabled and mono:
        longest = max(s.max_doc_chars for s in sources) / 5  # words of the longest piece
        signing = 2 * near.permutations * 8 * max(minhash.BLOCK_SHINGLES, longest) + (
            FLUSH_TEXTS * text_bytes * SIGN_BYTES_PER_TEXT_BYTE
        )
        scan += signing
        shuffle = lsh.memory_per_task(int(mono_texts * near.bands), near.partitions)
        # the sketches of VERIFY_EDGES pairs verified at a time, each in a numpy array of its own
        shuffle += 2 * VERIFY_EDGES * (minhash.SKETCH * 4 + SKETCH_OBJECT_BYTES)
        encode += 16 * mono_texts  # the removed ids and the sample's, worst case all
    if cfg.decontamination.enabled:
        # the evaluation keys every encode task holds: an 8-byte hash per word of valid and test
        evaluated = (cfg.split.valid + cfg.split.test) * total + sum(
            decompressed_size(spec.path) for spec in cfg.decontamination.eval_files
        )
        encode += evaluated / BYTES_PER_WORD * 8
        encode += ENCODE_CHUNK * text_bytes * DECONTAMINATE_BYTES_PER_TEXT_BYTE
    peak = BASE_MB * MB + max(encode, scan, shuffle)
    sample_bytes = min(cfg.tokenizer.sample_texts * text_bytes, total) if sampling else 0
    training = int(sample_bytes * TRAIN_BYTES_PER_SAMPLE_BYTE)
    if shuffle > max(encode, scan):
        return MemoryEstimate(
            int(peak),
            f"near-duplicate shuffle: ~{mono_texts * near.bands:,.0f} band records over "
            f"{near.partitions} partitions, + the verification's sketches, + {BASE_MB} MiB "
            "for the worker itself",
            "raise near_dedup.partitions (a shuffle task holds one partition)",
            mono_texts,
            train_bytes=training,
        )
    if encode >= scan:
        remedy = "raise shard.buckets (the de-duplication set is a bucket's)"
        why = (
            f"encode: ~{largest_bucket:,.0f} distinct texts in the largest bucket's train split "
            f"({records:,.0f} records estimated / {buckets} buckets) x {SEEN_BYTES} bytes of "
            f"de-duplication set, + {chunk / MB:,.0f} MiB for {ENCODE_CHUNK} texts in encoding"
        )
    else:
        remedy = "lower unit_bytes or tokenizer.sample_texts (a scan task holds both)"
        if record > held + sample:
            remedy = "cut the input's longest lines (a scan task reads a record whole)"
        why = f"scan: {held / MB:,.0f} MiB of a compressed file's chunk"
        if sampling:
            texts = min(cfg.tokenizer.sample_texts, task_texts)
            why += f" + a tokenizer sample of ~{texts:,.0f} texts"
        if record >= MB:
            why += f" + {record / MB:,.0f} MiB while the longest record is read, cleaned and hashed"
        if signing:
            why += f" + {signing / MB:,.0f} MiB signing {FLUSH_TEXTS} texts for near-duplicates"
    return MemoryEstimate(
        int(peak),
        f"{why}, + {BASE_MB} MiB for the worker itself",
        remedy,
        mono_texts,
        train_bytes=training,
    )


def available_bytes() -> int:
    """The memory this machine can still give processes (psutil's `available`), or less: what
    this process's cgroup can (a SLURM job's `--mem`, a container's limit)."""
    import psutil

    machine = int(psutil.virtual_memory().available)
    group = memory_left()
    return machine if group is None else min(machine, group)
