"""Scoring with lm-evaluation-harness, used as a library: `python -m launch.lm_eval checkpoint=DIR`.

The room: `command.py` (the command: inputs checked, model loaded, results written and logged),
`tasks.py` (the local tasks, built from a dataset's held-out split), `ours.py` (`OurLM`, our GPT
as an lm-eval model), `score.py` (lm-eval's evaluator over those tasks). Training runs the same
tasks every `lm_eval.every` steps (`launch.train.harness`). How the tasks are built and why:
docs/design.md#scoring-with-lm-evaluation-harness.
"""
