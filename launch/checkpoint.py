"""Checkpoint layout, the `latest` pointer and retention.

    RUN_DIR/checkpoints/step_00000100/            a DeepSpeed checkpoint (every rank writes its part)
    RUN_DIR/checkpoints/step_00000100.universal/  its universal copy, if one was made (launch.deepspeed.universal.to_universal)
    RUN_DIR/checkpoints/latest                    the tag of the newest complete checkpoint

The pointer moves only after every rank has finished writing (a barrier, then an atomic
rename by rank 0), so a crash during a save leaves the previous checkpoint in charge.
A ZeRO checkpoint is tied to the world size that wrote it (DeepSpeed #2898); its universal
copy loads on any world size. `launch.export` turns any checkpoint into plain weights.
This module reads DeepSpeed's file names but never imports it, nor torch.distributed.

Integrity: once every rank has written, each rank hashes its share of the files
(`hashing_shares`: those it wrote, and the shared ones balanced by size), and rank 0 records
every file's size and sha256 in the checkpoint's `integrity.json` (`write_integrity`), before
the pointer moves. A file damaged afterwards (a truncated copy, a full disk, bit rot) is found
before DeepSpeed reads it: a resume takes the newest checkpoint that every rank finds intact,
each rank hashing its share by the same rule (`files_for_rank`, `first_intact`: the trainer
supplies the all-gather), so that all ranks skip the same ones; export refuses a damaged one.
Checkpoints written before integrity.json existed are trusted with a warning, once their torch
files open as whole archives (`check_archives`).

A save that its file system cannot hold: `launch.train.space`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from omegaconf import OmegaConf

from common.configure import UserError
from common.hashing import file_sha256

POINTER = "latest"
UNIVERSAL_SUFFIX = ".universal"
UNIVERSAL_INFO = "universal.json"  # written last into a universal copy: it is complete
INTEGRITY = "integrity.json"  # every file's size and sha256, written once all ranks have written
# A ZeRO rank's optimizer partition (stages 1-3, or DeepSpeed's BF16_Optimizer; "bf16_" in bf16
# runs).
_RANK_FILE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
# The module's weights: whole below ZeRO-3 (`mp_rank_00_...`), one file per rank under ZeRO-3.
_MODEL_STATES = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


def checkpoint_root(run_dir: str | Path) -> Path:
    return Path(run_dir) / "checkpoints"


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


def latest_tag(root: str | Path) -> str | None:
    """The tag the pointer names, if the pointer and its checkpoint exist."""
    pointer = Path(root) / POINTER
    if not pointer.is_file():
        return None
    tag = pointer.read_text().strip()
    return tag if (Path(root) / tag).is_dir() else None


def move_pointer(root: str | Path, tag: str) -> None:
    root = Path(root)
    partial = root / (POINTER + ".partial")
    partial.write_text(tag + "\n")
    os.replace(partial, root / POINTER)


def prune(root: str | Path, keep_last: int) -> list[str]:
    """Delete all but the newest `keep_last` complete checkpoints (never the one the pointer
    names), each with its universal copy; copies count as part of their checkpoint."""
    root = Path(root)
    current = latest_tag(root)
    tags = checkpoint_tags(root)
    if current is not None:
        tags = [t for t in tags if t <= current]
    doomed = [t for t in tags[:-keep_last] if t != current]
    for tag in doomed:
        discard(root, tag)
    return doomed


def checkpoint_tags(root: str | Path) -> list[str]:
    """The step_* checkpoints under `root`, oldest first (universal copies are part of theirs)."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(
        p.name for p in root.glob("step_*") if p.is_dir() and not p.name.endswith(UNIVERSAL_SUFFIX)
    )


def discard(root: str | Path, tag: str) -> None:
    """Remove checkpoint `root/tag` with its universal copy, finished or not. Before a save into
    a tag that exists (what a save that never completed left, or a damaged checkpoint that a
    resume skipped), so that no stale file, nor a copy of the old contents, outlives it."""
    root = Path(root)
    for name in (tag, universal_tag_for(tag), f".{universal_tag_for(tag)}.partial"):
        shutil.rmtree(root / name, ignore_errors=True)


def universal_tag_for(tag: str) -> str:
    return tag + UNIVERSAL_SUFFIX


def is_universal(root: str | Path, tag: str) -> bool:
    """Whether `root/tag` is a universal checkpoint (DeepSpeed's `zero/` folder of whole tensors)."""
    return (Path(root) / tag / "zero").is_dir()


def is_zero_partitioned(checkpoint: str | Path) -> bool:
    """Whether a checkpoint's optimizer state is split over per-rank files (ZeRO 1-3, or
    DeepSpeed's BF16_Optimizer), as opposed to whole in `mp_rank_00_model_states.pt` (stage 0)."""
    return bool(_rank_files(Path(checkpoint)))


def client_info(root: str | Path, tag: str) -> dict:
    """The trainer's `client_state.json` of checkpoint `root/tag` (what its torch client state
    holds, readable without unpickling); {} if there is none or it is unreadable."""
    info = Path(root) / tag / "client_state.json"
    try:
        saved = json.loads(info.read_text()) if info.is_file() else {}
    except (OSError, json.JSONDecodeError):
        saved = {}
    return saved if isinstance(saved, dict) else {}


def saved_shape(root: str | Path, tag: str) -> dict:
    """How checkpoint `root/tag` was trained: `world_size` (see `saved_world_size`) and, from
    the trainer's `client_state.json` where it says, `global_batch_size`, `micro_batch_size` and
    `grad_accum` (absent in checkpoints written before the global batch was recorded)."""
    saved = client_info(root, tag)
    shape = {
        key: saved[key]
        for key in ("global_batch_size", "micro_batch_size", "grad_accum")
        if isinstance(saved.get(key), int)
    }
    return {"world_size": saved_world_size(root, tag), **shape}


def saved_model_config(root: str | Path, tag: str) -> dict | None:
    """The model config (a plain dict) that checkpoint `root/tag` holds weights of: from its
    `client_state.json`, else, for a checkpoint written before that recorded it, from its run's
    `config.yaml` beside the checkpoints (a job rewrites it only once it has loaded them, and
    export reads a run's model from there too); None if neither tells."""
    model = client_info(root, tag).get("model")
    if isinstance(model, dict):
        return model
    config_file = Path(root).parent / "config.yaml"
    try:
        model = (
            OmegaConf.to_container(OmegaConf.load(config_file)).get("model")
            if config_file.is_file()
            else None
        )
    except Exception:  # noqa: BLE001 - unreadable: no record, as without the file
        return None
    return model if isinstance(model, dict) else None


def saved_world_size(root: str | Path, tag: str) -> int | None:
    """The number of ranks that wrote checkpoint `root/tag`: from the trainer's
    `client_state.json`, else from DeepSpeed's per-rank files; None if neither tells
    (a stage-0 checkpoint without the json has no per-rank files, and loads on any world size)."""
    directory = Path(root) / tag
    world_size = client_info(root, tag).get("world_size")
    if isinstance(world_size, int):
        return world_size
    ranks = _rank_files(directory)
    if not ranks:
        return None
    data_parallel = {int(m.group(1)) for m in ranks}
    model_parallel = {int(m.group(2)) for m in ranks}
    return len(data_parallel) * len(model_parallel)


def _rank_files(directory: Path) -> list[re.Match]:
    if not directory.is_dir():
        return []
    return [m for m in (_RANK_FILE.match(p.name) for p in directory.iterdir()) if m]


# ----------------------------------------------------------------------------- resume from an
# intact checkpoint
#
# On every rank, in the trainer (it owns the process group; this module stays free of it):
#     candidates = rank 0's resume_candidates(resume, run_dir), broadcast
#     found = choose_resume(resume, candidates, lambda c: resume_verdict(c, rank, world_size),
#                           all_gather_object, report=rank == 0)


def resume_candidates(resume: str, run_dir: str | Path) -> list[tuple[Path, str]]:
    """The checkpoints `resume` may continue from, newest first; [] to start fresh.
    `auto` (or a checkpoints directory): the one the pointer names and every older one, for a
    resume to fall back on when the newest is damaged (newer directories are saves that never
    completed); a step_* directory: that one alone; `none`: none, refused if the run has some."""
    root = checkpoint_root(run_dir)
    if resume == "none":
        if latest_tag(root) is not None:
            raise UserError(
                f"{run_dir} already holds checkpoints; use resume=auto, or another run_dir"
            )
        return []
    if resume != "auto":
        path = Path(resume)
        if (path / POINTER).is_file():
            root = path
        elif path.is_dir() and path.name.startswith("step_"):
            return [(path.parent, path.name)]
        else:
            raise UserError(
                f"resume: {resume!r} is not auto, none, a checkpoints directory or a step_* checkpoint"
            )
    pointer = root / POINTER
    newest = pointer.read_text().strip() if pointer.is_file() else ""
    if not newest:
        return []
    # The pointer's own tag even if its directory is gone: the verdict says so, and the older ones
    # follow.
    tags = sorted({tag for tag in checkpoint_tags(root) if tag <= newest} | {newest}, reverse=True)
    return [(root, tag) for tag in tags]


def choose_resume(
    resume: str,
    candidates: Sequence[tuple[Path, str]],
    verify_here: Callable[[tuple[Path, str]], str | None] | None = None,
    all_agree: Callable[[str | None], list] | None = None,
    *,
    report: bool = True,
) -> tuple[Path, str] | None:
    """The newest of `candidates` (`resume_candidates`) that every rank finds intact; None for
    none. Call on every rank with the same candidates; `verify_here` is this rank's check
    (`resume_verdict` with its rank), `all_agree` gathers one value from every rank (an
    all-gather; by default a world of one). With `report` (one rank), the skipped ones are
    named on stderr with the reason, and so is a checkpoint that could not be verified.

    A step_* checkpoint named by hand that fails is an error; so is `auto` with every candidate
    damaged, rather than a fresh start that would write over the run. The verdict is the same on
    every rank, so a UserError raised here is raised everywhere."""
    if not candidates:
        return None
    chosen, skipped = first_intact(
        candidates, verify_here or resume_verdict, all_agree or (lambda verdict: [verdict])
    )
    named = resume not in ("auto", "none") and Path(resume).name.startswith("step_")
    if named and chosen is None:
        (root, tag), reason = skipped[0]
        raise UserError(f"resume: checkpoint {root / tag} fails verification: {reason}")
    if report:
        for (root, tag), reason in skipped:
            print(f"warning: skipping checkpoint {root / tag}: {reason}", file=sys.stderr)
    if chosen is None:
        (root, tag), reason = skipped[0]
        raise UserError(
            f"resume: no intact checkpoint in {root} ({len(skipped)} tried; the newest, {tag}: {reason}); "
            f"name one with resume=..., or remove them or use another run_dir to start afresh"
        )
    root, tag = chosen
    if report and not (root / tag / INTEGRITY).is_file():
        print(
            f"warning: checkpoint {root / tag} has no {INTEGRITY} (written before checkpoints were verified): "
            f"only checked that its torch files are whole archives; resuming from it",
            file=sys.stderr,
        )
    return chosen


def first_intact(
    candidates: Sequence,
    verify_here: Callable[..., str | None],
    all_agree: Callable[[str | None], list],
):
    """(the first candidate that no rank finds a fault in, or None; [(candidate, reason)] for
    those before it). Every rank calls `all_agree` once per candidate tried, in the same order, so
    the collective inside it pairs up across ranks; `verify_here` raising on one rank would leave
    the others waiting in it, so its exceptions become reasons too."""
    skipped = []
    for candidate in candidates:
        try:
            verdict = verify_here(candidate)
        except Exception as err:  # noqa: BLE001 - any fault is a verdict, never a missed collective
            verdict = f"{type(err).__name__}: {err}"
        verdicts = all_agree(verdict)
        faults = [(rank, reason) for rank, reason in enumerate(verdicts) if reason]
        if not faults:
            return candidate, skipped
        rank, reason = faults[0]
        skipped.append(
            (candidate, reason + (f" (found by rank {rank})" if len(verdicts) > 1 else ""))
        )
    return None, skipped


def resume_verdict(checkpoint: tuple[Path, str], rank: int = 0, world_size: int = 1) -> str | None:
    """What this rank finds wrong with checkpoint (root, tag); None if nothing. With
    integrity.json, every file's size and the sha256 of this rank's share (`files_for_rank`);
    without it (a checkpoint written before it existed), whether its torch files are whole."""
    root, tag = checkpoint
    tag_dir = Path(root) / tag
    if not tag_dir.is_dir():
        return "not found"
    if not (tag_dir / INTEGRITY).is_file():
        return _check_unrecorded(Path(root), tag)
    return verify(tag_dir, files_for_rank(tag_dir, rank, world_size))


def require_intact(root: str | Path, tag: str) -> None:
    """For a reader of one checkpoint (export, evaluation): UserError, in one line, if it fails
    verification, naming an older checkpoint to use instead; a warning if it cannot be verified."""
    root, tag_dir = Path(root), Path(root) / tag
    if (tag_dir / INTEGRITY).is_file():
        reason = verify(tag_dir)
    else:
        reason = _check_unrecorded(root, tag)
        if reason is None:
            print(
                f"warning: checkpoint {tag_dir} has no {INTEGRITY} (written before checkpoints were verified): "
                f"only checked that its torch files are whole archives",
                file=sys.stderr,
            )
    if reason is not None:
        older = [t for t in checkpoint_tags(root) if t < tag]
        hint = f"; the next older checkpoint is {root / older[-1]}" if older else ""
        raise UserError(f"checkpoint {tag_dir} fails verification: {reason}{hint}")


def _check_unrecorded(root: Path, tag: str) -> str | None:
    """What is wrong with checkpoint `root/tag`, which has no integrity.json: it is a save that did
    not complete if an older checkpoint of the run has one (the code that wrote that one writes it
    into every checkpoint); else it was written before integrity.json existed, and is checked as
    far as that goes (`check_archives`)."""
    recorded = [t for t in checkpoint_tags(root) if t < tag and (root / t / INTEGRITY).is_file()]
    if recorded:
        return (
            f"no {INTEGRITY}, though the older {recorded[-1]} has one: a save that did not complete"
        )
    return check_archives(root / tag)


# ----------------------------------------------------------------------------- integrity.json


def write_integrity(tag_dir: str | Path, files: dict[str, dict] | None = None) -> Path:
    """Record every file of checkpoint `tag_dir` (relative path, size, sha256) in its
    integrity.json, written atomically and last. `files`: the entries the ranks hashed
    (`hash_files` over their `hashing_shares`, gathered); None: hash them here, one by one. Call
    it on one rank once every rank has written and before the pointer moves; a file written
    later is not covered."""
    tag_dir = Path(tag_dir)
    if files is None:
        files = hash_files(tag_dir, sorted(files_on_disk(tag_dir)))
    partial = tag_dir / (INTEGRITY + ".partial")
    partial.write_text(
        json.dumps({"version": 1, "files": dict(sorted(files.items()))}, indent=1) + "\n"
    )
    os.replace(partial, tag_dir / INTEGRITY)
    return tag_dir / INTEGRITY


def files_on_disk(tag_dir: str | Path) -> dict[str, int]:
    """{relative path: size} of the files of checkpoint `tag_dir` that integrity.json covers."""
    tag_dir = Path(tag_dir)
    return {
        path.relative_to(tag_dir).as_posix(): path.stat().st_size
        for path in sorted(tag_dir.rglob("*"))
        if path.is_file() and path.name != INTEGRITY and not path.name.endswith(".partial")
    }


def hash_files(tag_dir: str | Path, names: Sequence[str]) -> dict[str, dict]:
    """{name: {"size", "sha256"}} of files `names` (relative to `tag_dir`), as integrity.json records them."""
    tag_dir = Path(tag_dir)
    return {
        name: {"size": (tag_dir / name).stat().st_size, "sha256": file_sha256(tag_dir / name)}
        for name in names
    }


def hashing_shares(sizes: dict[str, int], world_size: int) -> list[list[str]]:
    """Which rank hashes which file of a checkpoint ({relative path: size}), at save and at
    resume alike: a file named for the rank that wrote it (DeepSpeed's `zero_pp_rank_R_...`) goes
    to rank R, who has just written it (still in its page cache) and at save holds it first;
    every other file (the shared ones, and those of ranks this world lacks), biggest first, to the
    least loaded rank. The shares cover every file once."""
    loads, shares = [0] * world_size, [[] for _ in range(world_size)]
    rest = []
    for name, size in sizes.items():
        match = _RANK_FILE.match(name) or _MODEL_STATES.match(name)
        writer = int(match.group(1)) if match and match.group(1) is not None else None
        if writer is not None and writer < world_size:
            shares[writer].append(name)
            loads[writer] += size
        else:
            rest.append(name)
    for name in sorted(rest, key=lambda name: (-sizes[name], name)):
        least = min(range(world_size), key=lambda r: (loads[r], r))
        shares[least].append(name)
        loads[least] += sizes[name]
    return [sorted(share) for share in shares]


def verify(tag_dir: str | Path, files: list[str] | None = None) -> str | None:
    """None if checkpoint `tag_dir` is what its integrity.json records, else one line saying
    why. Every recorded file's presence and size are checked (a stat each), the sha256 of
    `files` only (paths relative to `tag_dir`; None: all), so that ranks can share the hashing.
    Never raises: an unreadable file is a reason like any other."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return "not found"
    record, reason = _read_integrity(tag_dir)
    if record is None:
        return reason
    try:
        for name, entry in record.items():
            path = tag_dir / name
            if not path.is_file():
                return f"{name} is missing"
            if path.stat().st_size != entry["size"]:
                return f"{name} is {path.stat().st_size} bytes, {INTEGRITY} records {entry['size']}"
        for name in sorted(record) if files is None else files:
            if name not in record:
                return f"{name} is not recorded in {INTEGRITY}"
            digest = file_sha256(tag_dir / name)
            if digest != record[name]["sha256"]:
                return f"{name} has sha256 {digest[:16]}..., {INTEGRITY} records {record[name]['sha256'][:16]}..."
    except OSError as err:
        return f"cannot be read: {err}"
    return None


def files_for_rank(tag_dir: str | Path, rank: int, world_size: int) -> list[str]:
    """This rank's share of the files integrity.json records, for it to hash on resume: the
    share it hashed at save on the same world size (`hashing_shares`); together the ranks check
    everything, whatever world size wrote the checkpoint. [] without a readable integrity.json
    (`verify` says why)."""
    record, _ = _read_integrity(Path(tag_dir))
    if record is None:
        return []
    return hashing_shares({name: entry["size"] for name, entry in record.items()}, world_size)[rank]


def check_archives(tag_dir: str | Path) -> str | None:
    """What can be told of a checkpoint without its integrity.json: None if a model-states file
    is there, the per-rank files number 0..N-1 and every torch file is a whole zip archive (a
    truncated or overwritten one loses the directory at its end); else one line saying why. Reads
    the end of each file only, so it finds no damage within."""
    tag_dir = Path(tag_dir)
    if not tag_dir.is_dir():
        return "not found"
    try:
        top = {p.name for p in tag_dir.iterdir() if p.is_file()}
        model_states = [m for m in map(_MODEL_STATES.match, top) if m]
        if not model_states:
            return "no model-states file (*model_states.pt)"
        ranks = {int(m.group(1)) for m in map(_RANK_FILE.match, top) if m}
        ranks |= {int(m.group(1)) for m in model_states if m.group(1) is not None}  # ZeRO-3
        if ranks and ranks != set(range(max(ranks) + 1)):
            return (
                f"the per-rank files of rank {min(set(range(max(ranks) + 1)) - ranks)} are missing"
            )
        for path in sorted(tag_dir.rglob("*.pt")):
            name = path.relative_to(tag_dir).as_posix()
            try:
                with zipfile.ZipFile(path) as archive:
                    if not any(member.endswith("data.pkl") for member in archive.namelist()):
                        return f"{name} is not a torch file"
            except zipfile.BadZipFile as err:
                return f"{name} is not a whole torch archive ({err})"
    except OSError as err:
        return f"cannot be read: {err}"
    return None


def _read_integrity(tag_dir: Path) -> tuple[dict | None, str | None]:
    """({relative path: {"size", "sha256"}}, None), or (None, why not)."""
    path = tag_dir / INTEGRITY
    if not path.is_file():
        return (
            None,
            f"no {INTEGRITY} (a checkpoint written before checkpoints were verified, or not complete)",
        )
    try:
        files = json.loads(path.read_text())["files"]
        if not all(
            isinstance(e["size"], int) and isinstance(e["sha256"], str) for e in files.values()
        ):
            raise ValueError("an entry without an integer size and a sha256")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return None, f"{INTEGRITY} is unreadable ({type(err).__name__}: {err})"
    return files, None
