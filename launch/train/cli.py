"""`python -m launch.train CONFIG [key=value ...] [--dry-run ...]`: the command line, either the
dry run (`launch.preflight`) or a training job (`launch.train.loop.train`), the config resolved by
the one route both take (`launch.run_config.training_config`)."""

from __future__ import annotations

import sys

from common.configure import parse_cli, strip_launcher_args
from launch.config import TrainConfig
from launch.preflight import checks as preflight
from launch.train import loop

USAGE = """usage: python -m launch.train CONFIG.yaml [key.sub=value ...] \
[--dry-run [--world-size N] [--ranks-per-node N] [--json]]

--dry-run: what the run would be (batch, parameters, FLOPs, memory per GPU) and every reason it
would fail, each naming its key, in seconds; starts nothing, writes nothing; exit 2 if any
(launch.preflight). Exit status: 2 for a bad input (one `error:` line), 1 for a run that failed."""


def main(argv: list[str] | None = None) -> int:
    argv = strip_launcher_args(sys.argv[1:] if argv is None else argv)
    if "--dry-run" in argv:  # report the run and every problem; start nothing
        return preflight.main_dry_run([arg for arg in argv if arg != "--dry-run"])
    from launch.run_config import training_config

    loop.train(training_config(parse_cli(TrainConfig, argv, usage=USAGE), argv[1:]))
    return 0
