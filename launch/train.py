"""`python -m launch.train CONFIG [key=value ...]`: one training loop for causal_lm, mlm and translation.

The same command runs alone, under `torchrun`, under the `deepspeed` launcher and under
`srun` (see `launch.distributed`). The loop is plain functions, in the order a batch meets
them: `setup` (config, process group, data, model, engine, resume) -> `fit` (train_step,
evaluate, save_checkpoint) -> the end-of-run checkpoint. DeepSpeed is reached only through
`launch.engine.Engine`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import importlib.util
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from launch import checkpoint as ckpt
from launch import preflight
from launch import distributed as dist
from launch import stop
from launch.stop import StopRequested, stoppable
from launch.config import BatchPlan, TrainConfig, batch_plan, check_config
from launch.engine import Engine, checkpoint_size, deepspeed_config
from launch.metrics import memory_mb, peak_flops, set_fp32_matmul
from launch.optim import build_optimizer, build_scheduler
from launch.preconditions import check_writable_dir, data_fits_model
from launch.tasks import Task, host_value
from launch.tracking import Tracker, git_commit, new_run_id, read_metrics_rows
from model import ModelConfig, Pretrained, attention_kernels, build_model, llmc_flops_per_token, warm_start
from model.config import TRAINING_ONLY_FIELDS
from pipeline.configure import UserError, config_to_dict, parse_cli, save_config, show, strip_launcher_args
from pipeline import remote
from pipeline.format import MANIFEST, TOKENIZER_FILE, ManifestError, read_manifest
from pipeline.loader import ShardLoader, describe_mixture
from pipeline.lock import dir_lock

USAGE = "usage: python -m launch.train CONFIG.yaml [key.sub=value ...]"


@dataclass
class Data:
    """What `open_data` resolves from the dataset: the loaders and the tokenizer's identity."""

    train: ShardLoader
    valid: ShardLoader | None  # None when the valid split is smaller than one global batch
    vocab_size: int
    tokenizer_sha256: str
    manifest_sha256: str = ""  # sha256 of manifest.json: the dataset's fingerprint (W&B's summary, exports' provenance)


@dataclass
class Progress:
    """Where a run stands: restored from a checkpoint, or a fresh start."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str | None = None  # the W&B run's id, kept across resumes
    guard: dict = field(default_factory=dict)  # `Guard.state_dict()`: skip counts and the loss history
    tokens_by_source: dict = field(default_factory=dict)  # training tokens read per source, all ranks


@dataclass
class Guard:
    """Guarded steps: a step whose loss is not finite on some rank, or (with `guard.spike_factor`)
    spikes above the recent losses, is skipped on every rank; see `train_step`."""

    max_consecutive_skips: int
    spike_factor: float
    spike_warmup_steps: int
    spike_window: int
    skipped: int = 0
    consecutive: int = 0
    fp16_overflows: int = 0  # steps DeepSpeed's fp16 loss scaler dropped (not the guard's)
    history: list = field(default_factory=list)  # the last `spike_window` applied steps' losses

    def spike_limit(self) -> float:
        """The loss above which a step counts as a spike (inf while off or warming up)."""
        if not self.spike_factor or len(self.history) < max(2, self.spike_warmup_steps):
            return math.inf
        mean = sum(self.history) / len(self.history)
        std = math.sqrt(sum((x - mean) ** 2 for x in self.history) / (len(self.history) - 1))
        return mean + self.spike_factor * std

    def record(self, loss: float, skipped: bool) -> None:
        if skipped:
            self.skipped += 1
            self.consecutive += 1
            return
        self.consecutive = 0
        self.history = (self.history + [loss])[-self.spike_window:]

    def state_dict(self) -> dict:
        return {"skipped": self.skipped, "consecutive": self.consecutive, "history": list(self.history),
                "fp16_overflows": self.fp16_overflows}

    def load_state_dict(self, state: dict) -> None:
        self.skipped, self.consecutive = int(state.get("skipped", 0)), int(state.get("consecutive", 0))
        self.fp16_overflows = int(state.get("fp16_overflows", 0))
        self.history = [float(x) for x in state.get("history", [])][-self.spike_window:]


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
    guard: Guard
    step: int = 0
    tokens_seen: int = 0
    n_parameters: int = 0  # all of them, for llm.c's FLOPs count
    # Tokens read per source, all ranks, before this process started (from the checkpoint);
    # the train loader counts this process's, this rank's.
    tokens_by_source_before: dict = field(default_factory=dict)


# ----------------------------------------------------------------------------- setup


def setup(cfg: TrainConfig) -> Run:
    """Named steps, each returning what it resolves: data -> model config -> process group ->
    model and engine -> resume -> run directory and tracker."""
    # DeepSpeed calls torch.distributed functions that torch now marks deprecated, every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    task = check_config(cfg)
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)
    plan = batch_plan(cfg, denv.world_size)
    cfg = replace(cfg, grad_accum=plan.grad_accum)
    with stoppable():  # every rank reads the manifest, before there is a process group to leave
        data = open_data(cfg, task, denv)
    cfg = replace(cfg, model=resolve_model_config(cfg.model, data.vocab_size, cfg.data.data_dir))
    dist.init_process_group(denv, cfg.dist_timeout_s)
    tf32 = set_fp32_matmul(cfg.tf32)  # before any GEMM: the peak measurement, compilation, training
    # The newest checkpoint that every rank finds intact (sizes and checksums written at save),
    # then, if another world size wrote it, its universal copy.
    candidates = _on_main(denv, lambda: ckpt.resume_candidates(cfg.resume, cfg.run_dir))
    intact = ckpt.choose_resume(cfg.resume, candidates,
                                lambda candidate: ckpt.resume_verdict(candidate, denv.rank, denv.world_size),
                                dist.all_gather_object, report=denv.is_main)
    resume_from = _on_main(denv, lambda: find_resume(intact, cfg, plan, data.tokenizer_sha256))
    engine, n_parameters = build_engine(cfg, task, plan, data.tokenizer_sha256, denv,
                                        load_universal=bool(resume_from) and ckpt.is_universal(*resume_from))
    progress = restore(resume_from, engine, data, denv) if resume_from else fresh_start(cfg.seed, denv)
    run_id = dist.broadcast_object(progress.run_id or (new_run_id() if denv.is_main else None))
    tracker, peak = open_run_dir(cfg, denv, plan, data, progress.step, run_id, n_parameters, tf32)
    guard = Guard(cfg.guard.max_consecutive_skips, cfg.guard.spike_factor, cfg.guard.spike_warmup_steps,
                  cfg.guard.spike_window)
    guard.load_state_dict(progress.guard)
    if denv.is_main:
        print(f"{cfg.task}: {n_parameters:,} parameters, world {denv.world_size}, global batch "
              f"{plan.global_batch_size} ({plan.micro_batch_size} x {plan.grad_accum} x {denv.world_size}), "
              f"ZeRO-{cfg.deepspeed.zero_stage} {cfg.deepspeed.precision}, {len(data.train)} batches/epoch per rank, "
              f"peak {peak[0] / 1e9:.1f} GFLOP/s ({peak[1]})", file=sys.stderr)
        if data.train.mixed:
            print(f"mixture: {describe_mixture(data.train.sources)}", file=sys.stderr)
    return Run(cfg, denv, task, plan, engine, data, tracker, run_id, peak, guard, progress.step, progress.tokens_seen,
               n_parameters, dict(progress.tokens_by_source))


def _on_main(denv: dist.DistEnv, work):
    """`work()` on rank 0, its result (or its UserError or StopRequested, raised on every rank)
    broadcast: a refusal on rank 0 alone would leave the other ranks waiting at the next collective."""
    outcome = None
    if denv.is_main:
        try:
            outcome = ("ok", work())
        except UserError as err:
            outcome = ("error", str(err))
        except StopRequested as request:
            outcome = ("stop", str(request))
    kind, value = dist.broadcast_object(outcome)
    if kind == "error":
        raise UserError(value)
    if kind == "stop":
        raise StopRequested(value)
    return value


def open_data(cfg: TrainConfig, task: Task, denv: dist.DistEnv) -> Data:
    """This rank's train and valid loaders over `data.data_dir`, checked against its manifest."""
    manifest = read_manifest(cfg.data.data_dir, remote.FetchConfig.from_loader_config(cfg.data))
    # Found here, before the engine is built, rather than at the first forward after start-up.
    if problem := data_fits_model(cfg.data.data_dir, manifest, task.name, cfg.model):
        raise UserError(problem)
    tokenizer = manifest["tokenizer"]
    sha256 = tokenizer["sha256"]
    train = ShardLoader.from_config(cfg.data, task.name, "train", rank=denv.rank, world_size=denv.world_size,
                                    grad_accum=cfg.grad_accum, expected_tokenizer_sha256=sha256,
                                    pin_memory=torch.cuda.is_available())
    try:
        valid = ShardLoader.from_config(cfg.data, task.name, "valid", rank=denv.rank, world_size=denv.world_size,
                                        expected_tokenizer_sha256=sha256, pin_memory=torch.cuda.is_available())
    except ManifestError:  # a damaged manifest stops the run, whichever split it damages
        raise
    except UserError as err:  # e.g. a valid split smaller than one global batch
        valid = None
        if denv.is_main:
            print(f"warning: no evaluation: {err}", file=sys.stderr)
    fetch = remote.FetchConfig.from_loader_config(cfg.data)
    manifest_bytes = remote.read_bytes(remote.join(cfg.data.data_dir, MANIFEST), fetch)
    return Data(train, valid, int(tokenizer["vocab_size"]), sha256, hashlib.sha256(manifest_bytes).hexdigest())


def resolve_model_config(model_cfg: ModelConfig, vocab_size: int, data_dir: str) -> ModelConfig:
    """The model config with the data's vocabulary size (`vocab_size: 0` asks for it)."""
    if model_cfg.vocab_size == 0:
        return replace(model_cfg, vocab_size=vocab_size)
    if model_cfg.vocab_size != vocab_size:
        raise UserError(f"model.vocab_size={model_cfg.vocab_size} but the tokenizer of {data_dir} has "
                        f"{vocab_size} pieces (set model.vocab_size=0 to take it from the data)")
    return model_cfg


def find_resume(found: tuple[Path, str] | None, cfg: TrainConfig, plan: BatchPlan,
                tokenizer_sha256: str) -> tuple[Path, str] | None:
    """The checkpoint to resume from (rank 0 only), given the newest intact one; refused, from
    its records and before anything loads it, if it was trained with another tokenizer, another
    network (`_model_misfit`) or another global batch. One written by another number of ranks is
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
    if world is None or world == plan.world_size or ckpt.is_universal(root, tag):
        return found
    print(f"checkpoint {root / tag} was written by {world} ranks; this job has {plan.world_size}: "
          f"global batch {plan.global_batch_size} kept ({plan.micro_batch_size} x {plan.grad_accum} x "
          f"{plan.world_size}); converting it to a universal checkpoint", file=sys.stderr)
    from launch.engine import to_universal

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
    differ = [key for key in here if key in there and key not in ignored and there[key] != here[key]]
    if not differ:
        return None
    values = "; ".join(f"{key} {show(there[key])} there, {show(here[key])} here" for key in differ)
    as_saved = " ".join(f"{key}={show(there[key])}" for key in differ)
    fresh = "in a new run_dir" if cfg.resume == "auto" else "in a new run_dir with resume=none"
    return (f"checkpoint {checkpoint} holds another model than this job: {values}; resume it as saved with "
            f"{as_saved}, or train the new model from scratch {fresh}")


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
    """One line: the sizes, and overrides that would keep the saved global batch on this world size."""
    target, world = saved["global_batch_size"], plan.world_size
    was = (f"{saved['micro_batch_size']} x {saved['grad_accum']} x {saved['world_size']} ranks"
           if saved.get("micro_batch_size") else f"{saved.get('world_size')} ranks")
    now = f"{plan.micro_batch_size} x {plan.grad_accum} x {world} ranks = {plan.global_batch_size}"
    fits = [(micro, target // (micro * world)) for micro in range(1, target + 1)
            if target % (micro * world) == 0]
    fits = sorted(fits, key=lambda f: (abs(f[0] - plan.micro_batch_size), f[1]))[:3]
    hint = ("; set " + " or ".join(f"data.micro_batch_size={m} grad_accum={a}" for m, a in fits)) if fits \
        else f"; no micro batch x grad_accum makes {target} on {world} ranks: use a world size that divides it"
    return (f"checkpoint {checkpoint} was trained with a global batch of {target} ({was}); this job would use "
            f"{now}{hint}")


def build_engine(cfg: TrainConfig, task: Task, plan: BatchPlan, tokenizer_sha256: str, denv: dist.DistEnv, *,
                 load_universal: bool = False) -> tuple[Engine, int]:
    """The model (random, warm-started, or init.model's weights), its optimizer and schedule under
    DeepSpeed; and its parameter count, taken before ZeRO-3 partitions the parameters away."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    try:
        if _warm_starts(cfg, task):
            model = _warm_start(cfg, tokenizer_sha256, denv.is_main)
        elif cfg.init.model:
            from launch import init_model

            fetch = remote.FetchConfig.from_loader_config(cfg.data)
            dataset_tokenizer = remote.local_file(remote.join(cfg.data.data_dir, TOKENIZER_FILE), fetch,
                                                  sha256=tokenizer_sha256)
            model = init_model.load(cfg, dataset_tokenizer)
        else:
            model = build_model(cfg.model)
    except ValueError as err:  # the model config's own check (ModelConfig.validate)
        raise UserError(str(err)) from err
    n_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim, skip_non_finite=cfg.deepspeed.zero_stage == 0,
                                cpu_offload=cfg.deepspeed.offload_optimizer)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps, cfg.model.d_model)
    if cfg.compile:
        compile_model(model)
    return Engine(model, optimizer, scheduler, deepspeed_config(cfg, plan, load_universal=load_universal)), n_parameters


def compile_model(model: torch.nn.Module) -> None:
    """`compile: true`: torch.compile (inductor) each transformer block's forward for training,
    in place, before DeepSpeed wraps the model. Nothing compiles here: the first forward does.

    The module keeps its class and its state dict its keys (no `_orig_mod.` prefix), so
    checkpoints, resume and export read the same names as without compilation. The blocks
    (`model.blocks.Block`, where nearly all the work is) rather than the whole model:
    - ZeRO-3 gathers parameters in hooks around every submodule, and in a compiled model each
      gather is a graph break, after which dynamo compiles the hook frames again for every
      module until its recompile limit. Each block is made a ZeRO-3 leaf instead
      (`launch.engine.zero3_leaf_modules`; no effect below stage 3): one gather around the
      block, no hooks inside it, which stay outside the compiled forward, eager.
    - The loss (`model.loss`) chunks its rows in a Python loop, which a compiled graph
      specializes to each sequence length (translation's lengths vary: a recompile per batch
      until the limit), and uses GEMMs with a float32 output that inductor cannot lower on CPU.
      It stays eager, as do the embeddings and the masks.
    The blocks of one class share a graph; a second sequence length recompiles it once with a
    dynamic length. `evaluate` runs eagerly: its no-grad, eval-mode forwards would need graphs
    of their own, counted against the same recompile limit. With dropout, inductor draws other
    random masks than eager mode does. In bf16 on a CPU the compiled blocks' attention recomputes
    its probabilities in backward rather than run SDPA's slow CPU flash backward
    (`model.blocks.attention`)."""
    if torch.cuda.is_available():
        if importlib.util.find_spec("triton") is None:
            raise UserError("compile: inductor needs Triton on a GPU, which is not installed (pip install triton, "
                            "or compile=false)")
    else:
        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(cxx) is None:
            raise UserError(f"compile: inductor needs a C++ compiler on CPU and {cxx!r} was not found (install one "
                            f"or set CXX, or compile=false)")
    from launch.engine import zero3_leaf_modules
    from model.blocks import Block

    blocks = [module for module in model.modules() if isinstance(module, Block)]
    zero3_leaf_modules(blocks)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend="inductor")


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
    if client.get("tokenizer_sha256") != data.tokenizer_sha256:
        raise UserError(_another_tokenizer(root / tag))
    data.train.load_state_dict(client["loader"])
    saved_world = len(client["rng"])
    if saved_world == denv.world_size:
        _set_rng_state(client["rng"][denv.rank])
    else:  # no rank's random streams carry over to another world size: new ones, from the step
        fresh_start(int(client["step"]) * 1_000_003 + int(client.get("config", {}).get("seed", 0)), denv)
    if denv.is_main:
        change = f" (written by {saved_world} ranks, resumed on {denv.world_size})" if saved_world != denv.world_size else ""
        print(f"resumed from {root / tag} at step {client['step']}{change}", file=sys.stderr)
    return Progress(client["step"], client["tokens_seen"], client.get("wandb_run_id"), client.get("guard", {}),
                    client.get("tokens_by_source", {}))


def fresh_start(seed: int, denv: dist.DistEnv) -> Progress:
    torch.manual_seed(seed + denv.rank)  # dropout differs across ranks
    np.random.seed(seed + denv.rank)
    random.seed(seed + denv.rank)
    return Progress()


def open_run_dir(cfg: TrainConfig, denv: dist.DistEnv, plan: BatchPlan, data: Data, step: int, run_id: str,
                 n_parameters: int, tf32: bool = False) -> tuple[Tracker, tuple[float, str]]:
    """RUN_DIR's config, tokenizer and metrics (rows after `step` dropped), and the W&B run;
    the peak FLOP/s that MFU is measured against (TF32's for fp32 when `tf32`: it is in use)."""
    run_dir = Path(cfg.run_dir)

    def write_run_dir() -> None:  # rank 0
        run_dir.mkdir(parents=True, exist_ok=True)
        dropped = truncate_metrics(run_dir, step)
        if dropped:
            print(f"metrics.jsonl: dropped {dropped} rows logged after step {step} by an interrupted job", file=sys.stderr)
        save_config(cfg, run_dir / "config.yaml")
        fetch = remote.FetchConfig.from_loader_config(cfg.data)
        # The dataset's tokenizer (through the shard cache when data_dir is a URL), checked
        # against the manifest's sha256.
        with stoppable():
            shutil.copyfile(remote.local_file(remote.join(cfg.data.data_dir, TOKENIZER_FILE), fetch,
                                              sha256=data.tokenizer_sha256), run_dir / TOKENIZER_FILE)

    _on_main(denv, write_run_dir)
    peak = peak_flops(cfg.deepspeed.precision, tf32=tf32) if denv.is_main else (float("nan"), "")
    summary = {"git_commit": git_commit(), "data_manifest_sha256": data.manifest_sha256,
               "tokenizer_sha256": data.tokenizer_sha256, "world_size": denv.world_size,
               "global_batch_size": plan.global_batch_size, "peak_flops": peak[0], "peak_flops_source": peak[1],
               "parameters": n_parameters}
    tracker = Tracker(enabled=denv.is_main, settings=cfg.wandb, run_dir=run_dir, run_id=run_id,
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

def _stop_requested(run: Run) -> bool:
    return stop.requested() or (run.denv.is_main and stop.stop_file(run.cfg.run_dir))


def _batches(loader: ShardLoader):
    """Batches forever, epoch after epoch (the loader advances its epoch at the end of each)."""
    while True:
        yield from loader


def train_step(run: Run, batches) -> dict | None:
    """One optimizer step: grad_accum micro batches, forward and backward through the engine;
    None, with no step taken, when a stop request cut some rank's wait for its batches short.

    The loss is the mean over every scored token of the step, all ranks and micro batches
    together (fairseq's normalisation; Hugging Face's average_tokens_across_devices): the step's
    micro batches are taken first, their scored tokens counted and summed over the ranks in one
    reduction, and each micro batch's mean loss is weighted by its share, n W A / N, before
    DeepSpeed's backward divides by A and its reduction averages over the W ranks. A mean per
    micro batch instead would weigh a token of a 32-pair batch of short sentences ten times one
    of a batch of long ones, which length-grouped batches (`data.length_grouping`) make common.
    Packed blocks score the same number of tokens in every batch: there the two agree.

    Guarded: before the last backward of the step, one reduction over the ranks carries the
    step's figures, whether any rank's loss is not finite, and whether any rank was asked to
    stop; so every rank takes the same decision, on the device (the host reads the figures once,
    after the optimizer step, in the same copy as this rank's own count of NaN, +inf and -inf
    losses, which `guard_step` gathers only for a skipped step's record). A step to skip (a
    non-finite loss anywhere, or a loss spike) gets a NaN loss on every rank for that backward:
    DeepSpeed then finds a non-finite gradient norm, which it all-reduces, and drops the update,
    the gradients and the schedule's step on every rank (ZeRO 1-3, bf16 and fp16 by their own
    check; ZeRO-0 fp32 through `launch.optim.AdamW`). The weights after a skipped step are
    those before it."""
    tokens, flops, flops_llmc, samples = 0, 0.0, 0.0, 0
    # The losses stay on the device until the one reduction of the step: reading each micro
    # batch's loss on the host would wait for the device at every micro batch.
    loss_sum = finite_scored = torch.zeros((), dtype=torch.float32, device=run.engine.device)
    non_finite_here = torch.zeros(len(NON_FINITE_KINDS), dtype=torch.float32, device=run.engine.device)  # micro batches
    served = []  # handles on this step's batches; their sample keys are worked out only when needed
    micro = []
    try:
        with stoppable():
            for _ in range(run.plan.grad_accum):
                micro.append(run.task.model_inputs(next(batches)))  # on the host: the counts below cost no device sync
                served.append(run.data.train.served_batch())
        stopped = False
    except StopRequested:
        stopped = True
    # A rank stopped while it waited for its batches has none to train on: every rank learns of
    # it here, before the step's first collective, and gives the step up.
    if dist.any_rank(stopped):
        run.data.train.rewind()
        return None
    scored = [float(host_value(run.task.target_mask(inputs).sum())) for inputs in micro]
    # Summed over the ranks and left on the device, as is every weight made from it below: the
    # host issues this step's forwards without waiting for the previous step to finish.
    step_scored = dist.all_reduce_sum_tensor([sum(scored)])[0].to(run.engine.device)
    share = (run.plan.grad_accum * run.denv.world_size) / step_scored.clamp(min=1.0)
    for index, inputs in enumerate(micro):
        output = run.engine(**run.task.to_device(inputs, run.engine.device))
        if (run.denv.rank, run.step + 1) in _INJECTED_LOSS:
            output = output._replace(loss=output.loss * _INJECTED_LOSS[run.denv.rank, run.step + 1])
        loss = output.loss.detach().float()
        finite = torch.isfinite(loss)
        non_finite_here = non_finite_here + torch.stack([loss.isnan(), loss.isposinf(), loss.isneginf()]).float()
        loss_sum = loss_sum + torch.where(finite, loss * scored[index], torch.zeros_like(loss))
        finite_scored = finite_scored + finite.float() * scored[index]
        tokens += run.task.tokens(inputs)
        flops += run.task.flops(run.cfg.model, inputs)
        flops_llmc += run.task.tokens(inputs) * llmc_flops_per_token(run.cfg.model, run.n_parameters,
                                                                     inputs["labels"].shape[1])
        samples += inputs["labels"].shape[0]
        weighted = output.loss * (scored[index] * share).to(output.loss.dtype)
        if index < run.plan.grad_accum - 1:
            run.engine.backward(weighted)
            run.engine.step()
    fillers = run.data.train.stats["epoch_filler_batches"]
    # The step's figures in one reduction, and the guard's decision taken on the device from
    # them: the last backward is issued without a wait, the figures read once, after the step.
    figures = dist.all_reduce_sum_tensor([loss_sum, finite_scored, non_finite_here.sum(), tokens, flops, flops_llmc,
                                          samples, fillers, float(_stop_requested(run))]).to(run.engine.device)
    spike_limit = run.guard.spike_limit()
    skip = (figures[2] > 0) | (figures[0] / figures[1] > spike_limit)  # 0 / 0 is NaN: not a spike
    weighted = weighted * torch.where(skip, torch.full_like(weighted, math.nan), torch.ones_like(weighted))
    # Queued before the backward; read after the step, which has waited past it.
    on_host = HostCopy(torch.cat([figures, non_finite_here.to(figures.dtype)]))
    run.engine.backward(weighted)
    skipped_before = run.engine.skipped_steps
    run.engine.step()
    skipped = run.engine.skipped_steps > skipped_before
    *summed, nan, pos_inf, neg_inf = on_host.values()
    loss_sum, finite_scored, non_finite, tokens, flops, flops_llmc, samples, fillers, stop = summed
    loss = loss_sum / finite_scored if finite_scored else math.nan  # per scored token, over the finite batches
    reason = "non-finite loss" if non_finite else ("loss spike" if loss > spike_limit else "")
    if reason and not skipped:  # the guard's premise: a NaN backward makes DeepSpeed drop the step
        raise RuntimeError(f"step {run.step + 1}: DeepSpeed applied an update the guard asked to skip ({reason})")
    if skipped and not reason:
        # fp16: DeepSpeed's loss scaler met an overflow and lowers the scale, which is how it
        # finds its scale (several in a row at the start are normal): counted, not guarded.
        reason = FP16_OVERFLOW if run.engine.loss_scale is not None else "non-finite gradient norm"
    return {"train/loss": loss, "tokens": tokens, "flops": flops, "flops_llmc": flops_llmc, "samples": samples,
            "stop": stop > 0, "skipped": reason, "spike_limit": spike_limit,
            "non_finite_here": dict(zip(NON_FINITE_KINDS, (int(nan), int(pos_inf), int(neg_inf)))),
            "served": served, "filler_fraction": fillers / (len(run.data.train) * run.denv.world_size)}


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


def _injected_loss(spec: str) -> dict[tuple[int, int], float]:
    """Fault injection for testing the guard: PRETRAIN_INJECT_NAN="RANK:STEP[-LAST][*FACTOR],..."
    multiplies that rank's loss at those steps (1-based) by FACTOR, NaN by default: NaN or inf as
    a bad batch or an overflow would make it, a large factor as a loss spike."""
    out = {}
    for item in filter(None, spec.replace(" ", "").split(",")):
        item, _, factor = item.partition("*")
        rank, _, steps = item.partition(":")
        first, _, last = steps.partition("-")
        out.update({(int(rank), step): float(factor or "nan") for step in range(int(first), int(last or first) + 1)})
    return out


_INJECTED_LOSS = _injected_loss(os.environ.get("PRETRAIN_INJECT_NAN", ""))
FP16_OVERFLOW = "fp16 overflow"
NON_FINITE_KINDS = ("nan", "inf", "-inf")  # a rank's non-finite losses, as skipped_batches.jsonl names them


def step_sample_keys(run: Run, result: dict) -> list[str]:
    """This rank's samples of one step ("SHARD_PATH#MEMBER"), named from its batches' handles."""
    return [key for served in result["served"] for key in run.data.train.sample_keys(served)]


def guard_step(run: Run, result: dict) -> dict:
    """Count and log a skipped step (RUN_DIR/skipped_batches.jsonl, with the global batch's
    sample keys, and W&B); end the job, with a checkpoint of the last good state, after more
    than `guard.max_consecutive_skips` in a row; end it when fillers stand in for more than
    `data.max_bad_fraction` of an epoch's batches. Returns the metrics to log for the step."""
    metrics = {}
    overflow = result["skipped"] == FP16_OVERFLOW
    if overflow:
        run.guard.fp16_overflows += 1
        metrics["train/fp16_overflow_steps"] = run.guard.fp16_overflows
    else:
        run.guard.record(result["train/loss"], bool(result["skipped"]))
    if result["skipped"] and not overflow:
        # One gather, on a skipped step only: each rank's sample keys and its non-finite losses.
        gathered = dist.all_gather_object((step_sample_keys(run, result), result["non_finite_here"]))
        keys = [key for rank_keys, _ in gathered for key in rank_keys]
        if run.denv.is_main:
            cause, said = skip_cause(result, [non_finite for _, non_finite in gathered])
            row = {"step": run.step, "reason": result["skipped"], **cause, "consecutive": run.guard.consecutive,
                   "sample_keys": keys}
            with open(Path(run.cfg.run_dir) / "skipped_batches.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(f"step {run.step}: skipped on every rank ({said}); {run.guard.skipped} skipped so far",
                  file=sys.stderr)
        metrics = {"guard/skipped_steps": run.guard.skipped, "guard/skip_reason": result["skipped"]}
        if run.guard.consecutive > run.guard.max_consecutive_skips:
            save_checkpoint(run)
            raise UserError(f"{run.guard.consecutive} steps in a row skipped ({result['skipped']}) at step {run.step}, "
                            f"more than guard.max_consecutive_skips={run.guard.max_consecutive_skips}; the last good "
                            f"weights are checkpointed (see {Path(run.cfg.run_dir) / 'skipped_batches.jsonl'})")
    if result["filler_fraction"] > run.cfg.data.max_bad_fraction:
        raise UserError(f"{result['filler_fraction']:.1%} of this epoch's batches are fillers for unreadable data, "
                        f"more than data.max_bad_fraction={run.cfg.data.max_bad_fraction:g}; see the skipped shards "
                        f"in the log (data.data_dir={run.cfg.data.data_dir})")
    return metrics


def skip_cause(result: dict, non_finite_by_rank: list[dict]) -> tuple[dict, str]:
    """What made a step skipped, as fields of its skipped_batches.jsonl row and in words. A
    non-finite loss: each rank's micro batches whose loss was nan, inf or -inf, and apart from
    them `finite_loss`, the loss per scored token of the micro batches that were finite, all ranks
    (null if none was): the step itself has no finite loss. A spike: the loss and the limit it
    passed (`Guard.spike_limit`). Otherwise (DeepSpeed found a non-finite gradient norm): the loss."""
    reason, loss = result["skipped"], result["train/loss"]
    if reason == "non-finite loss":
        found = [{"rank": rank, "loss": kind, "micro_batches": count}
                 for rank, counts in enumerate(non_finite_by_rank) for kind, count in counts.items() if count]
        by_kind = {kind: [entry["rank"] for entry in found if entry["loss"] == kind] for kind in NON_FINITE_KINDS}
        said = ", ".join(f"{kind} on {_ranks(ranks)}" for kind, ranks in by_kind.items() if ranks)
        return {"non_finite": found, "finite_loss": loss if math.isfinite(loss) else None}, f"{reason}: {said}"
    if reason == "loss spike":
        return ({"loss": loss, "limit": result["spike_limit"]},
                f"{reason}: loss {loss:.4g} above the limit {result['spike_limit']:.4g}")
    return {"loss": loss}, f"{reason}, loss {loss:.4g}"


def _ranks(ranks: list[int], shown: int = 8) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    more = f" and {len(ranks) - shown} more" if len(ranks) > shown else ""
    return f"ranks {', '.join(map(str, ranks[:shown]))}{more}"


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
    """Every rank writes its part and hashes its share of the files (`ckpt.hashing_shares`: the
    ones it wrote, and the shared ones balanced by size); rank 0 records them all in
    integrity.json, and the `latest` pointer moves once all have finished.

    A save that its file system cannot hold ends the job on every rank in one line naming it and
    what the save needs (`launch.engine.checkpoint_size`): refused before anything is written
    where the file system has less free space, else failed by any rank's OSError (ENOSPC) in
    any step (`_save_step`). The previous checkpoint stays the latest, and this one is removed."""
    root = ckpt.checkpoint_root(run.cfg.run_dir)
    tag = ckpt.tag_for(run.step)
    tag_dir = root / tag
    client_state = {
        "step": run.step, "tokens_seen": run.tokens_seen, "loader": run.data.train.state_dict(),
        "rng": dist.all_gather_object(_rng_state()), "config": config_to_dict(run.cfg),
        "tokenizer_sha256": run.data.tokenizer_sha256, "wandb_run_id": run.run_id, "world_size": run.denv.world_size,
        "global_batch_size": run.plan.global_batch_size, "micro_batch_size": run.plan.micro_batch_size,
        "grad_accum": run.plan.grad_accum, "guard": run.guard.state_dict(), "tokens_by_source": tokens_by_source(run),
        "dataset": dataset_record(run),
    }
    need, how = checkpoint_size(run.n_parameters, run.cfg.deepspeed.zero_stage, run.cfg.deepspeed.precision)
    free = None

    def part(work, doing: str, *, main_only: bool = False) -> list:  # `free` as measured by then
        return _save_step(run, root, tag, work, doing, main_only,
                          lambda failure: ckpt.save_failed(root, tag, failure, need, how, free))

    def make_room() -> int:
        ckpt.discard(root, tag)  # what a save that never completed, or a damaged checkpoint a resume skipped, left here
        room = ckpt.free_space(root)
        if room >= need:
            tag_dir.mkdir(parents=True)  # here, not in DeepSpeed's save, whose failure would leave the others waiting
        return room

    free = part(make_room, "writing", main_only=True)[0]
    if refusal := ckpt.short_of_space(root, tag, free, need, how):
        raise UserError(refusal)  # on every rank: each has rank 0's figure
    part(lambda: run.engine.save(root, tag, client_state), "writing")

    def listed() -> dict[str, int]:
        info = {k: client_state[k] for k in ("step", "tokens_seen", "tokenizer_sha256", "wandb_run_id", "world_size",
                                             "global_batch_size", "micro_batch_size", "grad_accum", "tokens_by_source",
                                             "dataset")}
        info["model"] = client_state["config"]["model"]  # what a resume checks before loading (`find_resume`)
        (tag_dir / "client_state.json").write_text(json.dumps(info, indent=1) + "\n")
        return ckpt.files_on_disk(tag_dir)

    # One listing, rank 0's, so that every rank computes the same shares.
    share = ckpt.hashing_shares(part(listed, "writing", main_only=True)[0], run.denv.world_size)[run.denv.rank]
    hashed = part(lambda: ckpt.hash_files(tag_dir, share), "hashing")

    def recorded() -> None:
        # Sizes and sha256 of every file, checked before a resume trusts it; who hashed each, for the record.
        ckpt.write_integrity(tag_dir, {name: {**entry, "hashed_by": rank} for rank, entries in enumerate(hashed)
                                       for name, entry in entries.items()})
        ckpt.move_pointer(root, tag)
        ckpt.prune(root, run.cfg.checkpoint.keep_last)

    part(recorded, "writing", main_only=True)
    return tag_dir


def _save_step(run: Run, root: Path, tag: str, work, doing: str, main_only: bool, failed) -> list:
    """One step of a save: `work()` on every rank (or on rank 0 alone), its values gathered from
    every rank. An OSError of any rank's work fails the save on every rank alike, none left
    waiting in a collective: rank 0 removes what was written of checkpoint `tag` (unless the
    pointer names it), then every rank raises the UserError `failed(ckpt.WriteFailure)` words."""
    value = failure = None
    if run.denv.is_main or not main_only:
        try:
            value = work()
        except OSError as err:
            failure = ckpt.WriteFailure(run.denv.rank, doing, err.errno, err.strerror or str(err), err.filename)
    gathered = dist.all_gather_object((value, failure))
    failures = [failure for _, failure in gathered if failure is not None]
    if failures:
        if run.denv.is_main and ckpt.latest_tag(root) != tag:
            ckpt.discard(root, tag)
        dist.barrier()  # removed before any rank ends the job
        raise UserError(failed(failures[0]))
    return [value for value, _ in gathered]


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
    # The throughput window times training steps only: evaluation and checkpoints between
    # two logged steps would otherwise count as slow training.
    window_tokens = window_flops = window_flops_llmc = window_samples = window_time = 0.0
    window_clipped = window_steps = 0
    last_eval: dict = {}
    last_saved = run.step
    stop_at = min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
    told_kernel = not (cfg.data.document_mask and run.denv.is_main)
    while run.step < stop_at:
        step_start = time.perf_counter()
        result = train_step(run, batches)
        if result is None:  # a stop request cut some rank's wait for its batches short: no step taken
            return stop_for_requeue(run, last_saved, last_eval)
        if not told_kernel:  # which kernel the document mask ran on (model.blocks), once
            print(f"attention: {', '.join(attention_kernels(run.engine.module))}", file=sys.stderr)
            told_kernel = True
        window_time += time.perf_counter() - step_start
        run.step += 1
        run.tokens_seen += int(result["tokens"])
        window_tokens += result["tokens"]
        window_flops += result["flops"]
        window_flops_llmc += result["flops_llmc"]
        window_samples += result["samples"]
        # Kept on the device and read at the next log line: a read here would wait for the update.
        grad_norm = run.engine.grad_norm()
        window_steps += 1
        if cfg.optim.grad_clip:
            window_clipped = window_clipped + (grad_norm.isfinite() & (grad_norm > cfg.optim.grad_clip))
        metrics: dict = guard_step(run, result)
        if cfg.data.log_sample_keys:  # which samples each step saw, per rank
            with open(Path(cfg.run_dir) / f"sample_keys.rank{run.denv.rank}.jsonl", "a") as fh:
                fh.write(json.dumps({"step": run.step, "keys": step_sample_keys(run, result)}) + "\n")
        if run.step % cfg.log_every == 0 or run.step == stop_at:
            elapsed = max(window_time, 1e-9)
            achieved = window_flops / elapsed / run.denv.world_size  # per rank, like the peak
            achieved_llmc = window_flops_llmc / elapsed / run.denv.world_size
            metrics.update({
                "train/loss": result["train/loss"], "train/lr": run.engine.lr, "train/grad_norm": float(grad_norm),
                "train/clipped_fraction": float(window_clipped) / window_steps,
                "train/tokens_seen": run.tokens_seen, "train/epoch": run.data.train.epoch,
                "perf/tokens_per_s": window_tokens / elapsed,
                "perf/samples_per_s": window_samples / elapsed,
                "perf/mfu": achieved / run.peak[0] if run.denv.is_main else float("nan"),
                **data_counters(run), **memory_mb(),
            })
            if run.denv.is_main and math.isfinite(achieved_llmc):  # llm.c's count has no Seq2Seq form
                metrics["perf/mfu_llmc"] = achieved_llmc / run.peak[0]
            if run.engine.loss_scale is not None:  # fp16: DeepSpeed's dynamic loss scale
                metrics.update({"train/loss_scale": run.engine.loss_scale})
            window_tokens = window_flops = window_flops_llmc = window_samples = window_time = 0.0
            window_clipped = window_steps = 0
        stopped = False
        if (cfg.eval_every and run.step % cfg.eval_every == 0) or run.step == stop_at:
            evaluated = evaluate(run)  # None: a stop request cut some rank's wait for validation data short
            stopped = evaluated is None
            last_eval = evaluated or last_eval
            metrics.update(evaluated or {})
        if metrics:
            _log(run, metrics)
        if stopped or (result["stop"] and run.step < stop_at):  # on the last step a normal end is as good
            return stop_for_requeue(run, last_saved, last_eval)
        if cfg.checkpoint.every_steps and run.step % cfg.checkpoint.every_steps == 0 and run.step < stop_at:
            save_checkpoint(run)
            last_saved = run.step
    if last_saved != run.step or ckpt.latest_tag(ckpt.checkpoint_root(cfg.run_dir)) is None:
        save_checkpoint(run)
    return {"step": run.step, "tokens_seen": run.tokens_seen, "skipped_steps": run.guard.skipped,
            **data_counters(run), **last_eval}


def stop_for_requeue(run: Run, last_saved: int, last_eval: dict) -> dict:
    """End a job asked to stop, on every rank: the step reached checkpointed (unless it is already,
    or none was trained), RUN_DIR/preempted.json left for the batch script, one line."""
    if run.step != last_saved:
        save_checkpoint(run)
        done = f"checkpoint at step {run.step} saved"
    else:
        done = f"step {run.step} is checkpointed already" if run.step else "nothing trained, nothing to checkpoint"
    if run.denv.is_main:
        stop.leave_for_requeue(run.cfg.run_dir, run.step)
        print(f"stop requested: {done}; exiting for a requeue", file=sys.stderr)
    return {"step": run.step, "tokens_seen": run.tokens_seen, "preempted": True, **last_eval}


def data_counters(run: Run) -> dict:
    """Unreadable data met so far, and the training tokens read per source since the run began,
    summed over the ranks (a collective: every rank calls it)."""
    names = ("shards_skipped", "samples_unreadable", "filler_batches")
    totals = dist.all_reduce_sum([float(run.data.train.stats[name]) for name in names])
    counters = {f"data/{name}": int(total) for name, total in zip(names, totals)}
    counters.update({f"data/tokens/{name}": tokens for name, tokens in tokens_by_source(run).items()})
    return counters


def dataset_record(run: Run) -> dict:
    """What an export's provenance names the data by (`launch.export.provenance`): the manifest's
    fingerprint, the train loader's (its shard listing with their sha256s) and its mixture."""
    loader = run.data.train.state_dict()["fingerprint"]
    return {"manifest_sha256": run.data.manifest_sha256, "train_shards_sha256": loader.get("shards_sha256"),
            "mixture": loader.get("mixture")}


def tokens_by_source(run: Run) -> dict[str, int]:
    """Training tokens read per source since the run began, all ranks (a collective)."""
    mine = run.data.train.stats["tokens_by_source"]
    names = sorted(set(mine) | set(run.tokens_by_source_before))
    totals = dist.all_reduce_sum([float(mine.get(name, 0)) for name in names])
    return {name: int(run.tokens_by_source_before.get(name, 0) + total) for name, total in zip(names, totals)}


def train(cfg: TrainConfig) -> dict:
    stop.install(cfg.run_dir)  # SIGTERM, SIGINT, SIGUSR1, RUN_DIR/STOP, the launcher's death: a checkpoint and exit
    # A native crash (an abort in a C++ library, a segfault) prints every thread's Python stack,
    # so the log says where the rank was, not only that it died.
    faulthandler.enable(all_threads=True)
    check_writable_dir(cfg.run_dir, "run_dir")  # every rank writes its checkpoint partition there
    # One job per run directory: a second one started on it (the same command twice, a requeue
    # racing a job that has not died) would interleave checkpoints and metrics with the first.
    # Rank 0 holds the lock for the job; on a refusal it exits, and the launcher ends the others.
    with dir_lock(cfg.run_dir, what="train") if dist.read_env().is_main else contextlib.nullcontext():
        return _train(cfg)


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
            return final  # the W&B run stays open for the requeued job (finished below, not marked done)
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
        print("stop requested before training began: nothing to checkpoint; exiting for a requeue", file=sys.stderr)
    return {"step": step, "preempted": True}


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:  # report the run and every problem; start nothing
        return preflight.main_dry_run([arg for arg in argv if arg != "--dry-run"])
    from launch import init_model

    # init.model=DIR: the model config is the directory's (command-line model.* overrides checked against it).
    cfg = init_model.resolve(parse_cli(TrainConfig, argv, usage=USAGE), argv[1:])
    train(cfg)
    return 0


if __name__ == "__main__":
    dist.die_with_parent()  # a rank whose launcher is killed must not train on unseen
    dist.run_rank(main)  # ends with os._exit: see run_rank
