"""How much of each rank's training step is spent off the CPU: the benchmarks' measure of ranks
waiting for each other, taken alike for ours and for theirs.

    torchrun ... benchmarks/rank_clock.py --out DIR [--skip N] CONFIG key=value ...

One rank of `python -m launch.train CONFIG key=value ...` with the loop's `train_step` wrapped:
each optimizer step's wall time (`time.perf_counter`) and the CPU time of the thread that runs it
(`time.thread_time`, the rank's main thread) are summed after the first N steps (default 5:
allocator, compilation), and `fit`'s end writes them to DIR/rank-R.json. The benchmarks time
Hugging Face's steps with the same `StepClock` (a TrainerCallback's step begin and end, or a
timed round), so both sides are measured by one rule.

Each rank computes on its main thread (one thread per rank, `launch.distributed.set_threads`),
so the step's off-CPU share, 1 - CPU / wall, is the time that thread was blocked: in collectives
(waiting for the slowest rank, or the transfer), for batches, or not scheduled by the OS (on a
machine with fewer free cores than ranks' threads). On a CPU with the ranks balanced it is the
collectives' cost; on a GPU it means nothing (the host waits for the device), and the benchmarks
print it only on a CPU.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


class StepClock:
    """Wall and this thread's CPU seconds summed over the steps after the first `skip`."""

    def __init__(self, skip: int = 0):
        self.skip, self.steps, self.wall, self.cpu = skip, 0, 0.0, 0.0
        self._started: tuple[float, float] | None = None
        self._seen = 0

    def begin(self) -> None:
        self._started = (time.perf_counter(), time.thread_time())

    def end(self) -> None:
        if self._started is None:
            return
        wall, cpu = time.perf_counter() - self._started[0], time.thread_time() - self._started[1]
        self._started = None
        self._seen += 1
        if self._seen > self.skip:
            self.steps += 1
            self.wall += wall
            self.cpu += cpu

    def figures(self) -> dict:
        return {
            "steps": self.steps,
            "wall_s": self.wall,
            "cpu_s": self.cpu,
            "off_cpu": off_cpu(self.cpu, self.wall),
        }


def off_cpu(cpu: float, wall: float) -> float | None:
    """1 - CPU / wall, the share of the wall time the thread did not run (None without time)."""
    return max(0.0, 1.0 - cpu / wall) if wall > 0 else None


def read(directory: Path) -> list[dict]:
    """The rank files of one job, by rank."""
    files = sorted(Path(directory).glob("rank-*.json"), key=lambda p: int(p.stem.split("-")[1]))
    return [json.loads(path.read_text()) for path in files]


def shares(values: list[float | None]) -> str:
    """'r0 12% r1 3%': each rank's off-CPU share."""
    return " ".join(f"r{r} {'-' if x is None else f'{x:.0%}'}" for r, x in enumerate(values))


def install(clock: StepClock, out: Path) -> None:
    """Wrap the loop's `train_step` in `clock` and its `fit` to write this rank's figures to
    OUT/rank-R.json at its end (the rank then leaves through `os._exit`, past any atexit)."""
    from launch.train import loop

    train_step, fit = loop.train_step, loop.fit

    def timed_step(*args, **kwargs):
        clock.begin()
        try:
            return train_step(*args, **kwargs)
        finally:
            clock.end()

    def timed_fit(*args, **kwargs):
        result = fit(*args, **kwargs)
        out.mkdir(parents=True, exist_ok=True)
        rank = int(os.environ.get("RANK", "0"))
        (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, **clock.figures()}))
        return result

    loop.train_step, loop.fit = timed_step, timed_fit  # looked up in the module at each call


if __name__ == "__main__":
    argv = sys.argv[1:]
    out, skip = None, 5
    while argv and argv[0] in ("--out", "--skip") and len(argv) > 1:
        flag, value, argv = argv[0], argv[1], argv[2:]
        out, skip = (Path(value), skip) if flag == "--out" else (out, int(value))
    if out is None:
        raise SystemExit("usage: rank_clock.py --out DIR [--skip N] CONFIG [key=value ...]")
    sys.path.insert(0, str(ROOT))
    from launch import distributed as dist
    from launch import launcher
    from launch.train.cli import main

    install(StepClock(skip), out)
    launcher.die_with_parent()
    dist.run_rank(lambda: main(argv))
