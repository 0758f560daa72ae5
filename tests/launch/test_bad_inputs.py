"""Bad inputs that ended in a traceback where one line belongs (issue #45, items 7-9): an
optimizer setting torch refuses only once the process group is up, a damaged or pickled weights
file given to the tools that read exported models, token ids outside the vocabulary in an
evaluation split."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from clirun import ENV, packed_data, run_cli, train_command
from errorlines import assert_one_error_line
from repo import ROOT
from shardtools import FIRST_ID, VOCAB_SIZE, make_dataset, save_manifest

from common.hashing import file_sha256
from launch.config import TrainConfig
from launch.resolve import config_problems
from model import ModelConfig, build_model
from pipeline.format import sample_key
from pipeline.shard_tar import write_shard
from pipeline.tokenizer import SENTENCEPIECE_FILE

# ----------------------------------------------------------------------------- item 4, training


def test_a_damaged_dataset_tokenizer_stops_the_trainer_at_start_in_one_line(tmp_path):
    """The dataset's tokenizer.model truncated: training exited 0 and copied the broken file into
    the run directory, whence every export took it. (The export's half: test_export_out.)"""
    data, run_dir = tmp_path / "data", tmp_path / "run"
    packed_data(data, seq_len=32)
    tokenizer = data / SENTENCEPIECE_FILE
    tokenizer.write_bytes(tokenizer.read_bytes()[:10])
    code, lines = run_cli(*train_command(data, run_dir, "model.max_seq_len=32", "max_steps=1"))
    assert_one_error_line(
        code, lines, f"{tokenizer}: sha256 ", "differs from the manifest's", "damaged or replaced"
    )
    assert not any("DeepSpeed" in line or "ZeRO" in line for line in lines)  # before the engine
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- item 7


@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("lr", float("nan"), "optim.lr: nan must be a finite number, 0 or more"),
        ("lr", -1.0, "optim.lr: -1.0 must be"),
        ("lr", float("inf"), "optim.lr: inf must be"),
        ("beta1", 1.0, "optim.beta1: 1.0 must be in [0, 1)"),
        ("beta2", float("nan"), "optim.beta2: nan must be in [0, 1)"),
        ("eps", -1e-8, "optim.eps: -1e-08 must be"),
        ("weight_decay", float("nan"), "optim.weight_decay: nan must be"),
        ("grad_clip", float("inf"), "optim.grad_clip: inf must be 0 (off) or"),
    ],
)
def test_optimizer_settings_torch_refuses_are_config_problems(key, value, expected):
    cfg = TrainConfig()
    cfg.model.vocab_size = 100
    assert config_problems(cfg) == []
    cfg.optim = dataclasses.replace(cfg.optim, **{key: value})
    assert config_problems(cfg) == [expected] or expected in config_problems(cfg)[0]


def test_a_bad_learning_rate_stops_the_trainer_in_one_line_leaving_nothing(tmp_path):
    """optim.lr=nan: a `ValueError: Invalid learning rate` traceback once the process group was up,
    and an empty run directory left; with -1, `--dry-run` said ready."""
    data, run_dir = tmp_path / "data", tmp_path / "runs" / "gpt"
    packed_data(data, seq_len=32)
    args = train_command(data, run_dir, "model.max_seq_len=32", "max_steps=1")
    code, lines = run_cli(*args, "optim.lr=nan")
    assert_one_error_line(code, lines, "optim.lr: nan must be a finite number, 0 or more")
    assert not (tmp_path / "runs").exists()  # no empty run directory left
    dry = subprocess.run(
        [sys.executable, *args, "optim.lr=-1", "--dry-run"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert dry.returncode == 2 and "optim.lr: -1.0 must be" in dry.stdout, dry.stdout
    assert not (tmp_path / "runs").exists()


# ----------------------------------------------------------------------------- item 8


class Planted:
    """Unpickled, it creates its marker file (`open(marker, "w")`)."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


@pytest.fixture(scope="module")
def broken_models(tiny_dataset, tmp_path_factory) -> dict[str, Path]:
    """Exports over the tiny dataset's tokenizer whose weights do not load: ours (a GPT and a
    translation model) with model.safetensors cut in half, and a GPT-2 in Hugging Face's layout
    whose only weights are a pytorch_model.bin holding a planted payload."""
    from launch.model_dir import save_hf_dir, save_model_dir

    top = tmp_path_factory.mktemp("broken-models")
    tokenizer = tiny_dataset / SENTENCEPIECE_FILE
    vocab = json.loads((tiny_dataset / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    shape = dict(vocab_size=vocab, d_model=16, n_layers=1, n_heads=2, max_seq_len=64)
    made = {}
    for arch in ("gpt", "seq2seq"):
        cfg = ModelConfig(arch=arch, activation="gelu_tanh", **shape)
        made[arch] = top / arch
        save_model_dir(made[arch], build_model(cfg).state_dict(), cfg, tokenizer, {"task": arch})
        weights = made[arch] / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    pytest.importorskip("transformers")
    cfg = ModelConfig(arch="gpt", activation="gelu_tanh", **shape)
    made["hf"] = top / "hf"
    save_hf_dir(made["hf"], build_model(cfg).state_dict(), cfg, tokenizer, {"task": "causal_lm"})
    (made["hf"] / "model.safetensors").unlink()
    torch.save(
        {"transformer.wte.weight": torch.zeros(2, 2), "planted": Planted(top / "payload-ran")},
        made["hf"] / "pytorch_model.bin",
    )
    return made


READERS = {
    "init.model": ("gpt", ["-m", "launch.train", "{configs}/tiny_gpt.yaml", "init.model={model}"]),
    "init.decoder": (
        "gpt",
        ["-m", "launch.train", "{configs}/tiny_translation.yaml", "init.decoder={model}"],
    ),
    "lm_eval": ("gpt", ["-m", "launch.lm_eval", "checkpoint={model}", "limit=2"]),
    "translate": ("seq2seq", ["-m", "launch.translate", "checkpoint={model}", "input={input}"]),
    "init.model, hf": (
        "hf",
        ["-m", "launch.train", "{configs}/tiny_gpt.yaml", "init.model={model}"],
    ),
    "lm_eval, hf": ("hf", ["-m", "launch.lm_eval", "checkpoint={model}", "limit=2"]),
}


@pytest.mark.parametrize("reader", READERS, ids=list(READERS))
def test_weights_that_do_not_load_are_one_line(broken_models, tiny_dataset, tmp_path, reader):
    """A truncated model.safetensors ended in a SafetensorError traceback; a planted pickle, refused
    by the weights-only load, in a 48-line traceback suggesting weights_only=False."""
    kind, args = READERS[reader]
    source = tmp_path / "in.txt"
    source.write_text("the red cat opens a door\n")
    argv = [
        arg.format(configs=ROOT / "configs", model=broken_models[kind], input=source)
        for arg in args
    ]
    if argv[1] == "launch.train":
        argv += [f"data.data_dir={tiny_dataset}", f"run_dir={tmp_path / 'run'}", "max_steps=1"]
        argv += ["data.num_workers=0", "wandb.mode=disabled"]
    elif argv[1] == "launch.lm_eval":
        argv += [f"data_dir={tiny_dataset}", f"out={tmp_path / 'scores.json'}"]
    code, lines = run_cli(*argv)
    expected = (
        "it holds io.open, which unpickling would call: refused"
        if kind == "hf"
        else f"{broken_models[kind] / 'model.safetensors'} cannot be read: SafetensorError: "
    )
    assert_one_error_line(code, lines, expected)
    assert not (broken_models["hf"].parent / "payload-ran").exists()
    assert sorted(path.name for path in tmp_path.iterdir()) == ["in.txt"]  # nothing written


# ----------------------------------------------------------------------------- item 9


def translation_model_dir(directory: Path, tokenizer: Path) -> ModelConfig:
    """An exported translation model over shardtools' vocabulary, trained on nothing."""
    from launch.model_dir import save_model_dir

    cfg = ModelConfig(
        arch="seq2seq", vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2, max_seq_len=16
    )
    save_model_dir(
        directory, build_model(cfg).state_dict(), cfg, tokenizer, {"task": "translation", "step": 1}
    )
    return cfg


def test_token_ids_outside_the_vocabulary_are_named_by_validate_and_refused_by_evaluate(tmp_path):
    """Training skips such a sample and counts it; evaluation ended in `IndexError: index out of
    range in self` inside the embedding, and pipeline.validate passed the dataset."""
    data = tmp_path / "data"
    manifest = make_dataset(data, translation=[6, 6], split="valid")
    tokenizer = data / SENTENCEPIECE_FILE
    tokenizer.write_bytes(b"a stand-in for a SentencePiece model")
    manifest["tokenizer"]["sha256"] = file_sha256(tokenizer)
    # One source id past the vocabulary, in the second sample of the second shard.
    entry = manifest["datasets"]["translation"]["splits"]["valid"]["shards"][1]
    keys = [sample_key(0, uid) for uid in range(6, 12)]
    samples = [
        {
            "src_ids": np.array([FIRST_ID + uid, VOCAB_SIZE + 7 if uid == 7 else 200], np.uint16),
            "tgt_ids": np.array([300, 301], np.uint16),
        }
        for uid in range(6, 12)
    ]
    entry.update(write_shard(data / entry["path"], keys, samples), path=entry["path"])
    split = manifest["datasets"]["translation"]["splits"]["valid"]
    split["samples"] = sum(shard["samples"] for shard in split["shards"])  # as prepare writes it
    save_manifest(data, manifest)

    check = subprocess.run(
        [sys.executable, "-m", "pipeline.validate", f"data_dir={data}"],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
    )
    assert check.returncode == 1, check.stdout + check.stderr
    assert (
        f"FAIL {entry['path']}: 1 sample holds token ids outside the vocabulary of {VOCAB_SIZE}: "
        f"sample {keys[1]} (src_ids: [{FIRST_ID + 7}, {VOCAB_SIZE + 7}])"
    ) in check.stdout, check.stdout

    translation_model_dir(tmp_path / "model", tokenizer)
    code, lines = run_cli(
        "-m",
        "launch.evaluate",
        f"checkpoint={tmp_path / 'model'}",
        f"data_dir={data}",
        "split=valid",
        "beam=1",
        f"out={tmp_path / 'eval'}",
    )
    assert_one_error_line(
        code,
        lines,
        f"{data / entry['path']}: sample {keys[1]}: src_ids: token ids in [{FIRST_ID + 7}, {VOCAB_SIZE + 7}], "
        f"outside the vocabulary of {VOCAB_SIZE}",
    )
    assert not (tmp_path / "eval" / "scores.json").exists()
