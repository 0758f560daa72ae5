"""The main job's run: `main` -> `main_job` -> each stage as a subprocess of the project's own
entry points, skipped when its output is complete; a signal to the job stops the stage it runs
(SIGINT as SIGINT, every other stop signal as SIGTERM); OUT_DIR.lock keeps a second job off the
same out_dir."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from common.configure import parse_cli, save_config
from common.lock import dir_lock
from common.progress import every_s, interval, is_progress_line
from common.terminal import leave_terminal
from launch import stop
from launch.config import MainConfig
from launch.main.plan import (
    StageClock,
    check_main,
    finetune_overrides,
    finished,
    own_eta_s,
    plan_stages,
    prepare_overrides,
    pretrain_overrides,
    pretrain_steps,
    pretrained_needed,
    say,
    train_command,
    wandb_group,
)
from launch.main.summary import write_report

LOCK_SUFFIX = ".lock"  # OUT_DIR.lock, held for the job

USAGE = """usage: python -m launch.main CONFIG.yaml [key.sub=value ...] [--dry-run]

The whole chain: prepare -> pretrain GPT and BERT -> export -> fine-tune -> evaluate -> report.
--dry-run: check every stage's config, the training runs' preflights and the warm starts' shapes; \
start nothing."""


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:  # check the whole chain; start nothing, write nothing
        from launch.main.preflight import dry_run  # it reads this module's stage commands

        rest = [arg for arg in argv if arg != "--dry-run"]
        return dry_run(parse_cli(MainConfig, rest, usage=USAGE), rest[0])
    cfg = parse_cli(MainConfig, argv, usage=USAGE)
    check_main(cfg)  # the job's own keys first, each refused in its own words
    out = Path(cfg.out_dir)
    # One job per out_dir: a second would run the same stages into the same directories, and
    # open their logs anew under the first. OUT_DIR.lock lies beside it, which it may not be yet.
    with dir_lock(out, what="main", lock_file=out.with_name(out.name + LOCK_SUFFIX)):
        return _main(cfg, argv)


def _main(cfg: MainConfig, argv: list[str]) -> int:
    problems = _chain_problems(cfg, argv[0])
    if problems:  # a stage that would fail, found before hours of the stages before it
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        print(
            f"error: {problems[0]}{more}; `python -m launch.main {argv[0]} "
            "--dry-run` reports every stage",
            file=sys.stderr,
        )
        return 2
    for signum in STOP_SIGNALS:
        signal.signal(signum, _on_signal)
    try:
        print(main_job(cfg))
    except StageFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        say(
            f"stopped by {stop}"
            + (f": {stop.ended}" if stop.ended else "")
            + "; a re-run continues from there"
        )
        return 128 + stop.signum
    return 0


def _chain_problems(cfg: MainConfig, config: str) -> list[str]:
    """What `--dry-run` would report as problems; its stage reports and the warnings of its
    checks (which the stages print when they run) left out."""
    import contextlib
    import io

    from launch.main.preflight import chain_problems  # it reads this module's stage commands

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return chain_problems(cfg, config)


def main_job(cfg: MainConfig) -> str:
    starts = check_main(cfg)
    out = Path(cfg.out_dir)
    logs = out / "logs"
    out.mkdir(parents=True, exist_ok=True)
    cfg = replace(cfg, wandb_group=wandb_group(cfg, out))
    save_config(cfg, out / "config.yaml")
    say(f"W&B group of this job's runs: {cfg.wandb_group}")
    clock = StageClock(plan_stages(cfg, starts))
    say(f"{len(clock.stages)} stages: {', '.join(stage.label for stage in clock.stages)}")
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
        finetuned[f"{encoder}/{decoder}"] = (
            run_dir,
            {split: stage_evaluate(cfg, run_dir, split, logs, clock) for split in cfg.eval_splits},
        )
    table, report = write_report(cfg, pretrained, finetuned, time.time() - started)
    say(f"all stages done in {time.time() - started:.0f} s; summary and loss curves in {report}/")
    return table


def stage_prepare(cfg: MainConfig, logs: Path, clock: StageClock) -> None:
    data = Path(cfg.data_dir)
    if (data / "manifest.json").is_file():
        check = subprocess.run(
            [sys.executable, "-m", "pipeline.validate", f"data_dir={data}"],
            capture_output=True,
            text=True,
        )
        if check.returncode == 0:
            say(f"prepare: skipped, {data} exists and validates")
            return
        # The summary line, or the one-line error of a dataset it cannot read (an older format).
        said = (
            check.stdout.strip().splitlines()
            or check.stderr.strip().splitlines()
            or [f"exit {check.returncode}"]
        )
        say(f"prepare: {data} does not validate ({said[-1]}); preparing it again")
    _run(
        "prepare",
        [sys.executable, "-m", "pipeline.prepare", cfg.prepare_config, *prepare_overrides(cfg)],
        logs / "prepare.log",
        clock,
    )


def _say_pretraining_text(cfg: MainConfig) -> None:
    """Which monolingual text the pretraining reads, per source; extra text (man
    pages) is optional."""
    manifest = json.loads((Path(cfg.data_dir) / "manifest.json").read_text())
    train = manifest.get("datasets", {}).get("packed", {}).get("splits", {}).get("train", {})
    sources = train.get("sources") or {"default": {"tokens": train.get("tokens", 0)}}
    counts = ", ".join(f"{name} {record.get('tokens', 0):,}" for name, record in sources.items())
    extra = (
        ""
        if len(sources) > 1
        else (
            "; no extra monolingual text (optional: make manpages, then a dataset from "
            "configs/prepare_gettext_manpages.yaml as data_dir)"
        )
    )
    say(f"pretraining text: {cfg.data_dir}'s packed training tokens by source: {counts}{extra}")


def stage_pretrain(
    cfg: MainConfig, name: str, config: str, out: Path, logs: Path, clock: StageClock
) -> Path:
    run_dir = out / f"pretrain-{name}"
    steps = pretrain_steps(cfg, name)
    if finished(run_dir, steps):
        say(f"pretrain {name}: skipped, {run_dir} finished {steps} steps")
    else:
        _run(
            f"pretrain {name}",
            train_command(cfg.nproc, config, pretrain_overrides(cfg, name, run_dir)),
            logs / f"pretrain-{name}.log",
            clock,
        )
    export = out / f"export-{name}"
    exported = export / "config.json"
    if exported.is_file() and json.loads(exported.read_text()).get("step") == steps:
        say(f"export {name}: skipped, {export} holds step {steps}")
    else:
        _run(
            f"export {name}",
            [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={export}"],
            logs / f"export-{name}.log",
            clock,
        )
    return export


def stage_finetune(
    cfg: MainConfig,
    encoder: str,
    decoder: str,
    exports: dict,
    out: Path,
    logs: Path,
    clock: StageClock,
) -> Path:
    name = f"{encoder}-{decoder}"
    run_dir = out / f"finetune-{name}"
    if finished(run_dir, cfg.finetune_steps):
        say(f"fine-tune {name}: skipped, {run_dir} finished {cfg.finetune_steps} steps")
        return run_dir
    init = {
        stack: str(exports[side])
        for stack, side in (("encoder", encoder), ("decoder", decoder))
        if side != "random"
    }
    _run(
        f"fine-tune {name}",
        train_command(cfg.nproc, cfg.translation_config, finetune_overrides(cfg, run_dir, init)),
        logs / f"finetune-{name}.log",
        clock,
    )
    return run_dir


def stage_evaluate(
    cfg: MainConfig, run_dir: Path, split: str, logs: Path, clock: StageClock
) -> dict:
    out = run_dir / f"eval-{split}"
    scores = out / "scores.json"
    if not scores.is_file():
        _run(
            f"evaluate {run_dir.name} {split}",
            [
                sys.executable,
                "-m",
                "launch.evaluate",
                f"checkpoint={run_dir}",
                f"data_dir={cfg.data_dir}",
                f"split={split}",
                f"beam={cfg.beam}",
                f"out={out}",
            ],
            logs / f"evaluate-{run_dir.name}-{split}.log",
            clock,
        )
    else:
        say(f"evaluate {run_dir.name} {split}: skipped, {scores} exists")
    return json.loads(scores.read_text())


class StageFailed(Exception):
    pass


class Stopped(Exception):
    """A stop signal to the main job (STOP_SIGNALS); `ended`: what became of the stage it ran."""

    def __init__(self, signum: int, ended: str = ""):
        super().__init__(signal.Signals(signum).name)
        self.signum, self.ended = signum, ended


# Every catchable signal that a scheduler, a shell or the kernel sends before a kill: a rank's.
STOP_SIGNALS = stop.SIGNALS
# Sent again by the kernel (past the soft CPU-time limit, once a second; at each write past the
# file size limit): a repeat is not a second signal, which kills the stage.
REPEATED_SIGNALS = stop.LIMIT_SIGNALS
_stopping = False  # a stop signal came
# how long a stage may take to stop (torchrun gives its ranks 30 s) before it is killed
STAGE_STOP_S = 60


def _on_signal(signum, frame) -> None:
    global _stopping
    if signum in REPEATED_SIGNALS and _stopping:
        return
    _stopping = True
    if signum == signal.SIGHUP:
        leave_terminal()  # gone: the stop's own lines must not end the job before its stage
    raise Stopped(signum)


def stage_signal(signum: int) -> int:
    """What the stage gets for the main job's stop signal: SIGINT as itself (a second one is "now"
    to a rank), any other as SIGTERM, which every stage takes for a stop request (prepare cleans
    up, torchrun passes it on to ranks that checkpoint, export removes OUT.partial); passed on
    as is, SIGUSR1, SIGXCPU or SIGXFSZ would kill torchrun outright."""
    return signal.SIGINT if signum == signal.SIGINT else signal.SIGTERM


def _run(stage: str, command: list[str], log: Path, clock: StageClock) -> None:
    """Run one stage's command, its output to `log`; a failure names the stage and the log. While
    it runs, every PROGRESS_EVERY_S seconds (at least 1), a line with its latest progress line
    and the job's overall ETA (`StageClock`)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    every = max(every_s(), 1.0)
    started = time.time()
    clock.start(stage)
    say(f"{stage}: {' '.join(command)}")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    # In a process group of its own, so that a Ctrl-C in the terminal reaches the main job alone,
    # which passes it on to the stage once (a rank takes a second SIGINT for "now").
    group = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
    with open(log, "w") as fh:
        process = subprocess.Popen(command, stdout=fh, stderr=subprocess.STDOUT, env=env, **group)
        try:
            while (code := _wait(process, every)) is None:
                running = time.time() - started
                line = _last_progress_line(log)
                say(
                    f"{stage} ({interval(running)}): {line or 'no progress line yet'}; "
                    f"{clock.eta(running, own_eta_s(line))}"
                )
        except Stopped as stop:
            raise Stopped(stop.signum, _stop_stage(stage, process, stop.signum, log)) from None
    if code != 0:
        lines = [
            line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()
        ]
        # The entry points' own one-line errors say most; else the log's last line.
        errors = [line for line in lines if line.startswith("error:")] or lines[-1:]
        raise StageFailed(
            f"stage {stage} failed (exit {code}): {errors[-1] if errors else ''} (log: {log})"
        )
    clock.finish(stage, time.time() - started)
    say(f"{stage}: done in {time.time() - started:.0f} s; {clock.eta()}")


def _wait(process: subprocess.Popen, seconds: float) -> int | None:
    """The process's exit status, or None if it still runs after `seconds`."""
    try:
        return process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        return None


def _last_progress_line(log: Path, tail: int = 1 << 16) -> str:
    """The last progress line (`common.progress.is_progress_line`) in the last
    `tail` bytes of `log`."""
    with open(log, "rb") as fh:
        fh.seek(max(fh.seek(0, os.SEEK_END) - tail, 0))
        text = fh.read().decode("utf-8", errors="replace")
    lines = [line.strip() for line in text.replace("\r", "\n").splitlines()]
    return next((line for line in reversed(lines) if is_progress_line(line)), "")


def _stop_stage(stage: str, process: subprocess.Popen, signum: int, log: Path) -> str:
    """Pass the main job's signal on to the stage (`stage_signal`) and wait for it to end
    (torchrun passes SIGTERM on to its ranks, which checkpoint; it has no parent-death handling, so
    it would otherwise train on unseen); its process group is killed after STAGE_STOP_S, or at a
    second signal. Returns what became of it, in words."""
    started = time.time()
    process.send_signal(stage_signal(signum))
    try:
        code = process.wait(timeout=STAGE_STOP_S)
        how = f"ended with it (exit {code})"
    except (subprocess.TimeoutExpired, Stopped):
        os.killpg(process.pid, signal.SIGKILL)
        code = process.wait()
        how = "killed, having not ended"
    return f"stage {stage} {how} {time.time() - started:.0f} s later (log: {log})"
