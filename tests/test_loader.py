"""The streaming loader: every sample once per epoch over ranks x workers, equal batch counts,
seeded order, exact resume without decoding what was already seen, corrupt shards, collation."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from pipeline import loader as loader_module
from pipeline.config import LoaderConfig
from pipeline.configure import UserError
from pipeline.format import BOS_ID, EOS_ID, MASK_ID, PAD_ID, write_shard
from pipeline.loader import ShardLoader
from tests.shardtools import (
    FIRST_ID,
    TOKENIZER_SHA256,
    VOCAB_SIZE,
    batch_ids,
    make_dataset,
    save_manifest,
    shard_ids,
)

UNEVEN = [1, 40, 7, 23, 3, 31, 12]  # 117 samples in 7 shards: not a multiple of 2 ranks x 2 workers


def epoch_batches(data_dir, kind="causal_lm", **kw):
    return list(ShardLoader(str(data_dir), kind, "train", **kw))


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key


@pytest.mark.parametrize(
    "sizes, num_workers", [(UNEVEN, 2), (UNEVEN, 0), ([5, 17, 2], 2)], ids=["uneven-2w", "uneven-0w", "few-shards-2w"]
)
def test_every_sample_once_across_ranks_and_workers(tmp_path, sizes, num_workers):
    make_dataset(tmp_path, packed=sizes)
    world, micro = 2, 4
    seen, counts = [], []
    for rank in range(world):
        loader = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=micro, rank=rank,
                             world_size=world, num_workers=num_workers, seed=3)
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
    kw = dict(kind="mlm", micro_batch_size=3, rank=1, world_size=2, seed=5)
    assert_same_batches(epoch_batches(tmp_path, num_workers=0, **kw), epoch_batches(tmp_path, num_workers=3, **kw))


def test_shuffle_is_seeded_by_seed_and_epoch(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)

    def order(**kw):
        return [i for b in epoch_batches(tmp_path, micro_batch_size=4, **kw) for i in batch_ids(b)]

    assert order(seed=1, epoch=2) == order(seed=1, epoch=2)
    assert order(seed=1, epoch=2) != order(seed=1, epoch=3)
    assert order(seed=1, epoch=2) != order(seed=2, epoch=2)

    # Iterating again serves the next epoch, as a loader built at that epoch would.
    loader = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4, seed=1, epoch=2)
    list(loader)
    assert_same_batches(list(loader), epoch_batches(tmp_path, micro_batch_size=4, seed=1, epoch=3))


@pytest.mark.parametrize("kind", ["mlm", "translation"])
def test_resume_yields_exactly_the_remaining_batches(tmp_path, kind):
    make_dataset(tmp_path, packed=UNEVEN, translation=UNEVEN)
    kw = dict(micro_batch_size=3, rank=1, world_size=2, seed=7)
    uninterrupted = ShardLoader(str(tmp_path), kind, "train", num_workers=2, **kw)
    full = list(uninterrupted) + list(uninterrupted)  # epochs 0 and 1

    interrupted = ShardLoader(str(tmp_path), kind, "train", num_workers=2, **kw)
    taken = []
    for batch in interrupted:  # the workers have prefetched beyond this point
        taken.append(batch)
        if len(taken) == 5:
            break
    state = json.loads(json.dumps(interrupted.state_dict()))
    assert state["epoch"] == 0 and state["batches_consumed"] == 5

    # Another process, another num_workers, another rank's copy of the state: the same batches.
    resumed = ShardLoader(str(tmp_path), kind, "train", num_workers=0, **kw)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert resumed.epoch == 1
    assert_same_batches(taken + rest + list(resumed), full)


def test_resume_at_epoch_end_starts_the_next_epoch(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    loader = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4)
    batches = iter(loader)
    for _ in range(len(loader)):
        next(batches)
    state = loader.state_dict()
    assert (state["epoch"], state["batches_consumed"]) == (1, 0)
    resumed = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4)
    resumed.load_state_dict(state)
    assert_same_batches(list(resumed), epoch_batches(tmp_path, micro_batch_size=4, epoch=1))


def test_resume_skips_shards_without_decoding_them(tmp_path, monkeypatch):
    manifest = make_dataset(tmp_path, packed=UNEVEN)
    opened = []
    read_shard = loader_module._read_shard

    def counting_read(shard, fields, wanted):
        opened.append(os.path.relpath(shard.path, tmp_path))
        return read_shard(shard, fields, wanted)

    monkeypatch.setattr(loader_module, "_read_shard", counting_read)
    kw = dict(micro_batch_size=4, seed=11)
    full = epoch_batches(tmp_path, **kw)
    assert len(opened) == len(UNEVEN)
    start = len(full) - 3

    opened.clear()
    resumed = ShardLoader(str(tmp_path), "causal_lm", "train", **kw)
    resumed.load_state_dict({**resumed.state_dict(), "batches_consumed": start})
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
    # (so the tar reader must notice); 3: garbage over its middle; 4: gone; 5: a token id outside the vocabulary.
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
    records[5].update(write_shard(paths[5], [f"x_{i:08d}" for i in range(sizes[5])],
                                  [{"input_ids": np.full(8, v, dtype=np.int32)} for v in ids]))
    records[5]["path"] = os.path.relpath(paths[5], data_dir)
    save_manifest(data_dir, manifest)
    good = set().union(*(ids for path, ids in shard_ids(manifest).items()
                         if path not in {records[i]["path"] for i in UNREADABLE}))
    return paths, good - {first + 3}


def test_corrupt_shards_are_skipped_and_ranks_stay_equal(tmp_path, caplog):
    sizes = CORRUPT_SIZES
    paths, good_ids = make_corrupt_dataset(tmp_path)
    skipped, fillers = set(), 0
    with caplog.at_level(logging.WARNING, logger="pipeline.loader"):
        for rank in range(2):
            loader = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4, rank=rank, world_size=2,
                                 num_workers=2)
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
    assert skipped == {str(paths[i]) for i in UNREADABLE}
    assert fillers > 0
    assert any("outside the vocabulary" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("rank", [0, 1])
def test_resume_repeats_the_same_fillers(tmp_path, rank):
    make_corrupt_dataset(tmp_path)
    kw = dict(micro_batch_size=4, rank=rank, world_size=2, seed=4)
    full = epoch_batches(tmp_path, **kw)
    for start in range(1, len(full)):
        resumed = ShardLoader(str(tmp_path), "causal_lm", "train", **kw)
        resumed.load_state_dict({**resumed.state_dict(), "batches_consumed": start})
        assert_same_batches(list(resumed), full[start:])


def test_all_shards_unreadable_is_a_clear_error(tmp_path):
    manifest = make_dataset(tmp_path, packed=[4, 4])
    for record in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        (tmp_path / record["path"]).write_bytes(b"not a tar" * 100)
    with pytest.raises(RuntimeError, match="none of the 2 batches is readable"):
        epoch_batches(tmp_path, micro_batch_size=4)


def test_mlm_masks_15_percent_80_10_10_and_never_special_tokens(tmp_path):
    make_dataset(tmp_path, packed=[64], seq_len=128)
    (batch,) = epoch_batches(tmp_path, kind="mlm", micro_batch_size=64, seed=1)
    labels, inputs = batch["labels"], batch["input_ids"]
    original = inputs.where(labels == -100, labels)
    special = original < 6
    selected = labels != -100
    assert special.sum() > 500
    assert not (selected & special).any()
    assert torch.equal(inputs[special], original[special])
    rate = selected.sum().item() / (~special).sum().item()
    assert abs(rate - 0.15) < 0.02
    masked = (inputs == MASK_ID) & selected
    kept = (inputs == original) & selected
    randomized = selected & ~masked & ~kept
    n = selected.sum().item()
    assert abs(masked.sum().item() / n - 0.8) < 0.05
    assert abs(randomized.sum().item() / n - 0.1) < 0.04
    assert abs(kept.sum().item() / n - 0.1) < 0.04
    assert (inputs[randomized] >= 6).all()
    assert torch.equal(batch["attention_mask"], torch.ones_like(inputs))


def test_causal_lm_collation_pads_and_ignores_padding(tmp_path):
    manifest = make_dataset(tmp_path, packed=[2])
    record = manifest["datasets"]["packed"]["splits"]["train"]["shards"][0]
    rows = [{"input_ids": np.array([7, 8, 9], np.uint16)}, {"input_ids": np.array([10], np.uint16)}]
    record.update(write_shard(tmp_path / record["path"], ["a", "b"], rows))
    record["path"] = os.path.relpath(record["path"], tmp_path)
    save_manifest(tmp_path, manifest)
    (batch,) = epoch_batches(tmp_path, micro_batch_size=2)
    rows = sorted(range(2), key=lambda r: -int(batch["attention_mask"][r].sum()))
    assert batch["input_ids"][rows].tolist() == [[7, 8, 9], [10, PAD_ID, PAD_ID]]
    assert batch["attention_mask"][rows].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["labels"][rows].tolist() == [[7, 8, 9], [10, -100, -100]]
    assert batch["input_ids"].dtype == torch.long


def test_translation_collation(tmp_path):
    manifest = make_dataset(tmp_path, translation=[2])
    record = manifest["datasets"]["translation"]["splits"]["train"]["shards"][0]
    pairs = [{"src_ids": np.array([10, 11, 12], np.uint16), "tgt_ids": np.array([20], np.uint16)},
             {"src_ids": np.array([13], np.uint16), "tgt_ids": np.array([21, 22, 23], np.uint16)}]
    record.update(write_shard(tmp_path / record["path"], ["a", "b"], pairs))
    record["path"] = os.path.relpath(record["path"], tmp_path)
    save_manifest(tmp_path, manifest)
    (batch,) = epoch_batches(tmp_path, kind="translation", micro_batch_size=2)
    rows = [0, 1] if batch["src_ids"][0, 0] == 10 else [1, 0]
    b = {key: value[rows].tolist() for key, value in batch.items()}
    assert b["src_ids"] == [[10, 11, 12, EOS_ID], [13, EOS_ID, PAD_ID, PAD_ID]]
    assert b["src_mask"] == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert b["decoder_input_ids"] == [[BOS_ID, 20, PAD_ID, PAD_ID], [BOS_ID, 21, 22, 23]]
    assert b["decoder_mask"] == [[1, 1, 0, 0], [1, 1, 1, 1]]
    assert b["labels"] == [[20, EOS_ID, -100, -100], [21, 22, 23, EOS_ID]]
    assert all(value.dtype == torch.long for value in batch.values())


def test_tokenizer_mismatch_and_missing_data_are_user_errors(tmp_path):
    make_dataset(tmp_path, packed=[8])
    cfg = LoaderConfig(data_dir=str(tmp_path), micro_batch_size=4, num_workers=0)
    ShardLoader.from_config(cfg, "causal_lm", "train", rank=0, world_size=1, expected_tokenizer_sha256=TOKENIZER_SHA256)
    with pytest.raises(UserError, match="tokenizer sha256"):
        ShardLoader.from_config(cfg, "causal_lm", "train", rank=0, world_size=1, expected_tokenizer_sha256="0" * 64)
    with pytest.raises(UserError, match="manifest"):
        ShardLoader(str(tmp_path / "nowhere"), "causal_lm", "train", micro_batch_size=4)
    with pytest.raises(UserError, match="translation"):
        ShardLoader(str(tmp_path), "translation", "train", micro_batch_size=4)
    with pytest.raises(UserError, match="fewer than one global batch"):
        ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=4)


def test_state_from_another_plan_is_refused(tmp_path):
    make_dataset(tmp_path, packed=UNEVEN)
    state = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=2).state_dict()
    other = ShardLoader(str(tmp_path), "causal_lm", "train", micro_batch_size=4, world_size=3)
    with pytest.raises(UserError, match="world_size: saved 2, now 3"):
        other.load_state_dict(state)


# The shard reader: a scan of the tar headers serves well-formed shards; webdataset's reader (over
# Python's tarfile) is the reference, and must be asked for anything the scan does not vouch for.

REAL_DATA = Path(__file__).resolve().parent.parent / "data" / "gettext-en-de"


def shards_of(data_dir, dataset, split="train", *, check_size=True):
    records = json.loads((Path(data_dir) / "manifest.json").read_text())["datasets"][dataset]["splits"][split]["shards"]
    return [loader_module._Shard(i, str(Path(data_dir) / r["path"]), r["samples"], r["bytes"] if check_size else None)
            for i, r in enumerate(records)]


def read_both(shard, fields):
    """What `_read_shard` and the reference reader make of all of `shard`: the members, or the error message."""
    answers = []
    for read in (loader_module._read_shard, loader_module._read_shard_with_webdataset):
        try:
            answers.append(read(shard, fields, set(range(shard.samples))))
        except loader_module._ShardError as err:
            answers.append(str(err))
    return answers


def test_tar_scan_reads_written_shards_as_webdataset_does(tmp_path):
    make_dataset(tmp_path, packed=[1, 40], translation=[30])
    cases = [(shard, ("input_ids",)) for shard in shards_of(tmp_path, "packed")]
    cases += [(shard, ("src_ids", "tgt_ids")) for shard in shards_of(tmp_path, "translation")]
    if (REAL_DATA / "manifest.json").is_file():  # the prepared dataset, when this checkout has it
        cases += [(shard, ("input_ids",)) for shard in shards_of(REAL_DATA, "packed", "valid")[:3]]
        cases += [(shard, ("src_ids", "tgt_ids")) for shard in shards_of(REAL_DATA, "translation", "valid")[:3]]
    for shard, fields in cases:
        scanned = loader_module._scan_tar(Path(shard.path).read_bytes(), fields)
        assert scanned is not None and len(scanned) == shard.samples  # served by the scan, not the fallback
        fast, reference = read_both(shard, fields)
        assert isinstance(fast, dict) and fast == reference and len(fast) == shard.samples


def rewrite_header(data: bytearray, offset: int, start: int, value: bytes) -> None:
    """Put `value` at `start` in the tar header at `offset` and fix its checksum, as a writer would."""
    data[offset + start : offset + start + len(value)] = value
    data[offset + 148 : offset + 156] = b" " * 8
    data[offset + 148 : offset + 156] = b"%06o\0 " % sum(data[offset : offset + 512])


def test_tar_scan_leaves_damaged_or_unusual_shards_to_webdataset(tmp_path):
    import tarfile

    make_dataset(tmp_path, translation=[4])
    (shard,) = shards_of(tmp_path, "translation", check_size=False)  # the tar readers decide, not the size check
    fields = ("src_ids", "tgt_ids")
    good = Path(shard.path).read_bytes()
    with tarfile.open(shard.path) as tar:
        headers = [member.offset for member in tar.getmembers()]
    end = headers[-1] + 1024  # the end-of-archive block: each member here is one header and one data block

    def verdict(data: bytes):
        Path(shard.path).write_bytes(data)
        fast, reference = read_both(shard, fields)
        assert fast == reference  # the same members, or the same error message
        return loader_module._scan_tar(data, fields), fast

    # Cut short anywhere before the end-of-archive block: rejected, by the reference reader's verdict.
    for cut in sorted({*range(0, end, 512), *range(100, end, 512), end - 1}):
        scanned, answer = verdict(good[:cut])
        assert scanned is None and isinstance(answer, str), cut
    # Cut just before it: every member is whole and tarfile takes the end of the file for the end.
    scanned, answer = verdict(good[:end])
    assert scanned is None and isinstance(answer, dict)
    # Cut only in the zero padding after it: whole, and read by the scan.
    scanned, answer = verdict(good[: end + 512])
    assert scanned is not None and isinstance(answer, dict)

    # A byte changed in a header (checksum left as it was), at the first member or a later one.
    for header in (headers[0], headers[3]):
        for start in (0, 20, 100, 124, 135, 148, 156, 257, 345):
            data = bytearray(good)
            data[header + start] ^= 0x41
            scanned, answer = verdict(bytes(data))
            assert scanned is None and isinstance(answer, str), (header, start)

    # Headers that are valid but not what the scan reads itself: other member types, names it does
    # not split, a ustar name prefix, numbers in forms it leaves to tarfile.
    name = good[headers[2] : headers[2] + 100].split(b"\0")[0]  # "<key>.src_ids.npy"
    unusual = [(156, b"5"), (156, b"2"), (156, b"x"), (0, b"noext\0"), (345, b"dir\0"),
               (124, b"\x80" + bytes(10) + b"\x01"), (100, b"07 7\0"), (100, b"0000644\n")]
    for start, value in unusual:
        data = bytearray(good)
        rewrite_header(data, headers[2], start, value)
        scanned, _ = verdict(bytes(data))
        assert scanned is None, value

    # Both members of a sample moved under "__meta__/", which webdataset skips as metadata: a sample short.
    data = bytearray(good)
    for header in headers[2:4]:
        rewrite_header(data, header, 0, b"__meta__/" + good[header : header + 100].split(b"\0")[0])
    scanned, answer = verdict(bytes(data))
    assert scanned is None and answer == "3 samples, the manifest says 4"

    # A first sample whose key Python's stream reader takes for the magic number of a bzip2 stream.
    data = bytearray(good)
    for header in headers[:2]:
        suffix = good[header : header + 100].split(b"\0")[0].split(b".", 1)[1]
        rewrite_header(data, header, 0, b"BZh91AY&SY." + suffix + b"\0")
    scanned, answer = verdict(bytes(data))
    assert scanned is None and answer.startswith("unreadable: ReadError")

    # What both readers take as it is: an upper-case suffix (webdataset lowercases it), numbers padded with spaces.
    for start, value in [(0, name.upper()),
                         (124, b" " + good[headers[2] + 125 : headers[2] + 135] + b" ")]:
        data = bytearray(good)
        rewrite_header(data, headers[2], start, value)
        scanned, answer = verdict(bytes(data))
        assert scanned is not None and isinstance(answer, dict), value


def test_workers_send_numpy_ids_not_tensors(tmp_path):
    # A batch crosses from a worker as numpy arrays (pickled in one message); the main process makes the tensors.
    make_dataset(tmp_path, packed=[8], translation=[8])
    for kind, keys in [("causal_lm", {"ids", "lengths"}), ("mlm", {"ids", "lengths", "labels"}),
                       ("translation", {"src", "src_lengths", "tgt", "tgt_lengths"})]:
        loader = ShardLoader(str(tmp_path), kind, "train", micro_batch_size=4)
        _, packed, _ = loader._epoch_batches(0, 0).build(0)
        assert set(packed) == keys and all(isinstance(value, np.ndarray) for value in packed.values())
