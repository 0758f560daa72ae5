"""`python -m launch.train`: one rank of a training job (`launch.train.cli.main`)."""

from launch import distributed as dist
from launch import launcher
from launch.train.cli import main

if __name__ == "__main__":
    launcher.die_with_parent()  # a rank whose launcher is killed must not train on unseen
    dist.run_rank(main)  # ends with os._exit: see run_rank
