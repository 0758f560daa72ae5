"""`python -m launch.preflight`: the dry run's report (`launch.preflight.checks.main`)."""

from common.configure import run_main
from launch.preflight.checks import main

if __name__ == "__main__":
    run_main(main)
