"""What the training loop carries from step to step: the run (resolved config, engine, data,
tracker, guard) and where it stands; the counters every rank sums."""

from __future__ import annotations

from dataclasses import dataclass, field

from common.configure import config_to_dict
from launch import distributed as dist
from launch.checkpoint.save import Checkpointer, SaveTarget
from launch.checkpoint.state import CheckpointState, rng_state
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.engine import Engine
from launch.preconditions import TargetSide
from launch.tasks import Task
from launch.tracking import Tracker
from launch.train.guard import Guard
from launch.train.reduce import BucketedReduction
from pipeline.load.loader import ShardLoader
from pipeline.specials import Specials


@dataclass
class Data:
    """What `open_data` resolves from the dataset: the loaders and the tokenizer's identity."""

    train: ShardLoader
    valid: ShardLoader | None  # None when the valid split is smaller than one global batch
    vocab_size: int
    tokenizer_sha256: str
    # sha256 of manifest.json: the dataset's fingerprint (W&B's summary, exports' provenance)
    manifest_sha256: str = ""
    specials: Specials = field(default_factory=Specials)  # the tokenizer's special ids and frames
    tokenizer_files: tuple[str, ...] = ()  # its files in the dataset, copied into the run directory
    target: TargetSide | None = None  # a translation target's own tokenizer, copied there too
    fetch: object = None  # `pipeline.remote.FetchConfig` the dataset was opened with (a URL's)


@dataclass
class Progress:
    """Where a run stands: restored from a checkpoint, or a fresh start."""

    step: int = 0
    tokens_seen: int = 0
    run_id: str | None = None  # the W&B run's id, kept across resumes
    # `Guard.state_dict()`: skip counts and the loss history
    guard: dict = field(default_factory=dict)
    # training tokens read per source, all ranks
    tokens_by_source: dict = field(default_factory=dict)


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
    # ZeRO-0 fp32 on more than one rank: the gradients reduced during the backward (reduce.py)
    reduction: BucketedReduction | None = None


def data_counters(run: Run) -> dict:
    """Unreadable data met so far, and the training tokens read per source since the run began,
    summed over the ranks (a collective: every rank calls it)."""
    names = ("shards_skipped", "samples_unreadable", "filler_batches")
    totals = dist.all_reduce_sum([float(run.data.train.stats[name]) for name in names])
    counters = {f"data/{name}": int(total) for name, total in zip(names, totals)}
    counters.update(
        {f"data/tokens/{name}": tokens for name, tokens in tokens_by_source(run).items()}
    )
    return counters


def dataset_record(run: Run) -> dict:
    """What an export's provenance names the data by (`launch.export.provenance`): the manifest's
    fingerprint, the train loader's (its shard listing with their sha256s) and its mixture."""
    loader = run.data.train.state_dict()["fingerprint"]
    return {
        "manifest_sha256": run.data.manifest_sha256,
        "train_shards_sha256": loader.get("shards_sha256"),
        "mixture": loader.get("mixture"),
    }


def tokens_by_source(run: Run) -> dict[str, int]:
    """Training tokens read per source since the run began, all ranks (a collective)."""
    mine = run.data.train.stats["tokens_by_source"]
    names = sorted(set(mine) | set(run.tokens_by_source_before))
    totals = dist.all_reduce_sum([float(mine.get(name, 0)) for name in names])
    return {
        name: int(run.tokens_by_source_before.get(name, 0) + total)
        for name, total in zip(names, totals)
    }


def checkpoint_state(run: Run) -> CheckpointState:
    """The run's record at the step it reached, for a checkpoint (a collective: every rank's
    random streams, the tokens read per source)."""
    return CheckpointState(
        step=run.step,
        tokens_seen=run.tokens_seen,
        loader=run.data.train.state_dict(),
        rng=dist.all_gather_object(rng_state()),
        config=config_to_dict(run.cfg),
        tokenizer_sha256=run.data.tokenizer_sha256,
        wandb_run_id=run.run_id,
        world_size=run.denv.world_size,
        global_batch_size=run.plan.global_batch_size,
        micro_batch_size=run.plan.micro_batch_size,
        grad_accum=run.plan.grad_accum,
        guard=run.guard.state_dict(),
        tokens_by_source=tokens_by_source(run),
        dataset=dataset_record(run),
        target_tokenizer_sha256=run.data.target.sha256 if run.data.target is not None else None,
    )


def make_checkpointer(run: Run, stop_at: int) -> Checkpointer:
    """The run's Checkpointer: its engine, run directory and sizes, its record
    (`checkpoint_state`) and the tracker's hook; `stop_at`: the job's last step."""
    target = SaveTarget(
        run.cfg.run_dir,
        run.cfg.checkpoint.keep_last,
        run.n_parameters,
        run.cfg.deepspeed.zero_stage,
        run.cfg.deepspeed.precision,
    )
    return Checkpointer(
        run.engine,
        target,
        run.denv,
        lambda: checkpoint_state(run),
        run.tracker.checkpointed,
        every_steps=run.cfg.checkpoint.every_steps,
        stop_at=stop_at,
        last_saved=run.step,
    )
