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
   permuted by (seed, epoch, shard). Concatenated, they form one virtual stream of N samples,
   the same whatever the number of ranks, workers or the micro batch size.
2. The stream is cut into global batches of G = micro batch b x grad_accum A x world size W
   samples, one per optimizer step: step s consumes stream positions [s G, (s + 1) G). Only the
   first S = floor(N / G) steps are used; the rest (fewer than G samples, different ones each
   epoch since the stream is reshuffled) is counted in `stats["samples_dropped_remainder"]`.
   Megatron's sampler does the same with one consumed-samples counter.
3. Within a step, micro batch slot k = a W + r (accumulation round a, rank r) is positions
   [s G + k b, s G + (k + 1) b). Rank r's batch j is step j // A, round j % A: B = S A batches on
   every rank. So the samples of each optimizer step are fixed by G alone: a job resumed on
   another world size, with grad_accum changed to keep G, trains on exactly the samples the
   uninterrupted job would have. MLM masks are drawn per sample, from (seed, epoch, stream
   position), so they do not change either. Everything about batch j is a pure function of
   (seed, epoch, G, b, W, r, j).
   The price: a global batch is a contiguous stretch of the stream, so every rank reads through
   every shard of the epoch (today's layout gave each rank 1/W of them), decoding (np.load, never
   pickle) only its own samples. Tokens are 2 to 4 bytes each, so at the token rates a GPU
   trains (10^4 to 10^6 tokens/s) this is at most a few MB/s per rank, read sequentially; and ranks
   on one node read the same files at about the same time, so the page cache (or the shared shard
   cache of a remote dataset) serves all but the first.
4. DataLoader worker w of n builds batches k+w, k+w+n, ... (k: the first batch still owed).
   PyTorch's DataLoader collects from its workers round-robin, so batches arrive as k, k+1, ...
   whatever n is (0 included): the batch stream does not depend on `num_workers`, and a run may
   resume with a different one. Every worker reads through the shards its batches touch but
   decodes only its own samples; the workers move through the same shard at the same time, so
   the page cache serves the repeated reads. The workers are started once and kept (persistent):
   a new epoch, or a new pass of an evaluation, is a position (epoch, k) written to a small
   shared-memory tensor before the DataLoader is iterated again, which the workers read when they
   restart their iteration; nothing else about them depends on the epoch. On CUDA the main
   process pins each batch (`pin_memory`), so its copy to the GPU is asynchronous.
5. Resume: the state is (epoch, samples consumed), counted in the main process because workers
   prefetch ahead of the trainer, and saved at a step boundary. A loader with the same G resumes
   at batch consumed / (b W) whatever its W and b; workers start there directly: shards that lie
   wholly before the resume point are never opened, so resuming costs the same at any position.
   The state does not depend on the rank, so one copy saved by rank 0, as DeepSpeed's
   `client_state` is, restores every rank; a fingerprint of what fixes the order (seed, G, shard
   list) is checked on load.
6. A shard that cannot be read (missing, wrong size, not a tar, truncated, wrong members or
   sample count) is skipped with a warning and counted; so is a sample that does not decode to
   token ids within the vocabulary (a bad id would otherwise end the job in the embedding on the
   GPU). A batch touching either is replaced by a filler so that every rank still yields exactly
   B batches (a missing batch on one rank is a hang on all): the first readable batch of the
   epoch in an order drawn from (seed, epoch, rank, j). Fillers are therefore spread over the
   epoch, not one batch repeated (which a model memorises), and, being a function of the data and
   the seed, are the same after a resume. `stats` counts skipped shards, unreadable samples and
   fillers; the trainer ends the job when fillers pass `data.max_bad_fraction` of an epoch.
7. Reading a shard (`pipeline.shards`: a header scan, checked against webdataset's reader) and
   collating a batch (`pipeline.collate`: numpy in the worker, tensors in the main process) are
   their own modules; this one decides which samples make batch j of a rank, and when.
   `sample_keys` names the samples of the last batch handed out ("path/of/shard.tar#member"),
   for logs of skipped steps and for tests.
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

# 3: the order is cut in global batches, and the state counts samples (1 and 2 cut it by rank,
# so their position cannot be carried over: such a run resumes with the code that wrote it).
STATE_VERSION = 3

# Tags that keep the seeded streams apart: the shard order, the in-shard orders and the MLM masks
# must not be drawn from the same numbers even when their other key parts coincide.
_SHARD_ORDER, _SAMPLE_ORDER, _MLM_MASK, _FILLER = 1, 2, 3, 4


class ShardLoader:
    """Token batches of one task and split for one rank; iterate once per epoch.

    `stats` holds the epoch's sizes (`batches_per_epoch` per rank, `steps_per_epoch`,
    `samples_per_epoch`, `samples_dropped_remainder`) and counters since construction:
    `shards_skipped`, `samples_unreadable`, `filler_batches`, `shard_opens` (over all workers),
    `samples_decoded`, `batches_yielded`; `epoch_filler_batches` counts this epoch's fillers.
    One iteration at a time.
    """

    def __init__(self, data_dir: str, task: str, split: str, *, micro_batch_size: int, grad_accum: int = 1,
                 rank: int = 0, world_size: int = 1, num_workers: int = 0, seed: int = 0, mlm_probability: float = 0.15,
                 mlm_mask_fraction: float = 0.8, mlm_random_fraction: float = 0.1,
                 expected_tokenizer_sha256: str | None = None, epoch: int = 0, pin_memory: bool = False):
        if micro_batch_size < 1 or grad_accum < 1:
            raise UserError(f"micro_batch_size ({micro_batch_size}) and grad_accum ({grad_accum}) must be at least 1")
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
        self.micro_batch_size, self.grad_accum, self.rank, self.world_size = micro_batch_size, grad_accum, rank, world_size
        self.global_batch_size = micro_batch_size * grad_accum * world_size
        self.num_workers, self.seed, self.epoch = num_workers, seed, epoch
        self.pin_memory = pin_memory
        self._workers: DataLoader | None = None  # started at the first iteration, kept (see the module doc, 4)
        self._cursor = torch.zeros(2, dtype=torch.int64).share_memory_()  # (epoch, first batch) for the workers
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
            "global_batch_size": self.global_batch_size,
            "shards_sha256": hashlib.sha256(listing).hexdigest(),
        }

        total = sum(shard.samples for shard in self._shards)
        self.steps_per_epoch = total // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise UserError(
                f"{self.data_dir}: {task}/{split} has {total} samples, fewer than one global batch "
                f"({micro_batch_size} x {grad_accum} accumulated x {world_size} ranks)"
            )
        self._num_batches = self.steps_per_epoch * grad_accum
        dropped = total - self.steps_per_epoch * self.global_batch_size
        self.stats = {
            "batches_per_epoch": self._num_batches,
            "steps_per_epoch": self.steps_per_epoch,
            "samples_per_epoch": total,
            "samples_dropped_remainder": dropped,
            "shards_skipped": 0,
            "samples_unreadable": 0,
            "filler_batches": 0,
            "epoch_filler_batches": 0,
            "shard_opens": 0,
            "samples_decoded": 0,
            "batches_yielded": 0,
        }
        self.skipped_shards: list[dict] = []
        self._skipped_seen: set[tuple[int, str]] = set()
        self._consumed = 0
        self._served: tuple[_EpochBatches, int] | None = None  # the last batch handed out (a filler: its source)
        log.info(
            "%s/%s: %d samples in %d shards; %d steps of %d samples per epoch, %d batches of %d per rank; "
            "%d samples per epoch dropped (remainder below one global batch)",
            task, split, total, len(self._shards), self.steps_per_epoch, self.global_batch_size, self._num_batches,
            micro_batch_size, dropped,
        )

    @classmethod
    def from_config(cls, cfg: LoaderConfig, task: str, split: str, *, rank: int, world_size: int, grad_accum: int = 1,
                    expected_tokenizer_sha256: str | None = None, pin_memory: bool = False) -> ShardLoader:
        return cls(
            cfg.data_dir, task, split,
            micro_batch_size=cfg.micro_batch_size, grad_accum=grad_accum, rank=rank, world_size=world_size,
            num_workers=cfg.num_workers, seed=cfg.seed, mlm_probability=cfg.mlm_probability,
            mlm_mask_fraction=cfg.mlm_mask_fraction, mlm_random_fraction=cfg.mlm_random_fraction,
            expected_tokenizer_sha256=expected_tokenizer_sha256, pin_memory=pin_memory,
        )

    def __len__(self) -> int:
        return self._num_batches

    def _epoch_batches(self, epoch: int, first_batch: int) -> _EpochBatches:
        return _epoch_batches(self._batch_spec(), epoch, first_batch)

    def _batch_spec(self) -> dict:
        """What fixes every epoch's batches apart from (epoch, first batch)."""
        return dict(task=self.task, shards=self._shards, seed=self.seed, rank=self.rank, world_size=self.world_size,
                    micro_batch_size=self.micro_batch_size, grad_accum=self.grad_accum,
                    num_batches=self._num_batches, vocab_size=self.vocab_size, mlm_masking=self.mlm_masking)

    def _items(self, epoch: int, first: int):
        """(j, packed batch or None, events) for batches first.. of the epoch: in this process
        without workers, else from the persistent workers, told the position first."""
        if not self.num_workers:
            return iter(self._epoch_batches(epoch, first))
        self._cursor[0], self._cursor[1] = epoch, first
        if self._workers is None:
            # A private generator: creating a DataLoader iterator draws a seed from the one it
            # is given, and drawing from torch's global generator would shift the trainer's
            # dropout stream, so a resumed run would no longer repeat an uninterrupted one.
            self._workers = DataLoader(_CursorBatches(self._batch_spec(), self._cursor), batch_size=None,
                                       num_workers=self.num_workers, collate_fn=_as_is, persistent_workers=True,
                                       generator=torch.Generator().manual_seed(self.seed))
        return iter(self._workers)  # the workers restart their iteration at the cursor

    def close(self) -> None:
        """Stop the workers (they are also stopped when the loader is collected)."""
        workers, self._workers = self._workers, None
        iterator = getattr(workers, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def __iter__(self):
        epoch, first = self.epoch, self._consumed
        if first < self._num_batches:
            epoch_batches = self._epoch_batches(epoch, first)
            items = self._items(epoch, first)
            if first == 0:
                self.stats["epoch_filler_batches"] = 0
            expected = first
            for j, packed, events in items:
                # Exact resume rests on the DataLoader's round-robin order; a change there must fail loudly.
                if j != expected:
                    raise RuntimeError(f"batch {j} arrived where batch {expected} was due")
                self._absorb(epoch, events)
                if packed is None:
                    source, batch = self._filler(epoch_batches, j)
                else:
                    source, batch = j, unpack(self.task, packed)  # tensors and masks are made here, not sent
                if self.pin_memory:
                    batch = {key: value.pin_memory() for key, value in batch.items()}
                self._served = (epoch_batches, source)
                expected += 1
                self._consumed = expected
                self.stats["batches_yielded"] += 1
                yield batch
            if expected != self._num_batches:
                raise RuntimeError(f"epoch {epoch} ended after {expected} of {self._num_batches} batches")
        self.epoch, self._consumed = epoch + 1, 0

    def _filler(self, epoch_batches: _EpochBatches, j: int) -> tuple[int, dict]:
        """(i, batch i) to stand in for unreadable batch j: the first readable batch of the epoch in
        an order drawn from (seed, epoch, rank, j), so fillers are spread over the epoch and are
        the same after a resume. Batches touching a shard already found bad are passed over unread."""
        epoch = epoch_batches.epoch
        bad_paths = {path for seen_epoch, path in self._skipped_seen if seen_epoch == epoch}
        for i in _rng(self.seed, epoch, _FILLER, self.rank, j).permutation(self._num_batches).tolist():
            if i == j or any(epoch_batches.shards[o].path in bad_paths for o in epoch_batches.shard_orders(i)):
                continue
            _, packed, events = epoch_batches.build(i)
            self._absorb(epoch, events)
            if packed is not None:
                self.stats["filler_batches"] += 1
                self.stats["epoch_filler_batches"] += 1
                log.warning("rank %d, epoch %d: batch %d is unreadable; batch %d stands in for it", self.rank, epoch, j, i)
                return i, unpack(self.task, packed)
            bad_paths = {path for seen_epoch, path in self._skipped_seen if seen_epoch == epoch}
        raise RuntimeError(
            f"rank {self.rank}, epoch {epoch}: none of the {self._num_batches} batches is readable; "
            f"see the warnings about skipped shards under {self.data_dir}"
        )

    def sample_keys(self) -> list[str]:
        """The samples of the batch most recently handed out (a filler's: those of the batch it
        repeats), as "SHARD_PATH#MEMBER", MEMBER the sample's position in its tar."""
        if self._served is None:
            return []
        epoch_batches, j = self._served
        return epoch_batches.sample_keys(j)

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
        """The position, valid at an optimizer-step boundary (after a multiple of grad_accum batches)."""
        epoch, consumed = self.epoch, self._consumed
        if consumed % self.grad_accum:
            raise RuntimeError(f"loader state asked for mid-step: {consumed} batches of {self.grad_accum} per step")
        if consumed >= self._num_batches:  # a finished epoch resumes at the start of the next
            epoch, consumed = epoch + 1, 0
        return {"version": STATE_VERSION, "epoch": epoch,
                "samples_consumed": consumed * self.micro_batch_size * self.world_size,
                "fingerprint": dict(self._fingerprint)}

    def load_state_dict(self, state: dict) -> None:
        version = state.get("version")
        if version in (1, 2):
            raise UserError(
                f"the loader state is of version {version}, whose order was cut by rank: its position cannot be "
                f"carried into this version's order (resume with the version that wrote it, or start anew)"
            )
        if version != STATE_VERSION:
            raise UserError(f"loader state version {version!r}, expected {STATE_VERSION}")
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
        epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
        per_batch = self.micro_batch_size * self.world_size
        consumed, remainder = divmod(samples, per_batch)
        if epoch < 0 or remainder or consumed % self.grad_accum or not 0 <= consumed <= self._num_batches:
            raise UserError(
                f"loader state epoch {epoch}, {samples} samples consumed: not a whole number of global batches "
                f"of {self.global_batch_size} within the epoch's {self.steps_per_epoch}"
            )
        self.epoch, self._consumed = epoch, consumed


def _epoch_batches(spec: dict, epoch: int, first_batch: int) -> _EpochBatches:
    """A rank's batches first_batch.. of an epoch, in the epoch's shard order."""
    shards = spec["shards"]
    order = _rng(spec["seed"], epoch, _SHARD_ORDER).permutation(len(shards))
    return _EpochBatches(**{**spec, "shards": [shards[i] for i in order]}, epoch=epoch, first_batch=first_batch)


class _CursorBatches(IterableDataset):
    """What the persistent workers iterate: the batches of the epoch and first batch that the
    shared `cursor` holds when they (re)start."""

    def __init__(self, spec: dict, cursor: torch.Tensor):
        self.spec, self.cursor = spec, cursor

    def __iter__(self):
        epoch, first = (int(value) for value in self.cursor.tolist())
        return iter(_epoch_batches(self.spec, epoch, first))


class _EpochBatches(IterableDataset):
    """One rank's batches [first_batch, num_batches) of one epoch, as (j, packed batch or None, events);
    `pipeline.collate.unpack(task, packed)` in the main process makes the token batch."""

    def __init__(self, *, task: str, shards: list[Shard], seed: int, epoch: int, rank: int, world_size: int,
                 micro_batch_size: int, grad_accum: int, num_batches: int, first_batch: int, vocab_size: int,
                 mlm_masking: MLMMasking | None):
        self.task = task
        self.fields = FIELDS[DATASET_FOR_TASK[task]]
        self.shards = shards
        self.starts = np.concatenate([[0], np.cumsum([shard.samples for shard in shards])]).astype(np.int64)
        self.seed, self.epoch, self.rank, self.world_size = seed, epoch, rank, world_size
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
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

    def positions(self, j: int) -> np.ndarray:
        """The stream positions of this rank's batch j: slot a W + r of global batch j // A."""
        step, round_ = divmod(j, self.grad_accum)
        global_batch = self.micro_batch_size * self.grad_accum * self.world_size
        first = step * global_batch + (round_ * self.world_size + self.rank) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def shard_orders(self, j: int) -> list[int]:
        """Which shards (by place in this epoch's order) batch j reads."""
        return sorted(set((np.searchsorted(self.starts, self.positions(j), side="right") - 1).tolist()))

    def sample_keys(self, j: int) -> list[str]:
        positions = self.positions(j)
        orders = np.searchsorted(self.starts, positions, side="right") - 1
        reader = _Reader(self, range(0))
        return [f"{self.shards[o].path}#{int(reader.permutation(o)[p - self.starts[o]])}"
                for p, o in zip(positions.tolist(), orders.tolist())]

    def build(self, j: int, reader: _Reader | None = None) -> tuple[int, dict[str, np.ndarray] | None, dict]:
        reader = reader or _Reader(self, range(j, j + 1))
        events = _new_events()
        positions = self.positions(j)
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
        return j, self._pack(positions, samples), events

    def _pack(self, positions: np.ndarray, samples: list[list[np.ndarray]]) -> dict[str, np.ndarray]:
        # MLM masks are drawn here, in the worker, one generator per sample seeded by its stream
        # position: where they are drawn, and which rank or batch the sample lands in, do not matter.
        generators = [_torch_generator(self.seed, self.epoch, p, _MLM_MASK) for p in positions.tolist()] \
            if self.mlm_masking else None
        return pack(self.task, samples, self.mlm_masking, generators)


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
            key = (self.epoch_batches.seed, self.epoch_batches.epoch, _SAMPLE_ORDER, shard.index)
            self.permutations[order] = _rng(*key).permutation(shard.samples)
        return self.permutations[order]

    def evict_before(self, order: int) -> None:
        # Batches only move forward through the stream, so nothing behind `order` is needed again.
        for stale in [o for o in self.loaded if o < order]:
            del self.loaded[stale]
            self.permutations.pop(stale, None)

    def wanted(self, order: int) -> set[int]:
        e, batches = self.epoch_batches, self.batches
        offsets = np.arange(e.shards[order].samples)
        # Invert `_EpochBatches.positions`: position -> (step, slot) -> (rank, this rank's batch).
        step, slot = np.divmod((e.starts[order] + offsets) // e.micro_batch_size, e.grad_accum * e.world_size)
        round_, rank = np.divmod(slot, e.world_size)
        batch = step * e.grad_accum + round_
        mine = (rank == e.rank) & (batch >= batches.start) & (batch < batches.stop)
        mine &= (batch - batches.start) % batches.step == 0
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
