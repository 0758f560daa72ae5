"""`launch.train`'s set-up of a run, and no step: what the engine's optimizer would step with next.
Used by tests/launch/test_resume_changes.py on a run directory that holds a checkpoint, to read
the rate and the hyperparameters of the first step after a resume (metrics.jsonl logs each step's
rate for the step after it).

    python tests/launch/resume_worker.py CONFIG.yaml [key=value ...]

The last line of stdout is "OPTIMIZER " and a JSON object: the step set up from, the engine's rate
(`Engine.lr`) and each parameter group's lr, betas, eps and weight_decay.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.configure import parse_cli, run_main  # noqa: E402
from launch import distributed as dist  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.run_config import training_config  # noqa: E402
from launch.train.cli import USAGE  # noqa: E402
from launch.train.setup import setup  # noqa: E402


def main() -> None:
    argv = sys.argv[1:]
    run = setup(training_config(parse_cli(TrainConfig, argv, usage=USAGE), argv[1:]))
    try:
        groups = run.engine._engine.basic_optimizer.param_groups
        print(
            "OPTIMIZER "
            + json.dumps(
                {
                    "step": run.step,
                    "lr": run.engine.lr,
                    "groups": [
                        {
                            "lr": group["lr"],
                            "betas": list(group["betas"]),
                            "eps": group["eps"],
                            "weight_decay": group["weight_decay"],
                        }
                        for group in groups
                    ],
                }
            ),
            flush=True,
        )
    finally:
        for loader in (run.data.train, run.data.valid):
            if loader is not None:
                loader.close()
        run.tracker.finish()
        dist.destroy()


if __name__ == "__main__":
    run_main(main)
