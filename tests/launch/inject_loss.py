"""One rank of `python -m launch.train` with a loss fault installed from outside the trainer, for
the guard's tests (tests/launch/test_elastic.py): run in place of `-m launch.train`, with
INJECT_LOSS="RANK:STEP[-LAST][*FACTOR],..." multiplying that rank's loss at those optimizer steps
(1-based) by FACTOR, NaN by default: NaN or inf as a bad batch or an overflow would make it, a
large factor as a loss spike. The trainer itself knows nothing of it."""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def parse(spec: str) -> dict[tuple[int, int], float]:
    out = {}
    for item in filter(None, spec.replace(" ", "").split(",")):
        item, _, factor = item.partition("*")
        rank, _, steps = item.partition(":")
        first, _, last = steps.partition("-")
        out.update(
            {
                (int(rank), step): float(factor or "nan")
                for step in range(int(first), int(last or first) + 1)
            }
        )
    return out


def install(faults: dict[tuple[int, int], float]) -> None:
    """Wrap the loop's `train_step` to know the step it runs and the engine's forward to scale
    that step's losses on the named ranks."""
    from launch.deepspeed.engine import Engine
    from launch.train import loop

    current = {}
    train_step, forward = loop.train_step, Engine.__call__

    def step_known(run, batches):
        current["key"] = (run.denv.rank, run.step + 1)
        return train_step(run, batches)

    def scaled(self, **batch):
        output = forward(self, **batch)
        factor = faults.get(current.get("key"))
        return output if factor is None else output._replace(loss=output.loss * factor)

    loop.train_step, Engine.__call__ = step_known, scaled


if __name__ == "__main__":
    from launch import distributed as dist
    from launch import launcher
    from launch.train.cli import main

    install(parse(os.environ.get("INJECT_LOSS", "")))
    launcher.die_with_parent()
    dist.run_rank(lambda: main(sys.argv[1:]))
