"""`init.model=DIR`: a run that starts from exported weights instead of random ones.

DIR is one of our exports (`launch.export`) or a directory in Hugging Face's format (ours,
`format=hf`, or any `save_pretrained` one on disk): a GPT-2, Llama, Qwen2.5, Qwen3, Mistral or OLMo
2 for causal_lm, a BERT for mlm, a BERT + GPT-2 EncoderDecoderModel for translation. The run starts
at step 0 with a fresh optimizer and schedule; its model config is the directory's
(`with_directory_model`), except the fields that only change how a network trains
(`model.config.TRAINING_ONLY_FIELDS`: dropout, ...), which stay the job's. A `model.*=` override on
the command line that contradicts the directory is refused in one line; the YAML's model section is
a template the directory replaces.

The weights must have been trained with the dataset's tokenizer (`check_tokenizer`, from `load`
and the dry run): the same file (sha256), or one that gives the same ids (its vocabulary, its
special ids, and its ids on a sample: fixed texts, every piece of the vocabulary as text,
sentences made of them, runs of rare characters for the byte pieces), as a tokenizer.json that
transformers saved again does. Otherwise one line names both and the first difference. A
translation model's stacks can instead be warm-started apart, from a BERT and a GPT, with
`init.encoder` / `init.decoder` (`model.warm_start`), which `init.model` excludes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from common.configure import UserError, show
from common.hashing import file_sha256
from common.optional import need
from launch.config import TrainConfig
from launch.model_dir import CONFIG, load_model_dir, read_json, read_model_config
from launch.tasks import TASKS
from model import ModelConfig, build_model
from model.config import TRAINING_ONLY_FIELDS
from pipeline.tokenizer import load_tokenizer, tokenizer_file_in
from pipeline.tokenizer_identity import difference

# A Hugging Face config's special ids may not fit the model's vocabulary (GPT2Config's default
# 50256 in a smaller one): they stand in these placeholders until the trainer sets the dataset's
# (launch.resolve.resolve), the directory's tokenizer checked to be the dataset's.
UNRESOLVED_IDS = dict(pad_id=0, bos_id=0, eos_id=0, mask_id=-1)


def with_directory_model(cfg: TrainConfig, argv: list[str]) -> TrainConfig:
    """The job's config with `init.model`'s model config; `argv`: the command line's overrides."""
    if not cfg.init.model:
        return cfg
    task = TASKS.get(cfg.task)
    if task is None:
        return cfg  # check_config names the unknown task
    if cfg.init.encoder or cfg.init.decoder:
        raise UserError(
            "init.model: starts the whole model, init.encoder / init.decoder warm-start a "
            "translation model's stacks apart: give one or the other"
        )
    directory = cfg.init.model
    found = model_config(directory)
    if found.arch != task.arch:
        raise UserError(
            f"init.model: {directory} holds a {found.arch} model; task "
            f"{cfg.task} trains {task.arch}"
        )
    given = {
        arg.split("=", 1)[0].lstrip("+")
        for arg in argv
        if "=" in arg and arg.startswith(("model.", "+model."))
    }
    training_only = {f"model.{name}" for name in TRAINING_ONLY_FIELDS}
    contradicting = [
        key
        for key in sorted(given - training_only)
        if _value(cfg.model, key) != _value(found, key, resolved=True)
        and not (key == "model.vocab_size" and cfg.model.vocab_size == 0)
    ]
    if contradicting:
        there = ", ".join(
            f"{key}={show(_value(found, key, resolved=True))}" for key in contradicting
        )
        here = ", ".join(f"{key}={show(_value(cfg.model, key))}" for key in contradicting)
        raise UserError(
            f"init.model: {directory} has {there}; the override {here} contradicts it (the model "
            "config is the directory's: drop the override)"
        )
    kept = {name: getattr(cfg.model, name) for name in TRAINING_ONLY_FIELDS}
    return dataclasses.replace(cfg, model=dataclasses.replace(found, **kept))


def _value(cfg: ModelConfig, key: str, resolved: bool = False):
    """The value of "model.field" or "model.encoder.field"; `resolved`: a stack's field as the
    stack is built (its override, else the shared value), where a directory may leave it None."""
    parts = key.split(".")[1:]
    if (
        resolved
        and len(parts) == 2
        and parts[0] in ("encoder", "decoder")
        and cfg.arch == "seq2seq"
    ):
        return getattr(cfg.for_stack(parts[0]), parts[1], None)
    value = cfg
    for part in parts:
        value = getattr(value, part, None)
    return value


def is_hf_dir(directory: str | Path) -> bool:
    """A Hugging Face model directory: a config.json with a model_type and no config of ours."""
    path = Path(directory) / CONFIG
    return path.is_file() and "model" not in read_json(path) and "model_type" in read_json(path)


def model_config(directory: str) -> ModelConfig:
    """The model config of an export of ours or of a Hugging Face directory, with
    our reserved ids."""
    if not Path(directory).is_dir():
        raise UserError(f"init.model: {directory} is not a directory")
    if not is_hf_dir(directory):
        return read_model_config(Path(directory))[1]
    transformers = need("transformers", f"init.model={directory} (a Hugging Face directory)")

    from model.hf import config_from_hf_bert, config_from_hf_gpt2
    from model.hf_decoders import FAMILIES, config_from_hf_decoder
    from model.hf_seq2seq import config_from_hf_encoder_decoder

    readers = {
        "gpt2": config_from_hf_gpt2,
        **{name: config_from_hf_decoder for name in FAMILIES},
        "bert": config_from_hf_bert,
        "encoder-decoder": config_from_hf_encoder_decoder,
    }
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    if hf_config.model_type not in readers:
        raise UserError(
            f"init.model: {directory} holds a Hugging Face {hf_config.model_type} model; GPT-2, "
            "Llama, Qwen2.5, Qwen3, Mistral, OLMo 2, BERT and BERT + GPT-2 encoder-decoder "
            "directories start a run"
        )
    try:
        return readers[hf_config.model_type](hf_config, **UNRESOLVED_IDS)
    except ValueError as err:
        raise UserError(f"init.model: {directory}: {err}") from None


def load(cfg: TrainConfig, dataset_tokenizer: str | Path) -> torch.nn.Module:
    """The model of `cfg.model` (`with_directory_model`'s) holding init.model's weights, once its
    tokenizer is found to be the dataset's (`dataset_tokenizer`, the dataset's tokenizer.model)."""
    directory = cfg.init.model
    check_tokenizer(directory, dataset_tokenizer)
    if is_hf_dir(directory):
        from model.hf_dir import load_hf_dir

        try:
            state = load_hf_dir(directory, **UNRESOLVED_IDS).state_dict()
        except ValueError as err:
            raise UserError(f"init.model: {err}") from None
    else:
        state = load_model_dir(directory)[0].state_dict()
    model = build_model(cfg.model)
    model.load_state_dict(state, strict=True)
    return model


def check_tokenizer(
    directory: str, dataset_tokenizer: str | Path, key: str = "init.model", side: str = ""
) -> None:
    """UserError, one line naming both and what differs, unless the directory's tokenizer is the
    dataset's (`dataset_tokenizer`: the dataset's file that fixes its ids; `side`: which side's of
    a translation dataset, "source" or "target", for the message; `key`: the config key that named
    the directory).

    A tokenizer is known by the ids it gives (`pipeline.tokenizer_identity.difference`: its
    vocabulary, its special ids, its ids on a sample), not by its file's bytes: the same sha256 is
    answer enough, another one is compared by its ids. An export of ours records the sha256 it was
    trained with; its copy of that tokenizer (the file of that sha256) is what is compared then."""
    dataset_sha256 = file_sha256(dataset_tokenizer)
    whose = f"the dataset's {side} tokenizer" if side else "the dataset's tokenizer"
    if not is_hf_dir(directory):
        recorded = read_json(Path(directory) / CONFIG).get("tokenizer_sha256")
        if recorded == dataset_sha256:
            return
        copy = tokenizer_file_in(directory)
        theirs = None
        if copy.is_file() and file_sha256(copy) == recorded:
            theirs = _tokenizer(copy, key, directory, required=False)
        differs = _difference(dataset_tokenizer, theirs) if theirs is not None else None
        if theirs is not None and differs is None:
            return
        raise UserError(
            f"{key}: {directory} was trained with another tokenizer (sha256 {recorded}) than "
            f"{whose} {dataset_tokenizer} ({dataset_sha256})" + (f": {differs}" if differs else "")
        )
    # The dataset's tokenizer file in the directory (a Hugging Face tokenizer.json it was prepared
    # from, or the tokenizer.model beside our HF export) if it has one, else its tokenizer.
    same_name = Path(directory) / Path(dataset_tokenizer).name
    if same_name.is_file() and file_sha256(same_name) == dataset_sha256:
        return
    theirs = _tokenizer(same_name if same_name.is_file() else Path(directory), key, directory)
    differs = _difference(dataset_tokenizer, theirs)
    if differs is not None:
        raise UserError(
            f"{key}: the tokenizer of {directory} gives other ids than {whose} "
            f"{dataset_tokenizer} (sha256 {dataset_sha256[:12]}): {differs}"
        )


def _tokenizer(path: Path, key: str, directory: str, required: bool = True):
    """The tokenizer at `path` in `directory`; one line if it cannot be read (None, when not
    `required`: the caller has its own line)."""
    try:
        return load_tokenizer(path)
    except UserError as err:
        if not required:
            return None
        raise UserError(
            f"{key}: {directory} has no tokenizer to check against the dataset's: {err}"
        ) from None


def _difference(dataset_tokenizer: str | Path, theirs) -> str | None:
    return difference(
        load_tokenizer(dataset_tokenizer), theirs, ("in the dataset's", "in the directory's")
    )
