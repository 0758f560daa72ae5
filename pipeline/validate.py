"""`python -m pipeline.validate [CONFIG.yaml] data_dir=DIR`: re-check a prepared dataset
against its manifest.

Every split must list each shard once with a positive sample count (`pipeline.format`'s rule,
which the loader enforces); every shard must exist with the recorded size and sha256, read as
a WebDataset with the recorded sample and token counts and the dataset's fields, every token
id inside its side's tokenizer's vocabulary, and each tokenizer file must match its recorded hash
and its id range (highest id + 1) the recorded vocabulary (`pipeline.format.vocabulary_problem`).
Each problem is printed on its own line; any problem exits 1.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from omegaconf import MISSING

from common.configure import UserError, parse_cli, run_main
from common.hashing import file_sha256
from common.progress import meter
from pipeline.format import (
    FIELDS,
    SIDES,
    decode_array,
    field_vocab,
    has_target_tokenizer,
    is_token_field,
    read_manifest,
    shard_list_problems,
    tokenizer_files,
    tokenizer_record,
    vocabulary_problem,
)

USAGE = """usage: python -m pipeline.validate [CONFIG.yaml] data_dir=DIR

Re-check a prepared dataset's shards and tokenizer against its manifest; exit 1 on any problem."""


@dataclass
class ValidateConfig:
    """The keys of `python -m pipeline.validate`."""

    data_dir: str = MISSING  # a dataset written by pipeline.prepare (its output_dir)


def _count_samples(
    path: Path, fields: tuple[str, ...], vocab: Mapping[str, int]
) -> tuple[int, int, list[str]]:
    """(samples, tokens, why each sample with token ids outside its field's vocabulary (`vocab`,
    `pipeline.format.field_vocab`) is one) of a shard read with WebDataset; raises on a malformed
    sample."""
    import webdataset as wds

    samples = tokens = 0
    outside = []
    expected = {f"{name}.npy" for name in fields}
    for sample in wds.WebDataset(str(path), shardshuffle=False, empty_check=False):
        present = {k for k in sample if not k.startswith("__")}
        if present != expected:
            raise ValueError(
                f"sample {sample['__key__']} has {sorted(present)}, expected {sorted(expected)}"
            )
        samples += 1
        for name in filter(is_token_field, fields):
            ids = decode_array(sample[f"{name}.npy"])
            tokens += int(ids.size)
            if ids.size and (ids.min() < 0 or ids.max() >= vocab[name]):
                outside.append(f"sample {sample['__key__']} ({name}: [{ids.min()}, {ids.max()}])")
    return samples, tokens, outside


def validate(data_dir: str | Path) -> list[str]:
    """The list of problems found (empty when the dataset is intact)."""
    data_dir = Path(data_dir)
    manifest = read_manifest(data_dir)
    problems = []
    for side in SIDES[: 1 + has_target_tokenizer(manifest)]:
        tokenizer = data_dir / tokenizer_files(manifest, side)[0]
        if not tokenizer.is_file():
            problems.append(f"{tokenizer}: missing")
        elif file_sha256(tokenizer) != tokenizer_record(manifest, side)["sha256"]:
            problems.append(f"{tokenizer}: sha256 differs from the manifest")
    if problem := vocabulary_problem(data_dir, manifest):
        problems.append(problem)
    listed = sum(
        len(entry["shards"])
        for dataset in manifest["datasets"].values()
        for entry in dataset["splits"].values()
        if isinstance(entry.get("shards"), list)
    )
    with meter(listed, "validate", "shard") as shown:
        for name, dataset in manifest["datasets"].items():
            for split, entry in dataset["splits"].items():
                problems += _check_split(
                    data_dir,
                    name,
                    split,
                    dataset,
                    entry,
                    field_vocab(manifest),
                    shown,
                )
    return problems


def _check_split(
    data_dir: Path,
    name: str,
    split: str,
    dataset: dict,
    entry: dict,
    vocab: Mapping[str, int],
    shown,
) -> list[str]:
    """The problems of one split's listing and shards; `shown` advances by each listed shard."""
    listing = shard_list_problems(entry["shards"], f"{name}/{split}")
    problems = list(listing)
    # A repeat or a bad count also breaks the total: the cause is the line to read.
    if not listing and entry["samples"] != sum(s["samples"] for s in entry["shards"]):
        problems.append(f"{name}/{split}: split total differs from the sum over its shards")
    checked = set()
    for shard in entry["shards"]:
        if (
            isinstance(shard, dict)
            and isinstance(shard.get("path"), str)
            and shard["path"] not in checked
        ):
            checked.add(shard["path"])  # else reported above; a shard listed twice is checked once
            problems += _check_shard(
                data_dir / shard["path"],
                shard,
                tuple(dataset.get("fields", FIELDS[name])),
                vocab,
            )
        shown.update()
    return problems


def _check_shard(
    path: Path, shard: dict, fields: tuple[str, ...], vocab: Mapping[str, int]
) -> list[str]:
    """The problems of one shard against its manifest entry."""
    if not path.is_file():
        return [f"{shard['path']}: missing"]
    problems = []
    if path.stat().st_size != shard["bytes"]:
        problems.append(
            f"{shard['path']}: {path.stat().st_size} bytes, manifest says {shard['bytes']}"
        )
    if file_sha256(path) != shard["sha256"]:
        problems.append(f"{shard['path']}: sha256 differs from the manifest")
    try:
        samples, tokens, outside = _count_samples(path, fields, vocab)
    except Exception as err:  # any decoding failure is a finding, not a crash
        return problems + [f"{shard['path']}: unreadable: {str(err).splitlines()[0]}"]
    if outside:
        problems.append(
            f"{shard['path']}: {len(outside)} sample{'s hold' if len(outside) > 1 else ' holds'} "
            f"token ids outside the vocabulary of {_vocab_text(fields, vocab)}: "
            f"{', '.join(outside[:3])}{', ...' if len(outside) > 3 else ''}"
        )
    if (samples, tokens) != (shard["samples"], shard["tokens"]):
        problems.append(
            f"{shard['path']}: {samples} samples / {tokens} tokens, manifest says "
            f"{shard['samples']} / {shard['tokens']}"
        )
    return problems


def _vocab_text(fields: tuple[str, ...], vocab: Mapping[str, int]) -> str:
    """The vocabulary size a shard's ids must stay under, or each side's when they differ."""
    sizes = {name: vocab[name] for name in fields if is_token_field(name)}
    if len(set(sizes.values())) == 1:
        return str(next(iter(sizes.values())))
    return " / ".join(f"{size} ({name})" for name, size in sizes.items())


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        ValidateConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    if not Path(cfg.data_dir).is_dir():
        raise UserError(f"data_dir: not a directory: {cfg.data_dir}")
    manifest = read_manifest(cfg.data_dir)
    problems = validate(cfg.data_dir)
    shards = sum(
        len(e["shards"]) for d in manifest["datasets"].values() for e in d["splits"].values()
    )
    for problem in problems:
        print(f"FAIL {problem}")
    print(f"{cfg.data_dir}: {shards} shards checked, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    run_main(main)
