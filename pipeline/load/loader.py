"""Stream prepared WebDataset shards into token batches: rank/worker split, seeded
shuffle, exact resume.

The design and its reasons: docs/design.md#pipelineloadloaderpy.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset

from common.configure import UserError
from pipeline import remote
from pipeline.format import (
    MANIFEST,
    Dataset,
    dataset_specials,
    field_vocab,
    has_target_tokenizer,
    read_manifest,
    shard_entries,
)
from pipeline.load.collate import MLMMasking, unpack
from pipeline.load.config import LoaderConfig, global_batch_size
from pipeline.load.epoch import FILLER, EpochBatches, rank_epoch, seeded_rng
from pipeline.load.mixture import (
    DEFAULT_SOURCE,
    describe_mixture,
    describe_shares,
    epoch_sources,
)
from pipeline.load.shards import Shard, sample_fields

log = logging.getLogger(__name__)

# 3: the order is cut in global batches, and the state counts samples (1 and 2 cut it by rank,
# so their position cannot be carried over: such a run resumes with the code that wrote it).
STATE_VERSION = 3


class ShardLoader:
    """Token batches of one task and split for one rank; iterate once per epoch.

    `stats` holds the epoch's sizes (`batches_per_epoch` per rank, `steps_per_epoch`,
    `samples_per_epoch`, `samples_dropped_remainder`) and counters since construction:
    `shards_skipped`, `samples_unreadable`, `filler_batches`, `shard_opens` (over all workers),
    `samples_decoded`, `batches_yielded`; `epoch_filler_batches` counts this epoch's fillers.
    One iteration at a time.
    """

    def __init__(
        self,
        data_dir: str,
        task: str,
        split: str,
        *,
        micro_batch_size: int,
        grad_accum: int = 1,
        rank: int = 0,
        world_size: int = 1,
        num_workers: int = 0,
        seed: int = 0,
        mlm_probability: float = 0.15,
        mlm_mask_fraction: float = 0.8,
        mlm_random_fraction: float = 0.1,
        expected_tokenizer_sha256: str | None = None,
        epoch: int = 0,
        pin_memory: bool = False,
        mixture: dict[str, float] | None = None,
        allow_mixture_change: bool = False,
        allow_data_change: bool = False,
        fetch: remote.FetchConfig | None = None,
        document_mask: bool = False,
        length_grouping: bool = False,
        length_bands: int = 2,
        manifest: dict | None = None,
    ):
        """`manifest`: the dataset's, already read and checked (`pipeline.format.open_dataset`),
        so that a trainer's loaders do not read it again; read here when None."""
        if micro_batch_size < 1 or grad_accum < 1:
            raise UserError(
                f"micro_batch_size ({micro_batch_size}) and grad_accum "
                f"({grad_accum}) must be at least 1"
            )
        if world_size < 1 or not 0 <= rank < world_size:
            raise UserError(f"rank {rank} is not in a world of size {world_size}")
        if num_workers < 0:
            raise UserError(f"num_workers must be 0 or more, got {num_workers}")
        if not 0.0 < mlm_probability <= 1.0:
            raise UserError(f"mlm_probability must be in (0, 1], got {mlm_probability}")
        if (
            mlm_mask_fraction < 0
            or mlm_random_fraction < 0
            or mlm_mask_fraction + mlm_random_fraction > 1
        ):
            raise UserError(
                f"mlm_mask_fraction ({mlm_mask_fraction}) and mlm_random_fraction "
                f"({mlm_random_fraction}) must be non-negative and add up to at most 1"
            )
        # a URL: see pipeline.remote
        self.data_dir = data_dir if remote.is_url(data_dir) else Path(data_dir)
        if manifest is None:
            manifest = read_manifest(self.data_dir, fetch)
        tokenizer = manifest.get("tokenizer") or {}
        if (
            expected_tokenizer_sha256 is not None
            and tokenizer.get("sha256") != expected_tokenizer_sha256
        ):
            raise UserError(
                f"{self.data_dir}: tokenizer sha256 {tokenizer.get('sha256')} differs from "
                f"the expected {expected_tokenizer_sha256}: the data was prepared with "
                "another tokenizer than the model's"
            )
        # each once, none empty
        entries = shard_entries(manifest, task, split, remote.join(self.data_dir, MANIFEST))
        # The members the shards hold (all read, for each shard's verdict) and those decoded.
        self.stored_fields, self.fields = sample_fields(
            manifest, task, document_mask, str(self.data_dir)
        )
        self.document_mask = document_mask
        self.length_grouping, self.length_bands = length_grouping, length_bands

        self.task, self.split = task, split
        self.micro_batch_size, self.grad_accum, self.rank, self.world_size = (
            micro_batch_size,
            grad_accum,
            rank,
            world_size,
        )
        self.global_batch_size = global_batch_size(micro_batch_size, grad_accum, world_size)
        self.num_workers, self.seed, self.epoch = num_workers, seed, epoch
        self.pin_memory = pin_memory
        # started at the first iteration, kept (the loader design in docs/design.md, 4)
        self._workers: DataLoader | None = None
        # (epoch, first batch) for the workers
        self._cursor = torch.zeros(2, dtype=torch.int64).share_memory_()
        # set by `close` for the workers: see `_worker_lifetime`
        self._closing: torch.Tensor | None = None
        self.vocab_size = int(tokenizer["vocab_size"])
        self.specials = dataset_specials(manifest)
        # a translation target's tokenizer, when it is not the source's (`pipeline.format.SIDES`)
        self.target_specials = (
            dataset_specials(manifest, "target") if has_target_tokenizer(manifest) else None
        )
        self.field_vocab = field_vocab(manifest)
        self.mlm_masking = (
            MLMMasking(
                self.vocab_size,
                sorted(set(self.specials.ids) | set(tokenizer.get("special_ids", []))),
                self.specials.require("mask", "MLM (task mlm)"),
                mlm_probability,
                mlm_mask_fraction,
                mlm_random_fraction,
            )
            if task == "mlm"
            else None
        )
        by_source: dict[str, list[Shard]] = {}
        for index, entry in enumerate(entries):
            shard = Shard(
                index,
                remote.join(self.data_dir, entry["path"]),
                int(entry["samples"]),
                entry.get("bytes"),
                entry.get("sha256"),
                fetch,
            )
            by_source.setdefault(str(entry.get("source", DEFAULT_SOURCE)), []).append(shard)
        self.sources = epoch_sources(by_source, mixture or {}, f"{self.data_dir} {task}/{split}")
        self.mixed = bool(mixture)
        self.allow_mixture_change = allow_mixture_change
        self.allow_data_change = allow_data_change
        # what differed from a loader state that `load_state_dict` did not take up, reading this
        # stream from its first sample instead (allow_data_change); "" if none
        self.restarted = ""
        listing = json.dumps(
            [[e["path"], int(e["samples"]), e.get("sha256")] for e in entries]
        ).encode()
        self._fingerprint = {
            "task": task,
            "split": split,
            "seed": seed,
            "global_batch_size": self.global_batch_size,
            "shards_sha256": hashlib.sha256(listing).hexdigest(),
            # Samples per epoch of each mixed source: what the weights fix (None: unmixed).
            "mixture": {s.name: s.per_epoch for s in self.sources} if self.mixed else None,
        }
        # grouping changes which samples share a step: k bands of 1/k global batch (already in
        # the fingerprint), each round dealt to the ranks (the loader design, 9)
        if length_grouping:
            if length_bands < 1 or self.global_batch_size % length_bands:
                raise UserError(
                    f"data.length_bands: {length_bands} must be a positive divisor of the global "
                    f"batch ({self.global_batch_size} samples)"
                )
            self._fingerprint["length_grouping"] = (
                f"{length_bands} length band(s) a step, rounds dealt"
            )

        total = sum(source.per_epoch for source in self.sources)
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
            "tokens_by_source": {source.name: 0 for source in self.sources},
        }
        self.skipped_shards: list[dict] = []
        self._skipped_seen: set[tuple[int, str]] = set()
        self._consumed = 0
        # as they were at the last step boundary
        self._tokens_at_step = dict(self.stats["tokens_by_source"])
        # the last batch handed out (a filler: its source)
        self._served: tuple[EpochBatches, int] | None = None
        log.info(
            "%s/%s: %d samples in %d shards; %d steps of %d samples per epoch, %d batches of %d "
            "per rank; %d samples per epoch dropped (remainder below one global batch)",
            task,
            split,
            total,
            sum(len(s.shards) for s in self.sources),
            self.steps_per_epoch,
            self.global_batch_size,
            self._num_batches,
            micro_batch_size,
            dropped,
        )
        if self.mixed:
            log.info("%s/%s mixture: %s", task, split, describe_mixture(self.sources))

    @classmethod
    def from_config(
        cls,
        cfg: LoaderConfig,
        task: str,
        split: str,
        *,
        rank: int,
        world_size: int,
        grad_accum: int = 1,
        expected_tokenizer_sha256: str | None = None,
        pin_memory: bool = False,
        dataset: Dataset | None = None,
    ) -> ShardLoader:
        """A loader of `cfg.data_dir` (or of `dataset`, opened from it already)."""
        return cls(
            cfg.data_dir,
            task,
            split,
            micro_batch_size=cfg.micro_batch_size,
            grad_accum=grad_accum,
            rank=rank,
            world_size=world_size,
            num_workers=cfg.num_workers,
            seed=cfg.seed,
            mlm_probability=cfg.mlm_probability,
            mlm_mask_fraction=cfg.mlm_mask_fraction,
            mlm_random_fraction=cfg.mlm_random_fraction,
            expected_tokenizer_sha256=expected_tokenizer_sha256,
            pin_memory=pin_memory,
            # Only training draws by weight: validation reads every source as it is.
            mixture=dict(cfg.mixture) if split == "train" else None,
            allow_mixture_change=cfg.allow_mixture_change,
            allow_data_change=cfg.allow_data_change,
            fetch=dataset.fetch if dataset else remote.FetchConfig.from_loader_config(cfg),
            document_mask=cfg.document_mask,
            length_grouping=cfg.length_grouping,
            length_bands=cfg.length_bands,
            manifest=dataset.manifest if dataset else None,
        )

    def __len__(self) -> int:
        return self._num_batches

    def _epoch_batches(self, epoch: int, first_batch: int) -> EpochBatches:
        return rank_epoch(self._batch_spec(), epoch, first_batch)

    def _batch_spec(self) -> dict:
        """What fixes every epoch's batches apart from (epoch, first batch)."""
        return dict(
            task=self.task,
            sources=self.sources,
            mixed=self.mixed,
            seed=self.seed,
            rank=self.rank,
            world_size=self.world_size,
            micro_batch_size=self.micro_batch_size,
            grad_accum=self.grad_accum,
            num_batches=self._num_batches,
            vocab_size=self.field_vocab,
            specials=self.specials,
            target_specials=self.target_specials,
            mlm_masking=self.mlm_masking,
            stored_fields=self.stored_fields,
            fields=self.fields,
            document_mask=self.document_mask,
            length_grouping=self.length_grouping,
            length_bands=self.length_bands,
        )

    def _items(self, epoch: int, first: int):
        """(j, packed batch or None, events) for batches first.. of the epoch: in this process
        without workers, else from the persistent workers, told the position first."""
        if not self.num_workers:
            return iter(self._epoch_batches(epoch, first))
        self._cursor[0], self._cursor[1] = epoch, first
        if self._workers is None:
            self._closing = torch.zeros(1, dtype=torch.int64).share_memory_()
            _OPEN_WORKER_FLAGS.append(self._closing)
            # A private generator: creating a DataLoader iterator draws a seed from the one it
            # is given, and drawing from torch's global generator would shift the trainer's
            # dropout stream, so a resumed run would no longer repeat an uninterrupted one.
            self._workers = DataLoader(
                _CursorBatches(self._batch_spec(), self._cursor),
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_as_is,
                persistent_workers=True,
                generator=torch.Generator().manual_seed(self.seed),
                worker_init_fn=functools.partial(_worker_lifetime, self._closing),
            )
        return iter(self._workers)  # the workers restart their iteration at the cursor

    def close(self) -> None:
        """Stop the workers (they are also stopped when the loader is collected). One that is
        blocked in a remote fetch ends itself a moment later (`_worker_lifetime`)."""
        workers, self._workers = self._workers, None
        if self._closing is not None:
            self._closing[0] = 1
        iterator = getattr(workers, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def rewind(self) -> None:
        """Forget the batches handed out since the last step boundary (a multiple of grad_accum),
        so that a step given up while its batches were being read (a stop request) is saved as
        not begun; the next iteration starts at that boundary."""
        self._consumed -= self._consumed % self.grad_accum
        self.stats["tokens_by_source"] = dict(self._tokens_at_step)

    def __iter__(self):
        epoch, first = self.epoch, self._consumed
        self._tokens_at_step = dict(self.stats["tokens_by_source"])
        if first < self._num_batches:
            epoch_batches = self._epoch_batches(epoch, first)
            items = self._items(epoch, first)
            if first == 0:
                self.stats["epoch_filler_batches"] = 0
            expected = first
            for j, packed, events in items:
                # Exact resume rests on the DataLoader's round-robin order; a change there must fail
                # loudly.
                if j != expected:
                    raise RuntimeError(f"batch {j} arrived where batch {expected} was due")
                self._absorb(epoch, events)
                if packed is None:
                    source, batch = self._filler(epoch_batches, j)
                else:
                    # tensors and masks are made here, not sent
                    source, batch = j, unpack(self.task, packed)
                if self.pin_memory:
                    batch = {key: value.pin_memory() for key, value in batch.items()}
                self._served = (epoch_batches, source)
                expected += 1
                self._consumed = expected
                if expected % self.grad_accum == 0:  # a step's last batch: what `rewind` returns to
                    self._tokens_at_step = dict(self.stats["tokens_by_source"])
                self.stats["batches_yielded"] += 1
                yield batch
            if expected != self._num_batches:
                raise RuntimeError(
                    f"epoch {epoch} ended after {expected} of {self._num_batches} batches"
                )
        self.epoch, self._consumed = epoch + 1, 0

    def _filler(self, epoch_batches: EpochBatches, j: int) -> tuple[int, dict]:
        """(i, batch i) to stand in for unreadable batch j: the first readable batch of the epoch in
        an order drawn from (seed, epoch, rank, j), so fillers are spread over the epoch and are
        the same after a resume. Batches touching a shard already found bad are
        passed over unread."""
        epoch = epoch_batches.epoch
        bad_paths = {path for seen_epoch, path in self._skipped_seen if seen_epoch == epoch}
        for i in (
            seeded_rng(self.seed, epoch, FILLER, self.rank, j)
            .permutation(self._num_batches)
            .tolist()
        ):
            if i == j or epoch_batches.shard_paths(i) & bad_paths:
                continue
            _, packed, events = epoch_batches.build(i)
            self._absorb(epoch, events)
            if packed is not None:
                self.stats["filler_batches"] += 1
                self.stats["epoch_filler_batches"] += 1
                log.warning(
                    "rank %d, epoch %d: batch %d is unreadable; batch %d stands in for it",
                    self.rank,
                    epoch,
                    j,
                    i,
                )
                return i, unpack(self.task, packed)
            bad_paths = {path for seen_epoch, path in self._skipped_seen if seen_epoch == epoch}
        raise RuntimeError(
            f"rank {self.rank}, epoch {epoch}: none of the {self._num_batches} batches is "
            f"readable; see the warnings about skipped shards under {self.data_dir}"
        )

    def sample_keys(self, served: tuple | None = None) -> list[str]:
        """The samples of the batch most recently handed out (a filler's: those of the batch it
        repeats), or of one `served_batch()` named earlier, as "SHARD_PATH#MEMBER", MEMBER the
        sample's position in its tar."""
        served = served or self._served
        if served is None:
            return []
        epoch_batches, j = served
        return epoch_batches.sample_keys(j)

    def served_batch(self) -> tuple | None:
        """A cheap handle on the batch most recently handed out, for `sample_keys` to name later:
        naming it re-derives its shards' sample orders, which the trainer needs only for a step
        it skips (or with `data.log_sample_keys`), not at every step."""
        return self._served

    def _absorb(self, epoch: int, events: dict) -> None:
        self.stats["shard_opens"] += events["shard_opens"]
        self.stats["samples_decoded"] += events["samples_decoded"]
        for name, tokens in events["tokens_by_source"].items():
            self.stats["tokens_by_source"][name] += tokens
        for path, reason in events["skipped"]:
            # every worker that reads a bad shard reports it
            if (epoch, path) in self._skipped_seen:
                continue
            self._skipped_seen.add((epoch, path))
            self.stats["shards_skipped"] += 1
            self.skipped_shards.append({"epoch": epoch, "path": path, "reason": reason})
            log.warning("skipping shard %s (epoch %d): %s", path, epoch, reason)
        for path, member, reason in events["bad_samples"]:
            self.stats["samples_unreadable"] += 1
            log.warning(
                "skipping sample %d of shard %s (epoch %d): %s", member, path, epoch, reason
            )

    def state_dict(self) -> dict:
        """The position, valid at an optimizer-step boundary (after a multiple of
        grad_accum batches)."""
        epoch, consumed = self.epoch, self._consumed
        if consumed % self.grad_accum:
            raise RuntimeError(
                f"loader state asked for mid-step: {consumed} batches of {self.grad_accum} per step"
            )
        if consumed >= self._num_batches:  # a finished epoch resumes at the start of the next
            epoch, consumed = epoch + 1, 0
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "samples_consumed": consumed * self.micro_batch_size * self.world_size,
            "fingerprint": dict(self._fingerprint),
        }

    def load_state_dict(self, state: dict, saved_data: str = "") -> None:
        """The position of a loader state (`state_dict`). One of another stream (another
        dataset's shards, data seed, length grouping: the fingerprint, but for the mixture) is
        refused, naming what differs and `saved_data` (the overrides of the data it read, where
        the caller knows them); with `allow_data_change` it is not taken up, and this stream is
        read from its first sample (`restarted` says what differed). Another mixture alone is
        refused unless `allow_mixture_change`, which keeps the position."""
        version = state.get("version")
        if version in (1, 2):
            raise UserError(
                f"the loader state is of version {version}, whose order was cut by rank: its "
                "position cannot be carried into this version's order (resume with the version "
                "that wrote it, or start anew)"
            )
        if version != STATE_VERSION:
            raise UserError(f"loader state version {version!r}, expected {STATE_VERSION}")
        saved = state.get("fingerprint", {})
        differences = [
            f"{key}: saved {saved.get(key)!r}, now {self._fingerprint.get(key)!r}"
            for key in sorted(set(self._fingerprint) | set(saved))
            if saved.get(key) != self._fingerprint.get(key) and key != "mixture"
        ]
        if differences and self.allow_data_change:
            self.restarted = "; ".join(differences)
            return
        mixture_changed = saved.get("mixture") != self._fingerprint["mixture"]
        if mixture_changed and not self.allow_mixture_change:
            raise UserError(
                "data.mixture: the checkpoint's run drew "
                f"{describe_shares(saved.get('mixture'))} per epoch, this run would draw "
                f"{describe_shares(self._fingerprint['mixture'])}; pass "
                "data.allow_mixture_change=true to continue from the "
                "same position with the new weights"
            )
        if differences:
            as_saved = f" ({saved_data})" if saved_data else ""
            raise UserError(
                "the loader state does not match this loader, so the batches "
                "after a resume would differ: " + "; ".join(differences) + "; resume on the data "
                f"it read{as_saved}, or pass data.allow_data_change=true to carry the "
                "checkpoint's weights, optimizer and step over onto this data, read from its "
                "first sample"
            )
        epoch, samples = int(state["epoch"]), int(state["samples_consumed"])
        per_batch = self.micro_batch_size * self.world_size
        consumed, remainder = divmod(samples, per_batch)
        if mixture_changed:
            if consumed >= self._num_batches:  # the new mixture's epoch is shorter: it is over
                epoch, consumed, remainder = epoch + 1, 0, 0
            log.warning(
                "data.mixture changed on resume (data.allow_mixture_change=true): was %s per "
                "epoch, now %s; continuing at epoch %d, batch %d with the new weights",
                describe_shares(saved.get("mixture")),
                describe_shares(self._fingerprint["mixture"]),
                epoch,
                consumed,
            )
        if (
            epoch < 0
            or remainder
            or consumed % self.grad_accum
            or not 0 <= consumed <= self._num_batches
        ):
            raise UserError(
                f"loader state epoch {epoch}, {samples} samples consumed: not a whole "
                f"number of global batches of {self.global_batch_size} within the "
                f"epoch's {self.steps_per_epoch}"
            )
        self.epoch, self._consumed = epoch, consumed


class _CursorBatches(IterableDataset):
    """What the persistent workers iterate: the batches of the epoch and first batch that the
    shared `cursor` holds when they (re)start."""

    def __init__(self, spec: dict, cursor: torch.Tensor):
        self.spec, self.cursor = spec, cursor

    def __iter__(self):
        epoch, first = (int(value) for value in self.cursor.tolist())
        return iter(rank_epoch(self.spec, epoch, first))


WORKER_EXIT_S = 1.0  # how long a closed loader's worker may take to end by itself
_OPEN_WORKER_FLAGS: list[torch.Tensor] = []  # every loader's `closing` flag, raised at exit


@atexit.register
def _close_workers_at_exit() -> None:
    """A process that ends with a loader still open (never closed, its iterator still referenced)
    raises every loader's flag, so that the workers end by themselves (`_worker_lifetime`).
    multiprocessing's own exit handler, which runs after this one (registered earlier), joins
    them; SIGTERM, which it would send first, they ignore, so without this the join waited for
    ever (a test process that never exited)."""
    for flag in _OPEN_WORKER_FLAGS:
        flag[0] = 1


def _worker_lifetime(closing: torch.Tensor, worker_id: int) -> None:
    """A DataLoader worker (its worker_init_fn) lives as long as its loader and its rank, no longer:
    * it ignores SIGTERM, SIGHUP and SIGQUIT, which reach every process of a job (torchrun sends
      them to each rank's process group, SLURM SIGTERM to every process of a step): dead of one
      mid-batch, a worker takes its rank down ("DataLoader worker is killed by signal") before
      the rank, which takes them for a stop request, could checkpoint (SIGXCPU and SIGXFSZ, which
      its own limits send it alone, the stop handler it inherits passes on to the rank);
    * a thread ends it WORKER_EXIT_S after its loader is closed, or at once when its rank is gone,
      if it has not ended by itself. Asked to stop, a worker ends between two batches, but one
      blocked in a remote fetch or a retry's back-off (minutes, at the default timeouts) would
      keep its rank, and a stop request, waiting. What it leaves in the shard cache is what a
      killed download leaves, which the next fetch clears (`pipeline.remote`). Exit status 0:
      the DataLoader takes any other for a worker that failed."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    rank = os.getppid()

    def leave():
        while not int(closing[0]) and os.getppid() == rank:
            time.sleep(0.1)
        if os.getppid() == rank:
            time.sleep(WORKER_EXIT_S)
        os._exit(0)

    threading.Thread(target=leave, name="worker-lifetime", daemon=True).start()


def _as_is(item):
    return item
