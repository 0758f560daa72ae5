"""Loss curves of finished runs as PNG, from their `metrics.jsonl` (the same rows W&B gets).

`python -m launch.report out=OUT.png runs=[RUN_DIR,...]` plots any runs; `launch.main` calls
`plot_losses` for its report directory. Training loss is a line, validation loss markers on
the same colour, against tokens seen (runs of different batch sizes share an axis that way).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only: no display on a compute node
import matplotlib.pyplot as plt  # noqa: E402

from common.configure import UserError, parse_cli, run_main  # noqa: E402
from launch.config import ReportConfig  # noqa: E402
from launch.tracking import read_metrics_rows  # noqa: E402

USAGE = """usage: python -m launch.report [CONFIG.yaml] out=OUT.png runs=[RUN_DIR,...]

Training and validation loss of finished runs against tokens seen, as one PNG."""


def read_metrics(run_dir: Path) -> list[dict]:
    """The run's logged rows merged per step (training and evaluation rows of one step), by step."""
    if not (Path(run_dir) / "metrics.jsonl").is_file():
        raise UserError(f"no metrics.jsonl in {run_dir}")
    rows: dict[int, dict] = {}
    for row in read_metrics_rows(run_dir):
        rows.setdefault(row["step"], {}).update(row)
    return [rows[step] for step in sorted(rows)]


def _series(rows: list[dict], key: str) -> tuple[list[float], list[float]]:
    # Tokens seen at each step: logged with the training rows, carried to the eval rows.
    xs, ys, tokens = [], [], 0.0
    for row in rows:
        tokens = row.get("train/tokens_seen", tokens)
        if key in row:
            xs.append(tokens / 1e6)
            ys.append(row[key])
    return xs, ys


def plot_losses(runs: dict[str, Path], path: Path, title: str) -> Path:
    """One axes: each run's training loss (line) and validation loss (markers) by tokens seen."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for index, (name, run_dir) in enumerate(runs.items()):
        rows = read_metrics(run_dir)
        colour = f"C{index}"
        # The mean over each log line's window where the run logged it (a step's own loss swings
        # with the lengths it drew); runs from before it, the step's.
        train = "train/loss_mean" if any("train/loss_mean" in r for r in rows) else "train/loss"
        ax.plot(*_series(rows, train), color=colour, linewidth=1.2, label=f"{name} train")
        xs, ys = _series(rows, "eval/loss")
        if xs:
            ax.plot(
                xs,
                ys,
                color=colour,
                marker="o",
                linestyle="--",
                linewidth=0.8,
                label=f"{name} valid",
            )
    ax.set_xlabel("tokens seen (millions, all ranks)")
    ax.set_ylabel("loss (nats per target token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        ReportConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    if not cfg.runs:
        raise UserError("runs: name at least one run directory, e.g. runs=[runs/tiny_gpt]")
    out, run_dirs = Path(cfg.out), [Path(d) for d in cfg.runs]
    plot_losses({d.name: d for d in run_dirs}, out, "loss")
    print(out)
    return 0


if __name__ == "__main__":
    run_main(main)
