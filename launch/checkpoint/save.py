"""Saving a training run's checkpoint: when (`Checkpointer`, the cadence the loop asks), and the
save itself on every rank (`save_checkpoint`: the engine's tensors and the `CheckpointState`,
integrity.json, the `latest` pointer and retention, or one line on every rank for a save its file
system cannot hold). Restoring one: `launch.checkpoint.restore`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from common.configure import UserError
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
from launch.checkpoint.state import CheckpointState
from launch.deepspeed.engine import Engine


@dataclass(frozen=True)
class SaveTarget:
    """Where a run's checkpoints go and how many stay; the model's size and ZeRO stage and
    precision, which tell what a save needs on disk (`checkpoint_size`)."""

    run_dir: str
    keep_last: int
    n_parameters: int
    zero_stage: int
    precision: str

    @property
    def root(self) -> Path:
        return checkpoint_root(self.run_dir)


class Checkpointer:
    """When a run saves, and the step of this job's newest save (`last_saved`: the step the job
    started from until it saves). Every `every_steps` steps before the job's last
    (`maybe_save`); the last step, unless saved already, and always where the run has no
    checkpoint yet (`ensure_final`); the step a job asked to stop reached, unless saved already
    (`save_unless_saved`); and when the loop asks (`save`: the guard's last good state, before it
    ends the job).

    Built from its parts, not from the run: the engine that writes the tensors, the target, the
    ranks, `snapshot` (the trainer's: the `CheckpointState` of the step reached, a collective every
    rank calls) and `on_saved` (the tracker's hook, on rank 0, with the step saved)."""

    def __init__(
        self,
        engine: Engine,
        target: SaveTarget,
        denv: dist.DistEnv,
        snapshot: Callable[[], CheckpointState],
        on_saved: Callable[[int], None],
        *,
        every_steps: int,
        stop_at: int,
        last_saved: int,
    ):
        self.engine, self.target, self.denv = engine, target, denv
        self.snapshot, self.on_saved = snapshot, on_saved
        self.every_steps = every_steps  # 0: no periodic save
        self.stop_at = stop_at  # the job's last step: saved by `ensure_final`, not the cadence
        self.last_saved = last_saved

    def save(self) -> Path:
        state = self.snapshot()
        tag_dir = save_checkpoint(self.engine, self.target, self.denv, state, self.on_saved)
        self.last_saved = state.step
        return tag_dir

    def maybe_save(self, step: int) -> None:
        """The periodic save, after a step."""
        if self.every_steps and step % self.every_steps == 0 and step < self.stop_at:
            self.save()

    def save_unless_saved(self, step: int) -> bool:
        """For a job that stops: whether it saved the step reached (not if that step is saved
        already, or none was trained)."""
        if step == self.last_saved:
            return False
        self.save()
        return True

    def ensure_final(self, step: int) -> None:
        """The end of the job: its last step saved, and never a run without a checkpoint."""
        if self.last_saved != step or latest_tag(self.target.root) is None:
            self.save()


def save_checkpoint(
    engine: Engine,
    target: SaveTarget,
    denv: dist.DistEnv,
    state: CheckpointState,
    on_saved: Callable[[int], None],
) -> Path:
    """Every rank writes its part and hashes its share of the files (`hashing_shares`: the
    ones it wrote, and the shared ones balanced by size); rank 0 records them all in
    integrity.json, and the `latest` pointer moves once all have finished.

    A save that its file system cannot hold ends the job on every rank in one line naming it and
    what the save needs (`checkpoint_size`): refused before anything is written where the file
    system has less free space, else failed by any rank's OSError (ENOSPC) in any step
    (`_save_step`). The previous checkpoint stays the latest, and this one is removed."""
    root = target.root
    tag = tag_for(state.step)
    tag_dir = root / tag
    need, how = checkpoint_size(target.n_parameters, target.zero_stage, target.precision)
    free = None

    def part(work, doing: str, *, main_only: bool = False) -> list:  # `free` as measured by then
        return _save_step(
            denv,
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
    part(lambda: engine.save(root, tag, state.client_state()), "writing")

    def listed() -> dict[str, int]:
        # what a resume checks before loading (`find_resume`): the network, and every setting
        # (`launch.train.changes`)
        (tag_dir / "client_state.json").write_text(json.dumps(state.listing(), indent=1) + "\n")
        return files_on_disk(tag_dir)

    # One listing, rank 0's, so that every rank computes the same shares.
    share = hashing_shares(part(listed, "writing", main_only=True)[0], denv.world_size)[denv.rank]
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
        prune(root, target.keep_last)
        on_saved(state.step)

    part(recorded, "writing", main_only=True)
    return tag_dir


def _save_step(
    denv: dist.DistEnv, root: Path, tag: str, work, doing: str, main_only: bool, failed
) -> list:
    """One step of a save: `work()` on every rank (or on rank 0 alone), its values gathered from
    every rank. An OSError of any rank's work fails the save on every rank alike, none left
    waiting in a collective: rank 0 removes what was written of checkpoint `tag` (unless the
    pointer names it), then every rank raises the UserError `failed(WriteFailure)` words."""
    value = failure = None
    if denv.is_main or not main_only:
        try:
            value = work()
        except OSError as err:
            failure = WriteFailure(
                denv.rank, doing, err.errno, err.strerror or str(err), err.filename
            )
    gathered = dist.all_gather_object((value, failure))
    failures = [failure for _, failure in gathered if failure is not None]
    if failures:
        if denv.is_main and latest_tag(root) != tag:
            discard(root, tag)
        dist.barrier()  # removed before any rank ends the job
        raise UserError(failed(failures[0]))
    return [value for value, _ in gathered]
