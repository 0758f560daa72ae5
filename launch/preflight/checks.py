"""The dry run: the config resolved as the trainer resolves it, each check in the order a run meets
it, every problem listed at once; `main` is `python -m launch.preflight`, `main_dry_run` is
`launch.train ... --dry-run`."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from common.configure import (
    UserError,
    parse_cli,
    strip_launcher_args,
)
from common.storage import file_system
from launch import checkpoint as ckpt
from launch import distributed as dist
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.config import deepspeed_config
from launch.preflight.data import check_data, planned_data
from launch.preflight.figures import batch_figures, model_figures
from launch.preflight.report import PlannedData, Report, render
from launch.preflight.sources import check_init_model, check_warm_start
from launch.resolve import Problem, World, resolve
from launch.tracking import wandb_dir, wandb_settings

USAGE = """usage: python -m launch.preflight [--world-size N] [--ranks-per-node N] [--json] \
CONFIG.yaml [key.sub=value ...]
   or: python -m launch.train CONFIG.yaml [key.sub=value ...] --dry-run [--world-size N] \
[--ranks-per-node N] [--json]

Resolve a training run and report it without starting it; every problem is listed, exit 2 if any."""


def main(argv: list[str] | None = None) -> int:
    return main_dry_run(sys.argv[1:] if argv is None else argv)


def main_dry_run(argv: list[str]) -> int:
    """`launch.train`'s `--dry-run`: argv is its command line without that flag
    (CONFIG.yaml [key.sub=value ...], plus this module's own flags anywhere). Prints the report;
    returns 2 if it found a problem, else 0."""
    from launch.run_config import training_config

    options, rest = _split_flags(strip_launcher_args(argv))
    # As the run resolves it: init.model's directory gives the model config (a misfit: one line).
    cfg = training_config(parse_cli(TrainConfig, rest, usage=USAGE), rest[1:])
    report = preflight(
        cfg, world_size=options["world_size"], ranks_per_node=options["ranks_per_node"]
    )
    if options["json"]:
        print(
            json.dumps(
                {
                    "config": rest[0],
                    "ok": not report.problems,
                    "facts": report.facts,
                    "figures": report.figures,
                    "problems": [_keyed(p) for p in report.problems],
                    "warnings": [_keyed(w) for w in report.warnings],
                },
                indent=1,
            )
        )
    else:
        print(render(report, rest[0]))
    return 2 if report.problems else 0


def _keyed(problem: Problem) -> dict[str, str]:
    return {"key": problem.key, "message": problem.message}


def _split_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """This module's flags (`--world-size N`, `--ranks-per-node N`, `--json`, each anywhere, `=` or
    a space before a value) apart from the trainer's own grammar."""
    options: dict[str, Any] = {"world_size": None, "ranks_per_node": None, "json": False}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--world-size", "--ranks-per-node"):
            value = value if eq else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"{name}: expects a positive integer, got {value!r}")
            options[name[2:].replace("-", "_")] = int(value)
        elif arg == "--json":
            options["json"] = True
        else:
            rest.append(arg)
    return options, rest


def preflight(
    cfg: TrainConfig,
    world_size: int | None = None,
    ranks_per_node: int | None = None,
    planned: PlannedData | None = None,
) -> Report:
    """Resolve `cfg` by the trainer's own route (`launch.resolve.resolve`), without a process
    group or an engine, then check what was resolved; every problem listed, not only the first.
    `planned`: the dataset a prepare stage will make, taken for `data.data_dir` while that does
    not exist."""
    world = world_from_flags(world_size, ranks_per_node)
    resolved, problems = resolve(
        cfg, world, planned_vocab=planned.vocab_size if planned is not None else None
    )
    report = Report(problems=problems)
    if 0 < cfg.max_steps <= cfg.schedule.warmup_steps:
        report.warn(
            "schedule.warmup_steps",
            f"{cfg.schedule.warmup_steps:,} but max_steps is {cfg.max_steps:,}: the "
            "learning rate never reaches optim.lr",
        )
    task, plan, model_cfg = resolved.task, resolved.plan, resolved.model
    if task is not None:
        report.facts["task"] = f"{task.name}: {task.arch} on the {task.dataset!r} shards"
    report.facts["world size"] = (
        f"{world.size} ({world.source}): {world.nodes} node{'s' * (world.nodes > 1)} x "
        f"{world.ranks_per_node} rank{'s' * (world.ranks_per_node > 1)}"
    )
    report.figures.update(
        world_size=world.size, ranks_per_node=world.ranks_per_node, nodes=world.nodes
    )
    if resolved.planned:
        data = planned_data(cfg, task, planned, report)
    else:
        data = check_data(cfg, task, resolved.data, report)
    report.model_config = model_cfg
    if model_cfg is None:
        report.facts["parameters"] = (
            "unknown: model.vocab_size 0 takes the data's vocabulary, which could not be read"
            if cfg.model.vocab_size == 0 and data is None
            else "not counted: the model config has a problem (below)"
        )
    if plan is not None:
        batch_figures(cfg, task, plan, data, report)
        if model_cfg is not None and task is not None:
            model_figures(cfg, task, plan, world, model_cfg, data, report)
        check_deepspeed(cfg, plan, report)
    check_warm_start(cfg, task, model_cfg, data, report)
    check_init_model(cfg, data, report)
    check_run_dir(cfg, world, report)
    check_wandb(cfg, report)
    return report


def world_from_flags(world_size: int | None, ranks_per_node: int | None) -> World:
    """The world the job would have: `--world-size`, else the environment's."""
    if world_size is not None:
        return World(world_size, min(ranks_per_node or 1, world_size), "--world-size")
    denv = dist.read_env()
    return World(
        denv.world_size,
        min(ranks_per_node or denv.local_world_size, denv.world_size),
        "the environment's; --world-size N plans another",
    )


def check_deepspeed(cfg: TrainConfig, plan: BatchPlan, report: Report) -> None:
    """The DeepSpeed JSON derives from the config (and a user's own file merged over it)."""
    if cfg.deepspeed.precision == "fp16" and not torch.cuda.is_available():
        report.warn(
            "deepspeed.precision",
            "fp16 runs on GPUs only (dynamic loss scaling): fine for this dry run, "
            "which sees no CUDA, but the job itself needs GPUs",
        )
        # to check the rest of the dict
        cfg = replace(cfg, deepspeed=replace(cfg.deepspeed, precision="bf16"))
    try:
        deepspeed_config(cfg, plan)
    except UserError as err:
        report.problem_line(str(err))


def check_wandb(cfg: TrainConfig, report: Report) -> None:
    """W&B's mode is one W&B knows, and, unless it is off, W&B's directory (RUN_DIR/wandb) can be
    written or made: what the trainer checks before it builds anything
    (`launch.tracking.check_wandb_dir`), here by permission and mount flags (a dry run writes
    nothing; `os.access` answers for a read-only mount, root or not)."""
    try:
        mode, _ = wandb_settings(cfg.wandb)["mode"]
    except UserError as err:
        report.problem_line(str(err))
        return
    if mode == "disabled":
        return
    directory = wandb_dir(Path(cfg.run_dir).absolute())
    if not directory.exists():
        # made in run_dir by W&B, where run_dir can be written (check_run_dir)
        report.facts["W&B"] = f"{mode}, in {directory} (to be made)"
        return
    if not directory.is_dir():
        report.problem(
            "wandb.mode",
            f"W&B's directory {directory} is a file, not a directory; move it away, or turn W&B "
            "off with wandb.mode=disabled",
        )
        return
    if os.access(directory, os.W_OK | os.X_OK):
        report.facts["W&B"] = f"{mode}, in {directory}"
        return
    read_only = bool(os.statvfs(directory).f_flag & os.ST_RDONLY)
    why = f"{file_system(directory)} is mounted read-only" if read_only else "not writable"
    report.problem(
        "wandb.mode",
        f"W&B's directory {directory} cannot be written ({why}); make it writable, choose "
        "another run_dir (W&B writes in RUN_DIR/wandb), or turn W&B off with wandb.mode=disabled",
    )


def check_run_dir(cfg: TrainConfig, world: World, report: Report) -> None:
    """run_dir can be written (or made), and what `resume` would continue from."""
    run_dir = Path(cfg.run_dir).absolute()
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        report.problem("run_dir", f"{existing} is not a directory, so {run_dir} cannot be made")
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == run_dir else f", so {run_dir} cannot be made"
        report.problem("run_dir", f"{existing} is not writable{made}")
        return
    try:
        # newest first, as the trainer tries them
        candidates = ckpt.resume_candidates(cfg.resume, run_dir)
    except UserError as err:
        report.problem("resume", str(err).removeprefix("resume: "))
        return
    resume_from = candidates[0] if candidates else None
    if resume_from is None:
        report.facts["run_dir"] = (
            f"{run_dir} ({'exists' if run_dir.exists() else 'will be made'}); a fresh start"
        )
        return
    root, tag = resume_from
    report.facts["run_dir"] = f"{run_dir}; resume from {root / tag}"
    saved = ckpt.saved_world_size(root, tag)
    if saved is not None and saved != world.size:
        report.warn(
            "resume",
            f"{root / tag} was written by {saved} ranks, this job would have {world.size}: a ZeRO "
            "checkpoint is tied to its world size "
            "(launch.deepspeed.universal.to_universal converts it)",
        )
