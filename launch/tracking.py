"""Run tracking: Weights & Biases on rank 0 only, and a progress line on rank 0's stderr.

One W&B run per job, not per rank (gpt-neox #198), whose id is kept in the checkpoint so
that a resumed or requeued job continues the same run (gpt-neox #902). Mode, project, entity
and group come from the config's `wandb.*` keys, else from W&B's own environment variables
(WANDB_MODE, WANDB_PROJECT, WANDB_ENTITY, WANDB_RUN_GROUP), else the defaults: offline, under
`RUN_DIR/wandb/` with no network, to upload later with `wandb sync` (the start line says how).
A W&B directory that cannot be written (a read-only mount, a full disk) stops the job at its
start in one line (`check_wandb_dir`), and in wandb.init the same way.
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
from dataclasses import dataclass, field
from pathlib import Path

from common.progress import interval, remaining


@dataclass
class WandbConfig:
    """Weights & Biases. A key set here wins over its environment variable, which wins over the
    default (`launch.tracking.wandb_settings`), so that `WANDB_MODE=online sbatch ...` works with
    the shipped configs, which leave these unset."""

    mode: str = ""  # online | offline | disabled; "" = $WANDB_MODE, else offline
    project: str = ""  # W&B project; "" = $WANDB_PROJECT, else pretrain-pipeline
    entity: str = ""  # W&B team or user; "" = $WANDB_ENTITY, else your default entity
    # W&B run group (a main job's stages share one); "" = $WANDB_RUN_GROUP, else none
    group: str = ""
    name: str = ""  # W&B run name; "" = the name of run_dir
    tags: list = field(default_factory=list)  # W&B run tags


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
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent.parent,
        )
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


# W&B's own names for its modes, as WANDB_MODE may spell them ("dryrun" and "run" are its older
# ones).
WANDB_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}
WANDB_SETTINGS = (
    ("mode", "WANDB_MODE", "offline"),
    ("project", "WANDB_PROJECT", "pretrain-pipeline"),
    ("entity", "WANDB_ENTITY", ""),
    ("group", "WANDB_RUN_GROUP", ""),
)


def wandb_settings(cfg, env=None) -> dict:
    """{setting: (value, where it came from)} for mode, project, entity and group: the config's
    key (`wandb.mode=...`), else the environment variable, else the default. A mode that W&B does
    not know, from either, is the user's error, in one line."""
    env = os.environ if env is None else env
    resolved = {}
    for key, variable, default in WANDB_SETTINGS:
        if getattr(cfg, key):
            resolved[key] = (getattr(cfg, key), f"wandb.{key}")
        elif env.get(variable):
            resolved[key] = (env[variable], variable)
        else:
            resolved[key] = (default, "default")
    mode, source = resolved["mode"]
    if mode not in WANDB_MODES:
        from common.configure import UserError

        raise UserError(f"{source}={mode}: W&B's mode is one of online, offline or disabled")
    resolved["mode"] = (WANDB_MODES[mode], source)
    return resolved


def wandb_problems(wandb: WandbConfig) -> list[str]:
    """`wandb.*`'s problem: the mode as the run would take it (the key, else WANDB_MODE) must be
    one W&B knows."""
    from common.configure import UserError

    try:
        wandb_settings(wandb)
        return []
    except UserError as err:
        return [str(err)]


def wandb_dir(run_dir: str | Path) -> Path:
    """Where W&B writes a run of `run_dir` (`wandb.init(dir=run_dir)`, which wins over
    WANDB_DIR): RUN_DIR/wandb, or RUN_DIR/.wandb where that exists, as W&B chooses."""
    run_dir = Path(run_dir)
    return run_dir / ".wandb" if (run_dir / ".wandb").exists() else run_dir / "wandb"


def wandb_storage(directory: Path):
    """W&B's directory full or unwritable (ENOSPC, EROFS, ...: common.storage) as one line that
    names it and the ways forward."""
    from common.storage import storage_errors

    off = "or turn W&B off with wandb.mode=disabled"
    return storage_errors(
        f"W&B's directory {directory}",
        directory,
        space=f"free some space there, choose a run_dir on another file system, {off}",
        access=f"make it writable, choose another run_dir (W&B writes in RUN_DIR/wandb), {off}",
    )


def check_wandb_dir(settings, run_dir: str | Path) -> Path | None:
    """W&B's directory of `run_dir` can be written (made, where it does not exist yet: its
    nearest existing parent can be written), unless `settings` (WandbConfig, resolved against
    the environment) turn W&B off; else one line, before anything is built. Trying is the only
    sure answer, as for run_dir (launch.preconditions.check_writable_dir), and nothing is left:
    the file tried is an unnamed temporary one. Returns the directory (None: W&B off)."""
    import tempfile

    from common.configure import UserError
    from common.storage import existing_ancestor

    if wandb_settings(settings)["mode"][0] == "disabled":
        return None
    directory = wandb_dir(run_dir)
    if directory.exists() and not directory.is_dir():
        raise UserError(
            f"W&B's directory {directory} is a file, not a directory; move it away, or turn W&B "
            "off with wandb.mode=disabled"
        )
    probe = existing_ancestor(directory)
    with wandb_storage(directory):
        try:
            with tempfile.TemporaryFile(dir=probe, prefix=".writable-"):
                pass
        except OSError as err:  # named by the directory, not by the file tried
            raise OSError(err.errno, err.strerror, str(probe)) from err
    return directory


def new_run_id() -> str:
    """A W&B-style run id: 8 lowercase letters and digits."""
    alphabet = string.ascii_lowercase + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(8))


class Tracker:
    """Logs metrics to W&B (when enabled) and a compact progress line, on rank 0 only."""

    def __init__(
        self,
        *,
        enabled: bool,
        settings,
        run_dir: str | Path,
        run_id: str,
        config: dict,
        summary: dict,
        start_step: int = 0,
    ):
        """`settings`: the config's WandbConfig, resolved against the environment here;
        `start_step`: the step this process starts from (a resume's), which its ETA counts from."""
        self.enabled = enabled
        self.run = None
        self.started = time.time()
        self.start_step = start_step
        self.saved: tuple[int, float] | None = None  # the last checkpoint's step and time
        if not enabled:
            return
        resolved = wandb_settings(settings)
        mode, source = resolved["mode"]
        if mode == "disabled":
            print(f"W&B: disabled ({source})", file=sys.stderr, flush=True)
            return
        import wandb

        os.environ.setdefault("WANDB_SILENT", "true")
        # checked at the start (check_wandb_dir); a disk that filled since is said the same way
        with wandb_storage(wandb_dir(run_dir)):
            self.run = wandb.init(
                project=resolved["project"][0],
                entity=resolved["entity"][0] or None,
                group=resolved["group"][0] or None,
                name=settings.name or Path(run_dir).name,
                tags=list(settings.tags) or None,
                id=run_id,
                resume="allow",
                dir=str(run_dir),
                mode=mode,
                config=config,
            )
        self.run.summary.update(summary)
        print(self.where(mode, source), file=sys.stderr, flush=True)

    def where(self, mode: str, source: str) -> str:
        """The start line: the online run's URL, or the offline run's directory and
        how to upload it."""
        group = f", group {self.run.group}" if self.run.group else ""
        if mode == "online":
            return (
                f"W&B: online run {self.run.url} (project "
                f"{self.run.project}{group}; mode from {source})"
            )
        files = Path(self.run.dir)  # RUN_DIR/wandb/offline-run-DATE-ID/files
        offline = files.parent if files.name == "files" else files
        return (
            f"W&B: offline run in {offline} (project {self.run.project}{group}; mode from "
            f"{source}); upload it with: wandb sync {offline}"
        )

    def log(self, metrics: dict, step: int) -> None:
        if self.run is not None:
            self.run.log(metrics, step=step)

    def checkpointed(self, step: int, at: float | None = None) -> None:
        """A checkpoint of `step` was completed (at `at`, default now), for the progress line."""
        self.saved = (step, time.time() if at is None else at)

    def progress(self, step: int, max_steps: int, metrics: dict) -> None:
        """One line on stderr: step, loss, rate, tokens/s, ..., the ETA to `max_steps` at this
        process's mean time per step so far (evaluation and checkpoints included),
        the last checkpoint."""
        if not self.enabled:
            return
        parts = [f"step {step}/{max_steps}"]
        for key, fmt in (
            ("train/loss", "loss {:.4f}"),
            ("train/loss_mean", "mean {:.4f}"),
            ("train/lr", "lr {:.2e}"),
            ("train/grad_norm", "gnorm {:.3f}"),
            ("perf/tokens_per_s", "{:.0f} tok/s"),
            ("perf/mfu", "mfu {:.2%}"),
            ("eval/loss", "eval {:.4f}"),
            ("eval/perplexity", "ppl {:.2f}"),
            ("eval/accuracy", "acc {:.3f}"),
        ):
            value = metrics.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(fmt.format(value))
        elapsed = time.time() - self.started
        parts.append(f"{elapsed:.0f}s")
        parts.append(
            "ETA "
            f"{interval(remaining(step - self.start_step, max_steps - self.start_step, elapsed))}"
        )
        if self.saved:
            parts.append(
                f"last ckpt step {self.saved[0]} at "
                f"{time.strftime('%H:%M:%S', time.localtime(self.saved[1]))}"
            )
        else:
            parts.append("last ckpt none yet")
        print(" | ".join(parts), file=sys.stderr, flush=True)

    def finish(self, summary: dict | None = None) -> None:
        if self.run is not None:
            if summary:
                self.run.summary.update(summary)
            self.run.finish()
            self.run = None
