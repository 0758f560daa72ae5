"""Saving a training run's checkpoint: when (`Checkpointer`, the cadence the loop asks), and the
save itself on every rank (`save_checkpoint`: the engine's state and the loader's, integrity.json,
the `latest` pointer and retention, or one line on every rank for a save its file system cannot
hold)."""

from __future__ import annotations

import json
from pathlib import Path

from common.configure import UserError, config_to_dict
from common.storage import free_space
from launch import distributed as dist
from launch.checkpoint.integrity import files_on_disk, hash_files, hashing_shares, write_integrity
from launch.checkpoint.layout import (
    checkpoint_root,
    discard,
    latest_tag,
    move_pointer,
    prune,
    tag_for,
)
from launch.checkpoint.space import (
    WriteFailure,
    checkpoint_size,
    save_failed,
    short_of_space,
)
from launch.train.resume import rng_state
from launch.train.state import Run, dataset_record, tokens_by_source


class Checkpointer:
    """When a run saves, and the step of this job's newest save (`last_saved`: the step the job
    started from until it saves). Every `checkpoint.every_steps` steps before the job's last
    (`maybe_save`); the last step, unless saved already, and always where the run has no
    checkpoint yet (`ensure_final`); the step a job asked to stop reached, unless saved already
    (`save_unless_saved`); and when the loop asks (`save`: the guard's last good state, before it
    ends the job)."""

    def __init__(self, every_steps: int, stop_at: int, last_saved: int):
        self.every_steps = every_steps  # 0: no periodic save
        self.stop_at = stop_at  # the job's last step: saved by `ensure_final`, not the cadence
        self.last_saved = last_saved

    def save(self, run: Run) -> Path:
        tag_dir = save_checkpoint(run)
        self.last_saved = run.step
        return tag_dir

    def maybe_save(self, run: Run) -> None:
        """The periodic save, after a step."""
        if self.every_steps and run.step % self.every_steps == 0 and run.step < self.stop_at:
            self.save(run)

    def save_unless_saved(self, run: Run) -> bool:
        """For a job that stops: whether it saved the step reached (not if that step is saved
        already, or none was trained)."""
        if run.step == self.last_saved:
            return False
        self.save(run)
        return True

    def ensure_final(self, run: Run) -> None:
        """The end of the job: its last step saved, and never a run without a checkpoint."""
        if self.last_saved != run.step or latest_tag(checkpoint_root(run.cfg.run_dir)) is None:
            self.save(run)


def save_checkpoint(run: Run) -> Path:
    """Every rank writes its part and hashes its share of the files (`hashing_shares`: the
    ones it wrote, and the shared ones balanced by size); rank 0 records them all in
    integrity.json, and the `latest` pointer moves once all have finished.

    A save that its file system cannot hold ends the job on every rank in one line naming it and
    what the save needs (`checkpoint_size`): refused before anything is written where the file
    system has less free space, else failed by any rank's OSError (ENOSPC) in any step
    (`_save_step`). The previous checkpoint stays the latest, and this one is removed."""
    root = checkpoint_root(run.cfg.run_dir)
    tag = tag_for(run.step)
    tag_dir = root / tag
    client_state = {
        "step": run.step,
        "tokens_seen": run.tokens_seen,
        "loader": run.data.train.state_dict(),
        "rng": dist.all_gather_object(rng_state()),
        "config": config_to_dict(run.cfg),
        "tokenizer_sha256": run.data.tokenizer_sha256,
        **(
            {"target_tokenizer_sha256": run.data.target.sha256}
            if run.data.target is not None
            else {}
        ),
        "wandb_run_id": run.run_id,
        "world_size": run.denv.world_size,
        "global_batch_size": run.plan.global_batch_size,
        "micro_batch_size": run.plan.micro_batch_size,
        "grad_accum": run.plan.grad_accum,
        "guard": run.guard.state_dict(),
        "tokens_by_source": tokens_by_source(run),
        "dataset": dataset_record(run),
    }
    need, how = checkpoint_size(
        run.n_parameters, run.cfg.deepspeed.zero_stage, run.cfg.deepspeed.precision
    )
    free = None

    def part(work, doing: str, *, main_only: bool = False) -> list:  # `free` as measured by then
        return _save_step(
            run,
            root,
            tag,
            work,
            doing,
            main_only,
            lambda failure: save_failed(root, tag, failure, need, how, free),
        )

    def make_room() -> int:
        # what a save that never completed, or a damaged checkpoint a resume skipped, left here
        discard(root, tag)
        room = free_space(root)
        if room >= need:
            # here, not in DeepSpeed's save, whose failure would leave the others waiting
            tag_dir.mkdir(parents=True)
        return room

    free = part(make_room, "writing", main_only=True)[0]
    if refusal := short_of_space(root, tag, free, need, how):
        raise UserError(refusal)  # on every rank: each has rank 0's figure
    part(lambda: run.engine.save(root, tag, client_state), "writing")

    def listed() -> dict[str, int]:
        info = {
            k: client_state[k]
            for k in (
                "step",
                "tokens_seen",
                "tokenizer_sha256",
                "target_tokenizer_sha256",
                "wandb_run_id",
                "world_size",
                "global_batch_size",
                "micro_batch_size",
                "grad_accum",
                "tokens_by_source",
                "dataset",
            )
            if k in client_state
        }
        # what a resume checks before loading (`find_resume`): the network, and every setting
        # (`launch.train.changes`)
        info["model"] = client_state["config"]["model"]
        info["config"] = client_state["config"]
        (tag_dir / "client_state.json").write_text(json.dumps(info, indent=1) + "\n")
        return files_on_disk(tag_dir)

    # One listing, rank 0's, so that every rank computes the same shares.
    share = hashing_shares(part(listed, "writing", main_only=True)[0], run.denv.world_size)[
        run.denv.rank
    ]
    hashed = part(lambda: hash_files(tag_dir, share), "hashing")

    def recorded() -> None:
        # Sizes and sha256 of every file, checked before a resume trusts it; who hashed each, for
        # the record.
        write_integrity(
            tag_dir,
            {
                name: {**entry, "hashed_by": rank}
                for rank, entries in enumerate(hashed)
                for name, entry in entries.items()
            },
        )
        move_pointer(root, tag)
        prune(root, run.cfg.checkpoint.keep_last)
        run.tracker.checkpointed(run.step)

    part(recorded, "writing", main_only=True)
    return tag_dir


def _save_step(run: Run, root: Path, tag: str, work, doing: str, main_only: bool, failed) -> list:
    """One step of a save: `work()` on every rank (or on rank 0 alone), its values gathered from
    every rank. An OSError of any rank's work fails the save on every rank alike, none left
    waiting in a collective: rank 0 removes what was written of checkpoint `tag` (unless the
    pointer names it), then every rank raises the UserError `failed(WriteFailure)` words."""
    value = failure = None
    if run.denv.is_main or not main_only:
        try:
            value = work()
        except OSError as err:
            failure = WriteFailure(
                run.denv.rank, doing, err.errno, err.strerror or str(err), err.filename
            )
    gathered = dist.all_gather_object((value, failure))
    failures = [failure for _, failure in gathered if failure is not None]
    if failures:
        if run.denv.is_main and latest_tag(root) != tag:
            discard(root, tag)
        dist.barrier()  # removed before any rank ends the job
        raise UserError(failed(failures[0]))
    return [value for value, _ in gathered]
