"""`python -m launch.train CONFIG [key=value ...]`: one training loop for causal_lm, mlm and translation.

The same command runs alone, under `torchrun`, under the `deepspeed` launcher and under
`srun` (see `launch.distributed`). The loop is plain functions, in the order a batch meets
them: `setup` (config, process group, data, model, engine, resume) -> `fit` (train_step,
evaluate, save_checkpoint) -> the end-of-run checkpoint. DeepSpeed is reached only through
`launch.engine.Engine`.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from launch import checkpoint as ckpt
from launch import distributed as dist
from launch.config import BatchPlan, TrainConfig, check_config
from launch.engine import Engine, deepspeed_config
from launch.metrics import memory_mb, peak_flops
from launch.optim import build_optimizer, build_scheduler
from launch.tasks import Task
from launch.tracking import Tracker, git_commit, new_run_id, read_metrics_rows
from model import ModelConfig, Pretrained, build_model, warm_start
from pipeline.configure import UserError, config_to_dict, parse_cli, run_main, save_config, strip_launcher_args
from pipeline.format import MANIFEST, TOKENIZER_FILE, file_sha256, read_manifest
from pipeline.loader import ShardLoader

USAGE = "usage: python -m launch.train CONFIG.yaml [key.sub=value ...]"


@dataclass
class Data:
    """What `open_data` resolves from the dataset: the loaders and the tokenizer's identity."""

    train: ShardLoader
    valid: ShardLoader | None  # None when the valid split is smaller than one global batch
    vocab_size: int
    tokenizer_sha256: str


@dataclass
class Progress:
    """Where a run stands: restored from a checkpoint, or a fresh start."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str | None = None  # the W&B run's id, kept across resumes


@dataclass
class Run:
    cfg: TrainConfig  # resolved: model.vocab_size is the data's
    denv: dist.DistEnv
    task: Task
    plan: BatchPlan
    engine: Engine
    data: Data
    tracker: Tracker
    run_id: str
    peak: tuple[float, str]
    step: int = 0
    tokens_seen: int = 0


# ----------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig) -> Run:
    """Named steps, each returning what it resolves: data -> model config -> process group ->
    model and engine -> resume -> run directory and tracker."""
    # DeepSpeed calls torch.distributed functions that torch now marks deprecated, every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    task = check_config(cfg)
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)
    data = open_data(cfg, task, denv)
    cfg = replace(cfg, model=resolve_model_config(cfg.model, data.vocab_size, cfg.data.data_dir))
    plan = BatchPlan(cfg.data.micro_batch_size, cfg.grad_accum, denv.world_size)
    dist.init_process_group(denv, cfg.dist_timeout_s)
    resume_from = dist.broadcast_object(ckpt.resolve_resume(cfg.resume, cfg.run_dir) if denv.is_main else None)
    engine, n_parameters = build_engine(cfg, task, plan, data.tokenizer_sha256, denv)
    progress = restore(resume_from, engine, data, denv) if resume_from else fresh_start(cfg.seed, denv)
    run_id = dist.broadcast_object(progress.run_id or (new_run_id() if denv.is_main else None))
    tracker, peak = open_run_dir(cfg, denv, plan, data, progress.step, run_id, n_parameters)
    if denv.is_main:
        print(f"{cfg.task}: {n_parameters:,} parameters, world {denv.world_size}, global batch "
              f"{plan.global_batch_size} ({plan.micro_batch_size} x {plan.grad_accum} x {denv.world_size}), "
              f"ZeRO-{cfg.deepspeed.zero_stage} {cfg.deepspeed.precision}, {len(data.train)} batches/epoch per rank, "
              f"peak {peak[0] / 1e9:.1f} GFLOP/s ({peak[1]})", file=sys.stderr)
    return Run(cfg, denv, task, plan, engine, data, tracker, run_id, peak, progress.step, progress.tokens_seen)


def open_data(cfg: TrainConfig, task: Task, denv: dist.DistEnv) -> Data:
    """This rank's train and valid loaders over `data.data_dir`, checked against its manifest."""
    tokenizer = read_manifest(cfg.data.data_dir)["tokenizer"]
    sha256 = tokenizer["sha256"]
    train = ShardLoader.from_config(cfg.data, task.name, "train", rank=denv.rank, world_size=denv.world_size,
                                    expected_tokenizer_sha256=sha256)
    try:
        valid = ShardLoader.from_config(cfg.data, task.name, "valid", rank=denv.rank, world_size=denv.world_size,
                                        expected_tokenizer_sha256=sha256)
    except UserError as err:  # e.g. a valid split smaller than one global batch
        valid = None
        if denv.is_main:
            print(f"warning: no evaluation: {err}", file=sys.stderr)
    return Data(train, valid, int(tokenizer["vocab_size"]), sha256)


def resolve_model_config(model_cfg: ModelConfig, vocab_size: int, data_dir: str) -> ModelConfig:
    """The model config with the data's vocabulary size (`vocab_size: 0` asks for it)."""
    if model_cfg.vocab_size == 0:
        return replace(model_cfg, vocab_size=vocab_size)
    if model_cfg.vocab_size != vocab_size:
        raise UserError(f"model.vocab_size={model_cfg.vocab_size} but the tokenizer of {data_dir} has "
                        f"{vocab_size} pieces (set model.vocab_size=0 to take it from the data)")
    return model_cfg


def build_engine(cfg: TrainConfig, task: Task, plan: BatchPlan, tokenizer_sha256: str,
                 denv: dist.DistEnv) -> tuple[Engine, int]:
    """The model (random or warm-started), its optimizer and schedule under DeepSpeed; and its
    parameter count, taken before ZeRO-3 partitions the parameters away."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    try:
        model = _warm_start(cfg, tokenizer_sha256, denv.is_main) if _warm_starts(cfg, task) else build_model(cfg.model)
    except ValueError as err:  # the model config's own check (ModelConfig.validate)
        raise UserError(str(err)) from err
    n_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps)
    return Engine(model, optimizer, scheduler, deepspeed_config(cfg, plan)), n_parameters


def _warm_starts(cfg: TrainConfig, task: Task) -> bool:
    return task.warm_startable and bool(cfg.init.encoder or cfg.init.decoder)


def _warm_start(cfg: TrainConfig, tokenizer_sha256: str, is_main: bool) -> torch.nn.Module:
    from launch.export import load_model_dir
    from model import WarmStartError

    sides = {}
    for side, directory in (("encoder", cfg.init.encoder), ("decoder", cfg.init.decoder)):
        if directory:
            pretrained, meta = load_model_dir(directory)
            sides[side] = Pretrained(pretrained.state_dict(), meta["model_config"], meta["tokenizer_sha256"])
    try:
        model, report = warm_start(cfg.model, tokenizer_sha256, **sides)
    except WarmStartError as err:
        raise UserError(f"init: {err}") from err
    if is_main:
        Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
        (Path(cfg.run_dir) / "warm_start.txt").write_text(str(report) + "\n")
        print(f"warm start: {report.summary()} (details in {cfg.run_dir}/warm_start.txt)", file=sys.stderr)
    return model


def restore(resume_from: tuple[Path, str], engine: Engine, data: Data, denv: dist.DistEnv) -> Progress:
    """Engine, loader and RNG state from a checkpoint; where the run stands."""
    root, tag = resume_from
    client = engine.load(root, tag)
    if client.get("world_size") != denv.world_size:
        raise UserError(f"checkpoint {root / tag} was written by {client.get('world_size')} ranks, this job has "
                        f"{denv.world_size}: ZeRO checkpoints are tied to their world size (export it and start anew)")
    if client.get("tokenizer_sha256") != data.tokenizer_sha256:
        raise UserError(f"checkpoint {root / tag} was trained with another tokenizer than this dataset's")
    data.train.load_state_dict(client["loader"])
    _set_rng_state(client["rng"][denv.rank])
    if denv.is_main:
        print(f"resumed from {root / tag} at step {client['step']}", file=sys.stderr)
    return Progress(client["step"], client["tokens_seen"], client.get("wandb_run_id"))


def fresh_start(seed: int, denv: dist.DistEnv) -> Progress:
    torch.manual_seed(seed + denv.rank)  # dropout differs across ranks
    np.random.seed(seed + denv.rank)
    random.seed(seed + denv.rank)
    return Progress()


def open_run_dir(cfg: TrainConfig, denv: dist.DistEnv, plan: BatchPlan, data: Data, step: int, run_id: str,
                 n_parameters: int) -> tuple[Tracker, tuple[float, str]]:
    """RUN_DIR's config, tokenizer and metrics (rows after `step` dropped), and the W&B run;
    the peak FLOP/s that MFU is measured against."""
    run_dir = Path(cfg.run_dir)
    if denv.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(run_dir, step)
        if dropped:
            print(f"metrics.jsonl: dropped {dropped} rows logged after step {step} by an interrupted job", file=sys.stderr)
        save_config(cfg, run_dir / "config.yaml")
        shutil.copyfile(Path(cfg.data.data_dir) / TOKENIZER_FILE, run_dir / TOKENIZER_FILE)
    peak = peak_flops(cfg.deepspeed.precision) if denv.is_main else (float("nan"), "")
    summary = {"git_commit": git_commit(), "data_manifest_sha256": file_sha256(Path(cfg.data.data_dir) / MANIFEST),
               "tokenizer_sha256": data.tokenizer_sha256, "world_size": denv.world_size,
               "global_batch_size": plan.global_batch_size, "peak_flops": peak[0], "peak_flops_source": peak[1],
               "parameters": n_parameters}
    tracker = Tracker(enabled=denv.is_main, mode=cfg.wandb.mode, project=cfg.wandb.project, entity=cfg.wandb.entity,
                      name=cfg.wandb.name, tags=cfg.wandb.tags, run_dir=run_dir, run_id=run_id,
                      config=config_to_dict(cfg), summary=summary)
    return tracker, peak


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ----------------------------------------------------------------------------- the loop

STOP_FILE = "STOP"  # touched by slurm/*.sbatch on SLURM's warning signal
PREEMPTED_FILE = "preempted.json"  # left for the batch script: requeue me
_signalled = False


def _on_signal(signum, frame) -> None:
    global _signalled
    _signalled = True


def install_preemption_handlers() -> None:
    """SIGUSR1 (SLURM's `--signal` warning) and SIGTERM ask for a checkpoint and a clean exit."""
    for sig in (signal.SIGUSR1, signal.SIGTERM):
        signal.signal(sig, _on_signal)


def _stop_requested(run: Run) -> bool:
    return _signalled or (run.denv.is_main and (Path(run.cfg.run_dir) / STOP_FILE).exists())


def _batches(loader: ShardLoader):
    """Batches forever, epoch after epoch (the loader advances its epoch at the end of each)."""
    while True:
        yield from loader


def train_step(run: Run, batches) -> dict:
    """One optimizer step: grad_accum micro batches, forward and backward through the engine."""
    loss_sum, tokens, flops, samples = 0.0, 0, 0.0, 0
    for _ in range(run.plan.grad_accum):
        inputs = run.task.model_inputs(next(batches))
        output = run.engine(**{key: value.to(run.engine.device, non_blocking=True) for key, value in inputs.items()})
        run.engine.backward(output.loss)
        run.engine.step()
        loss_sum += float(output.loss.detach())
        tokens += run.task.tokens(inputs)
        flops += run.task.flops(run.cfg.model, inputs)
        samples += inputs["labels"].shape[0]
    # One reduction carries the step's figures and whether any rank was asked to stop.
    loss_sum, tokens, flops, samples, stop = dist.all_reduce_sum([loss_sum, tokens, flops, samples, float(_stop_requested(run))])
    loss = loss_sum / (run.plan.grad_accum * run.denv.world_size)
    if not math.isfinite(loss):  # every rank sees the same reduced value, so all stop together
        raise RuntimeError(f"non-finite training loss ({loss}) at step {run.step + 1}; stopping")
    return {"train/loss": loss, "tokens": tokens, "flops": flops, "samples": samples, "stop": stop > 0}


@torch.no_grad()
def evaluate(run: Run) -> dict:
    """Token-weighted loss (and perplexity; masked-token accuracy for mlm) on the valid split.
    Every rank runs the same number of forwards, which ZeRO-3 needs."""
    loader = run.data.valid
    if loader is None:
        return {}
    run.engine.train(False)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "batches_consumed": 0})
    sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
    for index, batch in enumerate(loader):
        if run.cfg.eval_batches and index >= run.cfg.eval_batches:
            break
        inputs = run.task.model_inputs(batch, run.engine.device)
        output = run.engine(**inputs)
        n = int(run.task.target_mask(inputs).sum())
        sums["loss"] += float(output.loss) * n
        sums["count"] += n
        for key, value in (run.task.eval_sums(output, inputs) if run.task.eval_sums else {}).items():
            sums[key] = sums.get(key, 0.0) + value
    run.engine.train(True)
    # Every rank runs the same number of batches, so every rank has the same keys in the same order.
    sums = dict(zip(sums, dist.all_reduce_sum(list(sums.values()))))
    loss = sums["loss"] / max(sums["count"], 1)
    metrics = {"eval/loss": loss, "eval/perplexity": math.exp(min(loss, 50.0)), "eval/tokens": sums["count"]}
    if run.task.eval_metrics:
        metrics.update(run.task.eval_metrics(sums))
    return metrics


def save_checkpoint(run: Run) -> Path:
    """Every rank writes its part; the `latest` pointer moves once all have finished."""
    root = ckpt.checkpoint_root(run.cfg.run_dir)
    tag = ckpt.tag_for(run.step)
    client_state = {
        "step": run.step, "tokens_seen": run.tokens_seen, "loader": run.data.train.state_dict(),
        "rng": dist.all_gather_object(_rng_state()), "config": config_to_dict(run.cfg),
        "tokenizer_sha256": run.data.tokenizer_sha256, "wandb_run_id": run.run_id, "world_size": run.denv.world_size,
    }
    run.engine.save(root, tag, client_state)
    dist.barrier()
    if run.denv.is_main:
        info = {k: client_state[k] for k in ("step", "tokens_seen", "tokenizer_sha256", "wandb_run_id", "world_size")}
        (root / tag / "client_state.json").write_text(json.dumps(info, indent=1) + "\n")
        ckpt.move_pointer(root, tag)
        ckpt.prune(root, run.cfg.checkpoint.keep_last)
    dist.barrier()
    return root / tag


def truncate_metrics(run_dir: Path, step: int) -> int:
    """Drop the rows of RUN_DIR/metrics.jsonl logged after `step`, the step a run starts from
    (and any torn line): a job that died between checkpoints logged steps that the resumed job
    trains and logs again. Returns how many lines were dropped; the file is replaced atomically."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    kept = [row for row in read_metrics_rows(run_dir) if row.get("step", 0) <= step]
    if len(kept) < len(lines):
        partial = path.with_name(path.name + ".partial")
        partial.write_text("".join(json.dumps(row) + "\n" for row in kept))
        os.replace(partial, path)
    return len(lines) - len(kept)


def _log(run: Run, metrics: dict) -> None:
    if run.denv.is_main:
        run.tracker.log(metrics, step=run.step)
        run.tracker.progress(run.step, run.cfg.max_steps, metrics)
        with open(Path(run.cfg.run_dir) / "metrics.jsonl", "a") as fh:
            fh.write(json.dumps({"step": run.step, **metrics}) + "\n")


def fit(run: Run) -> dict:
    cfg = run.cfg
    batches = _batches(run.data.train)
    window_tokens = window_flops = window_samples = 0.0
    window_start = time.perf_counter()
    last_eval: dict = {}
    last_saved = run.step
    stop_at = min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
    while run.step < stop_at:
        result = train_step(run, batches)
        run.step += 1
        run.tokens_seen += int(result["tokens"])
        window_tokens += result["tokens"]
        window_flops += result["flops"]
        window_samples += result["samples"]
        metrics: dict = {}
        if run.step % cfg.log_every == 0 or run.step == stop_at:
            elapsed = time.perf_counter() - window_start
            achieved = window_flops / elapsed / run.denv.world_size  # per rank, like the peak
            metrics.update({
                "train/loss": result["train/loss"], "train/lr": run.engine.lr, "train/grad_norm": run.engine.grad_norm(),
                "train/tokens_seen": run.tokens_seen, "train/epoch": run.data.train.epoch,
                "perf/tokens_per_s": window_tokens / elapsed,
                "perf/samples_per_s": window_samples / elapsed,
                "perf/mfu": achieved / run.peak[0] if run.denv.is_main else float("nan"),
                **memory_mb(),
            })
            window_tokens = window_flops = window_samples = 0.0
            window_start = time.perf_counter()
        if (cfg.eval_every and run.step % cfg.eval_every == 0) or run.step == stop_at:
            last_eval = evaluate(run)
            metrics.update(last_eval)
        if metrics:
            _log(run, metrics)
        if result["stop"] and run.step < stop_at:  # on the last step a normal end is as good
            save_checkpoint(run)
            if run.denv.is_main:
                (Path(cfg.run_dir) / STOP_FILE).unlink(missing_ok=True)
                (Path(cfg.run_dir) / PREEMPTED_FILE).write_text(json.dumps({"step": run.step}) + "\n")
                print(f"stop requested: checkpoint at step {run.step} saved; exiting for a requeue", file=sys.stderr)
            return {"step": run.step, "tokens_seen": run.tokens_seen, "preempted": True, **last_eval}
        if cfg.checkpoint.every_steps and run.step % cfg.checkpoint.every_steps == 0 and run.step < stop_at:
            save_checkpoint(run)
            last_saved = run.step
    if last_saved != run.step or ckpt.latest_tag(ckpt.checkpoint_root(cfg.run_dir)) is None:
        save_checkpoint(run)
    return {"step": run.step, "tokens_seen": run.tokens_seen, **last_eval}


def train(cfg: TrainConfig) -> dict:
    install_preemption_handlers()
    run = setup(cfg)
    if run.denv.is_main:
        (Path(cfg.run_dir) / PREEMPTED_FILE).unlink(missing_ok=True)
    try:
        final = fit(run)
        if final.get("preempted"):
            return final  # the W&B run stays open for the requeued job (finished below, not marked done)
        run.tracker.finish({f"final/{k}": v for k, v in final.items()})
        if run.denv.is_main:
            (Path(cfg.run_dir) / "final.json").write_text(json.dumps(final, indent=1) + "\n")
        return final
    finally:
        run.tracker.finish()
        dist.destroy()


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    cfg = parse_cli(TrainConfig, argv, usage=USAGE)
    train(cfg)
    return 0


if __name__ == "__main__":
    run_main(main)
