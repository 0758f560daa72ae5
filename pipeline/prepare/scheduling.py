"""How a prepare's work is cut into Ray tasks: consecutive units grouped into scan tasks that
finish together, and the encode tasks handed out largest first. Neither changes the output.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Iterator

from pipeline.format import SPLITS
from pipeline.prepare.scan import MONO, PAIRS, bucket_file
from pipeline.prepare.units import Unit, stream_chunks

SCAN_TASKS_PER_WORKER = 4  # small units are batched into about this many scan tasks per worker


def scan_batches(
    units: list[Unit], num_workers: int, unit_bytes: int, numbered: list[Unit] | None = None
) -> Iterator[list[tuple[int, Unit]]]:
    """Consecutive units grouped into scan tasks: about total / (SCAN_TASKS_PER_WORKER x workers)
    bytes each at first, then a share of what is left (remaining / (2 x workers), down to one
    unit), so the last tasks are small and the workers finish together; few enough tasks that
    scheduling does not dominate small files. A `stream` unit is decompressed here, as its tasks
    are wanted, into chunks of `unit_bytes`, a task each; units are numbered as they come, and
    appended to `numbered` without their data."""
    sizes = [_unit_bytes(unit) for unit in units]
    workers = max(1, num_workers)
    remaining = sum(sizes)
    most = remaining / (SCAN_TASKS_PER_WORKER * workers)
    current: list[tuple[int, Unit]] = []
    load, index = 0, 0
    numbered = [] if numbered is None else numbered
    for unit, size in zip(units, sizes):
        if unit.stream:
            if current:
                yield current
                current, load = [], 0
            for chunk in stream_chunks(unit, unit_bytes):
                numbered.append(dataclasses.replace(chunk, data=None))
                yield [(index, chunk)]
                index += 1
            remaining -= size
            continue
        if not current:
            target = min(most, remaining / (2 * workers))
        current.append((index, unit))
        numbered.append(unit)
        index += 1
        load += size
        remaining -= size
        if load >= target:
            yield current
            current, load = [], 0
    if current:
        yield current


def _unit_bytes(unit: Unit) -> int:
    if unit.end >= 0 and not unit.path.endswith(".parquet"):
        return unit.end - unit.start
    try:
        return Path(unit.path).stat().st_size
    except OSError:
        return 0


def encode_jobs(
    work_dir: Path, unit_sources: list[int], datasets: list[str], buckets: int
) -> list[tuple[str, int, list[int]]]:
    """The encode tasks' arguments, (dataset, bucket, each unit's source), largest first (by
    bucket-file bytes), so that no worker is left with a big task at the end while the others
    idle; the results are put back in order, so the output does not depend on it."""
    jobs = [(d, b, unit_sources) for d in datasets for b in range(buckets)]
    jobs.sort(key=lambda job: -_job_bytes(work_dir, len(unit_sources), job[0], job[1]))
    return jobs


def _job_bytes(work_dir: Path, n_units: int, dataset: str, bucket: int) -> int:
    family = MONO if dataset == "packed" else PAIRS
    paths = (
        bucket_file(work_dir, u, family, split, bucket) for u in range(n_units) for split in SPLITS
    )
    return sum(path.stat().st_size for path in paths if path.is_file())
