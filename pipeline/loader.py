"""Stream prepared WebDataset shards into token batches: rank/worker split, seeded shuffle, exact resume.

Reads what `pipeline.prepare` writes (the contract is `pipeline.format`) and hands the trainer
token batches for the tasks `causal_lm`, `mlm` and `translation`. It is built against two failures of the usual
WebDataset recipe (`split_by_node` -> `split_by_worker` -> `shuffle` buffer) under multi-rank
training (webdataset issues #188, #225, #234, #271):

* uneven shards, or a shard count that is not a multiple of ranks x workers, give ranks different
  numbers of batches; the rank that runs out first leaves the others waiting in an all-reduce at
  the end of the epoch, forever;
* there is no exact mid-epoch resume: a restart replays the epoch, or skips by decoding and
  throwing away everything already seen, so the time to the first batch grows with the position.

Design. The manifest knows every shard's sample count, so each epoch's order costs no I/O to work out:

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
   of what fixes the order (seed, world size, micro batch, shard list) is checked on load.
6. A shard that cannot be read (missing, wrong size, not a tar, truncated, wrong members or
   sample count) is skipped with a warning and counted; so is a sample that does not decode to
   token ids within the vocabulary (a bad id would otherwise end the job in the embedding on the
   GPU). A batch touching either is replaced by a filler - the nearest preceding good batch of
   the epoch, else the nearest following one - so that every rank still yields exactly B batches
   (a missing batch on one rank is a hang on all). Fillers are a function of the data alone, so
   a resumed run repeats the same ones; after a resume the preceding batch is rebuilt if needed.
7. Reading a shard (`pipeline.shards`: a header scan, checked against webdataset's reader) and
   collating a batch (`pipeline.collate`: numpy in the worker, tensors in the main process) are
   their own modules; this one decides which samples make batch j of a rank, and when.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from pipeline.collate import MLMMasking, pack, unpack
from pipeline.config import LoaderConfig
from pipeline.configure import UserError
from pipeline.format import DATASET_FOR_TASK, FIELDS, SPECIAL_TOKENS, read_manifest, shard_entries
from pipeline.shards import Shard, ShardError, decode_sample, read_shard

log = logging.getLogger(__name__)

# 2: the fingerprint names the task ("kind" in version 1, read as the same thing).
STATE_VERSION = 2

# Tags that keep the seeded streams apart: the shard order, the in-shard orders and the MLM masks
# must not be drawn from the same numbers even when their other key parts coincide.
_SHARD_ORDER, _SAMPLE_ORDER, _MLM_MASK = 1, 2, 3


class ShardLoader:
    """Token batches of one task and split for one rank; iterate once per epoch.

    `stats` holds the epoch's sizes (`batches_per_epoch`, `samples_per_epoch`,
    `samples_dropped_remainder`: per epoch) and counters since construction: `shards_skipped`,
    `samples_unreadable`, `filler_batches`, `shard_opens` (over all workers), `samples_decoded`,
    `batches_yielded`. One iteration at a time.
    """

    def __init__(self, data_dir: str, task: str, split: str, *, micro_batch_size: int, rank: int = 0,
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
        entries = shard_entries(manifest, task, split)

        self.task, self.split = task, split
        self.micro_batch_size, self.rank, self.world_size = micro_batch_size, rank, world_size
        self.num_workers, self.seed, self.epoch = num_workers, seed, epoch
        self.vocab_size = int(tokenizer["vocab_size"])
        # The reserved ids are special in every tokenizer of this project, whatever the list says.
        special_ids = sorted(set(range(len(SPECIAL_TOKENS))) | set(tokenizer.get("special_ids", [])))
        self.mlm_masking = MLMMasking(self.vocab_size, special_ids, mlm_probability, mlm_mask_fraction,
                                      mlm_random_fraction) if task == "mlm" else None
        self._shards = [
            Shard(index, str(self.data_dir / entry["path"]), int(entry["samples"]), entry.get("bytes"))
            for index, entry in enumerate(entries)
            if int(entry["samples"]) > 0
        ]
        listing = json.dumps([[e["path"], int(e["samples"]), e.get("sha256")] for e in entries]).encode()
        self._fingerprint = {
            "task": task,
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
                f"{self.data_dir}: {task}/{split} has {total} samples, fewer than one global batch "
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
            task, split, total, len(self._shards), self._num_batches, micro_batch_size, dropped, global_batch,
        )

    @classmethod
    def from_config(cls, cfg: LoaderConfig, task: str, split: str, *, rank: int, world_size: int,
                    expected_tokenizer_sha256: str | None = None) -> ShardLoader:
        return cls(
            cfg.data_dir, task, split,
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
            task=self.task, shards=[self._shards[i] for i in order], seed=self.seed, epoch=epoch, rank=self.rank,
            rank_start=self.rank * self._num_batches * self.micro_batch_size, micro_batch_size=self.micro_batch_size,
            num_batches=self._num_batches, first_batch=first_batch, vocab_size=self.vocab_size,
            mlm_masking=self.mlm_masking,
        )

    def __iter__(self):
        epoch, first = self.epoch, self._consumed
        if first < self._num_batches:
            epoch_batches = self._epoch_batches(epoch, first)
            # Each epoch gets fresh workers: the order they hold is the epoch's.
            # A private generator: creating a DataLoader iterator draws a seed from the one it
            # is given, and drawing from torch's global generator would shift the trainer's
            # dropout stream, so a resumed run would no longer repeat an uninterrupted one.
            generator = torch.Generator().manual_seed(self.seed)
            items = iter(DataLoader(epoch_batches, batch_size=None, num_workers=self.num_workers, collate_fn=_as_is,
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
                        batch = self._filler(epoch_batches, j, first, last_good, found)
                    else:
                        batch = unpack(self.task, packed)  # tensors and masks are made here, not sent
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

    def _filler(self, epoch_batches: _EpochBatches, j: int, first: int, last_good: tuple[int, dict] | None,
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
                source = found["source"] = self._search_filler(epoch_batches, j, first)
        if source is None:
            raise RuntimeError(
                f"rank {self.rank}, epoch {epoch_batches.epoch}: none of the {self._num_batches} batches is readable; "
                f"see the warnings about skipped shards under {self.data_dir}"
            )
        self.stats["filler_batches"] += 1
        log.warning("rank %d, epoch %d: batch %d is unreadable; repeating batch %d in its place",
                    self.rank, epoch_batches.epoch, j, source[0])
        return source[1]

    def _search_filler(self, epoch_batches: _EpochBatches, j: int, first: int) -> tuple[int, dict] | None:
        # Batches first..j-1 were unreadable too; the good batch before them, if any, was served
        # by an earlier process (this is a resume), so rebuild it as the uninterrupted run had it.
        for i in range(first - 1, -1, -1):
            _, packed, events = epoch_batches.build(i)
            self._absorb(epoch_batches.epoch, events)
            if packed is not None:
                return i, unpack(self.task, packed)
        ahead = _Reader(epoch_batches, range(j + 1, self._num_batches))
        for i in ahead.batches:
            _, packed, events = epoch_batches.build(i, ahead)
            self._absorb(epoch_batches.epoch, events)
            if packed is not None:
                return i, unpack(self.task, packed)
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
        if state.get("version") not in (1, STATE_VERSION):
            raise UserError(f"loader state version {state.get('version')!r}, expected {STATE_VERSION}")
        saved = dict(state.get("fingerprint", {}))
        if state["version"] == 1:
            saved["task"] = saved.pop("kind", None)
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


class _EpochBatches(IterableDataset):
    """One rank's batches [first_batch, num_batches) of one epoch, as (j, packed batch or None, events);
    `pipeline.collate.unpack(task, packed)` in the main process makes the token batch."""

    def __init__(self, *, task: str, shards: list[Shard], seed: int, epoch: int, rank: int, rank_start: int,
                 micro_batch_size: int, num_batches: int, first_batch: int, vocab_size: int,
                 mlm_masking: MLMMasking | None):
        self.task = task
        self.fields = FIELDS[DATASET_FOR_TASK[task]]
        self.shards = shards
        self.starts = np.concatenate([[0], np.cumsum([shard.samples for shard in shards])]).astype(np.int64)
        self.seed, self.epoch, self.rank = seed, epoch, rank
        self.rank_start, self.micro_batch_size = rank_start, micro_batch_size
        self.num_batches, self.first_batch = num_batches, first_batch
        self.vocab_size = vocab_size
        self.mlm_masking = mlm_masking

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
        first = self.rank_start + j * self.micro_batch_size
        positions = np.arange(first, first + self.micro_batch_size)
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
                samples.append(decode_sample(members.pop(member), self.fields, self.vocab_size))
            except ValueError as err:
                events["bad_samples"].append((self.shards[order].path, member, str(err)))
                return j, None, events
            events["samples_decoded"] += 1
        return j, self._pack(j, samples), events

    def _pack(self, j: int, samples: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        # MLM masks are drawn here, in the worker, from a generator seeded by the batch: where
        # they are drawn does not matter.
        generator = _torch_generator(self.seed, self.epoch, self.rank, j, _MLM_MASK) if self.mlm_masking else None
        return pack(self.task, samples, self.mlm_masking, generator)


class _Reader:
    """The raw samples one worker needs, read once per shard; shards behind the current batch are dropped."""

    def __init__(self, epoch_batches: _EpochBatches, batches: range):
        self.epoch_batches = epoch_batches
        self.batches = batches
        self.loaded: dict[int, dict[int, dict[str, bytes]] | None] = {}
        self.permutations: dict[int, np.ndarray] = {}

    def permutation(self, order: int) -> np.ndarray:
        if order not in self.permutations:
            shard = self.epoch_batches.shards[order]
            self.permutations[order] = _rng(self.epoch_batches.seed, self.epoch_batches.epoch, _SAMPLE_ORDER,
                                            shard.index).permutation(
                shard.samples
            )
        return self.permutations[order]

    def evict_before(self, order: int) -> None:
        # Batches only move forward through the stream, so nothing behind `order` is needed again.
        for stale in [o for o in self.loaded if o < order]:
            del self.loaded[stale]
            self.permutations.pop(stale, None)

    def wanted(self, order: int) -> set[int]:
        epoch_batches, batches = self.epoch_batches, self.batches
        start = int(epoch_batches.starts[order])
        offsets = np.arange(epoch_batches.shards[order].samples)
        batch = (start + offsets - epoch_batches.rank_start) // epoch_batches.micro_batch_size
        mine = (batch >= batches.start) & (batch < batches.stop) & ((batch - batches.start) % batches.step == 0)
        return set(self.permutation(order)[offsets[mine]].tolist())

    def members(self, order: int, events: dict) -> dict[int, dict[str, bytes]] | None:
        if order not in self.loaded:
            shard = self.epoch_batches.shards[order]
            events["shard_opens"] += 1
            try:
                self.loaded[order] = read_shard(shard, self.epoch_batches.fields, self.wanted(order))
            except ShardError as err:
                self.loaded[order] = None
                events["skipped"].append((shard.path, str(err)))
        return self.loaded[order]


def _new_events() -> dict:
    # Workers are other processes: what they notice travels to the main process with each batch.
    return {"shard_opens": 0, "samples_decoded": 0, "skipped": [], "bad_samples": []}


def _as_is(item):
    return item


def _rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([k % 2**64 for k in key])))


def _torch_generator(*key: int) -> torch.Generator:
    seed = int(np.random.SeedSequence([k % 2**64 for k in key]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed & (2**63 - 1))
