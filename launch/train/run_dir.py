"""The run directory of a training job, made on rank 0 (`open_run_dir`: the config and tokenizer,
the metrics a resumed job truncates, the W&B tracker, the peak FLOP/s), its record on a full disk
in one line (`run_dir_storage`), and rank 0's work with its outcome on every rank (`on_main`)."""

from __future__ import annotations

import sys
from pathlib import Path

from common.atomic import atomic_copy
from common.configure import UserError, config_to_dict, save_config
from common.storage import storage_errors
from launch import distributed as dist
from launch.config import BatchPlan, TrainConfig
from launch.metrics import peak_flops
from launch.preconditions import local_tokenizer
from launch.stop import StopRequested, stoppable
from launch.tracking import Tracker, git_commit
from launch.train.resume import truncate_metrics
from launch.train.state import Data
from pipeline import remote
from pipeline.format import TARGET_DIR


def open_run_dir(
    cfg: TrainConfig,
    denv: dist.DistEnv,
    plan: BatchPlan,
    data: Data,
    step: int,
    run_id: str,
    n_parameters: int,
    tf32: bool = False,
) -> tuple[Tracker, tuple[float, str]]:
    """RUN_DIR's config, tokenizer and metrics (rows after `step` dropped), and the W&B run;
    the peak FLOP/s that MFU is measured against (TF32's for fp32 when `tf32`: it is in use)."""
    run_dir = Path(cfg.run_dir)

    def write_run_dir() -> None:  # rank 0
        # Every file written whole or not at all (common.atomic): a run_dir that fills up, or is
        # read-only, leaves the files that were there as they were, no truncated tokenizer.model,
        # and stops every rank with one line (run_dir_storage).
        with run_dir_storage(run_dir):
            run_dir.mkdir(parents=True, exist_ok=True)
            dropped = truncate_metrics(run_dir, step)
            if dropped:
                print(
                    f"metrics.jsonl: dropped {dropped} rows logged after step "
                    f"{step} by an interrupted job",
                    file=sys.stderr,
                )
            save_config(cfg, run_dir / "config.yaml")
            fetch = data.fetch
            # The dataset's tokenizer files (through the shard cache when data_dir is a URL), the
            # one that fixes its ids checked against the manifest's sha256.
            with stoppable():
                main, *others = data.tokenizer_files
                atomic_copy(
                    local_tokenizer(cfg.data.data_dir, fetch, data.tokenizer_sha256, main),
                    run_dir / main,
                )
                for name in others:
                    local = remote.local_file(remote.join(cfg.data.data_dir, name), fetch)
                    atomic_copy(local, run_dir / name)
                if data.target is not None:  # a translation target's own tokenizer, in target/
                    (run_dir / TARGET_DIR).mkdir(exist_ok=True)
                    for index, name in enumerate(data.target.files):
                        local = remote.local_file(
                            remote.join(cfg.data.data_dir, name),
                            fetch,
                            sha256=data.target.sha256 if index == 0 else None,
                        )
                        atomic_copy(local, run_dir / name)

    on_main(denv, write_run_dir)
    peak = peak_flops(cfg.deepspeed.precision, tf32=tf32) if denv.is_main else (float("nan"), "")
    summary = {
        "git_commit": git_commit(),
        "data_manifest_sha256": data.manifest_sha256,
        "tokenizer_sha256": data.tokenizer_sha256,
        "world_size": denv.world_size,
        "global_batch_size": plan.global_batch_size,
        "peak_flops": peak[0],
        "peak_flops_source": peak[1],
        "parameters": n_parameters,
    }

    def tracker(enabled: bool) -> Tracker:
        return Tracker(
            enabled=enabled,
            settings=cfg.wandb,
            run_dir=run_dir,
            run_id=run_id,
            config=config_to_dict(cfg),
            summary=summary,
            start_step=step,
        )

    # W&B on rank 0; its refusal (an unwritable W&B directory: one line) stops every rank.
    started: list[Tracker] = []
    on_main(denv, lambda: started.append(tracker(True)))
    return (started[0] if started else tracker(False)), peak


def run_dir_storage(run_dir: Path):
    """A run_dir whose file system is full or cannot be written (ENOSPC, EDQUOT, EFBIG, EROFS,
    EACCES) as one line naming the file and what to do (common.storage)."""
    return storage_errors(
        f"run_dir={run_dir}",
        run_dir,
        space="free some space there, or choose a run_dir on another file system",
        access="choose a run_dir this user can write",
    )


def on_main(denv: dist.DistEnv, work):
    """`work()` on rank 0, its result (or its UserError or StopRequested, raised on every rank)
    broadcast: a refusal on rank 0 alone would leave the other ranks waiting at
    the next collective."""
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
