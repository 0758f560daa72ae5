"""`python -m launch.train`: one rank of a training job (`launch.train.loop.main`)."""

from launch import distributed as dist
from launch.train.loop import main

if __name__ == "__main__":
    dist.die_with_parent()  # a rank whose launcher is killed must not train on unseen
    dist.run_rank(main)  # ends with os._exit: see run_rank
