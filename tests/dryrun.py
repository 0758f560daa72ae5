"""The dry run (`launch.preflight`) as its tests call it: a small dataset that passes every check
(make_data: packed and translation shards, a tokenizer file and its sha256 in the manifest), a
config's command line over it (args) and the dry run's answer read back (dry_run)."""

from __future__ import annotations

import itertools
from pathlib import Path

from repo import ROOT
from shardtools import make_dataset, save_manifest

from common.hashing import file_sha256
from launch.preflight.checks import main_dry_run
from pipeline.tokenizer import SENTENCEPIECE_FILE

TRAIN, VALID = (30, 30), (20,)  # samples per shard
SEQ_LEN, MAX_TOKENS = 8, 8
# micro 4 x accumulation 2 x 1 rank = 8 per step: 60 train samples give 7 steps (4 left out).
SMALL = ["model.max_seq_len=16", "data.micro_batch_size=4", "grad_accum=2", "wandb.mode=disabled"]


def make_data(directory: Path, train=TRAIN, valid=VALID) -> Path:
    """packed and translation shards for train and valid, a tokenizer file and its sha256 in the
    manifest, and the block lengths prepare records (packed seq_len, translation.max_tokens)."""
    manifest = make_dataset(
        directory, packed=list(train), translation=list(train), seq_len=SEQ_LEN, split="train"
    )
    valid_manifest = make_dataset(
        directory,
        packed=list(valid),
        translation=list(valid),
        seq_len=SEQ_LEN,
        split="valid",
        seed=1,
    )
    for name, dataset in manifest["datasets"].items():
        dataset["splits"]["valid"] = valid_manifest["datasets"][name]["splits"]["valid"]
    manifest["datasets"]["packed"]["seq_len"] = SEQ_LEN
    manifest["config"] = {"translation": {"max_tokens": MAX_TOKENS}}
    (directory / SENTENCEPIECE_FILE).write_bytes(b"the dataset's tokenizer")
    manifest["tokenizer"]["sha256"] = file_sha256(directory / SENTENCEPIECE_FILE)
    save_manifest(directory, manifest)
    return directory


def args(data: Path, tmp_path: Path, *overrides: str, config: str = "tiny_gpt.yaml") -> list[str]:
    """configs/CONFIG on `data`, a run_dir under `tmp_path`, SMALL and `overrides`."""
    return [
        str(ROOT / "configs" / config),
        f"data.data_dir={data}",
        f"run_dir={tmp_path / 'run'}",
        *SMALL,
        *overrides,
    ]


def dry_run(argv: list[str], capsys) -> tuple[int, str, list[str]]:
    """(exit status, stdout, the problem lines)."""
    code = main_dry_run(argv)
    out = capsys.readouterr().out
    lines = out.splitlines()
    problems = []
    if any(line.startswith("problems (") for line in lines):
        start = next(i for i, line in enumerate(lines) if line.startswith("problems ("))
        problems = [
            line.strip()
            for line in itertools.takewhile(lambda line: line.startswith("  "), lines[start + 1 :])
        ]
    return code, out, problems
