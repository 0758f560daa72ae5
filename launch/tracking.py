"""Run tracking: Weights & Biases on rank 0 only, and a progress line on rank 0's stderr.

One W&B run per job, not per rank (gpt-neox #198), whose id is kept in the checkpoint so
that a resumed or requeued job continues the same run (gpt-neox #902). The mode defaults to
offline: runs are written under `RUN_DIR/wandb/` with no network and can be uploaded later
with `wandb sync`.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import subprocess
import sys
import time
from pathlib import Path


def read_metrics_rows(run_dir: Path) -> list[dict]:
    """The rows of RUN_DIR/metrics.jsonl in file order; a line that does not parse (a job
    killed mid-write leaves a torn last line) is left out."""
    path = Path(run_dir) / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent.parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def new_run_id() -> str:
    """A W&B-style run id: 8 lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class Tracker:
    """Logs metrics to W&B (when enabled) and a compact progress line, on rank 0 only."""

    def __init__(self, *, enabled: bool, mode: str, project: str, entity: str, name: str, tags: list,
                 run_dir: str | Path, run_id: str, config: dict, summary: dict):
        self.enabled = enabled
        self.run = None
        self.started = time.time()
        if not enabled or mode == "disabled":
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        self.run = wandb.init(
            project=project, entity=entity or None, name=name or Path(run_dir).name, tags=list(tags) or None,
            id=run_id, resume="allow", dir=str(run_dir), mode=mode, config=config,
        )
        self.run.summary.update(summary)

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def progress(self, step: int, max_steps: int, metrics: dict) -> None:
        if not self.enabled:
            return
        parts = [f"step {step}/{max_steps}"]
        for key, fmt in (("train/loss", "loss {:.4f}"), ("train/lr", "lr {:.2e}"), ("train/grad_norm", "gnorm {:.3f}"),
                         ("perf/tokens_per_s", "{:.0f} tok/s"), ("perf/mfu", "mfu {:.2%}"),
                         ("eval/loss", "eval {:.4f}"), ("eval/perplexity", "ppl {:.2f}"), ("eval/accuracy", "acc {:.3f}")):
            value = metrics.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(fmt.format(value))
        parts.append(f"{time.time() - self.started:.0f}s")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def finish(self, summary: dict | None = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update(summary)
            self.run.finish()
            self.run = None
