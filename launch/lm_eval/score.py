"""Run the local tasks on an lm-eval model with the library's own evaluator, and
flatten its results.

`lm_eval.evaluator.evaluate` (what `simple_evaluate` calls once it has a model and tasks) over a
TaskManager that indexes none of lm-eval's bundled tasks: only ours, given as configs, so
nothing is looked up or downloaded (the tests run with HF_DATASETS_OFFLINE=1).
"""

from __future__ import annotations

import contextlib
import logging
import math
import tempfile
from pathlib import Path

from launch.lm_eval.tasks import build_docs, write_task_configs


def score(
    lm,
    names: list[str],
    texts: list[str],
    *,
    limit: int = 0,
    seed: int = 1234,
    bootstrap_iters: int = 0,
    workdir: str | Path | None = None,
) -> dict:
    """lm-eval's results dict for tasks `names` built from `texts` (the first `limit` docs of
    each; 0 = all); the docs are written to `workdir` (default a temporary directory)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.tasks import TaskManager

    # its per-task INFO lines drown the table
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    # A continuation may take half the model's positions; lm-eval refuses one longer than all of
    # them.
    docs = build_docs(
        texts, seed, lambda continuation: len(lm.tok_encode(continuation)) <= lm.max_length // 2
    )
    with (
        tempfile.TemporaryDirectory()
        if workdir is None
        else contextlib.nullcontext(workdir) as directory
    ):
        configs = write_task_configs(names, docs, Path(directory))
        loaded = TaskManager(include_defaults=False).load(configs)
        return evaluate(
            lm=lm,
            task_dict=loaded,
            limit=limit or None,
            bootstrap_iters=bootstrap_iters,
            log_samples=False,
        )


def flat_metrics(results: dict, prefix: str = "lm_eval") -> dict[str, float]:
    """{"lm_eval/TASK/METRIC": value} of every scored metric (lm-eval's "acc,none" keys: the
    metric, then its filter; standard errors and non-numbers left out)."""
    flat = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, _ = key.partition(",")
            if "," in key and not metric.endswith("_stderr") and isinstance(value, (int, float)):
                flat[f"{prefix}/{task}/{metric}"] = (
                    float(value) if math.isfinite(value) else float("nan")
                )
    return flat


def table(results: dict) -> str:
    from lm_eval.utils import make_table

    return make_table(results)
