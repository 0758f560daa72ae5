"""`python -m launch.lm_eval`: an exported GPT scored by lm-evaluation-harness (`launch.lm_eval.command.main`)."""

from launch.lm_eval.command import main
from common.configure import run_main

if __name__ == "__main__":
    run_main(main)
