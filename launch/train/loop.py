"""The training loop: `main` -> `train` -> `fit` -> `train_step` and `evaluate`, read top-down.

`fit` runs steps until `max_steps` (or a stop request), logging, evaluating and checkpointing
between them (when to save: `launch.checkpoint.save.Checkpointer`); `train_step` is one
optimizer step over grad_accum micro batches, guarded (`launch.train.guard`); the end of the run
is a checkpoint and final.json.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import math
import sys
import time
from pathlib import Path

import torch

from common.configure import UserError, parse_cli, strip_launcher_args
from common.lock import dir_lock
from launch import checkpoint as ckpt
from launch import distributed as dist
from launch import stop
from launch.checkpoint.save import Checkpointer
from launch.config import TrainConfig
from launch.metrics import memory_mb
from launch.preconditions import check_writable_dir
from launch.preflight import checks as preflight
from launch.stop import StopRequested, stoppable
from launch.tasks import host_value
from launch.tracking import check_wandb_dir
from launch.train import harness
from launch.train.guard import (
    FP16_OVERFLOW,
    NON_FINITE_KINDS,
    guard_step,
    step_sample_keys,
)
from launch.train.profiler import StepProfiler
from launch.train.setup import run_dir_storage, setup
from launch.train.state import Run, data_counters, make_checkpointer
from launch.train.step_result import StepResult
from launch.train.window import ThroughputWindow
from model import attention_kernels, llmc_flops_per_token
from pipeline.load.loader import ShardLoader

USAGE = """usage: python -m launch.train CONFIG.yaml [key.sub=value ...] \
[--dry-run [--world-size N] [--ranks-per-node N] [--json]]

--dry-run: what the run would be (batch, parameters, FLOPs, memory per GPU) and every reason it
would fail, each naming its key, in seconds; starts nothing, writes nothing; exit 2 if any
(launch.preflight). Exit status: 2 for a bad input (one `error:` line), 1 for a run that failed."""


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:  # report the run and every problem; start nothing
        return preflight.main_dry_run([arg for arg in argv if arg != "--dry-run"])
    from launch.run_config import training_config

    train(training_config(parse_cli(TrainConfig, argv, usage=USAGE), argv[1:]))
    return 0


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


def train_step(run: Run, batches) -> StepResult | None:
    """One optimizer step: grad_accum micro batches, forward and backward through the engine;
    None, with no step taken, when a stop request cut some rank's wait for its batches short.

    The loss is the mean over every scored token of the step, all ranks and micro batches
    together (fairseq's normalisation; Hugging Face's average_tokens_across_devices): each micro
    batch's mean loss is weighted by its scored tokens n, and the gradient divided by the step's
    N over all ranks. A mean per micro batch instead would weigh a token of a 32-pair batch of
    short sentences ten times one of a batch of long ones, which length-grouped batches
    (`data.length_grouping`) make common. Packed blocks score the same number of tokens in every
    batch: there the two agree.

    Guarded: one reduction over the ranks carries the step's figures, whether any rank's loss is
    not finite, whether any rank was asked to stop, and each rank's tokens; every rank takes the
    same decision from them, on the device (the host reads the figures once, after the optimizer
    step, in the same copy as this rank's own count of NaN, +inf and -inf losses, which
    `guard_step` gathers only for a skipped step's record). A step to skip (a non-finite loss
    anywhere, or a loss spike) gets NaN gradients on every rank: DeepSpeed then finds a
    non-finite gradient norm and drops the update, the gradients and the schedule's step on
    every rank (ZeRO 1-3, bf16 and fp16 by their own check; ZeRO-0 in fp32, and in bf16 as
    autocast, through `launch.optim.AdamW`). The weights after a skipped step are those before it.

    Who reduces: with `run.reduction` (ZeRO-0 on more than one rank) the trainer, in
    buckets during the last backward, the figures in the last bucket and the division by N and
    the skip applied to the reduced gradients (`launch.train.reduce`): one collective round per
    step. Otherwise DeepSpeed reduces the gradients after the backward, so N is summed before the
    forwards (each weight n A W / N before DeepSpeed divides by A and averages over W) and the
    figures before the last backward, whose loss a skip makes NaN."""
    device = run.engine.device
    tokens, flops, flops_llmc, samples = 0, 0.0, 0.0, 0
    # The losses stay on the device until the one reduction of the step: reading each micro
    # batch's loss on the host would wait for the device at every micro batch.
    loss_sum = finite_scored = torch.zeros((), dtype=torch.float32, device=device)
    non_finite_here = torch.zeros(len(NON_FINITE_KINDS), dtype=torch.float32, device=device)
    taken = _micro_batches(run, batches)
    if taken is None:
        return None
    micro, served = taken
    scored = [float(host_value(run.task.target_mask(inputs).sum())) for inputs in micro]
    if run.reduction is None:
        # Summed over the ranks and left on the device, as is every weight made from it below:
        # the host issues this step's forwards without waiting for the previous step to finish.
        step_scored = dist.all_reduce_sum_tensor([sum(scored)])[0].to(device)
        share = (run.plan.grad_accum * run.denv.world_size) / step_scored.clamp(min=1.0)
    else:
        share = torch.ones((), device=device)  # N divides the reduced gradients
    for index, inputs in enumerate(micro):
        output = run.engine(**run.task.to_device(inputs, device))
        loss = output.loss.detach().float()
        finite = torch.isfinite(loss)
        non_finite_here = (
            non_finite_here + torch.stack([loss.isnan(), loss.isposinf(), loss.isneginf()]).float()
        )
        loss_sum = loss_sum + torch.where(finite, loss * scored[index], torch.zeros_like(loss))
        finite_scored = finite_scored + finite.float() * scored[index]
        tokens += run.task.tokens(inputs)
        flops += run.task.flops(run.cfg.model, inputs)
        flops_llmc += run.task.tokens(inputs) * llmc_flops_per_token(
            run.cfg.model, run.n_parameters, inputs["labels"].shape[1]
        )
        samples += inputs["labels"].shape[0]
        weighted = output.loss * (scored[index] * share).to(output.loss.dtype)
        if index < run.plan.grad_accum - 1:
            run.engine.backward(weighted)
            run.engine.step()
    fillers = run.data.train.stats["epoch_filler_batches"]
    figures_here = [
        loss_sum,
        finite_scored,
        non_finite_here.sum(),
        tokens,
        flops,
        flops_llmc,
        samples,
        fillers,
        float(_stop_requested(run)),
        sum(scored),
        # each rank's tokens in its own slot: how evenly the step's work was spread
        *(tokens if r == run.denv.rank else 0 for r in range(run.denv.world_size)),
    ]
    spike_limit = run.guard.spike_limit()
    if run.reduction is None:
        figures = dist.all_reduce_sum_tensor(figures_here).to(device)
        skip = _skip(figures, spike_limit)
        weighted = weighted * torch.where(
            skip, torch.full_like(weighted, math.nan), torch.ones_like(weighted)
        )
        # Queued before the backward; read after the step, which has waited past it.
        on_host = HostCopy(torch.cat([figures, non_finite_here.to(figures.dtype)]))
        run.engine.backward(weighted)
    else:
        run.reduction.arm()
        run.engine.backward(weighted)
        # per scored token of the step, all ranks: DeepSpeed's backward divided by A already
        accumulated = float(run.plan.grad_accum)
        figures = run.reduction.finish(
            dist.scalars_tensor(figures_here),
            lambda summed: torch.where(
                _skip(summed, spike_limit),
                math.nan,
                accumulated / summed[9].clamp(min=1.0),
            ),
        ).to(device)
        on_host = HostCopy(torch.cat([figures, non_finite_here.to(figures.dtype)]))
    skipped_before = run.engine.skipped_steps
    run.engine.step()
    skipped = run.engine.skipped_steps > skipped_before
    return _step_result(run, on_host.values(), served, spike_limit, skipped)


def _skip(figures: torch.Tensor, spike_limit: float) -> torch.Tensor:
    """The guard's decision from the step's summed figures: a non-finite loss on any rank, or a
    loss spike (0 / 0 is NaN: not a spike)."""
    return (figures[2] > 0) | (figures[0] / figures[1] > spike_limit)


def _step_result(
    run: Run, values: list[float], served: list, spike_limit: float, skipped: bool
) -> StepResult:
    """The step's figures, summed over the ranks, read on the host: the StepResult."""
    *summed, nan, pos_inf, neg_inf = values
    loss_sum, finite_scored, non_finite, tokens, flops, flops_llmc, samples, fillers, stop = summed[
        :9
    ]
    rank_tokens = summed[10:]
    # per scored token, over the finite batches
    loss = loss_sum / finite_scored if finite_scored else math.nan
    return StepResult(
        loss=loss,
        tokens=tokens,
        flops=flops,
        flops_llmc=flops_llmc,
        samples=samples,
        stop=stop > 0,
        skipped=_skip_reason(run, bool(non_finite), loss > spike_limit, skipped),
        spike_limit=spike_limit,
        non_finite_here=dict(zip(NON_FINITE_KINDS, (int(nan), int(pos_inf), int(neg_inf)))),
        served=served,
        filler_fraction=fillers / (len(run.data.train) * run.denv.world_size),
        rank_tokens_max_min=max(rank_tokens) / max(min(rank_tokens), 1.0),
    )


def _micro_batches(run: Run, batches) -> tuple[list[dict], list] | None:
    """The step's grad_accum micro batches as model inputs (on the host: counting their tokens
    costs no device sync) and the loader's handles on them (their sample keys are worked out
    only when needed); None on every rank when a stop request cut some rank's wait for its
    batches short, which every rank learns here, before the step's first collective."""
    served, micro = [], []
    try:
        with stoppable():
            for _ in range(run.plan.grad_accum):
                micro.append(run.task.model_inputs(next(batches)))
                served.append(run.data.train.served_batch())
        stopped = False
    except StopRequested:
        stopped = True
    if dist.any_rank(stopped):  # a rank without its batches has none to train on
        run.data.train.rewind()
        return None
    return micro, served


def _skip_reason(run: Run, non_finite: bool, spike: bool, skipped: bool) -> str:
    """Why DeepSpeed dropped the step's update ("" when it did not): the guard's reason, which
    it must have honoured, else fp16's overflow or a non-finite gradient norm."""
    reason = "non-finite loss" if non_finite else ("loss spike" if spike else "")
    if reason and not skipped:  # the guard's premise: a NaN backward makes DeepSpeed drop the step
        raise RuntimeError(
            f"step {run.step + 1}: DeepSpeed applied an update the guard asked to skip ({reason})"
        )
    if skipped and not reason:
        # fp16: DeepSpeed's loss scaler met an overflow and lowers the scale, which is how it
        # finds its scale (several in a row at the start are normal): counted, not guarded.
        reason = FP16_OVERFLOW if run.engine.loss_scale is not None else "non-finite gradient norm"
    return reason


class HostCopy:
    """A device tensor's copy to the host, queued now (into page-locked memory) and read later:
    reading waits for the copy alone, where a `.tolist()` after the optimizer step would wait
    for the step's update kernels too. On the host it is the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tensor = tensor

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()


@torch.compiler.set_stance("force_eager")  # see compile_model: no eval graphs or their recompiles
@torch.no_grad()
def evaluate(run: Run) -> dict | None:
    """Token-weighted loss (and perplexity; masked-token accuracy for mlm) on the valid split.
    Every rank runs the same number of forwards, which ZeRO-3 needs, so the ranks agree after
    each batch read whether a stop request cut a rank's wait for it short: then None."""
    loader = run.data.valid
    if loader is None:
        return {}
    run.engine.train(False)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "samples_consumed": 0})
    sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
    batches = iter(loader)
    for _ in range(run.cfg.eval_batches or len(loader)):
        try:
            with stoppable():
                batch = next(batches, None)
            stopped = False
        except StopRequested:
            batch, stopped = None, True
        if dist.any_rank(stopped):
            run.engine.train(True)
            return None
        if batch is None:
            break
        inputs = run.task.model_inputs(batch, run.engine.device)
        output = run.engine(**inputs)
        n = int(run.task.target_mask(inputs).sum())
        sums["loss"] += float(output.loss) * n
        sums["count"] += n
        for key, value in (
            run.task.eval_sums(output, inputs) if run.task.eval_sums else {}
        ).items():
            sums[key] = sums.get(key, 0.0) + value
    run.engine.train(True)
    # Every rank runs the same number of batches, so every rank has the same keys in the same order.
    sums = dict(zip(sums, dist.all_reduce_sum(list(sums.values()))))
    loss = sums["loss"] / max(sums["count"], 1)
    metrics = {
        "eval/loss": loss,
        "eval/perplexity": math.exp(min(loss, 50.0)),
        "eval/tokens": sums["count"],
    }
    if run.task.eval_metrics:
        metrics.update(run.task.eval_metrics(sums))
    return metrics


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


def _stop_requested(run: Run) -> bool:
    return stop.requested() or (run.denv.is_main and stop.stop_file(run.cfg.run_dir))
