"""Setting a training run up, in named steps that each return what they resolve: data ->
model config -> process group -> model and engine -> resume -> run directory and tracker."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import warnings
from pathlib import Path

import torch

from common.atomic import atomic_write
from common.configure import UserError
from launch import checkpoint as ckpt
from launch import distributed as dist
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.config import deepspeed_config
from launch.deepspeed.engine import Engine
from launch.metrics import set_fp32_matmul
from launch.optim import build_optimizer, build_scheduler
from launch.preconditions import local_tokenizer
from launch.resolve import DatasetHandle, World, resolve
from launch.stop import stoppable
from launch.tasks import Task
from launch.tracking import new_run_id
from launch.train import reduce
from launch.train.guard import Guard
from launch.train.resume import find_resume, fresh_start, restore
from launch.train.run_dir import on_main, open_run_dir, run_dir_storage
from launch.train.state import Data, Run
from model import Pretrained, build_model
from model.warm_start import WarmStartError, warm_start
from pipeline import remote
from pipeline.format import ManifestError
from pipeline.load.loader import ShardLoader
from pipeline.load.mixture import describe_mixture
from pipeline.load.plan import LoaderPlan


def setup(cfg: TrainConfig) -> Run:
    """Named steps, each returning what it resolves: data -> model config -> process group ->
    model and engine -> resume -> run directory and tracker."""
    # DeepSpeed calls torch.distributed functions that torch now marks deprecated, every step.
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"torch\.distributed.*")
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)
    world = World(denv.world_size, denv.local_world_size, "the environment's")
    with stoppable():  # every rank reads the manifest, before there is a process group to leave
        resolved, problems = resolve(cfg, world)
        if problems:
            raise UserError(problems[0].error)
        cfg, task, plan = resolved.cfg, resolved.task, resolved.plan
        data = open_data(cfg, task, denv, resolved.data)
    dist.init_process_group(denv, cfg.dist_timeout_s)
    tf32 = set_fp32_matmul(cfg.tf32)  # before any GEMM: the peak measurement, compilation, training
    # The newest checkpoint that every rank finds intact (sizes and checksums written at save),
    # then, if another world size wrote it, its universal copy.
    candidates = on_main(denv, lambda: ckpt.resume_candidates(cfg.resume, cfg.run_dir))
    intact = ckpt.choose_resume(
        cfg.resume,
        candidates,
        lambda candidate: ckpt.resume_verdict(candidate, denv.rank, denv.world_size),
        dist.all_gather_object,
        report=denv.is_main,
    )
    resume_from = on_main(denv, lambda: find_resume(intact, cfg, plan, data.tokenizer_sha256))
    engine, n_parameters = build_engine(
        cfg,
        task,
        plan,
        data,
        denv,
        load_universal=bool(resume_from) and ckpt.is_universal(*resume_from),
    )
    progress = (
        restore(resume_from, engine, data, denv, cfg)
        if resume_from
        else fresh_start(cfg.seed, denv)
    )
    run_id = dist.broadcast_object(progress.run_id or (new_run_id() if denv.is_main else None))
    tracker, peak = open_run_dir(cfg, denv, plan, data, progress.step, run_id, n_parameters, tf32)
    # the progress line's last checkpoint, until this job saves one
    if resume_from and denv.is_main:
        tracker.checkpointed(progress.step, (resume_from[0] / resume_from[1]).stat().st_mtime)
    guard = Guard(
        cfg.guard.max_consecutive_skips,
        cfg.guard.spike_factor,
        cfg.guard.spike_warmup_steps,
        cfg.guard.spike_window,
    )
    guard.load_state_dict(progress.guard)
    reduction = None
    if reduce.applies(
        cfg.deepspeed.zero_stage,
        cfg.deepspeed.precision,
        denv.world_size,
        cfg.deepspeed.offload_optimizer,
    ):
        engine.reduce_gradients_elsewhere()
        reduction = reduce.BucketedReduction(engine.module)
        if denv.is_main:
            print(
                f"gradients all-reduced during the backward, in {len(reduction.buckets)} "
                f"buckets of about {reduce.BUCKET_MB:g} MB (launch.train.reduce)",
                file=sys.stderr,
            )
    if denv.is_main:
        print(
            f"{cfg.task}: {n_parameters:,} parameters, world {denv.world_size}, global batch "
            f"{plan.global_batch_size} ({plan.micro_batch_size} x {plan.grad_accum} x "
            f"{denv.world_size}), ZeRO-{cfg.deepspeed.zero_stage} "
            f"{cfg.deepspeed.precision}, {len(data.train)} batches/epoch per rank, peak "
            f"{peak[0] / 1e9:.1f} GFLOP/s ({peak[1]})",
            file=sys.stderr,
        )
        if data.train.mixed:
            print(f"mixture: {describe_mixture(data.train.sources)}", file=sys.stderr)
    return Run(
        cfg,
        denv,
        task,
        plan,
        engine,
        data,
        tracker,
        run_id,
        peak,
        guard,
        progress.step,
        progress.tokens_seen,
        n_parameters,
        dict(progress.tokens_by_source),
        reduction,
    )


def open_data(cfg: TrainConfig, task: Task, denv: dist.DistEnv, handle: DatasetHandle) -> Data:
    """This rank's train and valid loaders over the resolved dataset."""
    if not remote.is_url(cfg.data.data_dir):
        # The file training copies into run_dir, checked here, before anything is built or
        # written (a URL's is checked as it is fetched).
        remote.local_file(
            Path(cfg.data.data_dir) / handle.tokenizer_files[0], sha256=handle.tokenizer_sha256
        )
    loaders = {}
    for split in ("train", "valid"):
        try:
            plan = LoaderPlan.from_config(
                cfg.data,
                task.name,
                split,
                rank=denv.rank,
                world_size=denv.world_size,
                grad_accum=cfg.grad_accum if split == "train" else 1,
                expected_tokenizer_sha256=handle.tokenizer_sha256,
                pin_memory=torch.cuda.is_available(),
                fetch=handle.dataset.fetch,
            )
            loaders[split] = ShardLoader(plan, manifest=handle.dataset.manifest)
        except ManifestError:  # a damaged manifest stops the run, whichever split it damages
            raise
        except UserError as err:  # e.g. a valid split smaller than one global batch
            if split == "train":
                raise
            loaders[split] = None
            if denv.is_main:
                print(f"warning: no evaluation: {err}", file=sys.stderr)
    return Data(
        loaders["train"],
        loaders["valid"],
        handle.vocab_size,
        handle.tokenizer_sha256,
        handle.dataset.sha256,
        handle.specials,
        handle.tokenizer_files,
        handle.target,
        handle.fetch,
    )


def build_engine(
    cfg: TrainConfig,
    task: Task,
    plan: BatchPlan,
    data: Data,
    denv: dist.DistEnv,
    *,
    load_universal: bool = False,
) -> tuple[Engine, int]:
    """The model (random, warm-started, or init.model's weights), its optimizer and schedule under
    DeepSpeed; and its parameter count, taken before ZeRO-3 partitions the parameters away."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    try:
        if _warm_starts(cfg, task):
            model = _warm_start(cfg, data, denv.is_main)
        elif cfg.init.model:
            from launch import init_model

            dataset_tokenizer = local_tokenizer(
                cfg.data.data_dir, data.fetch, data.tokenizer_sha256, data.tokenizer_files[0]
            )
            model = init_model.load(cfg, dataset_tokenizer)
        else:
            model = build_model(cfg.model)
    except ValueError as err:  # the model config's own check (ModelConfig.validate)
        raise UserError(str(err)) from err
    n_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(
        model,
        cfg.optim,
        skip_non_finite=cfg.deepspeed.zero_stage == 0,
        cpu_offload=cfg.deepspeed.offload_optimizer,
    )
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps, cfg.model.d_model)
    if cfg.compile:
        from launch.config import compile_scope_for

        compile_model(model, compile_scope_for(cfg, torch.cuda.is_available()))
    return Engine(
        model, optimizer, scheduler, deepspeed_config(cfg, plan, load_universal=load_universal)
    ), n_parameters


def compile_model(model: torch.nn.Module, scope: str = "blocks") -> None:
    """`compile: true`: torch.compile (inductor) the model for training, in place, before
    DeepSpeed wraps it. Nothing compiles here: the first forward does.

    The module keeps its class and its state dict its keys (no `_orig_mod.` prefix), so
    checkpoints, resume and export read the same names as without compilation.

    scope 'model' (`compile_scope`; auto for the pretraining tasks under ZeRO 0-2 on a CPU): the
    whole forward, loss included, as `nn.Module.compile` does, one graph in which inductor fuses the
    embeddings, the norms and the loss's per-chunk element-wise work with the blocks' (measured in
    docs/results.md#training-ours-against-hugging-face-and-mfu). BERT's count of masked positions
    changes per batch: `Task.to_device` marks it dynamic, one graph for every count.

    scope 'blocks': each transformer block's forward (`model.blocks.Block`), the rest eager:
    - ZeRO-3 gathers parameters in hooks around every submodule, and in a compiled model each
      gather is a graph break, after which dynamo compiles the hook frames again for every
      module until its recompile limit. Each block is made a ZeRO-3 leaf instead
      (`launch.deepspeed.engine.zero3_leaf_modules`; no effect below stage 3): one gather around the
      block, no hooks inside it, which stay outside the compiled forward, eager.
    - The loss (`model.loss`) chunks its rows in a Python loop, which a compiled graph
      specializes to each sequence length (translation's lengths vary: a recompile per batch
      until the limit). It stays eager, as do the embeddings and the masks.
    The blocks of one class share a graph; a second sequence length recompiles it once with a
    dynamic length. `evaluate` runs eagerly: its no-grad, eval-mode forwards would need graphs
    of their own, counted against the same recompile limit. With dropout, inductor draws other
    random masks than eager mode does. In bf16 on a CPU the compiled blocks' attention recomputes
    its probabilities in backward rather than run SDPA's slow CPU flash backward
    (`model.attention.attention`)."""
    if torch.cuda.is_available():
        if importlib.util.find_spec("triton") is None:
            raise UserError(
                "compile: inductor needs Triton on a GPU, which is not installed (pip "
                "install triton, or compile=false)"
            )
    else:
        cxx = os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")
        if shutil.which(cxx) is None:
            raise UserError(
                f"compile: inductor needs a C++ compiler on CPU and {cxx!r} was not found (install "
                "one or set CXX, or compile=false)"
            )
    if scope == "model":
        model.compile(backend="inductor")
        return
    from launch.deepspeed.engine import zero3_leaf_modules
    from model.blocks import Block

    blocks = [module for module in model.modules() if isinstance(module, Block)]
    zero3_leaf_modules(blocks)
    for block in blocks:
        block.forward = torch.compile(block.forward, backend="inductor")


def _warm_starts(cfg: TrainConfig, task: Task) -> bool:
    return task.warm_startable and bool(cfg.init.encoder or cfg.init.decoder)


def _warm_start(cfg: TrainConfig, data: Data, is_main: bool) -> torch.nn.Module:
    """A Seq2Seq whose stacks come from `init.encoder` / `init.decoder`: our exports, or Hugging
    Face BERT / GPT-2 / Llama directories, each trained with its side's tokenizer (the encoder the
    source side's, the decoder the target side's: one tokenizer, or two as in Rothe et al.'s
    BERT2GPT2)."""
    fetch = data.fetch
    sides = {}
    for side, directory in (("encoder", cfg.init.encoder), ("decoder", cfg.init.decoder)):
        if directory:
            sides[side] = _pretrained_side(cfg, data, fetch, side, directory)
    sha = {
        "encoder": data.tokenizer_sha256,
        "decoder": data.target.sha256 if data.target else data.tokenizer_sha256,
    }
    try:
        model, report = warm_start(cfg.model, sha, **sides)
    except WarmStartError as err:
        raise UserError(f"init: {err}") from err
    if is_main:
        with run_dir_storage(Path(cfg.run_dir)):
            Path(cfg.run_dir).mkdir(parents=True, exist_ok=True)
            atomic_write(Path(cfg.run_dir) / "warm_start.txt", str(report) + "\n")
        print(
            f"warm start: {report.summary()} (details in {cfg.run_dir}/warm_start.txt)",
            file=sys.stderr,
        )
    return model


def _pretrained_side(cfg: TrainConfig, data: Data, fetch, side: str, directory: str) -> Pretrained:
    """One stack's source: an export of ours, or a Hugging Face directory whose tokenizer gives
    the ids of its side's tokenizer in the dataset (its special ids become that tokenizer's)."""
    from launch import init_model
    from launch.model_dir import load_model_dir
    from launch.preconditions import model_ids

    key, text_side = f"init.{side}", ("source" if side == "encoder" else "target")
    target = data.target if side == "decoder" else None
    sha256, name = (
        (target.sha256, target.files[0])
        if target
        else (data.tokenizer_sha256, data.tokenizer_files[0])
    )
    if not Path(directory).is_dir():
        raise UserError(f"{key}: {directory} is not a directory")
    # Its tokenizer is its side's by the ids it gives (the same file, or the same ids): from here
    # on it carries that side's sha256, which `warm_start` holds each source to.
    local = local_tokenizer(cfg.data.data_dir, fetch, sha256, name)
    init_model.check_tokenizer(directory, local, key, text_side if data.target else "")
    if not init_model.is_hf_dir(directory):
        pretrained, meta = load_model_dir(directory)
        return Pretrained(pretrained.state_dict(), meta["model_config"], sha256)
    from model.hf_dir import load_hf_dir

    specials = target.specials if target else data.specials
    try:
        model = load_hf_dir(directory, **model_ids(specials))
    except ValueError as err:
        raise UserError(f"{key}: {err}") from None
    if model.cfg.arch not in ("gpt", "bert"):
        raise UserError(
            f"{key}: {directory} holds a {model.cfg.arch} model; a "
            "stack starts from a BERT or a GPT"
        )
    return Pretrained(model.state_dict(), model.cfg, sha256)
