"""`python -m launch.main`: the main job (`launch.main.job.main`)."""

from common.configure import run_main
from launch.main.job import main

if __name__ == "__main__":
    run_main(main)
