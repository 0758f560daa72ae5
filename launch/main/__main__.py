"""`python -m launch.main`: the main job (`launch.main.job.main`)."""

from launch.main.job import main
from common.configure import run_main

if __name__ == "__main__":
    run_main(main)
