"""`python -m launch.main CONFIG.yaml [key.sub=value ...]`: the whole chain, stage by
stage, with a summary.

The room: `job.py` (main -> main_job -> the stages, each a subprocess; signals), `plan.py` (the
stages and the overrides each is given, the overall ETA), `preflight.py` (`--dry-run`),
`summary.py` (the results table and the report directory). How it works and why:
docs/design.md#launchmain.
"""
