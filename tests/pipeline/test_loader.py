"""The streaming loader: every sample once per epoch over ranks x workers, equal batch counts,
seeded order, exact resume without decoding what was already seen, corrupt shards, collation."""

from __future__ import annotations

import copy
import itertools
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from batches import UNEVEN, assert_same_batches

from common.configure import UserError
from pipeline.format import BATCH_FIELDS
from pipeline.load import epoch as epoch_module  # where a batch reads its shards
from pipeline.load.config import LoaderConfig
from pipeline.load.loader import ShardLoader
from pipeline.load.plan import LoaderPlan
from pipeline.shard_tar import write_shard
from pipeline.specials import sentencepiece_specials
from tests.shardtools import (
    FIRST_ID,
    TOKENIZER_SHA256,
    VOCAB_SIZE,
    batch_ids,
    make_dataset,
    save_manifest,
    shard_ids,
)

SP = sentencepiece_specials()  # the project's SentencePiece layout
ROOT = Path(__file__).resolve().parents[2]


def epoch_batches(data_dir, task="causal_lm", **kw):
    return list(ShardLoader(LoaderPlan(str(data_dir), task, "train", **kw)))


@pytest.mark.parametrize(
    "sizes, num_workers",
    [(UNEVEN, 2), (UNEVEN, 0), ([5, 17, 2], 2)],
    ids=["uneven-2w", "uneven-0w", "few-shards-2w"],
)
def test_every_sample_once_across_ranks_and_workers(tmp_path, sizes, num_workers):
    make_dataset(tmp_path, packed=sizes)
    world, micro = 2, 4
    seen, counts = [], []
    for rank in range(world):
        loader = ShardLoader(
            LoaderPlan(
                str(tmp_path),
                "causal_lm",
                "train",
                micro_batch_size=micro,
                rank=rank,
                world_size=world,
                num_workers=num_workers,
                seed=3,
            )
        )
        batches = list(loader)
        assert all(b["input_ids"].shape == (micro, 8) for b in batches)
        counts.append(len(batches))
        assert len(batches) == len(loader)
        seen += [i for b in batches for i in batch_ids(b)]
        assert loader.stats["samples_dropped_remainder"] == sum(sizes) % (world * micro)
        assert loader.epoch == 1
    assert counts[0] == counts[1] == sum(sizes) // (world * micro)
    assert len(seen) == len(set(seen)) == sum(sizes) - sum(sizes) % (world * micro)
    assert set(seen) <= set(range(sum(sizes)))


@pytest.mark.filterwarnings("ignore:This DataLoader will create 3 worker processes")
def test_batches_do_not_depend_on_num_workers(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    kw = dict(task="mlm", micro_batch_size=3, rank=1, world_size=2, seed=5)
    assert_same_batches(
        epoch_batches(tmp_path, num_workers=0, **kw), epoch_batches(tmp_path, num_workers=3, **kw)
    )


def test_shuffle_is_seeded_by_seed_and_epoch(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)

    def order(**kw):
        return [i for b in epoch_batches(tmp_path, micro_batch_size=4, **kw) for i in batch_ids(b)]

    assert order(seed=1, epoch=2) == order(seed=1, epoch=2)
    assert order(seed=1, epoch=2) != order(seed=1, epoch=3)
    assert order(seed=1, epoch=2) != order(seed=2, epoch=2)

    # Iterating again serves the next epoch, as a loader built at that epoch would.
    loader = ShardLoader(
        LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4, seed=1, epoch=2)
    )
    list(loader)
    assert_same_batches(list(loader), epoch_batches(tmp_path, micro_batch_size=4, seed=1, epoch=3))


@pytest.mark.parametrize("task", ["mlm", "translation"])
def test_resume_yields_exactly_the_remaining_batches(tmp_path, task):
    make_dataset(tmp_path, packed=UNEVEN, translation=UNEVEN)
    kw = dict(micro_batch_size=3, rank=1, world_size=2, seed=7)
    uninterrupted = ShardLoader(LoaderPlan(str(tmp_path), task, "train", num_workers=2, **kw))
    full = list(uninterrupted) + list(uninterrupted)  # epochs 0 and 1

    interrupted = ShardLoader(LoaderPlan(str(tmp_path), task, "train", num_workers=2, **kw))
    taken = []
    for batch in interrupted:  # the workers have prefetched beyond this point
        taken.append(batch)
        if len(taken) == 5:
            break
    state = json.loads(json.dumps(interrupted.state_dict()))
    # 5 batches of 3 on each of 2 ranks
    assert state["epoch"] == 0 and state["samples_consumed"] == 5 * 3 * 2

    # Another process, another num_workers, another rank's copy of the state: the same batches.
    resumed = ShardLoader(LoaderPlan(str(tmp_path), task, "train", num_workers=0, **kw))
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert resumed.epoch == 1
    assert_same_batches(taken + rest + list(resumed), full)


def test_resume_at_epoch_end_starts_the_next_epoch(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    loader = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4))
    batches = iter(loader)
    for _ in range(len(loader)):
        next(batches)
    state = loader.state_dict()
    assert (state["epoch"], state["samples_consumed"]) == (1, 0)
    resumed = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4))
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), epoch_batches(tmp_path, micro_batch_size=4, epoch=1))


def test_resume_skips_shards_without_decoding_them(tmp_path, monkeypatch):
    manifest = make_dataset(tmp_path, packed=UNEVEN)
    opened = []
    read_shard = epoch_module.read_shard

    def counting_read(shard, fields, wanted):
        opened.append(os.path.relpath(shard.path, tmp_path))
        return read_shard(shard, fields, wanted)

    monkeypatch.setattr(epoch_module, "read_shard", counting_read)
    kw = dict(micro_batch_size=4, seed=11)
    full = epoch_batches(tmp_path, **kw)
    assert len(opened) == len(UNEVEN)
    start = len(full) - 3

    opened.clear()
    resumed = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", **kw))
    resumed.load_state_dict({**resumed.state_dict(), "samples_consumed": start * 4})
    rest = list(resumed)
    assert_same_batches(rest, full[start:])

    remaining = {i for b in rest for i in batch_ids(b)}
    needed = {path for path, ids in shard_ids(manifest).items() if ids & remaining}
    assert set(opened) == needed and len(opened) == len(needed) < len(UNEVEN)
    assert resumed.stats["samples_decoded"] == 3 * 4


CORRUPT_SIZES = [9, 14, 10, 12, 11, 13, 9, 16, 10]
UNREADABLE = (1, 2, 3, 4)  # shards skipped whole; shard 5 holds one sample with a bad token id


def make_corrupt_dataset(data_dir):
    sizes = CORRUPT_SIZES
    manifest = make_dataset(data_dir, packed=sizes)
    records = manifest["datasets"]["packed"]["splits"]["train"]["shards"]
    paths = [data_dir / r["path"] for r in records]
    # 1: cut short, manifest size stale; 2: cut short at a member boundary, manifest size updated
    # (so the tar reader must notice); 3: garbage over its middle; 4: gone; 5: a token id outside
    # the vocabulary.
    data = paths[1].read_bytes()
    paths[1].write_bytes(data[: len(data) // 2])
    data = paths[2].read_bytes()
    paths[2].write_bytes(data[: 512 * 7])
    records[2]["bytes"] = 512 * 7
    data = bytearray(paths[3].read_bytes())
    data[1024:3072] = np.random.default_rng(0).integers(0, 256, 2048, dtype=np.uint8).tobytes()
    paths[3].write_bytes(bytes(data))
    paths[4].unlink()
    first = sum(sizes[:5])
    ids = np.arange(FIRST_ID + first, FIRST_ID + first + sizes[5], dtype=np.int64)
    ids[3] = VOCAB_SIZE + 5
    records[5].update(
        write_shard(
            paths[5],
            [f"x_{i:08d}" for i in range(sizes[5])],
            [{"input_ids": np.full(8, v, dtype=np.int32)} for v in ids],
        )
    )
    records[5]["path"] = os.path.relpath(paths[5], data_dir)
    save_manifest(data_dir, manifest)
    good = set().union(
        *(
            ids
            for path, ids in shard_ids(manifest).items()
            if path not in {records[i]["path"] for i in UNREADABLE}
        )
    )
    return paths, good - {first + 3}


def test_corrupt_shards_are_skipped_and_ranks_stay_equal(tmp_path, caplog):
    sizes = CORRUPT_SIZES
    paths, good_ids = make_corrupt_dataset(tmp_path)
    skipped, fillers = set(), 0
    with caplog.at_level(logging.WARNING, logger="pipeline.load.loader"):
        for rank in range(2):
            loader = ShardLoader(
                LoaderPlan(
                    str(tmp_path),
                    "causal_lm",
                    "train",
                    micro_batch_size=4,
                    rank=rank,
                    world_size=2,
                    num_workers=2,
                )
            )
            batches = list(loader)
            assert len(batches) == len(loader) == sum(sizes) // 8
            # A filler repeats a readable batch of the epoch; every other batch is new.
            unique = {tuple(batch_ids(b)) for b in batches}
            assert len(unique) + loader.stats["filler_batches"] == len(batches)
            ids = [i for b in unique for i in b]
            assert len(ids) == len(set(ids)) and set(ids) <= good_ids
            skipped |= {s["path"] for s in loader.skipped_shards}
            assert loader.stats["shards_skipped"] == len(loader.skipped_shards)
            fillers += loader.stats["filler_batches"]
            # Fillers are spread over the epoch's good batches, not one batch repeated.
            repeated = [b for b in unique if sum(tuple(batch_ids(x)) == b for x in batches) > 1]
            assert max(sum(tuple(batch_ids(x)) == b for x in batches) for b in unique) <= 3
            assert loader.stats["filler_batches"] < 2 or len(repeated) > 1
    assert skipped == {str(paths[i]) for i in UNREADABLE}
    assert fillers > 0
    assert any("outside the vocabulary" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_repeats_the_same_fillers(tmp_path, rank):
    make_corrupt_dataset(tmp_path)
    kw = dict(micro_batch_size=4, rank=rank, world_size=2, seed=4)
    full = epoch_batches(tmp_path, **kw)
    for start in range(1, len(full)):
        resumed = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", **kw))
        resumed.load_state_dict({**resumed.state_dict(), "samples_consumed": start * 4 * 2})
        assert_same_batches(list(resumed), full[start:])


def test_all_shards_unreadable_is_a_clear_error(tmp_path):
    manifest = make_dataset(tmp_path, packed=[4, 4])
    for record in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        (tmp_path / record["path"]).write_bytes(b"not a tar" * 100)
    with pytest.raises(RuntimeError, match="none of the 2 batches is readable"):
        epoch_batches(tmp_path, micro_batch_size=4)


def test_mlm_masks_15_percent_80_10_10_and_never_special_tokens(tmp_path):
    make_dataset(tmp_path, packed=[64], seq_len=128)
    (batch,) = epoch_batches(tmp_path, task="mlm", micro_batch_size=64, seed=1)
    inputs, original, selected = (
        batch["input_ids"],
        batch["original_ids"],
        batch["masked_positions"],
    )
    assert torch.equal(inputs[~selected], original[~selected])  # only selected tokens change
    special = original < 6
    assert special.sum() > 500
    assert not (selected & special).any()
    assert torch.equal(inputs[special], original[special])
    rate = selected.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.02
    masked = (inputs == SP.mask) & selected
    kept = (inputs == original) & selected
    randomized = selected & ~masked & ~kept
    n = selected.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.05
    assert abs(randomized.sum().item() / n - 0.1) < 0.04
    assert abs(kept.sum().item() / n - 0.1) < 0.04
    assert (inputs[randomized] >= 6).all()
    assert torch.equal(batch["attention_mask"], torch.ones_like(inputs))


def test_causal_lm_collation_pads(tmp_path):
    manifest = make_dataset(tmp_path, packed=[2])
    record = manifest["datasets"]["packed"]["splits"]["train"]["shards"][0]
    rows = [{"input_ids": np.array([7, 8, 9], np.uint16)}, {"input_ids": np.array([10], np.uint16)}]
    record.update(write_shard(tmp_path / record["path"], ["a", "b"], rows))
    record["path"] = os.path.relpath(record["path"], tmp_path)
    save_manifest(tmp_path, manifest)
    (batch,) = epoch_batches(tmp_path, micro_batch_size=2)
    rows = sorted(range(2), key=lambda r: -int(batch["attention_mask"][r].sum()))
    assert batch["input_ids"][rows].tolist() == [[7, 8, 9], [10, SP.pad, SP.pad]]
    assert batch["attention_mask"][rows].tolist() == [[1, 1, 1], [1, 0, 0]]
    # labels are the task's (tests/launch/test_tasks.py)
    assert set(batch) == set(BATCH_FIELDS["causal_lm"])
    assert batch["input_ids"].dtype == torch.long


def test_translation_collation(tmp_path):
    manifest = make_dataset(tmp_path, translation=[2])
    record = manifest["datasets"]["translation"]["splits"]["train"]["shards"][0]
    pairs = [
        {"src_ids": np.array([10, 11, 12], np.uint16), "tgt_ids": np.array([20], np.uint16)},
        {"src_ids": np.array([13], np.uint16), "tgt_ids": np.array([21, 22, 23], np.uint16)},
    ]
    record.update(write_shard(tmp_path / record["path"], ["a", "b"], pairs))
    record["path"] = os.path.relpath(record["path"], tmp_path)
    save_manifest(tmp_path, manifest)
    (batch,) = epoch_batches(tmp_path, task="translation", micro_batch_size=2)
    rows = [0, 1] if batch["src_ids"][0, 0] == 10 else [1, 0]
    b = {key: value[rows].tolist() for key, value in batch.items()}
    assert b["src_ids"] == [[10, 11, 12, SP.eos], [13, SP.eos, SP.pad, SP.pad]]
    assert b["src_mask"] == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["tgt_ids"] == [[SP.bos, 20, SP.eos, SP.pad, SP.pad], [SP.bos, 21, 22, 23, SP.eos]]
    assert b["tgt_mask"] == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]
    assert set(batch) == set(BATCH_FIELDS["translation"])
    assert all(value.dtype == torch.long for value in batch.values())


def test_tokenizer_mismatch_and_missing_data_are_user_errors(tmp_path):
    make_dataset(tmp_path, packed=[8])
    cfg = LoaderConfig(data_dir=str(tmp_path), micro_batch_size=4, num_workers=0)
    ShardLoader(
        LoaderPlan.from_config(
            cfg,
            "causal_lm",
            "train",
            rank=0,
            world_size=1,
            expected_tokenizer_sha256=TOKENIZER_SHA256,
        )
    )
    with pytest.raises(UserError, match="tokenizer sha256"):
        ShardLoader(
            LoaderPlan.from_config(
                cfg, "causal_lm", "train", rank=0, world_size=1, expected_tokenizer_sha256="0" * 64
            )
        )
    with pytest.raises(UserError, match="manifest"):
        ShardLoader(LoaderPlan(str(tmp_path / "nowhere"), "causal_lm", "train", micro_batch_size=4))
    with pytest.raises(UserError, match="translation"):
        ShardLoader(LoaderPlan(str(tmp_path), "translation", "train", micro_batch_size=4))
    with pytest.raises(UserError, match="fewer than one global batch"):
        ShardLoader(
            LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=4)
        )


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            lambda shards: shards.append(dict(shards[1])),
            "packed/train/0000-0001.tar: listed 2 times in packed/train",
        ),
        (
            lambda shards: shards[2].update(samples=-3),
            "packed/train/0000-0002.tar: samples -3 in the manifest",
        ),
        (
            lambda shards: shards[0].update(samples=0),
            "packed/train/0000-0000.tar: samples 0 in the manifest",
        ),
    ],
    ids=["listed twice", "negative count", "zero count"],
)
def test_a_manifest_repeating_a_shard_or_counting_no_samples_in_one_is_refused(
    tmp_path, change, expected
):
    """A shard listed twice was read twice an epoch, one whose count is not positive dropped,
    both without a word: refused, in one line naming the shard, before any batch."""
    manifest = copy.deepcopy(make_dataset(tmp_path, packed=[8, 8, 8]))
    change(manifest["datasets"]["packed"]["splits"]["train"]["shards"])
    save_manifest(tmp_path, manifest)
    with pytest.raises(UserError) as err:
        ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4))
    assert str(err.value).startswith(f"{tmp_path}/manifest.json: {expected}") and "\n" not in str(
        err.value
    )


def test_state_from_another_plan_is_refused(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    state = ShardLoader(
        LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=2)
    ).state_dict()
    other = ShardLoader(
        LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=3)
    )
    with pytest.raises(UserError, match="global_batch_size: saved 8, now 12"):
        other.load_state_dict(state)


# Global batches: the samples of each optimizer step are fixed by the global batch alone.

SHAPES = [
    dict(world_size=2, grad_accum=1, micro_batch_size=4),
    dict(world_size=1, grad_accum=2, micro_batch_size=4),
    dict(world_size=4, grad_accum=1, micro_batch_size=2),
    dict(world_size=1, grad_accum=1, micro_batch_size=8),
    dict(world_size=2, grad_accum=2, micro_batch_size=2),
]


def steps_of(
    data_dir, task="causal_lm", *, world_size, grad_accum, micro_batch_size, state=None, **kw
):
    """The sample ids of each optimizer step, over all ranks: a list of sets."""
    per_rank = []
    for rank in range(world_size):
        loader = ShardLoader(
            LoaderPlan(
                str(data_dir),
                task,
                "train",
                micro_batch_size=micro_batch_size,
                grad_accum=grad_accum,
                rank=rank,
                world_size=world_size,
                **kw,
            )
        )
        if state is not None:
            loader.load_state_dict(state)
        per_rank.append([batch_ids(b) for b in loader])
    steps = len(per_rank[0]) // grad_accum
    return [
        {i for rank in per_rank for b in rank[s * grad_accum : (s + 1) * grad_accum] for i in b}
        for s in range(steps)
    ]


def test_the_samples_of_each_step_do_not_depend_on_world_size_or_accumulation(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    reference = steps_of(tmp_path, **SHAPES[0], seed=3, num_workers=2)
    assert len(reference) == sum(UNEVEN) // 8 and all(len(step) == 8 for step in reference)
    for shape in SHAPES[1:]:
        assert steps_of(tmp_path, **shape, seed=3) == reference, shape


def test_resume_on_another_world_size_continues_the_same_steps(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    uninterrupted = steps_of(tmp_path, **SHAPES[0], seed=9)
    for done in (1, 5, len(uninterrupted) - 1):
        two_ranks = [
            ShardLoader(
                LoaderPlan(
                    str(tmp_path),
                    "causal_lm",
                    "train",
                    micro_batch_size=4,
                    rank=r,
                    world_size=2,
                    seed=9,
                )
            )
            for r in range(2)
        ]
        for loader in two_ranks:
            for index, _ in enumerate(loader):
                if index + 1 == done:
                    break
        state = json.loads(json.dumps(two_ranks[0].state_dict()))
        assert state == two_ranks[1].state_dict() and state["samples_consumed"] == done * 8
        for shape in SHAPES[1:]:
            assert steps_of(tmp_path, **shape, seed=9, state=state) == uninterrupted[done:], (
                done,
                shape,
            )


def test_mlm_masks_follow_the_sample_not_the_rank(tmp_path):
    make_dataset(tmp_path, packed=[24, 17])

    def masks(**shape):
        out = {}
        for rank in range(shape["world_size"]):
            for batch in ShardLoader(
                LoaderPlan(str(tmp_path), "mlm", "train", rank=rank, seed=2, **shape)
            ):
                for row, sample in enumerate(batch_ids(batch)):
                    out[sample] = (
                        batch["input_ids"][row].tolist(),
                        batch["masked_positions"][row].tolist(),
                    )
        return out

    reference = masks(**SHAPES[0])
    assert len(reference) == 40 and any(any(m) for _, m in reference.values())
    assert masks(**SHAPES[1]) == reference and masks(**SHAPES[4]) == reference


def test_sample_keys_name_the_samples_of_the_last_batch(tmp_path):
    manifest = make_dataset(tmp_path, packed=[5, 7])
    loader = ShardLoader(
        LoaderPlan(str(tmp_path), "causal_lm", "train", micro_batch_size=4, seed=1)
    )
    by_path = {str(tmp_path / path): sorted(ids) for path, ids in shard_ids(manifest).items()}
    for batch in loader:
        keys = loader.sample_keys()
        assert [by_path[key.split("#")[0]][int(key.split("#")[1])] for key in keys] == batch_ids(
            batch
        )


def test_workers_send_numpy_ids_not_tensors(tmp_path):
    # A batch crosses from a worker as numpy arrays (pickled in one message); the main process makes
    # the tensors.
    make_dataset(tmp_path, packed=[8], translation=[8])
    for task, keys in [
        ("causal_lm", {"ids", "lengths"}),
        ("mlm", {"ids", "lengths", "original_ids", "masked_positions"}),
        ("translation", {"src_ids", "src_lengths", "tgt_ids", "tgt_lengths"}),
    ]:
        loader = ShardLoader(LoaderPlan(str(tmp_path), task, "train", micro_batch_size=4))
        _, packed, _ = loader._epoch_batches(0, 0).build(0)
        assert set(packed) == keys and all(
            isinstance(value, np.ndarray) for value in packed.values()
        )


# Length grouping (data.length_grouping; the module doc, 9).
GROUPED = [64, 40, 7, 64, 33]  # 208 pairs: shards that do not start on a batch boundary


def pair_lengths(batch: dict) -> list[int]:
    """Source + target tokens of each pair of a translation batch (no <s>/</s>/padding)."""
    return [
        int(s) - 1 + int(t) - 2 for s, t in zip(batch["src_mask"].sum(1), batch["tgt_mask"].sum(1))
    ]


def test_length_grouping_keeps_the_epoch_and_batches_pairs_of_one_length(tmp_path):
    make_dataset(tmp_path, translation=GROUPED)
    plain, grouped = ([], []), ([], [])
    for rank in range(2):
        for out, grouping in ((plain, False), (grouped, True)):
            for batch in ShardLoader(
                LoaderPlan(
                    str(tmp_path),
                    "translation",
                    "train",
                    micro_batch_size=4,
                    rank=rank,
                    world_size=2,
                    num_workers=2,
                    seed=3,
                    length_grouping=grouping,
                    length_bands=1,
                )
            ):
                out[0].append(batch_ids(batch))
                out[1].append(pair_lengths(batch))
    # The same samples, each once (208 // 8 = 26 steps of 8: all of them), in other batches.
    assert (
        sorted(i for ids in grouped[0] for i in ids)
        == sorted(i for ids in plain[0] for i in ids)
        == list(range(208))
    )
    assert grouped[0] != plain[0]

    def spread(lengths):
        return sum(max(b) - min(b) for b in lengths) / len(lengths)

    # Pairs of 2 to 16 tokens: random batches of 4 spread over ~7 tokens, grouped ones over ~1.
    assert spread(plain[1]) > 5 and spread(grouped[1]) < 0.35 * spread(plain[1])
    # Most batches hold pairs within 2 tokens of each other: those of a step's group, dealt to
    # its micro batches, span the group's few lengths; the steps that straddle two shards keep
    # their seeded order.
    spreads = sorted(max(b) - min(b) for b in grouped[1])
    assert (
        spreads[len(spreads) // 2] <= 2
        and spreads[len(spreads) // 2]
        < sorted(max(b) - min(b) for b in plain[1])[len(spreads) // 2]
    )


def test_length_grouping_steps_do_not_depend_on_world_size_and_resume_exactly(tmp_path):
    make_dataset(tmp_path, translation=GROUPED)
    kw = dict(task="translation", seed=5, length_grouping=True, length_bands=1)
    reference = steps_of(tmp_path, **SHAPES[0], num_workers=2, **kw)
    # A step's bands are fractions of a global batch: the steps are the same for any world size,
    # accumulation and micro batch that make it, with one band a step or more.
    for shape in SHAPES[1:]:
        assert steps_of(tmp_path, **shape, **kw) == reference
    two = {**kw, "length_bands": 2}
    two_bands = steps_of(tmp_path, **SHAPES[0], **two)
    assert two_bands != reference
    for shape in SHAPES[1:]:
        assert steps_of(tmp_path, **shape, **two) == two_bands
    two_ranks = [
        ShardLoader(
            LoaderPlan(
                str(tmp_path),
                "translation",
                "train",
                micro_batch_size=4,
                rank=r,
                world_size=2,
                num_workers=2,
                seed=5,
                length_grouping=True,
                length_bands=1,
            )
        )
        for r in range(2)
    ]
    for loader in two_ranks:
        for index, _ in enumerate(loader):
            if index + 1 == 9:
                break
    state = json.loads(json.dumps(two_ranks[0].state_dict()))
    assert state["fingerprint"]["length_grouping"] == "1 length band(s) a step, rounds dealt"
    assert steps_of(tmp_path, **SHAPES[1], state=state, **kw) == reference[9:]
    # Grouping on or off, or another number of bands, changes which samples share a step: a
    # resume across the change is refused.
    for grouping, bands, saved in (
        (False, 1, state),
        (True, 2, state),
        (
            True,
            1,
            ShardLoader(
                LoaderPlan(str(tmp_path), "translation", "train", micro_batch_size=4, world_size=2)
            ).state_dict(),
        ),
    ):
        other = ShardLoader(
            LoaderPlan(
                str(tmp_path),
                "translation",
                "train",
                micro_batch_size=4,
                world_size=2,
                seed=5,
                length_grouping=grouping,
                length_bands=bands,
            )
        )
        with pytest.raises(UserError, match="length_grouping: saved"):
            other.load_state_dict(saved)


def test_length_grouping_gives_every_rank_about_the_same_tokens_each_step(tmp_path):
    """Each round of a step is dealt to its micro batches in a snake, so the ranks of a step hold
    about the same tokens (they would wait for each other's longer batches otherwise), from one
    length band a step or two."""
    make_dataset(tmp_path, translation=GROUPED)
    for shape, bands in itertools.product((SHAPES[0], SHAPES[2], SHAPES[4]), (1, 2)):
        ratios = {}
        for grouping in (False, True):
            per_rank = []
            for rank in range(shape["world_size"]):
                loader = ShardLoader(
                    LoaderPlan(
                        str(tmp_path),
                        "translation",
                        "train",
                        rank=rank,
                        seed=3,
                        length_grouping=grouping,
                        length_bands=bands,
                        **shape,
                    )
                )
                per_rank.append([sum(pair_lengths(b)) for b in loader])
            a = shape["grad_accum"]
            steps = len(per_rank[0]) // a
            step_tokens = [
                [sum(rank[s * a : (s + 1) * a]) for rank in per_rank] for s in range(steps)
            ]
            ratios[grouping] = [max(t) / min(t) for t in step_tokens]
        # Steps that straddle two shards mix two groups; the others are balanced to a pair.
        balanced = sorted(ratios[True])[: len(ratios[True]) - len(GROUPED)]
        assert max(balanced) < 1.2, (shape, bands, ratios[True])
        # Better balanced than random batches, which only the law of large numbers evens out.
        excess = {k: sum(r - 1 for r in v) for k, v in ratios.items()}
        assert excess[True] < 0.5 * excess[False], (shape, bands, excess)


def test_more_length_bands_mix_more_lengths_a_step_and_a_round_keeps_one(tmp_path):
    """Two bands a step: a step's pairs span two places of the length order, where one band's
    span one; with two rounds a step (grad_accum 2) each round is one band, so each micro batch
    still holds pairs of about one length. A band count that does not divide the global batch is
    refused by name."""
    make_dataset(tmp_path, translation=GROUPED)
    spans = {}
    for bands in (1, 2):
        per_round, per_step = [], []
        for loader in [
            ShardLoader(
                LoaderPlan(
                    str(tmp_path),
                    "translation",
                    "train",
                    micro_batch_size=2,
                    grad_accum=2,
                    world_size=2,
                    rank=rank,
                    seed=3,
                    length_grouping=True,
                    length_bands=bands,
                )
            )
            for rank in range(2)
        ]:
            per_round.append([pair_lengths(b) for b in loader])
        rounds = [a + b for a, b in zip(*per_round)]  # both ranks' batch of each round
        per_step = [rounds[i] + rounds[i + 1] for i in range(0, len(rounds), 2)]

        def median_span(groups):
            return float(np.median([max(g) - min(g) for g in groups]))

        spans[bands] = median_span(rounds), median_span(per_step)
    assert spans[2][1] > 2 * max(spans[1][1], 1), spans  # a step mixes lengths
    assert spans[2][0] <= 2 and spans[1][0] <= 2, spans  # a round does not
    with pytest.raises(UserError, match="data.length_bands: 3 must be a positive divisor"):
        ShardLoader(
            LoaderPlan(
                str(tmp_path),
                "translation",
                "train",
                micro_batch_size=4,
                world_size=2,
                length_grouping=True,
                length_bands=3,
            )
        )


def test_a_process_that_exits_with_a_loader_still_open_ends(tiny_dataset):
    """A loader's workers ignore SIGTERM (a rank's stop request must not kill them mid-batch), so
    multiprocessing's exit handler, which terminates and then joins them, waited for ever on a
    loader nobody closed: the test process of a CI run hung at exit. Its flag is raised at exit
    now, and the workers end by themselves."""
    script = (
        "from pipeline.load.loader import ShardLoader\n"
        "from pipeline.load.plan import LoaderPlan\n"
        f"loader = ShardLoader(LoaderPlan({str(tiny_dataset)!r}, 'causal_lm', 'train', "
        "micro_batch_size=2, num_workers=1))\n"
        "batches = iter(loader)\nnext(batches)\nkept = [loader, batches]\nprint('exiting', flush=True)\n"
    )
    try:
        run = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        raise AssertionError(
            "the process still runs 60 s after its last line: its loader's workers were never ended"
        )
    assert run.returncode == 0 and run.stdout.strip() == "exiting", run.stderr[-2000:]
