"""A checkpoint its file system cannot hold: what a save needs, the free space, the file system
named, and the one line that ends every rank, saying what the save needs and which checkpoint is
still the latest."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path
from typing import NamedTuple

from common.storage import byte_size, file_system
from launch.checkpoint.layout import POINTER, latest_tag


class WriteFailure(NamedTuple):
    """An OSError of one rank's step of a save, as the ranks gather it (`save_failed` says it)."""

    rank: int
    doing: str  # "writing", "hashing"
    errno: int | None
    strerror: str
    filename: str | None


def checkpoint_size(parameters: int, zero_stage: int, precision: str) -> tuple[int, str]:
    """(about how many bytes a checkpoint takes, all ranks' files together; how that is
    counted), from the parameter count: per parameter, the weights of the model-states file (4
    bytes in fp32, 2 in bf16 or fp16; none under ZeRO-3, where the weights are the fp32 masters'
    partitions), the fp32 master weights (a copy, except in fp32 without ZeRO) and AdamW's two
    fp32 moments. What DeepSpeed writes, less its pickles' overhead (a few percent on a tiny
    model; tests/launch/test_checkpoint_save.py compares the two). bf16 without ZeRO is torch's
    autocast over fp32 weights (`launch.deepspeed.config`): stored as fp32 is."""
    fp32_weights = precision == "fp32" or (zero_stage == 0 and precision == "bf16")
    per_parameter = {}
    if zero_stage < 3:
        per_parameter["weights"] = 4 if fp32_weights else 2
    if zero_stage > 0 or not fp32_weights:
        per_parameter["fp32 master weights"] = 4
    per_parameter["Adam moments"] = 8
    each = sum(per_parameter.values())
    how = ", ".join(f"{name} {size}" for name, size in per_parameter.items())
    return parameters * each, f"{parameters:,} parameters x {each} bytes: {how}"


def short_of_space(root: str | Path, tag: str, free: int, need: int, how: str) -> str | None:
    """The line refusing to save checkpoint `root/tag` where its file system has `free` bytes and
    the save needs about `need` (`how`: how that is counted); None where it fits."""
    if free >= need:
        return None
    return (
        f"checkpoint {tag} not saved: the file system of {root} ({file_system(root)}) has "
        f"{byte_size(free)} free and the save needs about {byte_size(need)} ({how}); "
        f"{_still_latest(root)}"
    )


def save_failed(
    root: str | Path, tag: str, failure: WriteFailure, need: int, how: str, free: int | None
) -> str:
    """The line for a save of checkpoint `root/tag` that `failure` ended, once what it wrote is
    removed: which file system, full or not, the rank and file, what the save needs and what
    was free before it."""
    root = Path(root)
    said = {errno.ENOSPC: "is full", errno.EDQUOT: "is over its quota"}.get(failure.errno, "failed")
    name = failure.filename or "?"
    for base in (root / tag, root):
        with contextlib.suppress(ValueError):
            name = Path(name).relative_to(base).as_posix()
            break
    was_free = f" and {byte_size(free)} was free before it" if free is not None else ""
    if failure.errno == errno.EFBIG:  # the process's file size limit, not its file system
        from launch.stop import file_size_limit

        latest = latest_tag(root)
        return (
            f"checkpoint {tag} not saved: rank {failure.rank} {failure.doing} {name}: "
            f"{failure.strerror}, past the file size limit (RLIMIT_FSIZE, `ulimit -f`: "
            f"{file_size_limit()}), which this run's checkpoint files outgrow; the partial {tag} "
            "is removed and "
            + (
                f"{root / POINTER} still names {latest}"
                if latest
                else "no checkpoint of this run is complete yet"
            )
            + ": raise the limit and start the job again"
        )
    return (
        f"checkpoint {tag} not saved: the file system of {root} ({file_system(root)}) {said}: rank "
        f"{failure.rank} {failure.doing} {name}: {failure.strerror}; the save needs about "
        f"{byte_size(need)} ({how}){was_free}; the partial {tag} is removed and "
        f"{_still_latest(root)}"
    )


def _still_latest(root: Path) -> str:
    latest = latest_tag(root)
    kept = (
        f"{Path(root) / POINTER} still names {latest}"
        if latest
        else "no checkpoint of this run is complete yet"
    )
    return (
        f"{kept}: make room there, or move run_dir to a roomier file "
        "system, and start the job again"
    )
