"""`python -m launch.train CONFIG [key=value ...] --dry-run`: what a run would be, and every reason
it would fail, in seconds.

The room: `checks.py` (the dry run and its checks; `python -m launch.preflight`), `data.py` (the
dataset), `figures.py` (batch, FLOPs, memory), `report.py` (what it found and prints). How it
works and why: docs/design.md#launchpreflight.
"""
