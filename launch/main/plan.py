"""The main job's plan: its stages, the command and overrides each stage is given (one owner,
read by the job and by its dry run alike), and the overall ETA from the stages done."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.configure import UserError, parse_cli
from common.progress import interval
from launch.config import MainConfig, TrainConfig


def say(message: str) -> None:
    print(f"[main] {message}", file=sys.stderr, flush=True)


SIDES = ("random", "bert", "gpt")


@dataclass(frozen=True)
class Stage:
    label: str  # as the stage's lines name it: "pretrain gpt", "evaluate finetune-bert-gpt valid"
    kind: str  # stages of a kind take alike per unit of work
    work: float  # optimizer steps for a training stage, else 1


class StageClock:
    """The main job's overall ETA from what is known so far: each stage still to come is given the
    seconds per unit of work (steps, for training) of the stages of its kind run this time; the
    running stage, its own ETA where its progress line gives one (and, for a kind not yet timed,
    the rate that ETA implies for the rest of the kind). A kind with neither is left out of the
    figure and named, so the figure is then a lower bound; with nothing known it says so rather
    than give a bound of zero. Stages skipped (their output complete) count as done and take
    nothing."""

    def __init__(self, stages: list[Stage]):
        self.stages = stages
        self.position = 0  # the stages before it are done, run or skipped
        self.timed: dict[str, tuple[float, float]] = {}  # kind: (seconds, work) of its stages run

    def _index(self, label: str) -> int:
        return [stage.label for stage in self.stages].index(label)

    def start(self, label: str) -> None:
        self.position = self._index(label)

    def finish(self, label: str, seconds: float) -> None:
        index = self._index(label)
        kind, work = self.stages[index].kind, self.stages[index].work
        before = self.timed.get(kind, (0.0, 0.0))
        self.timed[kind] = (before[0] + seconds, before[1] + work)
        self.position = index + 1

    def eta(self, running_s: float | None = None, running_left_s: float | None = None) -> str:
        """'N/M stages done, overall ETA T': `running_s` is how long the stage at the current
        position has run (None: none runs), `running_left_s` what its own progress line says is
        left of it (None: it says nothing)."""
        rates = {kind: seconds / work for kind, (seconds, work) in self.timed.items()}
        current = self.stages[self.position] if self.position < len(self.stages) else None
        own = running_s is not None and running_left_s is not None and current is not None
        if own and current.kind not in rates and current.work > 0:
            rates[current.kind] = (running_s + running_left_s) / current.work
        left, untimed = 0.0, []
        for offset, stage in enumerate(self.stages[self.position :]):
            running = offset == 0 and running_s is not None
            if running and own:
                left += running_left_s
                continue
            if stage.kind not in rates:
                untimed += [stage.kind] if stage.kind not in untimed else []
                continue
            estimate = rates[stage.kind] * stage.work
            left += max(estimate - running_s, 0.0) if running else estimate
        done = f"{self.position}/{len(self.stages)} stages done"
        if not untimed:
            return f"{done}, overall ETA {interval(left)}"
        what = f"({', '.join(untimed)} not yet timed)"
        if left <= 0:
            return f"{done}, overall ETA not known yet {what}"
        return f"{done}, overall ETA >= {interval(left)} {what}"


_OWN_ETA = re.compile(r"\bETA (\d+(?::\d\d){1,2})\b")


def own_eta_s(progress_line: str) -> float | None:
    """The seconds a stage's progress line says are left of it (`ETA [H:]MM:SS`), or None."""
    match = _OWN_ETA.search(progress_line)
    if match is None:
        return None
    seconds = 0.0
    for part in match.group(1).split(":"):
        seconds = seconds * 60 + int(part)
    return seconds


def plan_stages(cfg: MainConfig, starts: list[tuple[str, str]]) -> list[Stage]:
    """Every stage of the job in order, labelled as `_run` names it, for the overall ETA."""
    stages = [Stage("prepare", "prepare", 1)]
    for name in pretrained_needed(starts):
        stages += [
            Stage(f"pretrain {name}", "pretrain", pretrain_steps(cfg, name)),
            Stage(f"export {name}", "export", 1),
        ]
    for encoder, decoder in starts:
        stages.append(Stage(f"fine-tune {encoder}-{decoder}", "fine-tune", cfg.finetune_steps))
        stages += [
            Stage(f"evaluate finetune-{encoder}-{decoder} {split}", "evaluate", 1)
            for split in cfg.eval_splits
        ]
    return stages


def parse_starts(cfg: MainConfig) -> list[tuple[str, str]]:
    """(encoder, decoder) of each well-formed start of `starts`."""
    pairs = [start.partition("/")[::2] for start in cfg.starts]
    return [
        (encoder, decoder) for encoder, decoder in pairs if encoder in SIDES and decoder in SIDES
    ]


def main_problems(cfg: MainConfig) -> list[str]:
    """Every problem of the main job's own keys, each line starting with its key; empty if none."""
    problems = [
        f"starts: {start!r} is not ENCODER/DECODER with each of {', '.join(SIDES)}"
        for start in cfg.starts
        if len(start.split("/")) != 2 or not set(start.split("/")) <= set(SIDES)
    ]
    problems += [
        f"eval_splits: {split!r} is not train, valid or test"
        for split in cfg.eval_splits
        if split not in ("train", "valid", "test")
    ]
    if cfg.pretrain_steps <= 0 or cfg.bert_pretrain_steps < 0 or cfg.finetune_steps <= 0:
        problems.append(
            f"pretrain_steps={cfg.pretrain_steps}, bert_pretrain_steps={cfg.bert_pretrain_steps}, "
            f"finetune_steps={cfg.finetune_steps}: steps must be positive "
            "(bert_pretrain_steps 0: pretrain_steps)"
        )
    if cfg.nproc < 1:
        problems.append(f"nproc: {cfg.nproc}: must be at least 1")
    if cfg.beam < 1:
        problems.append(f"beam: {cfg.beam}: must be at least 1")
    for key in ("prepare_config", "gpt_config", "bert_config", "translation_config"):
        if not Path(getattr(cfg, key)).is_file():
            problems.append(f"{key}: config file not found: {getattr(cfg, key)}")
    return problems


def check_main(cfg: MainConfig) -> list[tuple[str, str]]:
    """The starts, or a UserError with the first of `main_problems`."""
    problems = main_problems(cfg)
    if problems:
        raise UserError(problems[0])
    return parse_starts(cfg)


def pretrained_needed(starts: list[tuple[str, str]]) -> list[str]:
    """The pretraining runs the starts need, in the order they run (both when
    there are no starts)."""
    needed = {side for start in starts for side in start} - {"random"}
    return [name for name in ("gpt", "bert") if name in needed or not starts]


def prepare_overrides(cfg: MainConfig) -> list[str]:
    return [*cfg.prepare_overrides, f"output_dir={cfg.data_dir}", "overwrite=true"]


def pretrain_overrides(cfg: MainConfig, name: str, run_dir: Path) -> list[str]:
    """What the job passes to the `name` (gpt | bert) pretraining run: its own keys, then the
    stage's overrides."""
    return [
        f"data.data_dir={cfg.data_dir}",
        f"run_dir={run_dir}",
        f"max_steps={pretrain_steps(cfg, name)}",
        *_zero_stage(cfg, getattr(cfg, f"{name}_overrides")),
        *_wandb_overrides(cfg),
        *getattr(cfg, f"{name}_overrides"),
    ]


def finetune_overrides(cfg: MainConfig, run_dir: Path, init: dict[str, str]) -> list[str]:
    """What the job passes to a fine-tuning run; `init`: stack -> exported
    directory of each warm side.
    Random sides are left to the config's default (""): an empty override would read as null."""
    return [
        f"data.data_dir={cfg.data_dir}",
        f"run_dir={run_dir}",
        f"max_steps={cfg.finetune_steps}",
        *_zero_stage(cfg, cfg.translation_overrides),
        *_wandb_overrides(cfg),
        *cfg.translation_overrides,
        *(f"init.{stack}={directory}" for stack, directory in init.items()),
    ]


def _zero_stage(cfg: MainConfig, stage_overrides: list[str]) -> list[str]:
    """The job's ZeRO stage for a run, unless the stage's own overrides set one (theirs wins,
    and the command line shows it once)."""
    if any(o.startswith("deepspeed.zero_stage=") for o in stage_overrides):
        return []
    return [f"deepspeed.zero_stage={cfg.deepspeed.zero_stage}"]


def _wandb_overrides(cfg: MainConfig) -> list[str]:
    """The training runs' W&B keys: the job's group, and its mode only where set (an empty
    override would read as null; unset, each run takes WANDB_MODE, else offline)."""
    return [
        f"wandb.group={cfg.wandb_group}",
        *([f"wandb.mode={cfg.wandb_mode}"] if cfg.wandb_mode else []),
    ]


def wandb_group(cfg: MainConfig, out: Path) -> str:
    """One W&B group for the job's runs: `wandb_group`, else $WANDB_RUN_GROUP, else the one this
    out_dir was given when the job first ran there (OUT/wandb_group), else a new one, kept there so
    that a re-run that skips finished stages adds its runs to the same group."""
    if cfg.wandb_group or os.environ.get("WANDB_RUN_GROUP"):
        return cfg.wandb_group or os.environ["WANDB_RUN_GROUP"]
    kept = out / "wandb_group"
    if not kept.is_file():
        kept.write_text(f"{out.resolve().name}-{time.strftime('%Y%m%d-%H%M%S')}\n")
    return kept.read_text().strip()


def pretrain_steps(cfg: MainConfig, name: str) -> int:
    return (
        cfg.bert_pretrain_steps
        if name == "bert" and cfg.bert_pretrain_steps
        else cfg.pretrain_steps
    )


def train_command(nproc: int, config: str, overrides: list[str]) -> list[str]:
    """`launch.train CONFIG overrides` on `nproc` ranks (torchrun when more than one). With
    CUDA, one rank per GPU: on a machine with fewer GPUs than `nproc` the job runs on as
    many ranks as there are GPUs, with gradient accumulation raised to keep the global batch
    (and so the samples of every step) of `nproc` ranks."""
    import torch  # here: the main job's --help and config errors answer without torch's import

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else nproc
    if gpus < nproc:
        accum = parse_cli(TrainConfig, [config, *overrides], usage="").grad_accum
        if (accum * nproc) % gpus:
            raise UserError(
                f"nproc={nproc} ranks, but this machine has {gpus} GPUs, and the global batch of "
                f"{nproc} ranks x grad_accum {accum} does not divide over {gpus}; set nproc={gpus}"
            )
        say(
            f"{gpus} GPU{'s' if gpus > 1 else ''} for nproc={nproc}: {gpus} "
            f"rank{'s' if gpus > 1 else ''} with "
            f"grad_accum={accum * nproc // gpus} (the same global batch)"
        )
        nproc, overrides = gpus, [*overrides, f"grad_accum={accum * nproc // gpus}"]
    return [*python_launcher(nproc), "-m", "launch.train", config, *overrides]


def torchrun(nproc: int) -> list[str]:
    """The start of a command that runs a module or script on `nproc` ranks of this machine
    (torchrun, standalone: its own rendezvous on a free port)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
    ]


def python_launcher(nproc: int) -> list[str]:
    """`torchrun(nproc)` for several ranks, the bare interpreter for one."""
    return torchrun(nproc) if nproc > 1 else [sys.executable]


def finished(run_dir: Path, steps: int) -> bool:
    final = run_dir / "final.json"
    return final.is_file() and json.loads(final.read_text()).get("step") == steps
