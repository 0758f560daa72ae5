"""The memory a process's control group can still give it: a SLURM job's `--mem` (its cgroup
plugin), a container's limit. psutil's `available` is the machine's, which a job on a shared node
never gets; a process over its cgroup's limit is killed by the kernel without a word.

Read from /proc/self/cgroup and the cgroup file system, version 2 (`memory.max`,
`memory.current`) or version 1 (`memory.limit_in_bytes`, `memory.usage_in_bytes`), at the
process's own group and every group above it (a limit may sit on the job, the step or the task);
the page cache's inactive files (`inactive_file` in `memory.stat`), which the kernel reclaims
first, are not counted as used.
"""

from __future__ import annotations

from pathlib import Path

NO_LIMIT = 1 << 60  # version 1 writes "no limit" as a number near 2**63


def _groups(proc_cgroup: Path) -> list[tuple[str, str]]:
    """(version, path) of this process's memory groups: ("2", path) for the unified hierarchy,
    ("1", path) for the memory controller's."""
    found = []
    for line in proc_cgroup.read_text().splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            found.append(("2", path))
        elif "memory" in controllers.split(","):
            found.append(("1", path))
    return found


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return None if value >= NO_LIMIT else value


def _inactive_file(folder: Path, key: str) -> int:
    try:
        for line in (folder / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _left_at(folder: Path, version: str) -> int | None:
    if version == "2":
        limit = _read_int(folder / "memory.max")
        used = _read_int(folder / "memory.current")
        cache = _inactive_file(folder, "inactive_file")
    else:
        limit = _read_int(folder / "memory.limit_in_bytes")
        used = _read_int(folder / "memory.usage_in_bytes")
        cache = _inactive_file(folder, "total_inactive_file")
    if limit is None or used is None:
        return None
    return max(0, limit - max(0, used - cache))


def memory_left(
    proc_cgroup: str | Path = "/proc/self/cgroup", root: str | Path = "/sys/fs/cgroup"
) -> int | None:
    """Bytes this process's cgroups can still give (the least over its group and those above
    it), or None when none of them has a memory limit or none can be read."""
    root = Path(root)
    try:
        groups = _groups(Path(proc_cgroup))
    except OSError:
        return None
    least = None
    for version, path in groups:
        mount = root if version == "2" else root / "memory"
        if version == "2" and not (mount / "cgroup.controllers").exists():
            continue  # a hybrid system's empty unified hierarchy: its limits are version 1's
        parts = [p for p in path.split("/") if p]
        # Inside a cgroup namespace (a container) the file system's root is the process's own
        # group and the path may name groups that are not there: the root is read alone.
        if not mount.joinpath(*parts).is_dir():
            parts = []
        for depth in range(len(parts), -1, -1):
            left = _left_at(mount.joinpath(*parts[:depth]), version)
            if left is not None:
                least = left if least is None else min(least, left)
    return least
