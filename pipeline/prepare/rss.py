"""A Ray task's peak resident memory and CPU seconds, for the log and the benchmarks (never the
manifest, whose bytes do not depend on the machine)."""

from __future__ import annotations

import os
import resource
import time


def reset_peak_rss() -> None:
    """Start a task's peak-memory count afresh (Linux: VmHWM is reset by writing 5 to
    /proc/self/clear_refs), so that a Ray worker's figure is the task's, not its earlier tasks'.
    Freed heap is handed back to the system first (glibc's malloc_trim), or the earlier tasks'
    high-water mark would stay resident and count again."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
    except OSError:
        pass


def peak_rss_mb() -> float:
    """This process's peak resident memory since `reset_peak_rss` (or since it started, where
    that cannot be reset); for benchmarks, not the manifest."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def cpu_noted(results: list[dict], cpu_started: float) -> list[dict]:
    """The task's CPU seconds on its first result, and the worker's pid on each: for benchmarks,
    which add them up per worker (a figure that machine load does not change), not the manifest."""
    for position, result in enumerate(results):
        result["task_cpu_s"] = time.process_time() - cpu_started if position == 0 else 0.0
        result["worker_pid"] = os.getpid()
    return results
