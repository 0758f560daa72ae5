"""`python -m pipeline.prepare CONFIG.yaml [key.sub=value ...]`: see `pipeline.prepare.job`."""

from common.configure import run_main
from pipeline.prepare.job import main

run_main(main)
