"""A checkpoint's integrity.json, and a resume that trusts only an intact checkpoint.

Once every rank has written, each rank hashes its share of the files
(`hashing_shares`: those it wrote, and the shared ones balanced by size), and rank 0 records
every file's size and sha256 in the checkpoint's `integrity.json` (`write_integrity`), before
the pointer moves. A file damaged afterwards (a truncated copy, a full disk, bit rot) is found
before DeepSpeed reads it: a resume takes the newest checkpoint that every rank finds intact,
each rank hashing its share by the same rule (`files_for_rank`, `first_intact`: the trainer
supplies the all-gather), so that all ranks skip the same ones; export refuses a damaged one.
Checkpoints written before integrity.json existed are trusted with a warning, once their torch
files open as whole archives (`check_archives`). Like the layout, this module never imports
DeepSpeed nor torch.distributed.
"""

from __future__ import annotations

import json
import os
import sys
import zipfile
from pathlib import Path
from typing import Callable, Sequence

from common.configure import UserError
from common.hashing import file_sha256
from launch.checkpoint.layout import MODEL_STATES, RANK_FILE, checkpoint_tags

INTEGRITY = "integrity.json"  # every file's size and sha256, written once all ranks have written

# ----------------------------------------------------------------------------- resume from an
# intact checkpoint
#
# On every rank, in the trainer (it owns the process group; this module stays free of it):
#     candidates = rank 0's resume_candidates(resume, run_dir), broadcast
#                  (launch.checkpoint.layout)
#     found = choose_resume(resume, candidates, lambda c: resume_verdict(c, rank, world_size),
#                           all_gather_object, report=rank == 0)


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
            f"resume: no intact checkpoint in {root} ({len(skipped)} tried; the "
            f"newest, {tag}: {reason}); name one with resume=..., or remove them or "
            "use another run_dir to start afresh"
        )
    root, tag = chosen
    if report and not (root / tag / INTEGRITY).is_file():
        print(
            f"warning: checkpoint {root / tag} has no {INTEGRITY} (written before checkpoints were "
            "verified): only checked that its torch files are whole archives; resuming from it",
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
                f"warning: checkpoint {tag_dir} has no {INTEGRITY} (written before checkpoints "
                "were verified): only checked that its torch files are whole archives",
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
    """{name: {"size", "sha256"}} of files `names` (relative to `tag_dir`), as
    integrity.json records them."""
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
        match = RANK_FILE.match(name) or MODEL_STATES.match(name)
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
                return (
                    f"{name} has sha256 {digest[:16]}..., {INTEGRITY} records "
                    f"{record[name]['sha256'][:16]}..."
                )
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
        model_states = [m for m in map(MODEL_STATES.match, top) if m]
        if not model_states:
            return "no model-states file (*model_states.pt)"
        ranks = {int(m.group(1)) for m in map(RANK_FILE.match, top) if m}
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
            f"no {INTEGRITY} (a checkpoint written before checkpoints "
            "were verified, or not complete)",
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
