"""`python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR [format=hf]`: a DeepSpeed checkpoint to a
self-contained model directory.

The checkpoint is a run directory, its `checkpoints/` directory (the latest complete
checkpoint is taken) or one `step_*` checkpoint, of any ZeRO stage. `out` receives, in our
format (the default):

    model.safetensors   consolidated fp32 weights (tied tensors stored once)
    config.json         {"model": ModelConfig, "task", "step", "tokens_seen", "tokenizer_sha256", "source"}
    tokenizer files     the tokenizer the weights were trained with, as the dataset held it:
                        tokenizer.model, or a Hugging Face tokenizer.json (+ tokenizer_config.json)
    provenance.json     what made the weights (`provenance`)

Fine-tuning (`init.*`), evaluation and the Hugging Face converters (`model.hf`) read this
directory: safetensors and JSON, nothing unpickled. With `format=hf`, `out` is a directory in
Hugging Face's `save_pretrained` layout instead (model.safetensors, config.json,
generation_config.json where it applies), of the class `model.hf_dir.hf_config_for` picks (GPT-2,
Llama, BERT, or a BERT + GPT-2 EncoderDecoderModel), with its tokenizer for `AutoTokenizer`: a
Hugging Face tokenizer's own files as the dataset held them, or our SentencePiece model converted
to a fast tokenizer (`launch.hf_tokenizer`) with tokenizer.model beside it; and provenance.json. A
model the class cannot compute is refused in one line naming the option, before the weights are
read.

The checkpoint is verified against its integrity.json and read weights-only
(`launch.deepspeed.safe_load.consolidated_state_dict`): a damaged or partial checkpoint, a universal copy, or
a torch file holding anything but tensors and plain data (a planted pickle payload) is refused
in one line, exit status 2.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from common.configure import (
    UserError,
    config_from_dict,
    config_to_dict,
    load_config,
    parse_cli,
    run_main,
)
from common.hashing import file_sha256
from common.progress import meter
from launch.checkpoint import checkpoint_root, latest_tag
from launch.config import ExportConfig, TrainConfig
from model import ModelConfig, build_model
from pipeline.tokenizer import SENTENCEPIECE_FILE, read_files, tokenizer_file_in

USAGE = """usage: python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR [format=ours|hf]

A training checkpoint of any ZeRO stage to plain weights, config.json and its tokenizer
(format=hf: a Hugging Face model directory with its tokenizer)."""
WEIGHTS, CONFIG, PROVENANCE = ("model.safetensors", "config.json", "provenance.json")
FORMATS = ("ours", "hf")


def locate_checkpoint(path: str | Path) -> tuple[Path, str]:
    """(checkpoints root, tag) for a run dir, a checkpoints dir or a step_* dir."""
    path = Path(path)
    for root in (checkpoint_root(path), path):
        tag = latest_tag(root)
        if tag:
            return root, tag
    if path.is_dir() and path.name.startswith("step_"):
        return path.parent, path.name
    raise UserError(f"no complete checkpoint at {path}")


@contextlib.contextmanager
def writing(out: str | Path):
    """A scratch directory beside `out` that becomes `out` only when the block completes."""
    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    yield partial
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


def model_with(state_dict: dict, model_cfg: ModelConfig) -> torch.nn.Module:
    """The model of `model_cfg` holding `state_dict`, every key accounted for."""
    model = build_model(model_cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise UserError(
            f"checkpoint does not match its model config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    return model


def save_model_dir(
    out: str | Path,
    state_dict: dict,
    model_cfg: ModelConfig,
    tokenizer: str | Path,
    meta: dict,
    provenance: dict | None = None,
) -> None:
    """Write weights, config, tokenizer (and provenance); the directory appears complete only at the end."""
    from safetensors.torch import save_model

    model = model_with(state_dict, model_cfg)
    with writing(out) as partial:
        # save_model stores each tied tensor once and records the alias.
        save_model(model, str(partial / WEIGHTS))
        copy_tokenizer(tokenizer, partial)
        config = {
            "model": dataclasses.asdict(model_cfg),
            "tokenizer_sha256": file_sha256(tokenizer),
            **meta,
        }
        (partial / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
        if provenance is not None:
            (partial / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")


def save_hf_dir(
    out: str | Path,
    state_dict: dict,
    model_cfg: ModelConfig,
    tokenizer: str | Path,
    provenance: dict,
) -> None:
    """Write a Hugging Face model directory with its tokenizer (a Hugging Face one as it is; ours
    as a fast tokenizer, with tokenizer.model beside it) and provenance."""
    from launch.hf_tokenizer import save_hf_tokenizer
    from model.hf_dir import to_hf

    hf_model = to_hf(model_with(state_dict, model_cfg))
    with writing(out) as partial:
        hf_model.save_pretrained(str(partial))
        if Path(tokenizer).name == SENTENCEPIECE_FILE:
            save_hf_tokenizer(tokenizer, partial, model_cfg.max_seq_len)
        copy_tokenizer(tokenizer, partial)
        (partial / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")


def copy_tokenizer(tokenizer: str | Path, directory: Path) -> None:
    """The tokenizer file `tokenizer` and the files beside it that belong to it, into `directory`."""
    for name, data in read_files(tokenizer).items():
        (directory / name).write_bytes(data)


def load_model_dir(directory: str | Path) -> tuple[torch.nn.Module, dict]:
    """The model of an exported directory (in eval mode) and its config.json."""
    from safetensors.torch import load_model

    directory = Path(directory)
    if not (directory / CONFIG).is_file() or not (directory / WEIGHTS).is_file():
        raise UserError(f"{directory} is not an exported model directory (run launch.export)")
    meta, model_cfg = read_model_config(directory)
    model = build_model(model_cfg)
    load_model(model, str(directory / WEIGHTS), strict=True)
    model.eval()
    meta["model_config"] = model_cfg
    return model, meta


def read_model_config(directory: Path) -> tuple[dict, ModelConfig]:
    """An exported directory's config.json and the model config in it."""
    meta = read_json(directory / CONFIG)
    if not isinstance(meta.get("model"), dict):
        raise UserError(f"{directory / CONFIG} has no model config (not written by launch.export)")
    return meta, config_from_dict(ModelConfig, meta["model"], source=str(directory / CONFIG))


def read_json(path: Path) -> dict:
    """A JSON object from a file of ours; UserError (one line) if it is unreadable or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable: {err}") from err
    if not isinstance(value, dict):
        raise UserError(f"{path} holds {type(value).__name__}, not an object")
    return value


@dataclass(frozen=True)
class RunCheckpoint:
    """A training run's checkpoint with what it was trained with."""

    root: Path  # RUN_DIR/checkpoints
    tag: str
    config: TrainConfig
    tokenizer: Path
    client: dict  # client_state.json: step, tokens_seen, tokenizer_sha256, ...


def read_run_checkpoint(path: str | Path) -> RunCheckpoint:
    """The checkpoint a run dir, checkpoints dir or step_* dir names, with its run's config."""
    root, tag = locate_checkpoint(path)
    config_file = root.parent / "config.yaml"
    if not config_file.is_file():
        raise UserError(f"{config_file} not found: the run directory of {root / tag} is incomplete")
    client_file = root / tag / "client_state.json"
    client = read_json(client_file) if client_file.is_file() else {}
    return RunCheckpoint(
        root, tag, load_config(TrainConfig, config_file), tokenizer_file_in(root.parent), client
    )


def provenance(run: RunCheckpoint) -> dict:
    """The one record every export carries: what trained the weights and on what. The dataset's
    fingerprints are those the run recorded at the checkpoint (`launch.train`; null for a checkpoint
    written before it recorded them): the manifest's, and the train shards' listing with their sha256s."""
    dataset = run.client.get("dataset") or {}
    return {
        "task": run.config.task,
        "step": run.client.get("step"),
        "tokens_seen": run.client.get("tokens_seen"),
        "tokens_by_source": run.client.get("tokens_by_source"),
        "tokenizer_sha256": file_sha256(run.tokenizer),
        "dataset": {
            "data_dir": run.config.data.data_dir,
            "manifest_sha256": dataset.get("manifest_sha256"),
            "train_shards_sha256": dataset.get("train_shards_sha256"),
        },
        "mixture": {
            "weights": dict(run.config.data.mixture),
            "samples_per_epoch": dataset.get("mixture"),
        },
        "checkpoint": str((run.root / run.tag).resolve()),
        "config": config_to_dict(run.config),
    }


def export(checkpoint: str | Path, out: str | Path, format: str = "ours") -> dict:
    from launch.deepspeed.safe_load import consolidated_state_dict
    from launch.preconditions import check_writable_dir

    if format not in FORMATS:
        raise UserError(f"format: {format!r} is not one of {', '.join(FORMATS)}")
    # Before the weights are consolidated: an export that cannot be written fails in one line.
    check_writable_dir(Path(out).absolute().parent, "out")
    run = read_run_checkpoint(checkpoint)
    if not run.tokenizer.is_file():
        raise UserError(f"{run.tokenizer} not found")
    if format == "hf":
        check_hf_exportable(run.config.model)
    record = provenance(run)
    with meter(2, f"export {run.tag}", "phase") as shown:  # verify and consolidate; write
        state = consolidated_state_dict(run.root, run.tag)
        shown.update()
        if format == "hf":
            save_hf_dir(out, state, run.config.model, run.tokenizer, record)
        else:
            meta = {key: record[key] for key in ("task", "step", "tokens_seen")} | {
                "source": record["checkpoint"]
            }
            save_model_dir(out, state, run.config.model, run.tokenizer, meta, record)
        shown.update()
    return record


def check_hf_exportable(model_cfg: ModelConfig) -> None:
    """UserError, one line naming the option, for a model no Hugging Face class computes."""
    from model.hf_dir import hf_config_for

    try:
        hf_config_for(model_cfg)
    except ValueError as err:
        raise UserError(f"format=hf: {err}") from None
    except ImportError as err:
        raise UserError(f"format=hf needs transformers (pip install -e '.[hf]'): {err}") from None


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        ExportConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    record = export(cfg.checkpoint, cfg.out, cfg.format)
    print(
        f"exported {record['task']} step {record['step']} from {record['checkpoint']} to {cfg.out} ({cfg.format})"
    )
    return 0


if __name__ == "__main__":
    run_main(main)
