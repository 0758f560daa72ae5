"""`python -m launch.main CONFIG.yaml [key.sub=value ...] --dry-run`: the whole chain
checked, nothing started.

Before a job that runs for days is queued: every stage's config resolved with the overrides the
main job would pass it (`launch.main`'s own functions make both), and each problem a stage would
meet, all at once. The prepare stage: its config and its sources' files (or the dataset, if it
exists: the job would skip the stage). Each training run: `launch.preflight` on the job's world of
`nproc` ranks, against the dataset, or against what the prepare config will make
(`preflight.PlannedData`). Each warm start: the pretraining run's model, the one its export will
hold, against the translation model's stack it fills (`launch.preflight.sources.check_source_fits`,
the fields `model.warm_start` requires equal). Exit 2 if any problem, else 0; nothing is written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from common.configure import UserError, load_config
from launch.config import MainConfig, TrainConfig
from launch.main import plan as job
from launch.preflight.checks import preflight
from launch.preflight.report import PlannedData, Report, render
from launch.preflight.sources import check_source_fits
from launch.run_config import training_config
from model.config import STACKS
from pipeline.format import MANIFEST
from pipeline.prepare.checks import check_config as check_prepare_config
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.sources import expand_paths, source_list, source_where

STACK_OF = dict(zip(STACKS, (0, 1)))  # (encoder, decoder) index of a start's side


def dry_run(cfg: MainConfig, config: str) -> int:
    """Print each stage's report and the chain's verdict; 2 if any stage has a problem, else 0."""
    problems = chain_problems(cfg, config)
    if problems:
        print(f"chain: {len(problems)} problem{'s' * (len(problems) > 1)}:")
        print("\n".join(f"  {line}" for line in problems))
        print("verdict: this job would fail (exit 2)")
        return 2
    print("verdict: ready: every stage resolves, every warm start fits (exit 0)")
    return 0


def chain_problems(cfg: MainConfig, config: str) -> list[str]:
    """Every problem that would stop a stage of the chain, each starting with its stage; the
    stages' reports go to stdout. The job runs it (quietly) before its first stage too."""
    # chosen at run time, kept in out_dir
    cfg = replace(cfg, wandb_group=cfg.wandb_group or "WANDB_GROUP")
    out = Path(cfg.out_dir)
    problems: list[str] = [f"main: {line}" for line in job.main_problems(cfg)]
    print(f"dry run of {config}: the whole chain, nothing started, nothing written")
    planned = check_prepare(cfg, problems)
    starts = job.parse_starts(cfg)

    sources = {}
    for name in job.pretrained_needed(starts):
        stage = f"pretrain {name}"
        overrides = job.pretrain_overrides(cfg, name, out / f"pretrain-{name}")
        report = stage_report(stage, getattr(cfg, f"{name}_config"), overrides, cfg, planned)
        sources[name] = report.model_config  # the model its export will hold
        finish(stage, report, problems)

    if starts:
        stage = f"fine-tune ({', '.join(cfg.starts)})"
        # One report for every start: they differ only in init.*, checked below against each source.
        report = stage_report(
            stage,
            cfg.translation_config,
            job.finetune_overrides(cfg, out / "finetune-START", {}),
            cfg,
            planned,
        )
        model_cfg = report.model_config
        for side in STACKS:
            for name in sorted({start[STACK_OF[side]] for start in starts} - {"random"}):
                if sources.get(name) is None or model_cfg is None:
                    continue  # its own stage has said why it cannot be resolved
                before = len(report.problems)
                check_source_fits(
                    report,
                    f"init.{side}",
                    f"{getattr(cfg, f'{name}_config')} (pretrain {name})",
                    sources[name],
                    side,
                    model_cfg,
                )
                if len(report.problems) == before:
                    report.facts[f"init.{side} <- {name}"] = report.facts.pop(f"init.{side}")
        finish(stage, report, problems)
    return problems


def check_prepare(cfg: MainConfig, problems: list[str]) -> PlannedData | None:
    """The prepare stage: skipped by the job if the dataset exists (it validates it first), else
    its config with the job's overrides and its sources' files; what it will make, if it can."""
    if (Path(cfg.data_dir) / MANIFEST).is_file():
        print(
            f"== prepare: skipped if {cfg.data_dir} validates "
            "(pipeline.validate; else prepared again)"
        )
        return None
    overrides = job.prepare_overrides(cfg)
    print(f"== prepare: python -m pipeline.prepare {cfg.prepare_config} {' '.join(overrides)}")
    try:
        prepare = load_config(PrepareConfig, cfg.prepare_config, overrides)
        check_prepare_config(prepare)
        files = [
            len(expand_paths(source, source_where(prepare, i)))
            for i, source in enumerate(source_list(prepare))
        ]
    except UserError as err:
        print(f"  problem: {err}")
        problems.append(f"prepare: prepare_config: {err}")
        return None
    vocabulary = planned_vocabulary(prepare, problems)
    if vocabulary is None:
        return None
    print(
        f"  {sum(files):,} source files; tasks {', '.join(prepare.tasks)}; seq_len "
        f"{prepare.seq_len}; vocabulary {vocabulary}"
    )
    return PlannedData(
        source=cfg.prepare_config,
        vocab_size=vocabulary,
        tasks=tuple(prepare.tasks),
        seq_len=prepare.seq_len,
        max_tokens=prepare.translation.max_tokens,
    )


def planned_vocabulary(prepare: PrepareConfig, problems: list[str]) -> int | None:
    """The vocabulary the prepare stage will record: a given tokenizer's id range (highest id + 1,
    as prepare records it), else the size asked of the one it trains; None after a problem."""
    if not prepare.tokenizer.path:
        return prepare.tokenizer.vocab_size
    from pipeline.tokenizer import load_tokenizer

    try:
        return load_tokenizer(prepare.tokenizer.path, prepare.tokenizer.lang_tags).vocab_size
    except UserError as err:
        print(f"  problem: tokenizer.path: {err}")
        problems.append(f"prepare: tokenizer.path: {err}")
        return None


def stage_report(
    stage: str, config: str, overrides: list[str], cfg: MainConfig, planned: PlannedData | None
) -> Report:
    """One training stage's config as the job would resolve it, and its preflight
    on `nproc` ranks."""
    print(f"== {stage}: python -m launch.train {config} {' '.join(overrides)} ({cfg.nproc} ranks)")
    try:
        # the trainer's own route: init.model among the overrides gives the directory's model
        train_cfg = training_config(load_config(TrainConfig, config, overrides), overrides)
    except UserError as err:
        report = Report()
        report.problem_line(str(err))
        return report
    return preflight(train_cfg, world_size=cfg.nproc, ranks_per_node=cfg.nproc, planned=planned)


def finish(stage: str, report: Report, problems: list[str]) -> None:
    print("\n".join(f"  {line}" for line in render(report, stage).splitlines()[1:]))
    problems.extend(f"{stage}: {problem}" for problem in report.problems)
