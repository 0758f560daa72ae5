"""`python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR`: a DeepSpeed checkpoint to a self-contained model directory.

The checkpoint is a run directory, its `checkpoints/` directory (the latest complete
checkpoint is taken) or one `step_*` checkpoint, of any ZeRO stage. `out` receives:

    model.safetensors   consolidated fp32 weights (tied tensors stored once)
    config.json         {"model": ModelConfig, "task", "step", "tokens_seen", "tokenizer_sha256", "source"}
    tokenizer.model     the SentencePiece model the weights were trained with

Fine-tuning (`init.encoder` / `init.decoder`), evaluation and the Hugging Face converters
(`model.hf`) read this directory: safetensors and JSON, nothing unpickled.

The checkpoint is verified against its integrity.json and read weights-only
(`launch.engine.consolidated_state_dict`): a damaged or partial checkpoint, a universal copy, or
a torch file holding anything but tensors and plain data (a planted pickle payload) is refused
in one line, exit status 2.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from launch.checkpoint import checkpoint_root, latest_tag
from launch.config import ExportConfig, TrainConfig
from model import ModelConfig, build_model
from common.configure import UserError, config_from_dict, load_config, parse_cli, run_main
from common.hashing import file_sha256
from pipeline.progress import meter

USAGE = """usage: python -m launch.export [CONFIG.yaml] checkpoint=RUN_DIR out=DIR

A training checkpoint of any ZeRO stage to plain weights, config.json and tokenizer.model."""
WEIGHTS, CONFIG, TOKENIZER = "model.safetensors", "config.json", "tokenizer.model"


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


def save_model_dir(out: str | Path, state_dict: dict, model_cfg: ModelConfig, tokenizer: str | Path, meta: dict) -> None:
    """Write weights, config and tokenizer; the directory appears complete only at the end."""
    from safetensors.torch import save_model

    out = Path(out)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    model = build_model(model_cfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    if missing or unexpected:
        raise UserError(f"checkpoint does not match its model config: missing {missing[:3]}, unexpected {unexpected[:3]}")
    # save_model stores each tied tensor once and records the alias.
    save_model(model, str(partial / WEIGHTS))
    shutil.copyfile(tokenizer, partial / TOKENIZER)
    config = {"model": dataclasses.asdict(model_cfg), "tokenizer_sha256": file_sha256(tokenizer), **meta}
    (partial / CONFIG).write_text(json.dumps(config, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)


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
    return RunCheckpoint(root, tag, load_config(TrainConfig, config_file), root.parent / TOKENIZER, client)


def export(checkpoint: str | Path, out: str | Path) -> dict:
    from launch.engine import consolidated_state_dict
    from launch.preconditions import check_writable_dir

    # Before the weights are consolidated: an export that cannot be written fails in one line.
    check_writable_dir(Path(out).absolute().parent, "out")
    run = read_run_checkpoint(checkpoint)
    if not run.tokenizer.is_file():
        raise UserError(f"{run.tokenizer} not found")
    meta = {"task": run.config.task, "step": run.client.get("step"), "tokens_seen": run.client.get("tokens_seen"),
            "source": str((run.root / run.tag).resolve())}
    with meter(2, f"export {run.tag}", "phase") as shown:  # verify and consolidate; write
        state = consolidated_state_dict(run.root, run.tag)
        shown.update()
        save_model_dir(out, state, run.config.model, run.tokenizer, meta)
        shown.update()
    return meta


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(ExportConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True)
    meta = export(cfg.checkpoint, cfg.out)
    print(f"exported {meta['task']} step {meta['step']} from {meta['source']} to {cfg.out}")
    return 0


if __name__ == "__main__":
    run_main(main)
