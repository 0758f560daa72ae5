"""Our model directory, the format every reader of weights shares: an export's or an average's
(`launch.export`, `launch.average`), read by fine-tuning (`init.*`), evaluation, lm-eval and the
Hugging Face converters; and the Hugging Face directory `format=hf` writes.

    model.safetensors   the weights (tied tensors stored once)
    config.json         {"model": ModelConfig, "tokenizer_sha256", ...: what the writer adds}
    tokenizer files     the tokenizer the weights were trained with, as the dataset held it
    provenance.json     what made the weights

Written into a staging directory that becomes the directory only when complete (`writing`); read
as safetensors and JSON, nothing unpickled.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from pathlib import Path

import torch

from common.configure import UserError, config_from_dict
from common.hashing import file_sha256
from common.outputs import discard, new_staging, publish, real_output
from common.weights import load_failure
from model import ModelConfig, build_model
from pipeline.format import TARGET_DIR
from pipeline.tokenizer import SENTENCEPIECE_FILE, load_tokenizer, read_files

WEIGHTS, CONFIG, PROVENANCE = ("model.safetensors", "config.json", "provenance.json")


@contextlib.contextmanager
def writing(out: str | Path):
    """A staging directory of this run's beside `out` that becomes `out` only when the block
    completes, and is removed if it fails (an error, an interrupt); the old `out` stays in place
    until then. Called under OUT.lock (`claiming`)."""
    out = real_output(out, "out")
    partial = new_staging(out, "export")
    try:
        yield partial
        publish(partial, out, "export")
    except BaseException:
        discard(partial)
        raise


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
    target_tokenizer: str | Path | None = None,
) -> None:
    """Write weights, config, tokenizer (a translation target's own under target/) and
    provenance; the directory appears complete only at the end."""
    from safetensors.torch import save_model

    model = model_with(state_dict, model_cfg)
    with writing(out) as partial:
        # save_model stores each tied tensor once and records the alias.
        save_model(model, str(partial / WEIGHTS))
        copy_tokenizer(tokenizer, partial)
        target = {}
        if target_tokenizer is not None:
            (partial / TARGET_DIR).mkdir()
            copy_tokenizer(target_tokenizer, partial / TARGET_DIR)
            target = {"target_tokenizer_sha256": file_sha256(target_tokenizer)}
        config = {
            "model": dataclasses.asdict(model_cfg),
            "tokenizer_sha256": file_sha256(tokenizer),
            **target,
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
    target_tokenizer: str | Path | None = None,
) -> None:
    """Write a Hugging Face model directory with its tokenizer (a Hugging Face one as it is; ours
    as a fast tokenizer, with tokenizer.model beside it) and provenance. A translation target's
    own tokenizer goes to target/, for `AutoTokenizer.from_pretrained(OUT/target)` to decode
    what `generate` returns (the encoder's is OUT's own, as transformers' BERT2GPT2 pairs them)."""
    from launch.hf_tokenizer import save_hf_tokenizer
    from model.hf_dir import to_hf

    hf_model = to_hf(model_with(state_dict, model_cfg))
    with writing(out) as partial:
        hf_model.save_pretrained(str(partial))
        if Path(tokenizer).name == SENTENCEPIECE_FILE:
            save_hf_tokenizer(
                tokenizer, partial, model_cfg.max_seq_len, input_frame(tokenizer, model_cfg)
            )
        copy_tokenizer(tokenizer, partial)
        if target_tokenizer is not None:
            (partial / TARGET_DIR).mkdir()
            if Path(target_tokenizer).name == SENTENCEPIECE_FILE:
                save_hf_tokenizer(
                    target_tokenizer, partial / TARGET_DIR, model_cfg.max_seq_len, ((), ())
                )
            copy_tokenizer(target_tokenizer, partial / TARGET_DIR)
        (partial / PROVENANCE).write_text(json.dumps(provenance, indent=1) + "\n")


def input_frame(tokenizer: str | Path, model_cfg: ModelConfig):
    """What training put around the model's inputs, for the exported tokenizer to add by default:
    a translation source's frame (ours `text </s>`); a BERT document's; nothing before a GPT's
    prompt (a document's first token follows the previous one's end, which lm-eval is told)."""
    specials = load_tokenizer(tokenizer).specials
    return {"seq2seq": specials.source, "bert": specials.document}.get(model_cfg.arch, ((), ()))


def copy_tokenizer(tokenizer: str | Path, directory: Path) -> None:
    """The tokenizer file `tokenizer` and the files beside it that belong to it,
    into `directory`."""
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
    try:
        load_model(model, str(directory / WEIGHTS), strict=True)
    # safetensors' errors (a truncated file), torch's (a tensor missing or of another shape)
    except Exception as err:
        raise UserError(f"{directory / WEIGHTS} cannot be read: {load_failure(err)}") from err
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
    """A JSON object from a file of ours; UserError (one line) if it is unreadable
    or not an object."""
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{path} is unreadable: {err}") from err
    if not isinstance(value, dict):
        raise UserError(f"{path} holds {type(value).__name__}, not an object")
    return value
