"""Resuming a training run: which checkpoint a job resumes from (refused in one line when it
does not fit the job), and what the trainer makes of the record `launch.checkpoint.restore`
reads back (its settings' changes, the loader, the random streams); the metrics rows a resumed
job logs again. Saving one: `launch.checkpoint.save`."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import numpy as np
import torch

from common.atomic import atomic_write
from common.configure import UserError, config_to_dict, show
from launch import checkpoint as ckpt
from launch import distributed as dist
from launch.checkpoint.restore import load_state
from launch.checkpoint.state import set_rng_state
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.engine import Engine
from launch.tracking import read_metrics_rows
from launch.train import changes
from launch.train.state import Data, Progress
from model.config import TRAINING_ONLY_FIELDS


def find_resume(
    found: tuple[Path, str] | None, cfg: TrainConfig, plan: BatchPlan, tokenizer_sha256: str
) -> tuple[Path, str] | None:
    """The checkpoint to resume from (rank 0 only), given the newest intact one; refused, from
    its records and before anything loads it, if it was trained with another tokenizer, another
    network (`_model_misfit`), another global batch, or settings that a resume cannot apply
    (`launch.train.changes.refusal`; a checkpoint whose client_state.json predates its config is
    checked by `restore`, after the load). One written by another number of ranks is
    converted to a universal checkpoint beside it: a run resumes on another world size only with
    the same global batch, so that each optimizer step sees the samples it would have seen."""
    if found is None:
        return None
    root, tag = found
    if ckpt.client_info(root, tag).get("tokenizer_sha256") not in (None, tokenizer_sha256):
        raise UserError(_another_tokenizer(root / tag))
    if problem := _model_misfit(root / tag, ckpt.saved_model_config(root, tag), cfg):
        raise UserError(problem)
    saved = ckpt.saved_shape(root, tag)
    world = saved.get("world_size")
    if saved.get("global_batch_size") not in (None, plan.global_batch_size):
        raise UserError(_global_batch_misfit(root / tag, saved, plan))
    if problem := changes.refusal(root / tag, ckpt.client_info(root, tag).get("config"), cfg):
        raise UserError(problem)
    if world is None or world == plan.world_size or ckpt.is_universal(root, tag):
        return found
    print(
        f"checkpoint {root / tag} was written by {world} ranks; this job has {plan.world_size}: "
        f"global batch {plan.global_batch_size} kept ({plan.micro_batch_size} x {plan.grad_accum} "
        f"x {plan.world_size}); converting it to a universal checkpoint",
        file=sys.stderr,
    )
    from launch.deepspeed.universal import to_universal

    return to_universal(root, tag)


def _another_tokenizer(checkpoint: Path) -> str:
    return f"checkpoint {checkpoint} was trained with another tokenizer than this dataset's"


def _model_misfit(checkpoint: Path, saved: dict | None, cfg: TrainConfig) -> str | None:
    """One line naming each model key whose value differs between the checkpoint (`saved`, its
    model config as a plain dict; None: unrecorded, not checked) and this job, with both values,
    and how to go on; None if none differs. Every key that defines the network counts: its
    parameters' names and shapes (arch, d_model, n_layers, d_ff, vocab_size, max_seq_len,
    positions, norm_position, share_embeddings...), on which DeepSpeed's load fails with a
    traceback from every rank, and what they compute (n_heads, activation, layer_norm_eps, the
    reserved ids), with which it would load without a word into another network. Only
    `model.config.TRAINING_ONLY_FIELDS` (dropout, label smoothing, activation checkpointing, the
    init std) may change on a resume: they leave the network its weights define as it was."""
    if saved is None:
        return None
    there, here = _dotted(saved, "model."), _dotted(config_to_dict(cfg.model), "model.")
    ignored = {f"model.{name}" for name in TRAINING_ONLY_FIELDS}
    differ = [
        key for key in here if key in there and key not in ignored and there[key] != here[key]
    ]
    if not differ:
        return None
    values = "; ".join(f"{key} {show(there[key])} there, {show(here[key])} here" for key in differ)
    as_saved = " ".join(f"{key}={show(there[key])}" for key in differ)
    fresh = "in a new run_dir" if cfg.resume == "auto" else "in a new run_dir with resume=none"
    return (
        f"checkpoint {checkpoint} holds another model than this job: {values}; resume it as saved "
        f"with {as_saved}, or train the new model from scratch {fresh}"
    )


def _dotted(values: dict, prefix: str) -> dict:
    """A nested dict as {"model.encoder.n_heads": 4, ...}, the keys as an override names them."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict):
            out.update(_dotted(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def _global_batch_misfit(checkpoint: Path, saved: dict, plan: BatchPlan) -> str:
    """One line: the sizes, and overrides that would keep the saved global batch
    on this world size."""
    target, world = saved["global_batch_size"], plan.world_size
    was = (
        f"{saved['micro_batch_size']} x {saved['grad_accum']} x {saved['world_size']} ranks"
        if saved.get("micro_batch_size")
        else f"{saved.get('world_size')} ranks"
    )
    now = f"{plan.micro_batch_size} x {plan.grad_accum} x {world} ranks = {plan.global_batch_size}"
    fits = [
        (micro, target // (micro * world))
        for micro in range(1, target + 1)
        if target % (micro * world) == 0
    ]
    fits = sorted(fits, key=lambda f: (abs(f[0] - plan.micro_batch_size), f[1]))[:3]
    hint = (
        ("; set " + " or ".join(f"data.micro_batch_size={m} grad_accum={a}" for m, a in fits))
        if fits
        else (
            f"; no micro batch x grad_accum makes {target} on {world} ranks: use "
            "a world size that divides it"
        )
    )
    return (
        f"checkpoint {checkpoint} was trained with a global batch of {target} ({was}); "
        f"this job would use {now}{hint}"
    )


def restore(
    resume_from: tuple[Path, str], engine: Engine, data: Data, denv: dist.DistEnv, cfg: TrainConfig
) -> Progress:
    """Engine, loader and RNG state from a checkpoint; where the run stands. What this job's
    config changes from the checkpoint's is applied (`launch.train.changes`), each key said in
    one line: the optimizer's hyperparameters and the schedule's peak, which the load replaced
    with the checkpoint's, are set back from `cfg`, and the next step's rate recomputed from them
    at the restored step; a change that cannot apply is refused in one line."""
    root, tag = resume_from
    hyper = engine.hyperparameters()  # as `cfg` built the optimizer: the load replaces them
    saved = load_state(engine, root, tag)
    target = data.target.sha256 if data.target is not None else None
    if saved.tokenizer_sha256 != data.tokenizer_sha256 or saved.target_tokenizer_sha256 != target:
        raise UserError(_another_tokenizer(root / tag))
    if problem := changes.refusal(root / tag, saved.config, cfg):  # a checkpoint older than its
        raise UserError(problem)  # client_state.json's config: refused after the load
    data.train.load_state_dict(saved.loader, saved_data=_saved_data(saved.config, cfg))
    rates = engine.set_hyperparameters(hyper, cfg.optim.lr)
    saved_world = len(saved.rng)
    if saved_world == denv.world_size:
        set_rng_state(saved.rng[denv.rank])
    else:  # no rank's random streams carry over to another world size: new ones, from the step
        fresh_start(saved.step * 1_000_003 + int((saved.config or {}).get("seed", 0)), denv)
    if denv.is_main:
        step = saved.step
        change = (
            f" (written by {saved_world} ranks, resumed on {denv.world_size})"
            if saved_world != denv.world_size
            else ""
        )
        print(f"resumed from {root / tag} at step {step}{change}", file=sys.stderr)
        for line in changes.applied_lines(saved.config, cfg, step):
            print(line, file=sys.stderr)
        if rates[0] != rates[1]:
            print(
                f"resume: learning rate of step {step + 1} {rates[0]:.4g} -> {rates[1]:.4g} "
                f"(optim.lr {show(cfg.optim.lr)} x the schedule's factor at step {step})",
                file=sys.stderr,
            )
        if data.train.restarted:
            print(
                f"resume: data.allow_data_change=true: the train data differs from the "
                f"checkpoint's ({data.train.restarted}); it is read from its first sample, "
                f"the weights, optimizer and step {step} carried over",
                file=sys.stderr,
            )
    return Progress(
        saved.step, saved.tokens_seen, saved.wandb_run_id, saved.guard, saved.tokens_by_source
    )


def _saved_data(saved_cfg: dict | None, cfg: TrainConfig) -> str:
    """The data keys the checkpoint read with that differ from this job's, as overrides
    ("data.data_dir=... data.seed=..."), for the loader's refusal of another stream."""
    keys = ("data.data_dir", "data.seed", "data.length_grouping", "data.length_bands")
    differ = {key: old for key, old, _ in changes.differences(saved_cfg, cfg) if key in keys}
    return " ".join(f"{key}={show(value)}" for key, value in differ.items())


def fresh_start(seed: int, denv: dist.DistEnv) -> Progress:
    torch.manual_seed(seed + denv.rank)  # dropout differs across ranks
    np.random.seed(seed + denv.rank)
    random.seed(seed + denv.rank)
    return Progress()


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
        atomic_write(path, "".join(json.dumps(row) + "\n" for row in kept))
    return len(lines) - len(kept)
