"""Training tokens/s of the 2017-2019 block recipe against the modern one, pair by pair; prints figures, asserts nothing.

    python benchmarks/bench_recipes.py [--data DIR] [--nproc 2] [--steps 40] [--rounds 2]
                                       [--pairs gpt,bert,translation]

Pairs (configs of about the same parameter count, everything but the blocks the same):
    gpt          configs/small_gpt.yaml          against configs/llama_small.yaml
    bert         configs/small_bert.yaml         against configs/rotary_bert_small.yaml
    translation  configs/small_translation.yaml  against configs/modern_translation_small.yaml

Each round trains each config of a pair from scratch with `launch.train` under `torchrun`
(`--nproc` ranks, ZeRO and precision as the config says) for `--steps` optimizer steps, no
evaluation or checkpoints, alternating old, new, old, new... so that the machine's load falls on
both alike. A run's figure is the median of the trainer's own tokens/s log windows (every 10
steps; the first window, which holds start-up, left out); the table gives the median over rounds
and the ratio new / old. The runs' directories are temporary.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAIRS = {
    "gpt": ("small_gpt", "llama_small"),
    "bert": ("small_bert", "rotary_bert_small"),
    "translation": ("small_translation", "modern_translation_small"),
}


def tokens_per_s(config: str, data: Path, nproc: int, steps: int, work: Path) -> float:
    """One short run of `config`; the median tokens/s of its log windows after the first."""
    run_dir = work / f"{config}-{len(list(work.iterdir()))}"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "launch.train",
        str(ROOT / "configs" / f"{config}.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        f"max_steps={steps}",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "log_every=10",
        "wandb.mode=disabled",
    ]
    run = subprocess.run(
        cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    if run.returncode != 0:
        raise SystemExit(
            f"error: {config}: launch.train exited {run.returncode}: {run.stderr.strip()[-2000:]}"
        )
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    rates = [row["perf/tokens_per_s"] for row in rows if "perf/tokens_per_s" in row][1:]
    if not rates:
        raise SystemExit(
            f"error: {config}: no tokens/s windows after the first in {steps} steps (raise --steps)"
        )
    return statistics.median(rates)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "gettext-en-de")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument(
        "--steps", type=int, default=40, help="optimizer steps per run (default: %(default)s)"
    )
    parser.add_argument(
        "--rounds", type=int, default=2, help="runs of each config (default: %(default)s)"
    )
    parser.add_argument("--pairs", default="gpt,bert,translation")
    args = parser.parse_args(argv)
    pairs = [p for p in args.pairs.split(",") if p]
    unknown = [p for p in pairs if p not in PAIRS]
    if unknown:
        parser.error(f"--pairs: unknown {', '.join(unknown)} (known: {', '.join(PAIRS)})")
    if not (args.data / "manifest.json").is_file():
        print(
            f"error: --data {args.data}: no prepared dataset (make main, or python -m pipeline.prepare "
            f"configs/prepare_gettext_en_de.yaml)",
            file=sys.stderr,
        )
        return 2
    load = os.getloadavg()[0]
    print(
        f"{platform.machine()} {os.cpu_count()} cores, load average {load:.2f} at the start; {args.nproc} ranks, "
        f"{args.steps} steps per run, {args.rounds} rounds, alternating",
        flush=True,
    )
    table = []
    with tempfile.TemporaryDirectory(prefix="bench_recipes_") as tmp:
        work = Path(tmp)
        for pair in pairs:
            figures: dict[str, list[float]] = {config: [] for config in PAIRS[pair]}
            for round_ in range(args.rounds):
                for config in PAIRS[pair]:
                    figures[config].append(
                        tokens_per_s(config, args.data, args.nproc, args.steps, work)
                    )
                    print(
                        f"{pair} round {round_ + 1}: {config} {figures[config][-1]:,.0f} tokens/s",
                        flush=True,
                    )
            old, new = (statistics.median(figures[config]) for config in PAIRS[pair])
            table.append((pair, *PAIRS[pair], old, new))
    print(f"\nload average {os.getloadavg()[0]:.2f} at the end\n")
    print("| pair | 2017-2019 recipe | tokens/s | modern recipe | tokens/s | modern / old |")
    print("|---|---|---:|---|---:|---:|")
    for pair, old_cfg, new_cfg, old, new in table:
        print(f"| {pair} | {old_cfg} | {old:,.0f} | {new_cfg} | {new:,.0f} | {new / old:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
