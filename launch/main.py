"""`python -m launch.main CONFIG.yaml [key.sub=value ...]`: the whole chain, stage by stage, with a summary.

prepare (Ray) -> pretrain GPT and BERT (torchrun, DeepSpeed ZeRO) -> export -> fine-tune a
translation model from each requested start (encoder/decoder: random, bert or gpt) for the
same number of steps -> evaluate BLEU and chrF on valid and test -> a report directory
(OUT/report: summary.md and .json with the table, loss curves as PNG), the table printed.

Each stage runs the project's own entry points as subprocesses, writes into its own
directory under `out_dir`, and is skipped when its output already exists and is complete
(the dataset must also pass `pipeline.validate`); a re-run says what it skipped. While a stage
runs, its latest progress line and the job's overall ETA (`StageClock`) are printed every
PROGRESS_EVERY_S seconds. A failed stage stops the run with its error and leaves earlier
stages' outputs as they were. SIGTERM, SIGINT or SIGHUP to the main job stops the stage it runs
too (a training stage checkpoints), and a re-run continues from there.
`configs/transfer.yaml` is the transfer experiment (all four starts; Rothe et al. 2020);
`configs/transfer_gpu.yaml` the same at GPT-2 small / BERT-base size on 8 GPUs.

`--dry-run` checks the whole chain and starts nothing (`launch.main_preflight`): every stage's
config resolved as the stage would resolve it, each training run's preflight, and the
pretrained models' shapes against the translation model they will warm-start; exit 2 if any
problem. Exit status otherwise: 2 for a bad input found before a stage ran (a config, a key),
1 for a stage that failed, 128 + N for signal N.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from launch.config import MainConfig, TrainConfig
from launch.report import plot_losses, read_metrics
from pipeline.configure import UserError, parse_cli, run_main, save_config
from pipeline.progress import every_s, interval, is_progress_line

USAGE = """usage: python -m launch.main CONFIG.yaml [key.sub=value ...] [--dry-run]

The whole chain: prepare -> pretrain GPT and BERT -> export -> fine-tune -> evaluate -> report.
--dry-run: check every stage's config, the training runs' preflights and the warm starts' shapes; start nothing."""
SIDES = ("random", "bert", "gpt")


def _say(message: str) -> None:
    print(f"[main] {message}", file=sys.stderr, flush=True)


class StageFailed(Exception):
    pass


class Stopped(Exception):
    """SIGTERM, SIGINT or SIGHUP to the main job; `ended` says what became of the stage it ran."""

    def __init__(self, signum: int, ended: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.ended = signum, ended


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STAGE_STOP_S = 60  # how long a stage may take to stop (torchrun gives its ranks 30 s) before it is killed


def _on_signal(signum, frame) -> None:
    raise Stopped(signum)


def _run(stage: str, command: list[str], log: Path, clock: StageClock) -> None:
    """Run one stage's command, its output to `log`; a failure names the stage and the log. While
    it runs, every PROGRESS_EVERY_S seconds (at least 1), a line with its latest progress line
    and the job's overall ETA (`StageClock`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    every = max(every_s(), 1.0)
    started = time.time()
    clock.start(stage)
    _say(f"{stage}: {' '.join(command)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # In a process group of its own, so that a Ctrl-C in the terminal reaches the main job alone,
    # which passes it on to the stage once (a rank takes a second SIGINT for "now").
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(log, "w") as fh:
        process = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, **group)
        try:
            while (code := _wait(process, every)) is None:
                running = time.time() - started
                _say(f"{stage} ({interval(running)}): {_last_progress_line(log) or 'no progress line yet'}; "
                     f"{clock.eta(running)}")
        except Stopped as stop:
            raise Stopped(stop.signum, _stop_stage(stage, process, stop.signum, log)) from None
    if code != 0:
        lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
        # The entry points' own one-line errors say most; else the log's last line.
        errors = [line for line in lines if line.startswith("error:")] or lines[-1:]
        raise StageFailed(f"stage {stage} failed (exit {code}): {errors[-1] if errors else ''} (log: {log})")
    clock.finish(stage, time.time() - started)
    _say(f"{stage}: done in {time.time() - started:.0f} s; {clock.eta()}")


def _wait(process: subprocess.Popen, seconds: float) -> int | None:
    """The process's exit status, or None if it still runs after `seconds`."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _last_progress_line(log: Path, tail: int = 1 << 16) -> str:
    """The last progress line (`pipeline.progress.is_progress_line`) in the last `tail` bytes of `log`."""
    with open(log, "rb") as fh:
        fh.seek(max(fh.seek(0, os.SEEK_END) - tail, 0))
        text = fh.read().decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines()]
    return next((line for line in reversed(lines) if is_progress_line(line)), "")


@dataclass(frozen=True)
class Stage:
    label: str  # as the stage's lines name it: "pretrain gpt", "evaluate finetune-bert-gpt valid"
    kind: str  # stages of a kind take alike per unit of work
    work: float  # optimizer steps for a training stage, else 1


class StageClock:
    """The main job's overall ETA from the stages it has run so far: each stage still to come is
    given the seconds per unit of work (steps, for training) of the stages of its kind run this
    time. A kind none of whose stages has run yet is left out of the figure, and named; stages
    skipped (their output complete) count as done and take nothing."""

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

    def eta(self, running_s: float | None = None) -> str:
        """'N/M stages done, overall ETA T': `running_s` is how long the stage at the current
        position has run (None: none runs)."""
        left, untimed = 0.0, []
        for offset, stage in enumerate(self.stages[self.position:]):
            if stage.kind not in self.timed:
                untimed += [stage.kind] if stage.kind not in untimed else []
                continue
            seconds, work = self.timed[stage.kind]
            estimate = seconds / work * stage.work
            left += max(estimate - running_s, 0.0) if offset == 0 and running_s is not None else estimate
        done = f"{self.position}/{len(self.stages)} stages done"
        if not untimed:
            return f"{done}, overall ETA {interval(left)}"
        return f"{done}, overall ETA >= {interval(left)} ({', '.join(untimed)} not yet timed)"


def _stop_stage(stage: str, process: subprocess.Popen, signum: int, log: Path) -> str:
    """Pass the main job's signal on to the stage and wait for it to end (torchrun passes SIGTERM
    on to its ranks, which checkpoint; it has no parent-death handling, so it would otherwise
    train on unseen); its process group is killed after STAGE_STOP_S, or at a second signal.
    Returns what became of it, in words."""
    started = time.time()
    process.send_signal(signum)
    try:
        code = process.wait(timeout=STAGE_STOP_S)
        how = f"ended with it (exit {code})"
    except (subprocess.TimeoutExpired, Stopped):
        os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
        how = "killed, having not ended"
    return f"stage {stage} {how} {time.time() - started:.0f} s later (log: {log})"


def _train_command(nproc: int, config: str, overrides: list[str]) -> list[str]:
    """`launch.train CONFIG overrides` on `nproc` ranks (torchrun when more than one). With
    CUDA, one rank per GPU: on a machine with fewer GPUs than `nproc` the job runs on as
    many ranks as there are GPUs, with gradient accumulation raised to keep the global batch
    (and so the samples of every step) of `nproc` ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else nproc
    if gpus < nproc:
        accum = parse_cli(TrainConfig, [config, *overrides], usage="").grad_accum
        if (accum * nproc) % gpus:
            raise UserError(f"nproc={nproc} ranks, but this machine has {gpus} GPUs, and the global batch of "
                            f"{nproc} ranks x grad_accum {accum} does not divide over {gpus}; set nproc={gpus}")
        _say(f"{gpus} GPU{'s' if gpus > 1 else ''} for nproc={nproc}: {gpus} rank{'s' if gpus > 1 else ''} with "
             f"grad_accum={accum * nproc // gpus} (the same global batch)")
        nproc, overrides = gpus, [*overrides, f"grad_accum={accum * nproc // gpus}"]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc)]
                if nproc > 1 else [sys.executable])
    return [*launcher, "-m", "launch.train", config, *overrides]


def _finished(run_dir: Path, steps: int) -> bool:
    final = run_dir / "final.json"
    return final.is_file() and json.loads(final.read_text()).get("step") == steps


def parse_starts(cfg: MainConfig) -> list[tuple[str, str]]:
    """(encoder, decoder) of each well-formed start of `starts`."""
    pairs = [start.partition("/")[::2] for start in cfg.starts]
    return [(encoder, decoder) for encoder, decoder in pairs if encoder in SIDES and decoder in SIDES]


def main_problems(cfg: MainConfig) -> list[str]:
    """Every problem of the main job's own keys, each line starting with its key; empty if none."""
    problems = [f"starts: {start!r} is not ENCODER/DECODER with each of {', '.join(SIDES)}" for start in cfg.starts
                if len(start.split("/")) != 2 or not set(start.split("/")) <= set(SIDES)]
    problems += [f"eval_splits: {split!r} is not train, valid or test" for split in cfg.eval_splits
                 if split not in ("train", "valid", "test")]
    if cfg.pretrain_steps <= 0 or cfg.bert_pretrain_steps < 0 or cfg.finetune_steps <= 0:
        problems.append(f"pretrain_steps={cfg.pretrain_steps}, bert_pretrain_steps={cfg.bert_pretrain_steps}, "
                        f"finetune_steps={cfg.finetune_steps}: steps must be positive (bert_pretrain_steps 0: pretrain_steps)")
    if cfg.nproc < 1:
        problems.append(f"nproc: {cfg.nproc}: must be at least 1")
    if cfg.beam < 1:
        problems.append(f"beam: {cfg.beam}: must be at least 1")
    for key in ("prepare_config", "gpt_config", "bert_config", "translation_config"):
        if not Path(getattr(cfg, key)).is_file():
            problems.append(f"{key}: config file not found: {getattr(cfg, key)}")
    return problems


def _check(cfg: MainConfig) -> list[tuple[str, str]]:
    """The starts, or a UserError with the first of `main_problems`."""
    problems = main_problems(cfg)
    if problems:
        raise UserError(problems[0])
    return parse_starts(cfg)


def pretrain_overrides(cfg: MainConfig, name: str, run_dir: Path) -> list[str]:
    """What the job passes to the `name` (gpt | bert) pretraining run: its own keys, then the stage's overrides."""
    return [f"data.data_dir={cfg.data_dir}", f"run_dir={run_dir}", f"max_steps={_pretrain_steps(cfg, name)}",
            f"deepspeed.zero_stage={cfg.zero_stage}", *_wandb_overrides(cfg), *getattr(cfg, f"{name}_overrides")]


def finetune_overrides(cfg: MainConfig, run_dir: Path, init: dict[str, str]) -> list[str]:
    """What the job passes to a fine-tuning run; `init`: stack -> exported directory of each warm side.
    Random sides are left to the config's default (""): an empty override would read as null."""
    return [f"data.data_dir={cfg.data_dir}", f"run_dir={run_dir}", f"max_steps={cfg.finetune_steps}",
            f"deepspeed.zero_stage={cfg.zero_stage}", *_wandb_overrides(cfg), *cfg.translation_overrides,
            *(f"init.{stack}={directory}" for stack, directory in init.items())]


def pretrained_needed(starts: list[tuple[str, str]]) -> list[str]:
    """The pretraining runs the starts need, in the order they run (both when there are no starts)."""
    needed = {side for start in starts for side in start} - {"random"}
    return [name for name in ("gpt", "bert") if name in needed or not starts]


def prepare_overrides(cfg: MainConfig) -> list[str]:
    return [*cfg.prepare_overrides, f"output_dir={cfg.data_dir}", "overwrite=true"]


def stage_prepare(cfg: MainConfig, logs: Path, clock: StageClock) -> None:
    data = Path(cfg.data_dir)
    if (data / "manifest.json").is_file():
        check = subprocess.run([sys.executable, "-m", "pipeline.validate", f"data_dir={data}"], capture_output=True, text=True)
        if check.returncode == 0:
            _say(f"prepare: skipped, {data} exists and validates")
            return
        # The summary line, or the one-line error of a dataset it cannot read (an older format).
        said = check.stdout.strip().splitlines() or check.stderr.strip().splitlines() or [f"exit {check.returncode}"]
        _say(f"prepare: {data} does not validate ({said[-1]}); preparing it again")
    _run("prepare", [sys.executable, "-m", "pipeline.prepare", cfg.prepare_config, *prepare_overrides(cfg)],
         logs / "prepare.log", clock)


def _say_pretraining_text(cfg: MainConfig) -> None:
    """Which monolingual text the pretraining reads, per source; extra text (man pages) is optional."""
    manifest = json.loads((Path(cfg.data_dir) / "manifest.json").read_text())
    train = manifest.get("datasets", {}).get("packed", {}).get("splits", {}).get("train", {})
    sources = train.get("sources") or {"default": {"tokens": train.get("tokens", 0)}}
    counts = ", ".join(f"{name} {record.get('tokens', 0):,}" for name, record in sources.items())
    extra = "" if len(sources) > 1 else (
        "; no extra monolingual text (optional: make manpages, then a dataset from "
        "configs/prepare_gettext_manpages.yaml as data_dir)")
    _say(f"pretraining text: {cfg.data_dir}'s packed training tokens by source: {counts}{extra}")


def _wandb_overrides(cfg: MainConfig) -> list[str]:
    """The training runs' W&B keys: the job's group, and its mode only where set (an empty
    override would read as null; unset, each run takes WANDB_MODE, else offline)."""
    return [f"wandb.group={cfg.wandb_group}", *([f"wandb.mode={cfg.wandb_mode}"] if cfg.wandb_mode else [])]


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


def _pretrain_steps(cfg: MainConfig, name: str) -> int:
    return cfg.bert_pretrain_steps if name == "bert" and cfg.bert_pretrain_steps else cfg.pretrain_steps


def stage_pretrain(cfg: MainConfig, name: str, config: str, out: Path, logs: Path, clock: StageClock) -> Path:
    run_dir = out / f"pretrain-{name}"
    steps = _pretrain_steps(cfg, name)
    if _finished(run_dir, steps):
        _say(f"pretrain {name}: skipped, {run_dir} finished {steps} steps")
    else:
        _run(f"pretrain {name}", _train_command(cfg.nproc, config, pretrain_overrides(cfg, name, run_dir)),
             logs / f"pretrain-{name}.log", clock)
    export = out / f"export-{name}"
    exported = export / "config.json"
    if exported.is_file() and json.loads(exported.read_text()).get("step") == steps:
        _say(f"export {name}: skipped, {export} holds step {steps}")
    else:
        _run(f"export {name}", [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={export}"],
             logs / f"export-{name}.log", clock)
    return export


def stage_finetune(cfg: MainConfig, encoder: str, decoder: str, exports: dict, out: Path, logs: Path,
                   clock: StageClock) -> Path:
    name = f"{encoder}-{decoder}"
    run_dir = out / f"finetune-{name}"
    if _finished(run_dir, cfg.finetune_steps):
        _say(f"fine-tune {name}: skipped, {run_dir} finished {cfg.finetune_steps} steps")
        return run_dir
    init = {stack: str(exports[side]) for stack, side in (("encoder", encoder), ("decoder", decoder)) if side != "random"}
    _run(f"fine-tune {name}", _train_command(cfg.nproc, cfg.translation_config, finetune_overrides(cfg, run_dir, init)),
         logs / f"finetune-{name}.log", clock)
    return run_dir


def stage_evaluate(cfg: MainConfig, run_dir: Path, split: str, logs: Path, clock: StageClock) -> dict:
    out = run_dir / f"eval-{split}"
    scores = out / "scores.json"
    if not scores.is_file():
        _run(f"evaluate {run_dir.name} {split}", [sys.executable, "-m", "launch.evaluate", f"checkpoint={run_dir}",
                                                  f"data_dir={cfg.data_dir}", f"split={split}", f"beam={cfg.beam}", f"out={out}"],
             logs / f"evaluate-{run_dir.name}-{split}.log", clock)
    else:
        _say(f"evaluate {run_dir.name} {split}: skipped, {scores} exists")
    return json.loads(scores.read_text())


def _last(run_dir: Path, key: str):
    values = [row[key] for row in read_metrics(run_dir) if key in row]
    return values[-1] if values else None


def _final(run_dir: Path) -> dict:
    return json.loads((run_dir / "final.json").read_text())


def summary_table(cfg: MainConfig, pretrained: dict, finetuned: dict) -> str:
    lines = ["| pretraining | steps | tokens seen | final train loss | valid loss | valid perplexity |", "|---|---:|---:|---:|---:|---:|"]
    for name, run_dir in pretrained.items():
        final = _final(run_dir)
        lines.append(f"| {name} | {final['step']} | {final['tokens_seen']:,} | {_last(run_dir, 'train/loss'):.3f} | "
                     f"{final.get('eval/loss', float('nan')):.3f} | {final.get('eval/perplexity', float('nan')):.1f} |")
    header = " | ".join(f"{split} BLEU | {split} chrF" for split in cfg.eval_splits)
    lines += ["", f"| fine-tuning start (encoder/decoder) | steps | tokens seen | final train loss | valid loss | "
                  f"valid perplexity | {header} |", "|---|---:|---:|---:|---:|---:|" + "---:|" * (2 * len(cfg.eval_splits))]
    baseline = finetuned.get("random/random")
    for start, (run_dir, scores) in finetuned.items():
        final = _final(run_dir)
        cells = []
        for split in cfg.eval_splits:
            bleu = scores[split]["bleu"]
            delta = f" ({bleu - baseline[1][split]['bleu']:+.1f})" if baseline and start != "random/random" else ""
            cells.append(f"{bleu:.1f}{delta} | {scores[split]['chrf']:.1f}")
        lines.append(f"| {start} | {final['step']} | {final['tokens_seen']:,} | {_last(run_dir, 'train/loss'):.3f} | "
                     f"{final.get('eval/loss', float('nan')):.3f} | {final.get('eval/perplexity', float('nan')):.1f} | "
                     f"{' | '.join(cells)} |")
    signature = next(iter(finetuned.values()))[1][cfg.eval_splits[0]].get("signature_bleu", "") if finetuned else ""
    lines += ["", "Tokens: input tokens of all ranks (fine-tuning: source + target). Losses in nats per target token; "
                  "perplexity = exp(valid loss).", f"BLEU in parentheses: difference from random/random. sacrebleu: {signature}"]
    return "\n".join(lines)


def write_report(cfg: MainConfig, pretrained: dict, finetuned: dict, seconds: float) -> tuple[str, Path]:
    """summary.md, summary.json and the loss-curve PNGs into OUT/report; returns the table."""
    report = Path(cfg.out_dir) / "report"
    report.mkdir(parents=True, exist_ok=True)
    table = summary_table(cfg, pretrained, finetuned)
    plots = []
    if pretrained:
        plots.append(plot_losses(pretrained, report / "pretrain_loss.png", "Pretraining: GPT (causal LM) and BERT (masked LM)"))
    if finetuned:
        runs = {start: run_dir for start, (run_dir, _) in finetuned.items()}
        plots.append(plot_losses(runs, report / "finetune_loss.png", "Translation fine-tuning by start (encoder/decoder)"))
    images = "\n".join(f"![{p.stem}]({p.name})" for p in plots)
    (report / "summary.md").write_text(f"# Main job summary\n\n{table}\n\nWall time of this invocation: {seconds:.0f} s.\n\n{images}\n")
    summary = {"pretraining": {name: _final(d) for name, d in pretrained.items()},
               "finetuning": {start: {"final": _final(d), "scores": scores}
                              for start, (d, scores) in finetuned.items()},
               "seconds": seconds}
    (report / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return table, report


def plan_stages(cfg: MainConfig, starts: list[tuple[str, str]]) -> list[Stage]:
    """Every stage of the job in order, labelled as `_run` names it, for the overall ETA."""
    stages = [Stage("prepare", "prepare", 1)]
    for name in pretrained_needed(starts):
        stages += [Stage(f"pretrain {name}", "pretrain", _pretrain_steps(cfg, name)), Stage(f"export {name}", "export", 1)]
    for encoder, decoder in starts:
        stages.append(Stage(f"fine-tune {encoder}-{decoder}", "fine-tune", cfg.finetune_steps))
        stages += [Stage(f"evaluate finetune-{encoder}-{decoder} {split}", "evaluate", 1) for split in cfg.eval_splits]
    return stages


def main_job(cfg: MainConfig) -> str:
    starts = _check(cfg)
    out = Path(cfg.out_dir)
    logs = out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, wandb_group=wandb_group(cfg, out))
    save_config(cfg, out / "config.yaml")
    _say(f"W&B group of this job's runs: {cfg.wandb_group}")
    clock = StageClock(plan_stages(cfg, starts))
    _say(f"{len(clock.stages)} stages: {', '.join(stage.label for stage in clock.stages)}")
    started = time.time()
    stage_prepare(cfg, logs, clock)
    _say_pretraining_text(cfg)
    exports, pretrained = {}, {}
    for name in pretrained_needed(starts):
        exports[name] = stage_pretrain(cfg, name, getattr(cfg, f"{name}_config"), out, logs, clock)
        pretrained[name] = out / f"pretrain-{name}"
    finetuned = {}
    for encoder, decoder in starts:
        run_dir = stage_finetune(cfg, encoder, decoder, exports, out, logs, clock)
        finetuned[f"{encoder}/{decoder}"] = (run_dir, {split: stage_evaluate(cfg, run_dir, split, logs, clock)
                                                       for split in cfg.eval_splits})
    table, report = write_report(cfg, pretrained, finetuned, time.time() - started)
    _say(f"all stages done in {time.time() - started:.0f} s; summary and loss curves in {report}/")
    return table


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:  # check the whole chain; start nothing, write nothing
        from launch.main_preflight import dry_run  # it reads this module's stage commands

        rest = [arg for arg in argv if arg != "--dry-run"]
        return dry_run(parse_cli(MainConfig, rest, usage=USAGE), rest[0])
    cfg = parse_cli(MainConfig, argv, usage=USAGE)
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    try:
        print(main_job(cfg))
    except StageFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        _say(f"stopped by {stop}" + (f": {stop.ended}" if stop.ended else "") + "; a re-run continues from there")
        return 128 + stop.signum
    return 0


if __name__ == "__main__":
    run_main(main)
