"""Evaluation on the valid split during training (`evaluate`): token-weighted loss, perplexity and
the task's own figures, the same number of forwards on every rank."""

from __future__ import annotations

import math

import torch

from launch import distributed as dist
from launch.stop import StopRequested, stoppable
from launch.train.state import Run


@torch.compiler.set_stance("force_eager")  # see compile_model: no eval graphs or their recompiles
@torch.no_grad()
def evaluate(run: Run) -> dict | None:
    """Token-weighted loss (and perplexity; masked-token accuracy for mlm) on the valid split.
    Every rank runs the same number of forwards, which ZeRO-3 needs, so the ranks agree after
    each batch read whether a stop request cut a rank's wait for it short: then None."""
    loader = run.data.valid
    if loader is None:
        return {}
    run.engine.train(False)
    loader.load_state_dict({**loader.state_dict(), "epoch": 0, "samples_consumed": 0})
    sums: dict[str, float] = {"loss": 0.0, "count": 0.0}
    batches = iter(loader)
    for _ in range(run.cfg.eval_batches or len(loader)):
        try:
            with stoppable():
                batch = next(batches, None)
            stopped = False
        except StopRequested:
            batch, stopped = None, True
        if dist.any_rank(stopped):
            run.engine.train(True)
            return None
        if batch is None:
            break
        inputs = run.task.model_inputs(batch, run.engine.device)
        output = run.engine(**inputs)
        n = int(run.task.target_mask(inputs).sum())
        sums["loss"] += float(output.loss) * n
        sums["count"] += n
        for key, value in (
            run.task.eval_sums(output, inputs) if run.task.eval_sums else {}
        ).items():
            sums[key] = sums.get(key, 0.0) + value
    run.engine.train(True)
    # Every rank runs the same number of batches, so every rank has the same keys in the same order.
    sums = dict(zip(sums, dist.all_reduce_sum(list(sums.values()))))
    loss = sums["loss"] / max(sums["count"], 1)
    metrics = {
        "eval/loss": loss,
        "eval/perplexity": math.exp(min(loss, 50.0)),
        "eval/tokens": sums["count"],
    }
    if run.task.eval_metrics:
        metrics.update(run.task.eval_metrics(sums))
    return metrics
