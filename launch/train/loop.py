"""The training loop: `train` -> `fit` -> `train_step` (`launch.train.step`) and `evaluate`
(`launch.train.evaluation`), read top-down; the command line is `launch.train.cli`.

`fit` runs steps until `max_steps` (or a stop request), logging, evaluating and checkpointing
between them (when to save: `launch.checkpoint.save.Checkpointer`); `train_step` is one
optimizer step over grad_accum micro batches, guarded (`launch.train.guard`); the end of the run
is a checkpoint and final.json.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import sys
import time
from pathlib import Path

from common.configure import UserError
from common.lock import dir_lock
from launch import checkpoint as ckpt
from launch import distributed as dist
from launch import stop
from launch.checkpoint.save import Checkpointer
from launch.config import TrainConfig
from launch.metrics import memory_mb
from launch.preconditions import check_writable_dir
from launch.stop import StopRequested
from launch.tracking import check_wandb_dir
from launch.train import harness
from launch.train.evaluation import evaluate
from launch.train.guard import (
    guard_step,
    step_sample_keys,
)
from launch.train.profiler import StepProfiler
from launch.train.run_dir import run_dir_storage
from launch.train.setup import setup
from launch.train.state import Run, data_counters, make_checkpointer
from launch.train.step import train_step
from launch.train.step_result import StepResult
from launch.train.window import ThroughputWindow
from model import attention_kernels
from pipeline.load.loader import ShardLoader


def train(cfg: TrainConfig) -> dict:
    # SIGTERM, SIGINT, SIGUSR1, SIGHUP, SIGQUIT, SIGXCPU, SIGXFSZ, RUN_DIR/STOP, the launcher's
    # death: a checkpoint and exit
    stop.install(cfg.run_dir)
    # A native crash (an abort in a C++ library, a segfault) prints every thread's Python stack,
    # so the log says where the rank was, not only that it died.
    faulthandler.enable(all_threads=True)
    made = [d for d in (Path(cfg.run_dir), *Path(cfg.run_dir).parents) if not d.exists()]
    check_writable_dir(cfg.run_dir, "run_dir")  # every rank writes its checkpoint partition there
    try:
        if dist.read_env().is_main:  # W&B runs on rank 0: its directory, before anything is built
            check_wandb_dir(cfg.wandb, cfg.run_dir)
        # One job per run directory: a second one started on it (the same command twice, a requeue
        # racing a job that has not died) would interleave checkpoints and metrics with the first.
        # Rank 0 holds the lock for the job; on a refusal it exits, and the launcher ends the
        # others.
        with contextlib.ExitStack() as held:
            if dist.read_env().is_main:
                with run_dir_storage(Path(cfg.run_dir)):  # its record, on a full disk: one line
                    held.enter_context(dir_lock(cfg.run_dir, what="train"))
            return _train(cfg)
    except BaseException:
        # A job that fails or stops before it writes anything (a bad input, a failure while the
        # engine is built) leaves no empty run directory behind that it made: only empty ones,
        # deepest first, are removed.
        for directory in made:
            try:
                directory.rmdir()
            except OSError:
                break
        raise


def _train(cfg: TrainConfig) -> dict:
    try:
        run = setup(cfg)
    except StopRequested:  # while it waited for the dataset: nothing trained
        return _stopped_in_setup(cfg)
    if run.denv.is_main:
        (Path(cfg.run_dir) / stop.PREEMPTED_FILE).unlink(missing_ok=True)
    try:
        final = fit(run)
        if final.get("preempted"):
            # the W&B run stays open for the requeued job (finished below, not marked done)
            return final
        run.tracker.finish({f"final/{k}": v for k, v in final.items()})
        if run.denv.is_main:
            (Path(cfg.run_dir) / "final.json").write_text(json.dumps(final, indent=1) + "\n")
        return final
    finally:
        for loader in (run.data.train, run.data.valid):
            if loader is not None:
                loader.close()  # its workers, before the rank ends (they would outlive it a while)
        run.tracker.finish()
        dist.destroy()


def _stopped_in_setup(cfg: TrainConfig) -> dict:
    """End a job whose wait for the dataset (its manifest, its tokenizer) a stop request cut short:
    nothing to checkpoint; a requeue continues from the latest checkpoint, if any."""
    dist.destroy()
    tag = ckpt.latest_tag(ckpt.checkpoint_root(cfg.run_dir))
    step = int(tag.rpartition("_")[2]) if tag else 0
    if dist.read_env().is_main:
        stop.leave_for_requeue(cfg.run_dir, step)
        print(
            "stop requested before training began: nothing to checkpoint; exiting for a requeue",
            file=sys.stderr,
        )
    return {"step": step, "preempted": True}


def fit(run: Run) -> dict:
    """Steps until `max_steps` (or `stop_after_steps`, or a stop request); between them, what is
    due: the guard's verdict, the log line, evaluation, lm-eval and a checkpoint."""
    cfg = run.cfg
    batches = _batches(run.data.train)
    window = ThroughputWindow(
        cfg.optim.grad_clip, run.denv.world_size, run.peak[0], run.denv.is_main
    )
    last_eval: dict = {}
    start, stop_at = run.step, min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
    checkpointer = make_checkpointer(run, stop_at)
    profiler = StepProfiler(run)
    while run.step < stop_at:
        profiler.before_step()
        step_start = time.perf_counter()
        result = train_step(run, batches)
        profiler.after_step(trained=result is not None)
        # a stop request cut some rank's wait for its batches short: no step taken
        if result is None:
            return stop_for_requeue(run, checkpointer, last_eval)
        first = run.step == start
        metrics = _after_step(run, result, window, step_start, checkpointer, stop_at, first)
        evaluated, stopped = _evaluate_if_due(run, stop_at)
        last_eval = evaluated or last_eval
        metrics.update(evaluated)
        if not stopped and harness.due(run):  # lm-evaluation-harness tasks
            metrics.update(harness.lm_eval_metrics(run))
        if metrics:
            _log(run, metrics)
        # on the last step a normal end is as good
        if stopped or (result.stop and run.step < stop_at):
            profiler.close()
            return stop_for_requeue(run, checkpointer, last_eval)
        checkpointer.maybe_save(run.step)
    profiler.close()  # the run ended inside the profiled steps: what was profiled
    checkpointer.ensure_final(run.step)
    return {
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "skipped_steps": run.guard.skipped,
        **data_counters(run),
        **last_eval,
    }


def _after_step(
    run: Run,
    result: StepResult,
    window: ThroughputWindow,
    step_start: float,
    checkpointer: Checkpointer,
    stop_at: int,
    first: bool,
) -> dict:
    """A step taken, counted: the step and its tokens, the throughput window, the guard's
    verdict (too many skips in a row: the last good state checkpointed, and the job ends), the
    sample keys and, when due, the log line's figures; returns the step's metrics so far."""
    cfg = run.cfg
    if first and cfg.data.document_mask and run.denv.is_main:
        # which kernel the document mask ran on (model.attention), once
        print(f"attention: {', '.join(attention_kernels(run.engine.module))}", file=sys.stderr)
    run.step += 1
    run.tokens_seen += int(result.tokens)
    # Kept on the device and read at the next log line: a read here would wait for the update.
    grad_norm = run.engine.grad_norm()
    window.add(result, time.perf_counter() - step_start, grad_norm)
    metrics, verdict = guard_step(run, result)
    if verdict:
        checkpointer.save()
        raise UserError(verdict)
    if cfg.data.log_sample_keys:
        _log_sample_keys(run, result)
    if run.step % cfg.log_every == 0 or run.step == stop_at:
        metrics.update(_train_metrics(run, result, grad_norm, window))
    return metrics


def _train_metrics(run: Run, result: StepResult, grad_norm, window: ThroughputWindow) -> dict:
    """The log line's training figures: this step's, the throughput window's since the last
    line (then a fresh window), the loader's counters and memory."""
    perf = window.figures()
    metrics = {
        "train/loss": result.loss,
        "train/loss_mean": perf.pop("train/loss_mean"),
        "train/lr": run.engine.lr,
        "train/grad_norm": float(grad_norm),
        "train/clipped_fraction": perf.pop("train/clipped_fraction"),
        "train/tokens_seen": run.tokens_seen,
        "train/epoch": run.data.train.epoch,
        **{k: perf.pop(k) for k in ("perf/tokens_per_s", "perf/samples_per_s", "perf/mfu")},
        **data_counters(run),
        **memory_mb(),
        **perf,  # perf/mfu_llmc, where it has a value
    }
    if run.engine.loss_scale is not None:  # fp16: DeepSpeed's dynamic loss scale
        metrics["train/loss_scale"] = run.engine.loss_scale
    if result.expert_load_max_mean:  # a mixture of experts: this step's routing
        metrics["train/aux_loss"] = result.aux_loss
        metrics["moe/dropped_fraction"] = result.dropped_fraction
        for i, ratio in enumerate(result.expert_load_max_mean):
            metrics[f"moe/load_max_mean/{i}"] = ratio
    return metrics


def _evaluate_if_due(run: Run, stop_at: int) -> tuple[dict, bool]:
    """The valid split's metrics when evaluation is due (every `eval_every` steps and at the
    end; {} otherwise), and whether a stop request cut some rank's wait for its data short."""
    if not ((run.cfg.eval_every and run.step % run.cfg.eval_every == 0) or run.step == stop_at):
        return {}, False
    evaluated = evaluate(run)
    return evaluated or {}, evaluated is None


def _log_sample_keys(run: Run, result: StepResult) -> None:
    """`data.log_sample_keys`: which samples this step saw on this rank, a line per step."""
    keys = Path(run.cfg.run_dir) / f"sample_keys.rank{run.denv.rank}.jsonl"
    with stop.log_write(), open(keys, "a") as fh:
        fh.write(json.dumps({"step": run.step, "keys": step_sample_keys(run, result)}) + "\n")


def stop_for_requeue(run: Run, checkpointer: Checkpointer, last_eval: dict) -> dict:
    """End a job asked to stop, on every rank: the step reached checkpointed (unless it is already,
    or none was trained), RUN_DIR/preempted.json left for the batch script, one line. A stop
    that a write past the file size limit asked for (on any rank) ends the job checkpointed, in
    one error line instead, without preempted.json: a requeued job would meet the same limit."""
    if checkpointer.save_unless_saved(run.step):
        done = f"checkpoint at step {run.step} saved"
    else:
        done = (
            f"step {run.step} is checkpointed already"
            if run.step
            else "nothing trained, nothing to checkpoint"
        )
    if dist.any_rank(stop.past_file_size_limit()):
        raise UserError(
            f"a write went past the file size limit (SIGXFSZ; RLIMIT_FSIZE, `ulimit -f`: "
            f"{stop.file_size_limit()}): {done}; not left for a requeue, which would meet the "
            "same limit: raise it, or make room under it (metrics.jsonl, the log), and start the "
            "job again, which resumes from there"
        )
    if run.denv.is_main:
        stop.leave_for_requeue(run.cfg.run_dir, run.step)
        print(f"stop requested: {done}; exiting for a requeue", file=sys.stderr)
    return {"step": run.step, "tokens_seen": run.tokens_seen, "preempted": True, **last_eval}


def _log(run: Run, metrics: dict) -> None:
    """The step's metrics to W&B, the progress line and metrics.jsonl; each write past the file
    size limit dropped, as a stop request (`stop.log_write`)."""
    if run.denv.is_main:
        run.tracker.log(metrics, step=run.step)
        with stop.log_write():
            run.tracker.progress(run.step, run.cfg.max_steps, metrics)
        with stop.log_write(), open(Path(run.cfg.run_dir) / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": run.step, **metrics}) + "\n")


def _batches(loader: ShardLoader):
    """Batches forever, epoch after epoch (the loader advances its epoch at the end of each)."""
    while True:
        yield from loader
