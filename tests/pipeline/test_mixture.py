"""Weighted mixtures of a dataset's sources (`data.mixture`): shares, repetition and sub-sampling,
exact resume, refusal of changed weights, and tokens counted per source."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from common.configure import UserError
from pipeline.format import FIELDS, sample_key, shard_name
from pipeline.load.loader import ShardLoader
from pipeline.load.mixture import mixture_shares
from pipeline.load.plan import LoaderPlan
from pipeline.shard_tar import write_shard
from pipeline.specials import sentencepiece_specials
from tests.shardtools import FIRST_ID, TOKENIZER_SHA256, VOCAB_SIZE, save_manifest

SP = sentencepiece_specials()  # the project's SentencePiece layout

SEQ_LEN = 8


def make_sources(data_dir: Path, sources: dict[str, list[int]], seed: int = 0) -> dict[int, str]:
    """A packed train split whose shards belong to named sources (shard sizes per source, shards
    interleaved in the manifest); returns sample id -> source. A sample's id is its first token."""
    rng = np.random.default_rng(seed)
    records, owner, uid, part = [], {}, 0, 0
    longest = max(len(sizes) for sizes in sources.values())
    for i in range(longest):
        for name, sizes in sources.items():
            if i >= len(sizes):
                continue
            samples = []
            for _ in range(sizes[i]):
                ids = rng.integers(FIRST_ID + 1000, VOCAB_SIZE, size=SEQ_LEN)
                ids[rng.random(SEQ_LEN) < 0.1] = SP.eos
                ids[0] = FIRST_ID + uid + len(samples)
                sample = {"input_ids": ids.astype(np.uint16)}
                if "doc_starts" in FIELDS["packed"]:
                    sample["doc_starts"] = np.array([0], dtype=np.uint16)
                samples.append(sample)
            rel = shard_name("packed", "train", 0, part)
            record = write_shard(
                data_dir / rel, [sample_key(0, uid + k) for k in range(len(samples))], samples
            )
            record.update(path=rel, source=name)
            records.append(record)
            owner.update({uid + k: name for k in range(len(samples))})
            uid, part = uid + len(samples), part + 1
    save_manifest(
        data_dir,
        {
            "format_version": 1,
            "tokenizer": {
                "file": "tokenizer.model",
                "sha256": TOKENIZER_SHA256,
                "vocab_size": VOCAB_SIZE,
                "special_ids": [0, 1, 2, 3, 4, 5],
            },
            "datasets": {
                "packed": {
                    "fields": list(FIELDS["packed"]),
                    "splits": {"train": {"shards": records}},
                }
            },
        },
    )
    return owner


def ids_of(batch) -> list[int]:
    return (batch["input_ids"][:, 0] - FIRST_ID).tolist()


def loader(data_dir, mixture, **kw) -> ShardLoader:
    kw = {"micro_batch_size": 4, **kw}
    return ShardLoader(
        LoaderPlan(
            str(data_dir), "causal_lm", "train", mixture=mixture, seed=kw.pop("seed", 7), **kw
        )
    )


def test_shares_are_exact_and_add_up():
    assert mixture_shares({"a": 100, "b": 300}, {"a": 0.75, "b": 0.25}) == {"a": 300, "b": 100}
    shares = mixture_shares({"a": 7, "b": 5, "c": 1}, {"a": 1, "b": 1, "c": 1})
    assert sum(shares.values()) == 13 and max(shares.values()) - min(shares.values()) <= 1


def test_an_epoch_draws_the_weights_repeating_the_small_source_and_subsampling_the_large(tmp_path):
    # 100 and 300 samples
    owner = make_sources(tmp_path, {"small": [40, 60], "large": [100, 150, 50]})
    run = loader(tmp_path, {"small": 0.75, "large": 0.25})
    epochs = [[i for batch in run for i in ids_of(batch)] for _ in range(3)]
    for seen in epochs:
        assert len(seen) == 400  # micro batch 4 divides the 100 + 300 samples: nothing dropped
        share = Counter(owner[i] for i in seen)
        assert (
            abs(share["small"] / len(seen) - 0.75) < 0.01
            and abs(share["large"] / len(seen) - 0.25) < 0.01
        )
        small = Counter(i for i in seen if owner[i] == "small")
        # three whole passes over the small source
        assert len(small) == 100 and set(small.values()) == {3}
    large = [[i for i in seen if owner[i] == "large"] for seen in epochs]
    # Each epoch reads a new third of the large source: over three epochs, every sample once.
    assert sorted(i for part in large for i in part) == sorted(
        i for i in owner if owner[i] == "large"
    )
    # The two sources are interleaved through the epoch, not read one after the other.
    first_half = Counter(owner[i] for i in epochs[0][:200])
    assert 130 < first_half["small"] < 170


def test_the_measured_share_is_within_one_percent_when_batches_do_not_divide_the_epoch(tmp_path):
    owner = make_sources(tmp_path, {"a": [333, 101], "b": [97, 211, 58]})
    run = loader(tmp_path, {"a": 3, "b": 1}, micro_batch_size=7)
    seen = [i for batch in run for i in ids_of(batch)]
    share = Counter(owner[i] for i in seen)
    assert abs(share["a"] / len(seen) - 0.75) < 0.01


@pytest.mark.parametrize("num_workers", [0, 1])
def test_resume_mid_epoch_continues_the_same_sequence(tmp_path, num_workers):
    make_sources(tmp_path, {"small": [40, 60], "large": [100, 150, 50]})
    mixture = {"small": 0.6, "large": 0.4}
    whole = loader(tmp_path, mixture, grad_accum=2, world_size=2, rank=1)
    reference = [ids_of(b) for _ in range(2) for b in whole]
    first = loader(tmp_path, mixture, grad_accum=2, world_size=2, rank=1)
    iterator = iter(first)
    head = [ids_of(next(iterator)) for _ in range(30)]
    state = first.state_dict()
    resumed = loader(tmp_path, mixture, grad_accum=2, world_size=2, rank=1, num_workers=num_workers)
    resumed.load_state_dict(state)
    tail = [ids_of(b) for b in resumed] + [ids_of(b) for b in resumed]
    resumed.close()
    assert head + tail[: len(reference) - 30] == reference


def test_the_samples_of_a_step_do_not_depend_on_the_world_size(tmp_path):
    make_sources(tmp_path, {"a": [50, 30], "b": [70]})
    mixture = {"a": 1, "b": 2}

    def steps(world_size, grad_accum, micro):
        loaders = [
            loader(
                tmp_path,
                mixture,
                world_size=world_size,
                grad_accum=grad_accum,
                micro_batch_size=micro,
                rank=r,
            )
            for r in range(world_size)
        ]
        assert len({len(x) for x in loaders}) == 1  # every rank the same number of batches
        per_rank = [[ids_of(b) for b in x] for x in loaders]
        n = len(per_rank[0]) // grad_accum
        return [
            sorted(
                i
                for r in range(world_size)
                for b in per_rank[r][s * grad_accum : (s + 1) * grad_accum]
                for i in b
            )
            for s in range(n)
        ]

    assert steps(1, 4, 6) == steps(2, 2, 6) == steps(4, 1, 6)


def test_changed_weights_are_refused_on_resume_unless_allowed(tmp_path, caplog):
    make_sources(tmp_path, {"a": [50, 30], "b": [70]})
    first = loader(tmp_path, {"a": 0.5, "b": 0.5})
    iterator = iter(first)
    for _ in range(10):
        next(iterator)
    state = first.state_dict()
    with pytest.raises(UserError, match="allow_mixture_change"):
        loader(tmp_path, {"a": 0.9, "b": 0.1}).load_state_dict(state)
    with pytest.raises(UserError, match="allow_mixture_change"):
        loader(tmp_path, {}).load_state_dict(state)
    changed = loader(tmp_path, {"a": 0.9, "b": 0.1}, allow_mixture_change=True)
    with caplog.at_level(logging.WARNING, logger="pipeline.load.loader"):
        changed.load_state_dict(state)
    assert "data.mixture changed on resume" in caplog.text
    reference = loader(tmp_path, {"a": 0.9, "b": 0.1})
    expected = [ids_of(b) for b in reference][10:]
    # the new weights' sequence, from the same position
    assert [ids_of(b) for b in changed] == expected


def test_tokens_are_counted_per_source(tmp_path):
    owner = make_sources(tmp_path, {"a": [50, 30], "b": [70]})
    run = loader(tmp_path, {"a": 0.25, "b": 0.75}, num_workers=1)
    counted = Counter()
    for batch in run:
        counted.update(owner[i] for i in ids_of(batch))
    run.close()
    assert run.stats["tokens_by_source"] == {name: n * SEQ_LEN for name, n in counted.items()}


def test_unmixed_counts_tokens_under_the_datasets_one_source(tmp_path):
    make_sources(tmp_path, {"only": [20, 12]})
    run = loader(tmp_path, {})
    assert sum(len(ids_of(b)) for b in run) == 32
    assert run.stats["tokens_by_source"] == {"only": 32 * SEQ_LEN}


@pytest.mark.parametrize(
    "mixture, message",
    [
        ({"a": 1, "nope": 1}, "no source 'nope'"),
        ({"a": 1, "b": 0}, r"data.mixture.b: a weight must be a positive number"),
        ({"a": -1}, r"data.mixture.a: a weight must be a positive number"),
    ],
)
def test_bad_mixtures_are_one_line_errors(tmp_path, mixture, message):
    make_sources(tmp_path, {"a": [10], "b": [10]})
    with pytest.raises(UserError, match=message):
        loader(tmp_path, mixture)


# ----------------------------------------------------------------------------- the trainer


def tagged_copy(dataset: Path, out: Path) -> Path:
    """The prepared tiny dataset with its train shards split between two sources, a and b."""
    import json
    import shutil

    shutil.copytree(dataset, out)
    manifest = json.loads((out / "manifest.json").read_text())
    for split in manifest["datasets"]["packed"]["splits"].values():
        for i, shard in enumerate(split["shards"]):
            shard["source"] = "ab"[i % 2]
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


@pytest.mark.slow
def test_the_trainer_logs_and_checkpoints_tokens_per_source_and_resumes_exactly(
    tiny_dataset, tmp_path
):
    import json

    from trainruns import metrics, train

    data = tagged_copy(tiny_dataset, tmp_path / "data")
    common = [
        "max_steps=6",
        "log_every=3",
        "eval_every=0",
        "checkpoint.every_steps=3",
        "data.mixture.a=0.75",
        "data.mixture.b=0.25",
        "data.micro_batch_size=2",
    ]
    straight = tmp_path / "straight"
    run = train("tiny_gpt.yaml", data, straight, *common)
    assert "mixture: a 0.750" in run.stderr
    rows = [r for r in metrics(straight) if "data/tokens/a" in r]
    a, b = rows[-1]["data/tokens/a"], rows[-1]["data/tokens/b"]
    # steps x micro batch x ranks x seq_len: every token counted once
    assert a + b == 6 * 2 * 2 * 32
    assert 0.5 < a / (a + b) < 0.95
    saved = json.loads(
        (straight / "checkpoints" / "step_00000006" / "client_state.json").read_text()
    )
    assert saved["tokens_by_source"] == {"a": a, "b": b}

    # The uninterrupted run's step-3 checkpoint resumed in another run_dir: the resume under test,
    # with one 2-rank job less than stopping a second run at step 3.
    stopped = tmp_path / "stopped"
    step_3 = straight / "checkpoints" / "step_00000003"
    run = train("tiny_gpt.yaml", data, stopped, *common, f"resume={step_3}")
    assert f"resumed from {step_3}" in run.stderr
    resumed = metrics(stopped)
    assert [r["step"] for r in resumed if "train/loss" in r] == [6]  # steps 4-6, logged every 3
    assert [r["train/loss"] for r in resumed if "train/loss" in r] == [
        r["train/loss"] for r in metrics(straight) if "train/loss" in r and r["step"] > 3
    ]
    assert resumed[-1]["data/tokens/a"] == a and resumed[-1]["data/tokens/b"] == b

    with pytest.raises(AssertionError, match="allow_mixture_change"):
        train(
            "tiny_gpt.yaml",
            data,
            stopped,
            *common[:4],
            "data.micro_batch_size=2",
            "data.mixture.a=0.5",
            "data.mixture.b=0.5",
            "max_steps=9",
        )
