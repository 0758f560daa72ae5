"""The dry run's checks of what a run starts from: `init.model`'s tokenizer against the dataset's,
and each warm-start source (an export of ours, a Hugging Face directory, a config to be trained)
against the stack it fills, as the trainer checks them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from common.configure import (
    UserError,
    config_from_dict,
    load_config,
)
from launch.config import TrainConfig
from launch.init_model import is_hf_dir
from launch.model_dir import CONFIG as EXPORT_CONFIG
from launch.model_dir import WEIGHTS as EXPORT_WEIGHTS
from launch.preflight.report import DataInfo, Report
from launch.tasks import Task
from model import ModelConfig
from model.config import STACKS
from model.warm_start import SOURCE_CLASSES, architecture_fields
from pipeline import remote
from pipeline.format import read_manifest


def check_warm_start(
    cfg: TrainConfig,
    task: Task | None,
    model_cfg: ModelConfig | None,
    data: DataInfo | None,
    report: Report,
) -> None:
    """Each `init.encoder` / `init.decoder`: an exported directory (launch.export) made with the
    dataset's tokenizer, whose architecture fits its stack (what `model.warm_start` checks
    before loading; the weights are not read here), or the training config that will make it."""
    if task is None or not task.warm_startable:
        return  # config_problems has said that init is for another task
    for side in STACKS:
        given = getattr(cfg.init, side)
        if not given:
            continue
        key, path = f"init.{side}", Path(given)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            source = _source_from_config(key, path, data, report)
            what = f"{path} (the model its run will export)"
        elif is_hf_dir(path):
            source = _source_from_hf(key, path, side, cfg, data, report)
            what = f"{path} (Hugging Face)"
        else:
            source = _source_from_export(key, path, side, cfg, data, report)
            what = str(path)
        if source is not None and model_cfg is not None:
            check_source_fits(report, key, what, source, side, model_cfg)


def check_init_model(cfg: TrainConfig, data: DataInfo | None, report: Report) -> None:
    """`init.model`'s tokenizer against the dataset's, as the trainer checks it before it loads
    the weights (`init_model.check_tokenizer`: the same file, or the same ids). Not when another
    problem names init.model already (a vocabulary of another size), nor for a dataset at a URL
    (the trainer checks the fetched file)."""
    from launch import init_model

    if not cfg.init.model or data is None or remote.is_url(cfg.data.data_dir):
        return
    if any(problem.key == "init.model" for problem in report.problems):
        return
    local = local_tokenizer(cfg, "source")
    if local is None:
        return  # check_data has said what is wrong with it
    try:
        init_model.check_tokenizer(cfg.init.model, local)
    except UserError as err:
        report.problem_line(str(err))
        return
    read = ""
    if cfg.model.family:  # the decoder family the directory's config named
        from model.hf_decoders import FAMILIES

        family = FAMILIES[cfg.model.family]
        read = f"a {family.name} model ({family.model_class}); "
    report.facts["init.model"] = f"{cfg.init.model}: {read}its tokenizer gives the dataset's ids"


def local_tokenizer(cfg: TrainConfig, text_side: str) -> Path | None:
    """The local dataset's file that fixes one side's ids; None if it cannot be read."""
    from pipeline.format import tokenizer_files

    try:
        manifest = read_manifest(cfg.data.data_dir)
    except UserError:
        return None
    local = Path(cfg.data.data_dir) / tokenizer_files(manifest, text_side)[0]
    return local if local.is_file() else None


def _side_tokenizer(side: str, data: DataInfo | None) -> tuple[str | None, str]:
    """The sha256 of the tokenizer a stack's source must have been trained with (the encoder's:
    the source side's; the decoder's: a target tokenizer of its own, else the
    same), and its name."""
    if data is None:
        return None, "the dataset's tokenizer"
    if side == "decoder" and data.target is not None:
        return data.target.sha256, "the dataset's target tokenizer"
    return data.tokenizer_sha256, (
        "the dataset's source tokenizer" if data.target is not None else "the dataset's tokenizer"
    )


def _source_from_hf(
    key: str, path: Path, side: str, cfg: TrainConfig, data: DataInfo | None, report: Report
) -> ModelConfig | None:
    """A Hugging Face BERT, GPT-2 or Llama directory as a stack's source: its config with its
    side's special ids, and its tokenizer checked to be that side's (as the trainer checks it)."""
    from launch import init_model
    from launch.preconditions import model_ids

    try:
        source = init_model.model_config(str(path))
    except UserError as err:
        report.problem(key, str(err).removeprefix("init.model: "))
        return None
    if data is not None:
        specials = data.target.specials if side == "decoder" and data.target else data.specials
        if specials is not None:
            source = replace(source, **model_ids(specials))
        _check_source_tokenizer(key, path, side, cfg, data, report)
    return source


def _check_source_tokenizer(
    key: str, path: Path, side: str, cfg: TrainConfig, data: DataInfo, report: Report
) -> bool:
    """A warm-start source's tokenizer against its side's in a local dataset, as the trainer
    checks it (`init_model.check_tokenizer`); False (a problem reported) if it is another. A
    dataset at a URL: True, the trainer checks the fetched file."""
    from launch import init_model

    if remote.is_url(cfg.data.data_dir):
        return True
    text_side = "target" if side == "decoder" else "source"
    local = local_tokenizer(cfg, text_side)
    if local is None:
        return True  # check_data has said what is wrong with it
    try:
        init_model.check_tokenizer(
            str(path), local, key, text_side if data.target is not None else ""
        )
    except UserError as err:
        report.problem(key, str(err).removeprefix(f"{key}: "))
        return False
    return True


def _source_from_export(
    key: str, path: Path, side: str, cfg: TrainConfig, data: DataInfo | None, report: Report
) -> ModelConfig | None:
    if not (path / EXPORT_CONFIG).is_file() or not (path / EXPORT_WEIGHTS).is_file():
        report.problem(
            key,
            f"{path}: not an exported model directory (no {EXPORT_CONFIG} and "
            f"{EXPORT_WEIGHTS}; write one with launch.export)",
        )
        return None
    try:
        meta = json.loads((path / EXPORT_CONFIG).read_text())
        source = config_from_dict(ModelConfig, meta["model"], source=str(path / EXPORT_CONFIG))
    except (json.JSONDecodeError, KeyError, TypeError, UserError) as err:
        report.problem(key, f"{path / EXPORT_CONFIG}: unreadable: {err}")
        return None
    sha256 = meta.get("tokenizer_sha256")
    wanted, whose = _side_tokenizer(side, data)
    if wanted and sha256 != wanted and not remote.is_url(cfg.data.data_dir):
        # another file: compared by the ids it gives, as the trainer compares it
        _check_source_tokenizer(key, path, side, cfg, data, report)
    elif wanted and sha256 != wanted:
        report.problem(
            key,
            f"{path} was trained with another tokenizer (sha256 {str(sha256)[:12]}...) than "
            f"{whose} in {cfg.data.data_dir} ({wanted[:12]}...): its embeddings would not "
            "mean the same tokens",
        )
    return source


def _source_from_config(
    key: str, path: Path, data: DataInfo | None, report: Report
) -> ModelConfig | None:
    """The model a training config will export, its vocabulary (0) the dataset's: a plan, which
    the run itself cannot load (a warning says so)."""
    try:
        source = load_config(TrainConfig, path).model
    except UserError as err:
        report.problem(key, str(err))
        return None
    report.warn(
        key,
        f"{path} is a training config: its model is checked here; the run needs the directory "
        "launch.export writes from its checkpoint",
    )
    if source.vocab_size == 0:
        if data is None or data.vocab_size is None:
            return None
        source = replace(source, vocab_size=int(data.vocab_size))
    return source


def check_source_fits(
    report: Report, key: str, what: str, source: ModelConfig, side: str, model_cfg: ModelConfig
) -> None:
    """A warm-start source (`what`: where it comes from) against the Seq2Seq stack `side` it
    would fill: the fields `model.warm_start` requires equal; the problem names every
    one that differs."""
    if source.arch not in SOURCE_CLASSES:
        report.problem(
            key,
            f"{what} holds a {source.arch}; a warm start takes one of {', '.join(SOURCE_CLASSES)}",
        )
        return
    stack = model_cfg.for_stack(side)
    differ = [
        name for name in architecture_fields(side) if getattr(source, name) != getattr(stack, name)
    ]
    if differ:
        report.problem(
            key,
            f"{what} ({source.arch}) has "
            + ", ".join(f"{n}={getattr(source, n)!r}" for n in differ)
            + f" but the Seq2Seq {side} has "
            + ", ".join(f"{n}={getattr(stack, n)!r}" for n in differ),
        )
    else:
        report.facts[key] = f"{what}: {source.arch}, fits the {side}"
