"""`python -m launch.lm_eval`: an exported GPT scored by lm-evaluation-harness
(`launch.lm_eval.command.main`)."""

from common.configure import run_main
from launch.lm_eval.command import main

if __name__ == "__main__":
    run_main(main)
