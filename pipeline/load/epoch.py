"""Which samples make batch j of a rank, and when: the epoch's order as a pure function of (seed,
epoch, global batch, micro batch, world size, rank, j), mixtures of sources, length groups, and
reading the shards a batch touches (the sources of a mixture: `pipeline.load.mixture`).
`pipeline.load.loader.ShardLoader` hands these batches out and keeps the state that resumes
them.

The design and its reasons: docs/design.md#pipelineloadloaderpy.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from pipeline import remote
from pipeline.format import is_token_field
from pipeline.load.collate import MLMMasking, pack
from pipeline.load.config import global_batch_size
from pipeline.load.mixture import Source
from pipeline.load.shards import Shard, ShardError, decode_sample, read_shard, sample_sizes
from pipeline.specials import Specials

# Tags that keep the seeded streams apart: the shard order, the in-shard orders and the MLM masks
# must not be drawn from the same numbers even when their other key parts coincide.
_SHARD_ORDER, _SAMPLE_ORDER, _MLM_MASK, FILLER, _MIXTURE, _LENGTH_GROUPS = 1, 2, 3, 4, 5, 6


def rank_epoch(spec: dict, epoch: int, first_batch: int) -> EpochBatches:
    """A rank's batches first_batch.. of an epoch."""
    return EpochBatches(**spec, epoch=epoch, first_batch=first_batch)


# A shard's place in the stream: (source, pass of that source, place in the pass's shard order).
ShardKey = tuple[int, int, int]


class EpochBatches(IterableDataset):
    """One rank's batches [first_batch, num_batches) of one epoch, as (j, packed batch or None,
    events); `pipeline.load.collate.unpack(task, packed)` in the main process makes the token
    batch.

    Where a stream position's sample lies (docs/design.md, the loader, 8): the position's source s
    and its index i in that source's own endless stream of passes, pass q = i // N_s; pass q is the
    source's shards in an order drawn from (seed, q[, source]), and each shard's samples in an order
    drawn from (seed, q, shard). Unmixed, the one source is the whole dataset, i = epoch N +
    position and q = epoch: the orders of the loader design, 1."""

    def __init__(
        self,
        *,
        task: str,
        sources: tuple[Source, ...],
        mixed: bool,
        seed: int,
        epoch: int,
        rank: int,
        world_size: int,
        micro_batch_size: int,
        grad_accum: int,
        num_batches: int,
        first_batch: int,
        vocab_size: int | Mapping[str, int],
        specials: Specials,
        mlm_masking: MLMMasking | None,
        stored_fields: tuple[str, ...],
        fields: tuple[str, ...],
        document_mask: bool,
        length_grouping: bool = False,
        length_bands: int = 2,
        target_specials: Specials | None = None,
    ):
        self.task = task
        # read, decoded
        self.stored_fields, self.fields, self.document_mask = stored_fields, fields, document_mask
        self.length_grouping, self.length_bands = length_grouping, length_bands
        self.sources, self.mixed = sources, mixed
        self.seed, self.epoch, self.rank, self.world_size = seed, epoch, rank, world_size
        self.micro_batch_size, self.grad_accum = micro_batch_size, grad_accum
        self.num_batches, self.first_batch = num_batches, first_batch
        self.vocab_size, self.specials = vocab_size, specials
        self.target_specials = target_specials
        self.mlm_masking = mlm_masking
        self._passes: dict[tuple[int, int], tuple[list[Shard], np.ndarray]] = {}
        self._layout: tuple[np.ndarray, np.ndarray, list[np.ndarray]] | None = None

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        mine = range(self.first_batch + worker, self.num_batches, workers)
        # Remote shards: downloaded ahead, in the order this worker reads them from its first batch
        # (computed lazily, by the prefetch thread); those before it are never fetched.
        remote.prefetch(self.shard(key) for j in mine for key in self.locate(self.positions(j))[0])
        reader = _Reader(self, mine)
        for j in mine:
            yield self.build(j, reader)

    def positions(self, j: int) -> np.ndarray:
        """The stream positions of this rank's batch j: slot a W + r of global batch j // A."""
        step, round_ = divmod(j, self.grad_accum)
        global_batch = global_batch_size(self.micro_batch_size, self.grad_accum, self.world_size)
        first = step * global_batch + (round_ * self.world_size + self.rank) * self.micro_batch_size
        return np.arange(first, first + self.micro_batch_size)

    def source_pass(self, s: int, q: int) -> tuple[list[Shard], np.ndarray]:
        """Source s's shards in the order of its pass q, and the pass index each one starts at."""
        if (s, q) not in self._passes:
            source = self.sources[s]
            key = (
                (self.seed, q, _SHARD_ORDER, source.tag)
                if self.mixed
                else (self.seed, q, _SHARD_ORDER)
            )
            shards = [source.shards[i] for i in seeded_rng(*key).permutation(len(source.shards))]
            starts = np.concatenate([[0], np.cumsum([shard.samples for shard in shards])]).astype(
                np.int64
            )
            self._passes[(s, q)] = (shards, starts)
        return self._passes[(s, q)]

    def mixture_layout(self) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """Mixed: each position's source, its index among that source's positions this epoch, and,
        per source, its positions. The epoch holds n_s positions of source s, in an order drawn
        from (seed, epoch): over an epoch the shares are exactly the weights' (to one sample)."""
        if self._layout is None:
            labels = np.repeat(
                np.arange(len(self.sources), dtype=np.int16), [s.per_epoch for s in self.sources]
            )
            labels = labels[seeded_rng(self.seed, self.epoch, _MIXTURE).permutation(len(labels))]
            where = [np.flatnonzero(labels == s) for s in range(len(self.sources))]
            occurrence = np.empty(len(labels), dtype=np.int64)
            for positions in where:
                occurrence[positions] = np.arange(len(positions))
            self._layout = (labels, occurrence, where)
        return self._layout

    def locate(self, positions: np.ndarray) -> tuple[list[ShardKey], list[int]]:
        """Each position's shard, and the sample's place in that shard's (permuted) order."""
        if self.mixed:
            labels, occurrence, _ = self.mixture_layout()
            sources = labels[positions].astype(np.int64)
            per_epoch = np.array([s.per_epoch for s in self.sources], dtype=np.int64)
            indices = self.epoch * per_epoch[sources] + occurrence[positions]
        else:
            sources = np.zeros(len(positions), dtype=np.int64)
            indices = self.epoch * self.sources[0].samples + positions
        sizes = np.array([s.samples for s in self.sources], dtype=np.int64)
        passes, offsets = np.divmod(indices, sizes[sources])
        orders = np.empty_like(offsets)
        for s, q in {(int(s), int(q)) for s, q in zip(sources, passes)}:
            chosen = (sources == s) & (passes == q)
            starts = self.source_pass(s, q)[1]
            orders[chosen] = np.searchsorted(starts, offsets[chosen], side="right") - 1
            offsets[chosen] -= starts[orders[chosen]]
        keys = list(zip(sources.tolist(), passes.tolist(), orders.tolist()))
        return keys, offsets.tolist()

    def shard(self, key: ShardKey) -> Shard:
        return self.source_pass(key[0], key[1])[0][key[2]]

    def shard_paths(self, j: int) -> set[str]:
        """The shards batch j reads."""
        return {self.shard(key).path for key in self.locate(self.positions(j))[0]}

    def sample_keys(self, j: int) -> list[str]:
        reader = _Reader(self, range(0))
        return [
            f"{self.shard(key).path}#{int(reader.permutation(key)[offset])}"
            for key, offset in zip(*self.locate(self.positions(j)))
        ]

    def build(
        self, j: int, reader: _Reader | None = None
    ) -> tuple[int, dict[str, np.ndarray] | None, dict]:
        reader = reader or _Reader(self, range(j, j + 1))
        events = _new_events()
        positions = self.positions(j)
        keys, offsets = self.locate(positions)
        reader.evict_before(keys)
        samples = []
        for key, offset in zip(keys, offsets):
            members = reader.members(key, events)
            if members is None:
                return j, None, events
            member = int(reader.permutation(key)[offset])
            try:
                # Each member serves one batch of this reader: let it go as soon as it is decoded.
                samples.append(decode_sample(members.pop(member), self.fields, self.vocab_size))
            except ValueError as err:
                events["bad_samples"].append((self.shard(key).path, member, str(err)))
                return j, None, events
            events["samples_decoded"] += 1
        tokens = events["tokens_by_source"]
        for key, sample in zip(keys, samples):
            name = self.sources[key[0]].name
            tokens[name] = tokens.get(name, 0) + sum(
                array.size
                for field_name, array in zip(self.fields, sample)
                if is_token_field(field_name)
            )
        return j, self._pack(positions, samples), events

    def _pack(
        self, positions: np.ndarray, samples: list[list[np.ndarray]]
    ) -> dict[str, np.ndarray]:
        # MLM masks are drawn here, in the worker, one generator per sample seeded by its stream
        # position: where they are drawn, and which rank or batch the sample lands in, do not
        # matter.
        generators = (
            [_torch_generator(self.seed, self.epoch, p, _MLM_MASK) for p in positions.tolist()]
            if self.mlm_masking
            else None
        )
        return pack(
            self.task,
            samples,
            self.specials,
            self.mlm_masking,
            generators,
            document_mask=self.document_mask,
            target_specials=self.target_specials,
        )


class _Reader:
    """The raw samples one worker needs, read once per shard; shards behind the current
    batch are dropped."""

    def __init__(self, epoch_batches: EpochBatches, batches: range):
        self.epoch_batches = epoch_batches
        self.batches = batches
        self.loaded: dict[ShardKey, dict[int, dict[str, bytes]] | None] = {}
        self.permutations: dict[ShardKey, np.ndarray] = {}

    def permutation(self, key: ShardKey) -> np.ndarray:
        if key not in self.permutations:
            e = self.epoch_batches
            shard = e.shard(key)
            order = seeded_rng(e.seed, key[1], _SAMPLE_ORDER, shard.index).permutation(
                shard.samples
            )
            self.permutations[key] = self._grouped(key, order) if e.length_grouping else order
        return self.permutations[key]

    def _grouped(self, key: ShardKey, order: np.ndarray) -> np.ndarray:
        """`order` sorted by sample size and cut into bands of 1/k global batch (k =
        `length_bands`), the bands shuffled, k of them to a step, each of the step's rounds dealt
        to its ranks so that every rank gets about the same tokens (the loader design, 9)."""
        e = self.epoch_batches
        shard = e.shard(key)
        sizes = sample_sizes(shard, e.stored_fields)
        if sizes is None:  # unreadable: `members` skips the shard, whatever its order
            return order
        g, k = global_batch_size(e.micro_batch_size, e.grad_accum, e.world_size), e.length_bands
        # Unmixed, the shard's first sample is stream position `start` (its pass is the epoch).
        head = 0 if e.mixed else int(-e.source_pass(key[0], key[1])[1][key[2]]) % g
        head = min(head, len(order))
        full = (len(order) - head) // g
        # The samples of the steps this shard shares with its neighbours stay in their seeded
        # order: sorted, they would be its shortest and longest, and one rank would get the ones,
        # the other the others.
        body = order[head : head + full * g]
        bands = body[np.argsort(sizes[body], kind="stable")].reshape(full * k, g // k)
        steps = bands[
            seeded_rng(e.seed, key[1], _LENGTH_GROUPS, shard.index).permutation(full * k)
        ].reshape(full, g)
        return np.concatenate(
            [
                order[:head],
                _deal(steps, sizes, e.grad_accum, e.world_size),
                order[head + full * g :],
            ]
        )

    def evict_before(self, keys: list[ShardKey]) -> None:
        # Each source's samples are read forward through its passes, so nothing behind the first
        # shard this batch reads of a source is needed again.
        first: dict[int, tuple[int, int]] = {}
        for source, pass_, order in keys:
            first.setdefault(source, (pass_, order))
        for stale in [k for k in self.loaded if k[0] in first and k[1:] < first[k[0]]]:
            del self.loaded[stale]
            self.permutations.pop(stale, None)

    def wanted(self, key: ShardKey) -> set[int]:
        e, batches = self.epoch_batches, self.batches
        source_index, pass_, order = key
        source = e.sources[source_index]
        offsets = np.arange(e.shard(key).samples)
        indices = pass_ * source.samples + e.source_pass(source_index, pass_)[1][order] + offsets
        if e.mixed:  # index in the source's stream -> its position in this epoch, if it falls in it
            within = indices - e.epoch * source.per_epoch
            inside = (within >= 0) & (within < source.per_epoch)
            offsets, positions = (
                offsets[inside],
                e.mixture_layout()[2][source_index][within[inside]],
            )
        else:
            positions = indices - e.epoch * source.samples
        # Invert `EpochBatches.positions`: position -> (step, slot) -> (rank, this rank's batch).
        step, slot = np.divmod(positions // e.micro_batch_size, e.grad_accum * e.world_size)
        round_, rank = np.divmod(slot, e.world_size)
        batch = step * e.grad_accum + round_
        mine = (rank == e.rank) & (batch >= batches.start) & (batch < batches.stop)
        mine &= (batch - batches.start) % batches.step == 0
        return set(self.permutation(key)[offsets[mine]].tolist())

    def members(self, key: ShardKey, events: dict) -> dict[int, dict[str, bytes]] | None:
        if key not in self.loaded:
            shard = self.epoch_batches.shard(key)
            events["shard_opens"] += 1
            try:
                self.loaded[key] = read_shard(
                    shard, self.epoch_batches.stored_fields, self.wanted(key)
                )
            except ShardError as err:
                self.loaded[key] = None
                events["skipped"].append((shard.path, str(err)))
        return self.loaded[key]


def _deal(steps: np.ndarray, sizes: np.ndarray, rounds: int, ranks: int) -> np.ndarray:
    """Each row (a step's samples) cut into its `rounds` in order, each round's samples sorted
    by size and dealt to its `ranks` micro batches in a snake: samples 0..W-1 to ranks 0..W-1,
    the next W back from the last, and so on, so each rank's batch spans the round's sizes and
    all of them hold about the same tokens; flattened in stream order (slot a W + r is rank r's
    batch of round a)."""
    n, g = steps.shape
    per_round = steps.reshape(n * rounds, g // rounds)
    per_round = np.take_along_axis(
        per_round, np.argsort(sizes[per_round], axis=1, kind="stable"), axis=1
    )
    dealt = per_round.reshape(n * rounds, g // rounds // ranks, ranks).copy()
    dealt[:, 1::2] = dealt[:, 1::2, ::-1]
    return dealt.transpose(0, 2, 1).ravel()


def _new_events() -> dict:
    # Workers are other processes: what they notice travels to the main process with each batch.
    return {
        "shard_opens": 0,
        "samples_decoded": 0,
        "skipped": [],
        "bad_samples": [],
        "tokens_by_source": {},
    }


def seeded_rng(*key: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([k % 2**64 for k in key])))


def _torch_generator(*key: int) -> torch.Generator:
    seed = int(np.random.SeedSequence([k % 2**64 for k in key]).generate_state(1, np.uint64)[0])
    return torch.Generator().manual_seed(seed & (2**63 - 1))
