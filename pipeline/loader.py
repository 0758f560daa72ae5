"""Stream prepared WebDataset shards into padded training batches: rank/worker split, seeded shuffle, exact resume.

Reads what `pipeline.prepare` writes (the contract is `pipeline.format`) and hands the trainer
batches for `causal_lm`, `mlm` and `translation`. It is built against two failures of the usual
WebDataset recipe (`split_by_node` -> `split_by_worker` -> `shuffle` buffer) under multi-rank
training (webdataset issues #188, #225, #234, #271):

* uneven shards, or a shard count that is not a multiple of ranks x workers, give ranks different
  numbers of batches; the rank that runs out first leaves the others waiting in an all-reduce at
  the end of the epoch, forever;
* there is no exact mid-epoch resume: a restart replays the epoch, or skips by decoding and
  throwing away everything already seen, so the time to the first batch grows with the position.

Design. The manifest knows every shard's sample count, so each epoch has a plan that costs no I/O:

1. The shard order is a permutation drawn from (seed, epoch); the samples inside each shard are
   permuted by (seed, epoch, shard). Concatenated, they form one virtual stream of N samples.
2. Only the first N' = floor(N / G) * G are used, G = micro_batch_size * world_size. The rest
   (fewer than G, and different samples each epoch since the stream is reshuffled) is counted in
   `stats["samples_dropped_remainder"]` and logged.
3. Rank r owns stream positions [r N'/W, (r+1) N'/W): B = N' / (W b) batches on every rank.
   Batch j of a rank is positions [j b, (j+1) b) of its range, a pure function of
   (seed, epoch, rank, j) - MLM masks included, drawn from a generator seeded by the same key.
4. DataLoader worker w of n builds batches k+w, k+w+n, ... (k: the first batch still owed).
   PyTorch's DataLoader collects from its workers round-robin, so batches arrive as k, k+1, ...
   whatever n is (0 included): the batch stream does not depend on `num_workers`, and a run may
   resume with a different one. The price, chosen over giving each worker a contiguous slice
   (which would tie the order to n): every worker reads through each shard of its rank's range,
   but decodes (np.load, never pickle) only its own samples; the workers move through the same
   shard at the same time, so the page cache serves the repeated reads.
5. Resume: the state is (epoch, batches handed to the trainer), counted in the main process
   because workers prefetch ahead of the trainer. Workers start at batch k directly: shards that
   lie wholly before the resume point are never opened, so resuming costs the same at any
   position. The state does not depend on the rank (every rank consumes the same B batches), so
   one copy saved by rank 0, as DeepSpeed's `client_state` is, restores every rank; a fingerprint
   of what fixes the plan (seed, world size, micro batch, shard list) is checked on load.
6. A shard that cannot be read (missing, wrong size, not a tar, truncated, wrong members or
   sample count) is skipped with a warning and counted; so is a sample that does not decode to
   token ids within the vocabulary (a bad id would otherwise end the job in the embedding on the
   GPU). A batch touching either is replaced by a filler - the nearest preceding good batch of
   the epoch, else the nearest following one - so that every rank still yields exactly B batches
   (a missing batch on one rank is a hang on all). Fillers are a function of the data alone, so
   a resumed run repeats the same ones; after a resume the preceding batch is rebuilt if needed.
7. Speed, without changing any of the above. A shard is taken apart by a scan of its 512-byte tar
   headers (checksums and number fields checked), not through tarfile. The reference stays
   webdataset's reader over tarfile: every shard the scan does not vouch for (another member type,
   a damaged header, data cut short, no end-of-archive block...) goes to it, so a shard is read,
   or skipped for the same reason, as before. A batch leaves a worker as a few numpy arrays (ids
   padded in their stored dtype, row lengths; for MLM also the masked ids and labels), pickled in
   one message, rather than as tensors that each take a separate trip through shared memory; the
   main process makes the tensors, attention masks and labels included.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.config import LoaderConfig
from pipeline.configure import UserError
from pipeline.format import (
    BOS_ID,
    DATASET_FOR_TASK,
    EOS_ID,
    FIELDS,
    MASK_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    decode_array,
    read_manifest,
    shard_entries,
)

log = logging.getLogger(__name__)

STATE_VERSION = 1
IGNORE_INDEX = -100  # the label torch's cross_entropy ignores

# Tags that keep the seeded streams apart: the shard order, the in-shard orders and the MLM masks
# must not be drawn from the same numbers even when their other key parts coincide.
_SHARD_ORDER, _SAMPLE_ORDER, _MLM_MASK = 1, 2, 3


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([k % 2**64 for k in key])))


def _torch_generator(*key: int) -> torch.Generator:
    seed = int(np.random.SeedSequence([k % 2**64 for k in key]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed & (2**63 - 1))


@dataclass(frozen=True)
class _Shard:
    index: int  # position in the manifest's list: the stable name its in-shard order is seeded by
    path: str
    samples: int
    bytes: int | None


class _ShardError(Exception):
    pass


def _read_shard(shard: _Shard, fields: tuple[str, ...], wanted: set[int]) -> dict[int, dict[str, bytes]]:
    """The raw members of the `wanted` samples (by position in the tar), after checking the whole shard.

    The whole shard is read even when few samples are wanted: a shard is good or bad as a whole,
    so every worker and every rank reaches the same verdict and the batch stream stays the same.
    A well-formed shard is taken apart by `_scan_tar`; anything it does not vouch for goes to
    `_read_shard_with_webdataset`, the reference reader, which gives the verdict.
    """
    try:
        size = os.path.getsize(shard.path)
    except OSError as err:
        raise _ShardError(f"cannot stat: {err}") from err
    # A size check catches most truncations before the tar reader sees them.
    if shard.bytes is not None and size != shard.bytes:
        raise _ShardError(f"{size} bytes, the manifest says {shard.bytes}")
    try:
        with open(shard.path, "rb") as stream:
            data = stream.read()
    except OSError:
        data = b""  # the reference reader meets the error again and reports it
    samples = _scan_tar(data, fields)
    if samples is None or len(samples) != shard.samples:
        return _read_shard_with_webdataset(shard, fields, wanted)
    kept: dict[int, dict[str, bytes]] = {}
    for position in sorted(wanted):
        members = {}
        for name in fields:
            start, length = samples[position][f"{name}.npy"]
            members[name] = data[start : start + length]
        kept[position] = members
    return kept


def _read_shard_with_webdataset(shard: _Shard, fields: tuple[str, ...],
                                wanted: set[int]) -> dict[int, dict[str, bytes]]:
    """`_read_shard` through webdataset's tar expander and Python's tarfile: slower, but it defines
    which shards are readable and what a readable shard holds."""
    from webdataset import tariterators

    expected = {f"{name}.npy" for name in fields}
    kept: dict[int, dict[str, bytes]] = {}
    count = 0
    try:
        with open(shard.path, "rb") as stream:
            members = tariterators.tar_file_expander([{"url": shard.path, "stream": stream}])
            for position, sample in enumerate(tariterators.group_by_keys(members)):
                found = {key for key in sample if not key.startswith("__")}
                if found != expected:
                    raise _ShardError(f"sample {sample['__key__']!r} has {sorted(found)}, expected {sorted(expected)}")
                if position in wanted:
                    kept[position] = {name: sample[f"{name}.npy"] for name in fields}
                count += 1
    except _ShardError:
        raise
    except Exception as err:  # tarfile, I/O and webdataset errors alike mean one thing: an unusable shard
        # webdataset appends the stream and url to the message; the path is in the warning already.
        message = str(err.args[0]).split(" @ <")[0] if err.args else ""
        raise _ShardError(f"unreadable: {type(err).__name__}: {message}") from err
    # Python's tar reader ends quietly at a damaged header after the first; the count tells.
    if count != shard.samples:
        raise _ShardError(f"{count} samples, the manifest says {shard.samples}")
    return kept


_BLOCK = 512  # tar's unit: a header, or a share of a member's data (zero-padded to whole blocks)
# What Python's stream reader ("r|*") takes for a compressed archive when it opens the file.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\x5d\x00\x00\x80", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
# The header's number fields (mode, uid, gid, size, mtime, checksum, devmajor, devminor) as
# (start, end). Python's tarfile rejects the header if any of them is not octal.
_NUMBER_FIELDS = ((100, 108), (108, 116), (116, 124), (124, 136), (136, 148), (148, 156), (329, 337), (337, 345))
_SIZE, _CHECKSUM = 3, 5
# The octal numbers tarfile reads (its `nti`): digits between optional spaces, ended by a NUL or
# the field's end. It reads a few more forms (base-256, other whitespace), left to it.
_OCTAL = re.compile(rb" *([0-7]*) *(?:\0|\Z)")
_REGULAR_FILE = (ord("0"), 0)  # ustar's type flag of a regular file, and the pre-POSIX one


def _scan_tar(data: bytes, fields: tuple[str, ...]) -> list[dict[str, tuple[int, int]]] | None:
    """Where each sample's members lie in `data`, a plain (uncompressed) tar, in file order:
    {"<field>.npy": (start, length)} per sample, found from the 512-byte headers alone.

    It answers only for a tar the reference reader (webdataset over tarfile) would read the same
    way: regular files named "<key>.<field>.npy", whole and in place, each header's checksum and
    number fields valid, each sample holding exactly `fields`, an end-of-archive block at the end.
    For anything else - other member types (directories, links, pax or GNU extension headers),
    other names, a damaged header, missing data - it answers None, without telling why: the
    caller then asks the reference reader, so a shard gets the same verdict either way.
    """
    from webdataset.tariterators import base_plus_ext  # webdataset's split of a name into key and suffix

    if data.startswith(_COMPRESSED):
        return None
    expected = {f"{name}.npy" for name in fields}
    samples: list[dict[str, tuple[int, int]]] = []
    key = None
    headers: list[int] = []
    checksums: list[int] = []
    offset = 0
    while True:
        if offset + _BLOCK > len(data):
            return None  # cut short: no end-of-archive block
        if data.count(0, offset, offset + _BLOCK) == _BLOCK:
            break  # the end-of-archive block; tar readers read no further
        numbers = []
        for start, end in _NUMBER_FIELDS:
            match = _OCTAL.match(data, offset + start, offset + end)
            if match is None:
                return None
            numbers.append(int(match[1] or b"0", 8))
        # Another member type, or a ustar name prefix (field 345:500) that would lengthen the name.
        if data[offset + 156] not in _REGULAR_FILE or data[offset + 345] != 0:
            return None
        name_end = data.find(b"\0", offset, offset + 100)
        raw_name = data[offset : name_end if name_end >= 0 else offset + 100]
        if not raw_name.isascii():
            return None
        name = raw_name.decode("ascii")
        # "__...": what webdataset skips as metadata; ".../": a directory in the old tar format.
        if name.startswith("__") or name.endswith("/"):
            return None
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            return None
        suffix = suffix.lower()  # webdataset's group_by_keys lowercases suffixes
        if prefix != key:  # members with the same key in a row form one sample
            if samples and len(samples[-1]) != len(expected):
                return None
            samples.append({})
            key = prefix
        if suffix not in expected or suffix in samples[-1]:
            return None
        start, length = offset + _BLOCK, numbers[_SIZE]
        if start + length > len(data):
            return None
        samples[-1][suffix] = (start, length)
        headers.append(offset)
        checksums.append(numbers[_CHECKSUM])
        offset = start + -(-length // _BLOCK) * _BLOCK
    if samples and len(samples[-1]) != len(expected):
        return None
    # A header's checksum is the sum of its bytes, the checksum field counted as 8 spaces. All the
    # headers lie before `offset`, the end-of-archive block, a whole number of blocks in.
    blocks = np.frombuffer(data, np.uint8, count=offset).reshape(-1, _BLOCK)
    blocks = blocks[np.array(headers, dtype=np.int64) // _BLOCK]
    sums = blocks.sum(axis=1, dtype=np.int64) - blocks[:, 148:156].sum(axis=1, dtype=np.int64) + 8 * ord(" ")
    if not np.array_equal(sums, checksums):
        return None
    return samples


def _decode(raw: dict[str, bytes], fields: tuple[str, ...], vocab_size: int) -> list[np.ndarray]:
    """The token ids of one sample, in the integer dtype they are stored in (checked to be in the vocabulary)."""
    arrays = []
    for name in fields:
        try:
            array = decode_array(raw[name])
        except Exception as err:
            raise ValueError(f"{name}: not a npy array: {type(err).__name__}: {err}") from err
        if array.ndim != 1 or array.dtype.kind not in "iu" or array.size == 0:
            raise ValueError(f"{name}: {array.dtype} array of shape {array.shape}, expected non-empty 1-D integers")
        if array.min() < 0 or array.max() >= vocab_size:
            raise ValueError(
                f"{name}: token ids in [{array.min()}, {array.max()}], outside the vocabulary of {vocab_size}"
            )
        arrays.append(array)
    return arrays


# Collation is split in two. In the worker, `_pack_*` turns a batch's samples into a few numpy
# arrays: the token ids padded to the longest row (in their stored dtype), the row lengths, and
# for MLM the seeded masking's results. In the main process, `_unpack` makes the tensors the
# trainer gets, attention masks and labels included. A dict of numpy arrays crosses from a worker
# pickled in one message; torch tensors would each take a separate trip through shared memory,
# which for batches of this size costs more than building the masks and labels again.


def _stack(sequences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(B, T) ids padded with <pad> to the longest, and the (B,) lengths."""
    lengths = np.array([len(seq) for seq in sequences], dtype=np.int64)
    longest = int(lengths.max())
    if (lengths == longest).all():  # packed blocks: all of one length
        return np.stack(sequences), lengths
    ids = np.full((len(sequences), longest), PAD_ID, dtype=np.result_type(*sequences))
    ids[np.arange(longest) < lengths[:, None]] = np.concatenate(sequences)  # row by row, each row's start
    return ids, lengths


def _mask(lengths: np.ndarray, width: int) -> torch.Tensor:
    """(B, width) attention mask: 1 over the first `lengths[b]` positions of row b, 0 over the padding."""
    return torch.from_numpy((np.arange(width) < lengths[:, None]).astype(np.int64))


def _pack_causal_lm(sequences: list[np.ndarray]) -> dict[str, np.ndarray]:
    ids, lengths = _stack(sequences)
    return {"ids": ids, "lengths": lengths}


def _pack_mlm(
    sequences: list[np.ndarray],
    generator: torch.Generator,
    *,
    special_ids: torch.Tensor,
    replacement_ids: torch.Tensor,
    probability: float,
    mask_fraction: float,
    random_fraction: float,
) -> dict[str, np.ndarray]:
    """BERT's masking (Devlin et al. 2019, section 3.1): select `probability` of the real,
    non-special tokens; of those, `mask_fraction` become <mask>, `random_fraction` a random
    non-special token, the rest stay; labels hold the original token at selected positions only."""
    ids, lengths = _stack(sequences)
    original = torch.from_numpy(ids.astype(np.int64))
    attention_mask = _mask(lengths, original.shape[1])
    candidates = attention_mask.bool() & ~torch.isin(original, special_ids)
    selected = candidates & (torch.rand(original.shape, generator=generator) < probability)
    action = torch.rand(original.shape, generator=generator)
    to_mask = selected & (action < mask_fraction)
    to_random = selected & (action >= mask_fraction) & (action < mask_fraction + random_fraction)
    random_ids = replacement_ids[torch.randint(len(replacement_ids), original.shape, generator=generator)]
    input_ids = torch.where(to_mask, torch.full_like(original, MASK_ID), original)
    input_ids = torch.where(to_random, random_ids, input_ids)
    labels = original.masked_fill(~selected, IGNORE_INDEX)
    return {"ids": input_ids.numpy(), "lengths": lengths, "labels": labels.numpy()}


def _pack_translation(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, np.ndarray]:
    src, src_lengths = _stack([np.concatenate([src, [EOS_ID]]).astype(src.dtype) for src, _ in pairs])
    # "<s> target </s>": the decoder's input is this without the last token, its labels without the first.
    tgt, tgt_lengths = _stack([np.concatenate([[BOS_ID], tgt, [EOS_ID]]).astype(tgt.dtype) for _, tgt in pairs])
    return {"src": src, "src_lengths": src_lengths, "tgt": tgt, "tgt_lengths": tgt_lengths}


def _unpack(kind: str, packed: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The trainer's batch, all int64, from what `_pack_<kind>` made; labels are IGNORE_INDEX on padding."""
    if kind == "translation":
        src = torch.from_numpy(packed["src"].astype(np.int64))
        tgt = torch.from_numpy(packed["tgt"].astype(np.int64))
        decoder_mask = _mask(packed["tgt_lengths"] - 1, tgt.shape[1] - 1)
        return {
            "src_ids": src,
            "src_mask": _mask(packed["src_lengths"], src.shape[1]),
            "decoder_input_ids": tgt[:, :-1].masked_fill(decoder_mask == 0, PAD_ID),  # drops the </s>
            "decoder_mask": decoder_mask,
            "labels": tgt[:, 1:].masked_fill(decoder_mask == 0, IGNORE_INDEX),
        }
    input_ids = torch.from_numpy(packed["ids"].astype(np.int64, copy=False))
    attention_mask = _mask(packed["lengths"], input_ids.shape[1])
    if kind == "mlm":
        labels = torch.from_numpy(packed["labels"])
    else:
        labels = input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)  # the model shifts them
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# Both halves in one call, for collating outside a loader.


def collate_causal_lm(sequences: list[np.ndarray]) -> dict[str, torch.Tensor]:
    return _unpack("causal_lm", _pack_causal_lm(sequences))


def collate_mlm(sequences: list[np.ndarray], generator: torch.Generator, **masking) -> dict[str, torch.Tensor]:
    """`_pack_mlm`'s masking (`masking`: its keyword arguments), as the trainer's batch."""
    return _unpack("mlm", _pack_mlm(sequences, generator, **masking))


def collate_translation(pairs: list[tuple[np.ndarray, np.ndarray]]) -> dict[str, torch.Tensor]:
    return _unpack("translation", _pack_translation(pairs))


def _new_events() -> dict:
    # Workers are other processes: what they notice travels to the main process with each batch.
    return {"shard_opens": 0, "samples_decoded": 0, "skipped": [], "bad_samples": []}


class _EpochBatches(IterableDataset):
    """One rank's batches [first_batch, num_batches) of one epoch, as (j, packed batch or None, events);
    `_unpack(kind, packed)` in the main process makes the trainer's batch."""

    def __init__(self, *, kind: str, shards: list[_Shard], seed: int, epoch: int, rank: int, rank_start: int,
                 batch_size: int, num_batches: int, first_batch: int, vocab_size: int, special_ids: list[int],
                 mlm: dict):
        self.kind = kind
        self.fields = FIELDS[DATASET_FOR_TASK[kind]]
        self.shards = shards
        self.starts = np.concatenate([[0], np.cumsum([shard.samples for shard in shards])]).astype(np.int64)
        self.seed, self.epoch, self.rank = seed, epoch, rank
        self.rank_start, self.batch_size = rank_start, batch_size
        self.num_batches, self.first_batch = num_batches, first_batch
        self.vocab_size = vocab_size
        self.special_ids = special_ids
        self.mlm = mlm

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.first_batch + worker, self.num_batches, workers)
        reader = _Reader(self, mine)
        for j in mine:
            yield self.build(j, reader)

    def build(self, j: int, reader: _Reader | None = None) -> tuple[int, dict[str, np.ndarray] | None, dict]:
        reader = reader or _Reader(self, range(j, j + 1))
        events = _new_events()
        first = self.rank_start + j * self.batch_size
        positions = np.arange(first, first + self.batch_size)
        orders = np.searchsorted(self.starts, positions, side="right") - 1
        reader.evict_before(int(orders[0]))
        samples = []
        for position, order in zip(positions.tolist(), orders.tolist()):
            members = reader.members(order, events)
            if members is None:
                return j, None, events
            member = int(reader.permutation(order)[position - self.starts[order]])
            try:
                # Each member serves one batch of this reader: let it go as soon as it is decoded.
                samples.append(_decode(members.pop(member), self.fields, self.vocab_size))
            except ValueError as err:
                events["bad_samples"].append((self.shards[order].path, member, str(err)))
                return j, None, events
            events["samples_decoded"] += 1
        return j, self._pack(j, samples), events

    def _pack(self, j: int, samples: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        if self.kind == "translation":
            return _pack_translation([(src, tgt) for src, tgt in samples])
        if self.kind == "causal_lm":
            return _pack_causal_lm([ids for (ids,) in samples])
        special = torch.tensor(sorted(self.special_ids), dtype=torch.long)
        keep = np.ones(self.vocab_size, dtype=bool)
        keep[[i for i in self.special_ids if i < self.vocab_size]] = False
        # Masked here, in the worker: the draws are seeded by the batch, so where they are made does not matter.
        return _pack_mlm(
            [ids for (ids,) in samples],
            _torch_generator(self.seed, self.epoch, self.rank, j, _MLM_MASK),
            special_ids=special,
            replacement_ids=torch.from_numpy(np.flatnonzero(keep)),
            **self.mlm,
        )


class _Reader:
    """The raw samples one worker needs, read once per shard; shards behind the current batch are dropped."""

    def __init__(self, plan: _EpochBatches, batches: range):
        self.plan = plan
        self.batches = batches
        self.loaded: dict[int, dict[int, dict[str, bytes]] | None] = {}
        self.permutations: dict[int, np.ndarray] = {}

    def permutation(self, order: int) -> np.ndarray:
        if order not in self.permutations:
            shard = self.plan.shards[order]
            self.permutations[order] = _rng(self.plan.seed, self.plan.epoch, _SAMPLE_ORDER, shard.index).permutation(
                shard.samples
            )
        return self.permutations[order]

    def evict_before(self, order: int) -> None:
        # Batches only move forward through the stream, so nothing behind `order` is needed again.
        for stale in [o for o in self.loaded if o < order]:
            del self.loaded[stale]
            self.permutations.pop(stale, None)

    def wanted(self, order: int) -> set[int]:
        plan, batches = self.plan, self.batches
        start = int(plan.starts[order])
        offsets = np.arange(plan.shards[order].samples)
        batch = (start + offsets - plan.rank_start) // plan.batch_size
        mine = (batch >= batches.start) & (batch < batches.stop) & ((batch - batches.start) % batches.step == 0)
        return set(self.permutation(order)[offsets[mine]].tolist())

    def members(self, order: int, events: dict) -> dict[int, dict[str, bytes]] | None:
        if order not in self.loaded:
            shard = self.plan.shards[order]
            events["shard_opens"] += 1
            try:
                self.loaded[order] = _read_shard(shard, self.plan.fields, self.wanted(order))
            except _ShardError as err:
                self.loaded[order] = None
                events["skipped"].append((shard.path, str(err)))
        return self.loaded[order]


def _as_is(item):
    return item


class ShardLoader:
    """Batches of one sample kind and split for one rank; iterate once per epoch.

    `stats` holds the plan's sizes (`batches_per_epoch`, `samples_per_epoch`,
    `samples_dropped_remainder`: per epoch) and counters since construction: `shards_skipped`,
    `samples_unreadable`, `filler_batches`, `shard_opens` (over all workers), `samples_decoded`,
    `batches_yielded`. One iteration at a time.
    """

    def __init__(self, data_dir: str, kind: str, split: str, *, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, num_workers: int = 0, seed: int = 0, mlm_probability: float = 0.15,
                 mlm_mask_fraction: float = 0.8, mlm_random_fraction: float = 0.1,
                 expected_tokenizer_sha256: str | None = None, epoch: int = 0):
        if micro_batch_size < 1:
            raise UserError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in a world of size {world_size}")
        if num_workers < 0:
            raise UserError(f"num_workers must be 0 or more, got {num_workers}")
        if not 0.0 < mlm_probability <= 1.0:
            raise UserError(f"mlm_probability must be in (0, 1], got {mlm_probability}")
        if mlm_mask_fraction < 0 or mlm_random_fraction < 0 or mlm_mask_fraction + mlm_random_fraction > 1:
            raise UserError(
                f"mlm_mask_fraction ({mlm_mask_fraction}) and mlm_random_fraction ({mlm_random_fraction}) "
                "must be non-negative and add up to at most 1"
            )
        self.data_dir = Path(data_dir)
        manifest = read_manifest(self.data_dir)
        tokenizer = manifest.get("tokenizer") or {}
        if expected_tokenizer_sha256 is not None and tokenizer.get("sha256") != expected_tokenizer_sha256:
            raise UserError(
                f"{self.data_dir}: tokenizer sha256 {tokenizer.get('sha256')} differs from the expected "
                f"{expected_tokenizer_sha256}: the data was prepared with another tokenizer than the model's"
            )
        if "vocab_size" not in tokenizer:
            raise UserError(f"{self.data_dir}: the manifest's tokenizer record has no vocab_size")
        entries = shard_entries(manifest, kind, split)

        self.kind, self.split = kind, split
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.num_workers, self.seed, self.epoch = num_workers, seed, epoch
        self.mlm = {"probability": mlm_probability, "mask_fraction": mlm_mask_fraction,
                    "random_fraction": mlm_random_fraction}
        self.vocab_size = int(tokenizer["vocab_size"])
        # The reserved ids are special in every tokenizer of this project, whatever the list says.
        self.special_ids = sorted(set(range(len(SPECIAL_TOKENS))) | set(tokenizer.get("special_ids", [])))
        self._shards = [
            _Shard(index, str(self.data_dir / entry["path"]), int(entry["samples"]), entry.get("bytes"))
            for index, entry in enumerate(entries)
            if int(entry["samples"]) > 0
        ]
        listing = json.dumps([[e["path"], int(e["samples"]), e.get("sha256")] for e in entries]).encode()
        self._fingerprint = {
            "kind": kind,
            "split": split,
            "seed": seed,
            "world_size": world_size,
            "micro_batch_size": micro_batch_size,
            "shards_sha256": hashlib.sha256(listing).hexdigest(),
        }

        total = sum(shard.samples for shard in self._shards)
        global_batch = micro_batch_size * world_size
        self._num_batches = total // global_batch
        if self._num_batches == 0:
            raise UserError(
                f"{self.data_dir}: {kind}/{split} has {total} samples, fewer than one global batch "
                f"({micro_batch_size} x {world_size} ranks)"
            )
        dropped = total - self._num_batches * global_batch
        self.stats = {
            "batches_per_epoch": self._num_batches,
            "samples_per_epoch": total,
            "samples_dropped_remainder": dropped,
            "shards_skipped": 0,
            "samples_unreadable": 0,
            "filler_batches": 0,
            "shard_opens": 0,
            "samples_decoded": 0,
            "batches_yielded": 0,
        }
        self.skipped_shards: list[dict] = []
        self._skipped_seen: set[tuple[int, str]] = set()
        self._consumed = 0
        log.info(
            "%s/%s: %d samples in %d shards; %d batches of %d per rank per epoch; %d samples per epoch "
            "dropped (remainder below one global batch of %d)",
            kind, split, total, len(self._shards), self._num_batches, micro_batch_size, dropped, global_batch,
        )

    @classmethod
    def from_config(cls, cfg: LoaderConfig, kind: str, split: str, *, rank: int, world_size: int,
                    expected_tokenizer_sha256: str | None = None) -> ShardLoader:
        return cls(
            cfg.data_dir, kind, split,
            micro_batch_size=cfg.micro_batch_size, rank=rank, world_size=world_size,
            num_workers=cfg.num_workers, seed=cfg.seed, mlm_probability=cfg.mlm_probability,
            mlm_mask_fraction=cfg.mlm_mask_fraction, mlm_random_fraction=cfg.mlm_random_fraction,
            expected_tokenizer_sha256=expected_tokenizer_sha256,
        )

    def __len__(self) -> int:
        return self._num_batches

    def _epoch_batches(self, epoch: int, first_batch: int) -> _EpochBatches:
        order = _rng(self.seed, epoch, _SHARD_ORDER).permutation(len(self._shards))
        return _EpochBatches(
            kind=self.kind, shards=[self._shards[i] for i in order], seed=self.seed, epoch=epoch, rank=self.rank,
            rank_start=self.rank * self._num_batches * self.micro_batch_size, batch_size=self.micro_batch_size,
            num_batches=self._num_batches, first_batch=first_batch, vocab_size=self.vocab_size,
            special_ids=self.special_ids, mlm=self.mlm,
        )

    def __iter__(self):
        epoch, first = self.epoch, self._consumed
        if first < self._num_batches:
            plan = self._epoch_batches(epoch, first)
            # Each epoch gets fresh workers: the plan they hold is the epoch's.
            # A private generator: creating a DataLoader iterator draws a seed from the one it
            # is given, and drawing from torch's global generator would shift the trainer's
            # dropout stream, so a resumed run would no longer repeat an uninterrupted one.
            generator = torch.Generator().manual_seed(self.seed)
            items = iter(DataLoader(plan, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
                                    generator=generator))
            try:
                last_good: tuple[int, dict] | None = None
                found: dict = {}
                expected = first
                for j, packed, events in items:
                    # Exact resume rests on the DataLoader's round-robin order; a change there must fail loudly.
                    if j != expected:
                        raise RuntimeError(f"batch {j} arrived where batch {expected} was due")
                    self._absorb(epoch, events)
                    if packed is None:
                        batch = self._filler(plan, j, first, last_good, found)
                    else:
                        batch = _unpack(self.kind, packed)  # masks and labels are made here, not sent
                        last_good = (j, batch)
                    expected += 1
                    self._consumed = expected
                    self.stats["batches_yielded"] += 1
                    yield batch
                if expected != self._num_batches:
                    raise RuntimeError(f"epoch {epoch} ended after {expected} of {self._num_batches} batches")
            finally:
                del items  # shuts the workers down when the trainer leaves mid-epoch
        self.epoch, self._consumed = epoch + 1, 0

    def _filler(self, plan: _EpochBatches, j: int, first: int, last_good: tuple[int, dict] | None,
                found: dict) -> dict:
        """The batch to repeat for unreadable batch j: the nearest good batch before it, else after it."""
        source = last_good
        if source is None:
            # A run of unreadable batches needs one search, not one per batch: the batch found
            # stays the answer until a good batch arrives.
            cached = found.get("source")
            if cached is not None and (cached[0] < first or cached[0] > j):
                source = cached
            else:
                source = found["source"] = self._search_filler(plan, j, first)
        if source is None:
            raise RuntimeError(
                f"rank {self.rank}, epoch {plan.epoch}: none of the {self._num_batches} batches is readable; "
                f"see the warnings about skipped shards under {self.data_dir}"
            )
        self.stats["filler_batches"] += 1
        log.warning("rank %d, epoch %d: batch %d is unreadable; repeating batch %d in its place",
                    self.rank, plan.epoch, j, source[0])
        return source[1]

    def _search_filler(self, plan: _EpochBatches, j: int, first: int) -> tuple[int, dict] | None:
        # Batches first..j-1 were unreadable too; the good batch before them, if any, was served
        # by an earlier process (this is a resume), so rebuild it as the uninterrupted run had it.
        for i in range(first - 1, -1, -1):
            _, packed, events = plan.build(i)
            self._absorb(plan.epoch, events)
            if packed is not None:
                return i, _unpack(self.kind, packed)
        ahead = _Reader(plan, range(j + 1, self._num_batches))
        for i in ahead.batches:
            _, packed, events = plan.build(i, ahead)
            self._absorb(plan.epoch, events)
            if packed is not None:
                return i, _unpack(self.kind, packed)
        return None

    def _absorb(self, epoch: int, events: dict) -> None:
        self.stats["shard_opens"] += events["shard_opens"]
        self.stats["samples_decoded"] += events["samples_decoded"]
        for path, reason in events["skipped"]:
            if (epoch, path) in self._skipped_seen:  # every worker that reads a bad shard reports it
                continue
            self._skipped_seen.add((epoch, path))
            self.stats["shards_skipped"] += 1
            self.skipped_shards.append({"epoch": epoch, "path": path, "reason": reason})
            log.warning("skipping shard %s (epoch %d): %s", path, epoch, reason)
        for path, member, reason in events["bad_samples"]:
            self.stats["samples_unreadable"] += 1
            log.warning("skipping sample %d of shard %s (epoch %d): %s", member, path, epoch, reason)

    def state_dict(self) -> dict:
        epoch, consumed = self.epoch, self._consumed
        if consumed >= self._num_batches:  # a finished epoch resumes at the start of the next
            epoch, consumed = epoch + 1, 0
        return {"version": STATE_VERSION, "epoch": epoch, "batches_consumed": consumed,
                "fingerprint": dict(self._fingerprint)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != STATE_VERSION:
            raise UserError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved = state.get("fingerprint", {})
        differences = [
            f"{key}: saved {saved.get(key)!r}, now {value!r}"
            for key, value in self._fingerprint.items()
            if saved.get(key) != value
        ]
        if differences:
            raise UserError(
                "the loader state does not match this loader, so the batches after a resume would differ: "
                + "; ".join(differences)
            )
        epoch, consumed = int(state["epoch"]), int(state["batches_consumed"])
        if epoch < 0 or not 0 <= consumed <= self._num_batches:
            raise UserError(f"loader state epoch {epoch}, batch {consumed} is outside 0..{self._num_batches}")
        self.epoch, self._consumed = epoch, consumed
