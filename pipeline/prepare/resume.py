"""Resuming a prepare after its scan: the scan is most of a prepare's work (every byte read,
judged, signed and bucketed), and what follows it — the near-duplicate shuffle, the tokenizer,
the encode — reads only its files. A run stopped after the scan (SIGTERM, Ctrl-C, SIGHUP, a
time limit, kill -9) leaves its staging directory with the scan's record, `_work/scan.json`; the
next run of the same config on the same inputs adopts that directory and goes on from there,
writing the bytes an uninterrupted run writes (every later stage is a pure function of the
scan's files and results).

"The same" is a fingerprint: the resolved config less the keys that change nothing written
(Ray's address and workers, progress, overwrite, keep_partial, resume) and each input file's
path, size and modification time. Anything else differing and the staging directory is an
interrupted run's leftover like any other, cleared.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from common.configure import config_to_dict
from common.outputs import MARKER, staging_dirs
from pipeline.prepare.config import PrepareConfig
from pipeline.prepare.units import Unit

SCAN_RECORD = "scan.json"  # in the staging directory's _work/: written when the scan is done
RESUME_VERSION = 1  # bumped when the scan's files or results change shape
_UNCHANGING = ("ray", "progress", "overwrite", "keep_partial", "resume")


def fingerprint(cfg: PrepareConfig, files: list[list[str]]) -> str:
    """What the scan's work depends on, as one hash."""
    settings = {k: v for k, v in config_to_dict(cfg).items() if k not in _UNCHANGING}
    inputs = []
    for paths in files:
        for path in paths:
            try:
                status = os.stat(path)
                inputs.append([path, status.st_size, status.st_mtime_ns])
            except OSError:
                inputs.append([path, -1, -1])  # a URL or a file gone: never the same
    blob = json.dumps([RESUME_VERSION, settings, inputs], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def save_scan(work_dir: Path, print_: str, units: list[Unit], scanned: list[dict]) -> None:
    """The scan's record, written once the scan is done (atomically: a run killed while writing
    it leaves no record, and the next run scans again)."""
    record = {
        "fingerprint": print_,
        "units": [dataclasses.asdict(dataclasses.replace(u, data=None)) for u in units],
        "scanned": scanned,
    }
    partial = work_dir / (SCAN_RECORD + ".partial")
    partial.write_text(json.dumps(record))
    os.replace(partial, work_dir / SCAN_RECORD)


def load_scan(work_dir: Path, print_: str) -> tuple[list[Unit], list[dict]] | None:
    """The units and the scan's results of a resumable staging directory; None if it has none
    (or another fingerprint's)."""
    try:
        record = json.loads((work_dir / SCAN_RECORD).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record.get("fingerprint") != print_:
        return None
    units = [Unit(**fields) for fields in record["units"]]
    return units, record["scanned"]


def resumable(output: Path, print_: str) -> Path | None:
    """A staging directory of an earlier run of this prepare whose scan is done, if any (the
    newest)."""
    found = [path for path in staging_dirs(output) if load_scan(path / "_work", print_)]
    return (
        max(found, key=lambda path: (path / "_work" / SCAN_RECORD).stat().st_mtime)
        if found
        else None
    )


def clear_after_scan(staging: Path) -> None:
    """Remove what a stopped run wrote after its scan (shards, tokenizer, samples), so that the
    staging directory holds the scan's work alone again."""
    for path in staging.iterdir():
        if path.name in ("_work", MARKER):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
