"""Did a refactor leave training unchanged? Fixed-seed losses of two git revisions, compared bitwise.

    python benchmarks/fixed_seed_losses.py --before REV [--after REV] [--steps 30]
        [--models gpt,bert,llama,translation] [--work DIR] [--data-per-revision]

Each revision (--before, and --after if given, in temporary git worktrees; else this checkout,
uncommitted changes included) trains tiny GPT, BERT, Llama-shaped GPT and Seq2Seq models from its
configs/tiny_*.yaml on one tiny dataset prepared by the after tree: 2 ranks, 2 micro batches
accumulated, evaluation every 10 steps, stopped after step 15 and resumed to --steps. Every figure
of metrics.jsonl but time and memory must be bitwise equal; exit 0 if so. --data-per-revision:
each revision prepares its own dataset (for a before that cannot read the after's), the two
compared byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The tests' helper modules (the tiny corpus, its prepare and the tiny shape), from this checkout
# for both revisions.
sys.path.insert(0, str(ROOT / "tests"))
from trainruns import TINY_SHAPE as SHAPE  # noqa: E402

STOP_AT = 15  # the first job's last step; the second resumes from its checkpoint

# Llama's blocks on the GPT (tests/launch/test_llama_train.py LLAMA).
LLAMA = [
    "model.positions=rope",
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.n_kv_heads=1",
    "model.bias=false",
    "model.tie_embeddings=false",
]
MODELS = {
    "gpt": ("tiny_gpt.yaml", []),
    "bert": ("tiny_bert.yaml", []),
    "llama": ("tiny_gpt.yaml", LLAMA),
    "translation": ("tiny_translation.yaml", []),
}
# Reported in the table; every other figure is compared too, but for those that measure time or
# memory.
FIELDS = {"loss": "train/loss", "lr": "train/lr", "grad norm": "train/grad_norm"}
EVAL_LOSS = "eval/loss"
IGNORED_PREFIXES = ("perf/", "memory/")


@dataclass
class Comparison:
    steps: list[int]  # steps logged by both runs
    unmatched_steps: list[int]  # steps logged by one run only
    max_diff: dict[str, float]  # FIELDS' names and "eval loss": the largest |after - before|
    evaluations: int  # steps with an eval loss in both
    first_diff: int | None  # the first step where any compared figure differs
    differing: list[str] = field(default_factory=list)  # every figure that differs somewhere
    one_sided: list[str] = field(default_factory=list)  # figures only one run logs (not a failure)

    @property
    def identical(self) -> bool:
        return not self.unmatched_steps and self.first_diff is None


def compare(before: list[dict], after: list[dict]) -> Comparison:
    """Two runs' metrics rows, step by step; a figure logged at a step by one run only differs."""
    rows_b, rows_a = {r["step"]: r for r in before}, {r["step"]: r for r in after}
    steps = sorted(rows_b.keys() & rows_a.keys())
    keys_b = {k for r in before for k in r if not k.startswith(IGNORED_PREFIXES)}
    keys_a = {k for r in after for k in r if not k.startswith(IGNORED_PREFIXES)}
    names = {**FIELDS, "eval loss": EVAL_LOSS}
    max_diff = dict.fromkeys(names, 0.0)
    first_diff, differing = None, set()
    for step in steps:
        for key in sorted((keys_b & keys_a) - {"step"}):
            b, a = rows_b[step].get(key), rows_a[step].get(key)
            if a == b or (a != a and b != b):  # NaN in both counts as equal
                continue
            differing.add(key)
            first_diff = step if first_diff is None else first_diff
            for name, metric in names.items():
                if key == metric:
                    gap = abs(a - b) if a is not None and b is not None else float("inf")
                    max_diff[name] = max(max_diff[name], gap)
    evaluations = sum(EVAL_LOSS in rows_b[s] and EVAL_LOSS in rows_a[s] for s in steps)
    return Comparison(
        steps=steps,
        unmatched_steps=sorted(rows_b.keys() ^ rows_a.keys()),
        max_diff=max_diff,
        evaluations=evaluations,
        first_diff=first_diff,
        differing=sorted(differing),
        one_sided=sorted(keys_b ^ keys_a),
    )


def table(model: str, result: Comparison) -> str:
    steps = result.steps
    span = f" ({steps[0]}-{steps[-1]})" if steps else ""
    lines = [
        f"== {model} ==",
        f"steps compared         {len(steps)}{span}",
        f"losses bitwise equal   {'no' if FIELDS['loss'] in result.differing else 'yes'}",
        f"all figures identical  {'yes' if result.identical else 'NO'}",
    ]
    for name, gap in result.max_diff.items():
        extra = f" ({result.evaluations} evaluations)" if name == "eval loss" else ""
        lines.append(f"max |diff| {name:<11} {gap:.3g}{extra}")
    lines.append(f"first differing step   {result.first_diff or 'none'}")
    if result.unmatched_steps:
        lines.append(f"steps in one run only  {result.unmatched_steps}")
    if result.differing:
        lines.append(f"figures that differ    {', '.join(result.differing)}")
    if result.one_sided:
        lines.append(f"logged by one only     {', '.join(result.one_sided)} (not compared)")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="a git revision")
    parser.add_argument("--after", default="", help="a git revision (default: this checkout)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--work", default="", help="runs, logs, dataset (default: a new temp dir)")
    parser.add_argument("--data-per-revision", action="store_true")
    args = parser.parse_args()
    models = args.models.split(",")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        parser.error(f"unknown --models {unknown}: known are {', '.join(MODELS)}")
    if args.steps <= STOP_AT:
        parser.error(f"--steps must be over {STOP_AT}, the step the first job stops at")
    work = Path(args.work or tempfile.mkdtemp(prefix="fixed-seed-losses-")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    print(f"work directory: {work}", flush=True)
    started, made, results = time.time(), [], {}
    try:
        trees = {"before": checkout(args.before, work / "trees" / "before", made)}
        trees["after"] = (
            checkout(args.after, work / "trees" / "after", made) if args.after else ROOT
        )
        for name, rev in (("before", args.before), ("after", args.after)):
            describe(name, trees[name], rev)
        corpus = write_corpus(work)
        data = dict.fromkeys(trees, work / "data" / "after")
        prepare(trees["after"], corpus, data["after"], work / "logs" / "prepare-after.log")
        if args.data_per_revision:
            data["before"] = work / "data" / "before"
            prepare(trees["before"], corpus, data["before"], work / "logs" / "prepare-before.log")
            differ = dataset_differences(data["before"], data["after"])
            print(f"the revisions' datasets: {differ or 'byte-identical'}", flush=True)
        for model in models:  # one training at a time
            for name, tree in trees.items():
                train(tree, model, args.steps, data[name], work / "runs" / name / model, work)
            results[model] = compare(*(read_rows(work / "runs" / n / model) for n in trees))
    finally:
        for tree in made:
            git("worktree", "remove", "--force", str(tree))
    print()
    print("\n\n".join(table(model, result) for model, result in results.items()))
    same = all(r.identical for r in results.values())
    print(f"\n{'all identical' if same else 'NOT identical'}; {time.time() - started:.0f} s")
    return 0 if same else 1


def git(*args: str, cwd: Path = ROOT) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def checkout(rev: str, path: Path, trees: list[Path]) -> Path:
    """`rev` in a new detached worktree at `path` (listed in `trees`, for removal)."""
    if path.exists():
        sys.exit(f"{path} exists: a worktree left by an earlier run? (git worktree remove {path})")
    git("worktree", "add", "--detach", str(path), git("rev-parse", "--verify", rev + "^{commit}"))
    trees.append(path)
    return path


def describe(name: str, tree: Path, rev: str) -> None:
    """One line: the commit a tree runs; exit if Python would import the project from elsewhere."""
    where = "a temporary worktree"
    if not rev:
        changed = git("status", "--porcelain", cwd=tree)
        where = "this checkout" + (", with uncommitted changes" if changed else ", clean")
    imported = subprocess.run(
        [sys.executable, "-c", "import launch; print(launch.__file__)"],
        cwd=tree,
        env=environment(tree),
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    if not Path(imported).is_relative_to(tree):
        sys.exit(f"{name}: Python imports launch from {imported}, not from {tree}")
    commit = git("rev-parse", "HEAD", cwd=tree)[:12]
    print(f"{name}: {rev or 'working tree'} = {commit}, {where} ({tree})", flush=True)


def environment(tree: Path) -> dict:
    """The venv's Python importing the project from `tree` (PYTHONPATH comes before the editable
    install's finder), one thread per rank, W&B off."""
    return {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}


def write_corpus(work: Path) -> Path:
    """The tests' tiny corpus (one owner: tests/corpora.py)."""
    from corpora import write_tiny_corpus

    (work / "corpus").mkdir(exist_ok=True)
    return write_tiny_corpus(work / "corpus")


def prepare(tree: Path, corpus: Path, out: Path, log: Path) -> None:
    """The tests' tiny dataset (causal_lm, mlm, translation) of `corpus`, by `tree`'s pipeline."""
    from corpora import prepare_args

    if out.exists():
        sys.exit(f"{out} exists: give a new --work directory")
    config = tree / "configs" / "prepare_gettext_en_de.yaml"
    args = prepare_args(corpus, out, **{"ray.num_workers": 2})
    run([sys.executable, "-m", "pipeline.prepare", str(config), *args], tree, log)


def dataset_differences(a: Path, b: Path) -> list[str]:
    """Files of two prepared datasets that differ, but for their configs (which name their
    directories) and the manifest's timing."""

    def contents(top: Path) -> dict[str, bytes]:
        files = {str(p.relative_to(top)): p.read_bytes() for p in top.rglob("*") if p.is_file()}
        files.pop("config.yaml", None)
        manifest = json.loads(files.pop("manifest.json"))
        manifest.pop("config", None)
        manifest.pop("seconds", None)
        return {**files, "manifest.json": json.dumps(manifest, sort_keys=True).encode()}

    ca, cb = contents(a), contents(b)
    return sorted(k for k in ca.keys() | cb.keys() if ca.get(k) != cb.get(k))


def train(tree: Path, model: str, steps: int, data: Path, run_dir: Path, work: Path) -> None:
    """Two 2-rank jobs of `tree`'s launch.train: steps 1-STOP_AT, then a resume to `steps`."""
    if run_dir.exists():
        sys.exit(f"{run_dir} exists: give a new --work directory")
    config, extra = MODELS[model]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    common = [
        *torchrun,
        *("-m", "launch.train", str(tree / "configs" / config)),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *SHAPE,
        *extra,
        f"max_steps={steps}",
        "grad_accum=2",
        "log_every=1",
        "eval_every=10",
        "eval_batches=2",
        "checkpoint.every_steps=0",  # a checkpoint where each job ends
        "threads_per_rank=1",
        "wandb.mode=disabled",
    ]
    name = run_dir.parent.name
    for leg, overrides in (("stop", [f"stop_after_steps={STOP_AT}"]), ("resume", [])):
        seconds = run([*common, *overrides], tree, work / "logs" / f"{name}-{model}-{leg}.log")
        print(f"{name:6s} {model:11s} {leg:6s} {seconds:5.1f} s", flush=True)
        if leg == "stop":
            latest = (run_dir / "checkpoints" / "latest").read_text().strip()
            if latest != f"step_{STOP_AT:08d}":
                sys.exit(f"{run_dir}: the stopped job's latest checkpoint is {latest}")


def run(command: list[str], tree: Path, log: Path) -> float:
    """`command` in `tree`, its output to `log`; its seconds, or exit with the log's tail."""
    log.parent.mkdir(parents=True, exist_ok=True)
    start = time.time()
    with open(log, "w") as out:
        code = subprocess.run(
            command, cwd=tree, env=environment(tree), stdout=out, stderr=subprocess.STDOUT
        ).returncode
    if code:
        sys.exit(f"failed ({code}): {' '.join(command)}\n{log.read_text()[-3000:]}")
    return time.time() - start


def read_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


if __name__ == "__main__":
    sys.exit(main())
