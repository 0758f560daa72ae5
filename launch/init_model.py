"""`init.model=DIR`: a run that starts from exported weights instead of random ones.

DIR is one of our exports (`launch.export`) or a directory in Hugging Face's format (ours,
`format=hf`, or any `save_pretrained` one on disk): a GPT-2 or Llama for causal_lm, a BERT for
mlm, a BERT + GPT-2 EncoderDecoderModel for translation. The run starts at step 0 with a fresh
optimizer and schedule; its model config is the directory's (`resolve`), except the fields that
only change how a network trains (`model.config.TRAINING_ONLY_FIELDS`: dropout, ...), which stay
the job's. A `model.*=` override on the command line that contradicts the directory is refused in
one line; the YAML's model section is a template the directory replaces.

The weights must have been trained with the dataset's tokenizer (`load`): for our exports and
our HF exports, the same tokenizer.model (sha256); for any other HF directory, its tokenizer must
give the dataset's SentencePiece ids on a sample (every piece of the vocabulary as text, sentences
made of them, runs of rare characters for the byte pieces). Otherwise one line names both. A
translation model's stacks can instead be warm-started apart, from a BERT and a GPT, with
`init.encoder` / `init.decoder` (`model.warm_start`), which `init.model` excludes.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from common.configure import UserError, show
from common.hashing import file_sha256
from launch.config import TrainConfig
from launch.export import CONFIG, load_model_dir, read_json, read_model_config
from launch.tasks import TASKS
from model import ModelConfig, build_model
from model.config import TRAINING_ONLY_FIELDS

# A Hugging Face config's special ids may not fit the model's vocabulary (GPT2Config's default
# 50256 in a smaller one): they stand in these placeholders until the trainer sets the dataset's
# (launch.resolve.resolve), the directory's tokenizer checked to be the dataset's.
UNRESOLVED_IDS = dict(pad_id=0, bos_id=0, eos_id=0, mask_id=-1)
SAMPLE_SENTENCE_PIECES = 12  # pieces per sentence of the tokenizer check's sample


def resolve(cfg: TrainConfig, argv: list[str]) -> TrainConfig:
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
    import transformers

    from model.hf import config_from_hf_bert, config_from_hf_gpt2, config_from_hf_llama
    from model.hf_seq2seq import config_from_hf_encoder_decoder

    readers = {
        "gpt2": config_from_hf_gpt2,
        "llama": config_from_hf_llama,
        "bert": config_from_hf_bert,
        "encoder-decoder": config_from_hf_encoder_decoder,
    }
    hf_config = transformers.AutoConfig.from_pretrained(directory)
    if hf_config.model_type not in readers:
        raise UserError(
            f"init.model: {directory} holds a Hugging Face {hf_config.model_type} model; GPT-2, "
            "Llama, BERT and BERT + GPT-2 encoder-decoder directories start a run"
        )
    try:
        return readers[hf_config.model_type](hf_config, **UNRESOLVED_IDS)
    except ValueError as err:
        raise UserError(f"init.model: {directory}: {err}") from None


def load(cfg: TrainConfig, dataset_tokenizer: str | Path) -> torch.nn.Module:
    """The model of `cfg.model` (resolved by `resolve`) holding init.model's weights, once its
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
    """UserError, one line naming both, unless the directory's tokenizer is the dataset's (`side`:
    which side's of a translation dataset, "source" or "target", for the message; `key`: the
    config key that named the directory)."""
    dataset_sha256 = file_sha256(dataset_tokenizer)
    whose = f"the dataset's {side} tokenizer" if side else "the dataset's tokenizer"
    if not is_hf_dir(directory):
        theirs = read_json(Path(directory) / CONFIG).get("tokenizer_sha256")
        if theirs != dataset_sha256:
            raise UserError(
                f"{key}: {directory} was trained with tokenizer sha256 {theirs}, {whose} "
                f"{dataset_tokenizer} is {dataset_sha256}"
            )
        return
    # The dataset's tokenizer file in the directory (a Hugging Face tokenizer.json it was prepared
    # from, or the tokenizer.model beside our HF export): the same bytes, or another tokenizer.
    same_name = Path(directory) / Path(dataset_tokenizer).name
    if same_name.is_file():
        theirs = file_sha256(same_name)
        if theirs != dataset_sha256:
            raise UserError(
                f"{key}: {same_name} has sha256 {theirs}, {whose} {dataset_tokenizer} "
                f"{dataset_sha256}"
            )
        return
    text, theirs, ours = first_difference(directory, dataset_tokenizer, key)
    if text is not None:
        raise UserError(
            f"{key}: the tokenizer of {directory} gives other ids than {whose} "
            f"{dataset_tokenizer} (sha256 {dataset_sha256[:12]}): {text[:40]!r} -> "
            f"{theirs[:8]} there, {ours[:8]} here"
        )


def first_difference(
    directory: str, dataset_tokenizer: str | Path, key: str = "init.model"
) -> tuple[str | None, list, list]:
    """The first text of the sample on which the directory's tokenizer and the dataset's disagree
    (None if none), with both tokenizations; the sample: every piece of the dataset's vocabulary
    as text (`Tokenizer.vocabulary_texts`), sentences of consecutive ones, and runs of rare
    characters (for the byte pieces)."""
    import transformers

    from pipeline.tokenizer import load_tokenizer

    ours = load_tokenizer(dataset_tokenizer)
    try:
        hf = transformers.AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError) as err:
        raise UserError(
            f"{key}: {directory} has no tokenizer to check against the dataset's: "
            f"{str(err).splitlines()[0]}"
        ) from None
    words = ours.vocabulary_texts()
    sentences = [
        "".join(words[i : i + SAMPLE_SENTENCE_PIECES])
        for i in range(0, len(words), SAMPLE_SENTENCE_PIECES)
    ]
    # Characters a vocabulary rarely holds, for its byte pieces: private use, Cyrillic, CJK, emoji.
    rare = [
        "".join(map(chr, range(start, start + 64)))
        for start in (0xE000, 0xE040, 0x0400, 0x4E00, 0x1F600)
    ]
    sample = words + sentences + rare
    theirs = hf(sample, add_special_tokens=False)["input_ids"]
    for text, there, here in zip(sample, theirs, ours.encode_batch(sample)):
        if there != here:
            return text, there, here
    return None, [], []
