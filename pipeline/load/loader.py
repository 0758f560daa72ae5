"""Stream prepared WebDataset shards into token batches: rank/worker split, seeded
shuffle, exact resume.

The design and its reasons: docs/design.md#pipelineloadloaderpy.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from common.configure import UserError
from pipeline import remote
from pipeline.format import (
    MANIFEST,
    dataset_specials,
    field_vocab,
    has_target_tokenizer,
    read_manifest,
    shard_entries,
)
from pipeline.load.collate import MLMMasking, unpack
from pipeline.load.epoch import FILLER, EpochBatches, rank_epoch, seeded_rng
from pipeline.load.mixture import DEFAULT_SOURCE, describe_mixture, epoch_sources
from pipeline.load.plan import LoaderPlan
from pipeline.load.position import position_state, saved_position, stream_fingerprint
from pipeline.load.shards import Shard, sample_fields
from pipeline.load.workers import start_workers, stop_workers

log = logging.getLogger(__name__)


class ShardLoader:
    """Token batches of one task and split for one rank; iterate once per epoch.

    `stats` holds the epoch's sizes (`batches_per_epoch` per rank, `steps_per_epoch`,
    `samples_per_epoch`, `samples_dropped_remainder`) and counters since construction:
    `shards_skipped`, `samples_unreadable`, `filler_batches`, `shard_opens` (over all workers),
    `samples_decoded`, `batches_yielded`; `epoch_filler_batches` counts this epoch's fillers.
    One iteration at a time.
    """

    def __init__(self, plan: LoaderPlan, manifest: dict | None = None):
        """`manifest`: the dataset's, already read and checked (`pipeline.format.open_dataset`),
        so that a trainer's loaders do not read it again; read here when None."""
        plan.check()
        self.plan = plan
        self.task, self.split, self.seed, self.epoch = plan.task, plan.split, plan.seed, plan.epoch
        self.rank, self.world_size, self.grad_accum = plan.rank, plan.world_size, plan.grad_accum
        self.micro_batch_size, self.global_batch_size = (
            plan.micro_batch_size,
            plan.global_batch_size,
        )
        self.num_workers, self.pin_memory = plan.num_workers, plan.pin_memory
        # a URL: see pipeline.remote
        self.data_dir = plan.data_dir if remote.is_url(plan.data_dir) else Path(plan.data_dir)
        manifest = read_manifest(self.data_dir, plan.fetch) if manifest is None else manifest
        entries = self._read(manifest)
        self.sources = self._sources(entries)
        self.mixed = bool(plan.mixture)
        # what differed from a loader state that `load_state_dict` did not take up, reading this
        # stream from its first sample instead (allow_data_change); "" if none
        self.restarted = ""
        self._fingerprint = stream_fingerprint(plan, entries, self.sources)
        total = sum(source.per_epoch for source in self.sources)
        self.steps_per_epoch = total // self.global_batch_size
        if self.steps_per_epoch == 0:
            raise UserError(
                f"{self.data_dir}: {self.task}/{self.split} has {total} samples, fewer than one "
                f"global batch ({self.micro_batch_size} x {self.grad_accum} accumulated x "
                f"{self.world_size} ranks)"
            )
        self._num_batches = self.steps_per_epoch * self.grad_accum
        self._start_counting(total)
        # started at the first iteration, kept (the loader design in docs/design.md, 4)
        self._workers: DataLoader | None = None
        # (epoch, first batch) for the workers
        self._cursor = torch.zeros(2, dtype=torch.int64).share_memory_()
        # set by `close` for the workers: see `pipeline.load.workers`
        self._closing: torch.Tensor | None = None

    def _read(self, manifest: dict) -> list[dict]:
        """The split's shard entries (each once, none empty) and what decoding them needs: the
        fields, the vocabulary and special ids, MLM's masking; the tokenizer checked against the
        model's."""
        plan = self.plan
        tokenizer = manifest.get("tokenizer") or {}
        expected = plan.expected_tokenizer_sha256
        if expected is not None and tokenizer.get("sha256") != expected:
            raise UserError(
                f"{self.data_dir}: tokenizer sha256 {tokenizer.get('sha256')} differs from "
                f"the expected {expected}: the data was prepared with "
                "another tokenizer than the model's"
            )
        entries = shard_entries(
            manifest, plan.task, plan.split, remote.join(self.data_dir, MANIFEST)
        )
        # The members the shards hold (all read, for each shard's verdict) and those decoded.
        self.stored_fields, self.fields = sample_fields(
            manifest, plan.task, plan.document_mask, str(self.data_dir)
        )
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
                plan.mlm_probability,
                plan.mlm_mask_fraction,
                plan.mlm_random_fraction,
            )
            if plan.task == "mlm"
            else None
        )
        return entries

    def _sources(self, entries: list[dict]) -> tuple:
        """The shards by source, each source's share of an epoch fixed by the mixture."""
        by_source: dict[str, list[Shard]] = {}
        for index, entry in enumerate(entries):
            shard = Shard(
                index,
                remote.join(self.data_dir, entry["path"]),
                int(entry["samples"]),
                entry.get("bytes"),
                entry.get("sha256"),
                self.plan.fetch,
            )
            by_source.setdefault(str(entry.get("source", DEFAULT_SOURCE)), []).append(shard)
        where = f"{self.data_dir} {self.task}/{self.split}"
        return epoch_sources(by_source, self.plan.mixture or {}, where)

    def _start_counting(self, total: int) -> None:
        """The epoch's sizes and the counters since construction (`stats`), said in the log."""
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
            self.task,
            self.split,
            total,
            sum(len(s.shards) for s in self.sources),
            self.steps_per_epoch,
            self.global_batch_size,
            self._num_batches,
            self.micro_batch_size,
            dropped,
        )
        if self.mixed:
            log.info("%s/%s mixture: %s", self.task, self.split, describe_mixture(self.sources))

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
            document_mask=self.plan.document_mask,
            length_grouping=self.plan.length_grouping,
            length_bands=self.plan.length_bands,
        )

    def _items(self, epoch: int, first: int):
        """(j, packed batch or None, events) for batches first.. of the epoch: in this process
        without workers, else from the persistent workers, told the position first."""
        if not self.num_workers:
            return iter(self._epoch_batches(epoch, first))
        self._cursor[0], self._cursor[1] = epoch, first
        if self._workers is None:
            self._workers, self._closing = start_workers(
                self._batch_spec(), self._cursor, self.num_workers, self.seed
            )
        return iter(self._workers)  # the workers restart their iteration at the cursor

    def close(self) -> None:
        """Stop the workers (they are also stopped when the loader is collected)."""
        workers, self._workers = self._workers, None
        stop_workers(workers, self._closing)

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
        grad_accum batches): `pipeline.load.position`."""
        return position_state(
            self.plan, self.epoch, self._consumed, self._num_batches, self._fingerprint
        )

    def load_state_dict(self, state: dict, saved_data: str = "") -> None:
        """The position of a loader state (`state_dict`), or with `allow_data_change` on another
        stream none (`restarted` says what differed): `pipeline.load.position.saved_position`."""
        found = saved_position(state, self.plan, self._fingerprint, self._num_batches, saved_data)
        if isinstance(found, str):
            self.restarted = found
        else:
            self.epoch, self._consumed = found
