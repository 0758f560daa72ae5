"""One route from a config to a resolved run, taken by the trainer and by its dry run alike.

`resolve(cfg, world)` returns the run as it would start (its task, batch plan, the dataset opened
once with its tokenizer's identity, and the model config with the data's vocabulary and special
ids) together with every problem found on the way, in the order a run meets them. The trainer
(`launch.train.setup`) stops at the first; the dry run (`launch.preflight`) lists them all and
adds the checks that need no more than what was resolved (shards, figures, warm starts, run_dir).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from pathlib import Path

from common.configure import UserError
from launch.config import BatchPlan, TrainConfig, batch_plan, field_problems
from launch.lm_eval.tasks import training_problem
from launch.preconditions import TargetSide, data_fits_model, target_side, with_data_tokenizer
from launch.tasks import TASKS, Task
from model import ModelConfig
from pipeline import remote
from pipeline.format import (
    Dataset,
    dataset_specials,
    open_dataset,
    tokenizer_files,
    vocabulary_problem,
)
from pipeline.specials import Specials


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every problem the types cannot express, each message starting with its key; empty if
    none. The task's name first, then each field's and section's own (`field_problems`), then
    what needs two sections or the task table. All of them, not only the first: a dry run
    (`launch.preflight`) lists them at once."""
    task = TASKS.get(cfg.task)
    ds = cfg.deepspeed
    checks = [
        (task is not None, f"task: {cfg.task!r} is not one of {', '.join(TASKS)}"),
        *((False, message) for message in field_problems(cfg)),
        (
            cfg.optim.implementation == "auto" or not ds.offload_optimizer,
            "optim.implementation: with deepspeed.offload_optimizer DeepSpeed's "
            "CPU Adam steps; leave it auto",
        ),
        (
            not (cfg.compile_scope == "model" and ds.zero_stage == 3),
            "compile_scope: model needs deepspeed.zero_stage 0-2 (ZeRO-3 gathers parameters in "
            "hooks that break the graph); use blocks or auto",
        ),
    ]
    if task is not None:  # the rules below depend on what the task is
        warm_startable = [name for name, t in TASKS.items() if t.warm_startable]
        checks += [
            (
                cfg.model.arch == task.arch,
                f"model.arch: task {cfg.task} trains {task.arch}, not {cfg.model.arch}",
            ),
            (
                task.warm_startable or not (cfg.init.encoder or cfg.init.decoder),
                f"init: warm starting is for task {' or '.join(warm_startable)}",
            ),
        ]
    if cfg.lm_eval.every:
        checks.append(
            (
                cfg.task == "causal_lm",
                f"lm_eval.every: the lm-eval tasks score a causal_lm, not {cfg.task}",
            )
        )
    return [message for ok, message in checks if not ok]


def check_config(cfg: TrainConfig) -> Task:
    """The run's task, or a UserError with the first of `config_problems`.

    The model config's own checks (`ModelConfig.validate`) run once, where the model is built:
    `model.vocab_size: 0` is only resolved from the data then."""
    problems = config_problems(cfg)
    if problems:
        raise UserError(problems[0])
    return TASKS[cfg.task]


@dataclass(frozen=True)
class Problem:
    """One thing that would stop the run: the config key to change and what is wrong."""

    key: str  # the config key to change (or the flag)
    message: str
    line: str = ""  # the trainer's one-line error, when it is not `key: message`

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"

    @property
    def error(self) -> str:
        """What the trainer says when it stops at this problem."""
        return self.line or str(self)

    @classmethod
    def from_line(cls, line: str) -> Problem:
        """A message that already starts with its key (`config_problems`, most UserErrors)."""
        key, _, message = line.partition(": ")
        return cls(key, message, line) if message else cls("config", line, line)


@dataclass(frozen=True)
class World:
    size: int
    ranks_per_node: int
    source: str  # where the size came from, for the dry run's report

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.ranks_per_node)


@dataclass(frozen=True)
class DatasetHandle:
    """The dataset as a run resolves it, once: the manifest (read by `open_dataset`), the fetch
    settings it was read with, and its tokenizer's identity."""

    dataset: Dataset
    fetch: remote.FetchConfig
    vocab_size: int
    tokenizer_sha256: str
    specials: Specials
    tokenizer_files: tuple[str, ...]  # in the dataset; the first fixes its ids
    target: TargetSide | None  # a translation target's own tokenizer

    @property
    def manifest(self) -> dict:
        return self.dataset.manifest


@dataclass(frozen=True)
class ResolvedRun:
    """A config as the run takes it; None where a problem kept a part from resolving."""

    cfg: TrainConfig  # grad_accum from the plan, the model config below (when they resolved)
    task: Task | None
    world: World
    plan: BatchPlan | None
    data: DatasetHandle | None  # None: unreadable, or a planned dataset not made yet
    model: ModelConfig | None  # None: the vocabulary is unknown or the config is invalid
    planned: bool = False  # data_dir is a dataset a prepare stage will make (not there yet)


def resolve(
    cfg: TrainConfig, world: World, planned_vocab: int | None = None
) -> tuple[ResolvedRun, list[Problem]]:
    """`cfg` resolved for `world` (see the module's docstring). `planned_vocab`: the vocabulary of
    a dataset a prepare stage will make, taken while a local `data.data_dir` does not exist."""
    problems = [Problem.from_line(line) for line in config_problems(cfg)]
    if cfg.task == "causal_lm":  # config_problems names lm_eval.every on another task
        lm_eval = cfg.lm_eval
        if problem := training_problem(lm_eval.every, lm_eval.tasks, lm_eval.split):
            problems.append(Problem.from_line(problem))
    task = TASKS.get(cfg.task)
    plan = None
    if cfg.data.micro_batch_size > 0 and cfg.grad_accum > 0:
        try:
            plan = batch_plan(cfg, world.size)
            cfg = replace(cfg, grad_accum=plan.grad_accum)
        except UserError as err:
            problems.append(Problem.from_line(str(err)))
    data_dir = cfg.data.data_dir
    planned = (
        planned_vocab is not None and not remote.is_url(data_dir) and not Path(data_dir).exists()
    )
    handle = None if planned else _open(cfg, problems)
    if handle is not None and task is not None:
        if problem := data_fits_model(data_dir, handle.manifest, task.name, cfg.model):
            problems.append(Problem("model.max_seq_len", problem, problem))
    vocab = handle.vocab_size if handle is not None else planned_vocab
    model = _model_config(cfg, handle, vocab, problems)
    if model is not None:
        cfg = replace(cfg, model=model)
    return ResolvedRun(cfg, task, world, plan, handle, model, planned), problems


def _open(cfg: TrainConfig, problems: list[Problem]) -> DatasetHandle | None:
    """`data.data_dir`'s manifest, read once, and its tokenizer's identity."""
    fetch = remote.FetchConfig.from_loader_config(cfg.data)
    try:
        dataset = open_dataset(cfg.data.data_dir, fetch)
    except UserError as err:
        problems.append(Problem("data.data_dir", str(err), str(err)))
        return None
    manifest = dataset.manifest
    # The vocabulary every reader takes is the manifest's: its tokenizer's id range, or the run
    # would stop at its first batch, every id above the recorded size read as damage.
    if problem := vocabulary_problem(cfg.data.data_dir, manifest, fetch):
        problems.append(Problem("data.data_dir", problem, problem))
    return DatasetHandle(
        dataset,
        fetch,
        int(manifest["tokenizer"]["vocab_size"]),
        manifest["tokenizer"]["sha256"],
        dataset_specials(manifest),
        tuple(tokenizer_files(manifest)),
        target_side(manifest),
    )


def _model_config(
    cfg: TrainConfig, data: DatasetHandle | None, vocab: int | None, problems: list[Problem]
) -> ModelConfig | None:
    """The model config with the data's vocabulary (`model.vocab_size: 0` asks for it) and its
    tokenizer's special ids, checked by `ModelConfig.validate`."""
    model_cfg = cfg.model
    if model_cfg.vocab_size == 0 and vocab is None:
        return None
    if vocab is not None:
        model_cfg, problem = with_data_tokenizer(
            model_cfg,
            vocab,
            data.specials if data is not None else None,
            cfg.data.data_dir,
            cfg.init.model,
            data.target if data is not None else None,
        )
        if problem:
            key = "init.model" if problem.startswith("init.model: ") else "model.vocab_size"
            message = problem.removeprefix(f"{key}: ").removeprefix(f"{key}=")
            problems.append(Problem(key, message, problem))
    try:
        model_cfg.validate()
    except ValueError as err:
        # validate stops at its first problem; name the field it blames (the one before its
        # first ": ", else the last one it mentions, as in "d_model=768 is not divisible by
        # n_heads=5").
        message = str(err).removeprefix("model config: ")
        named = re.findall(r"([A-Za-z_][\w.]*)=", message.split(": ", 1)[0])
        problems.append(Problem(f"model.{named[-1]}" if named else "model", message, str(err)))
        return None
    return model_cfg
