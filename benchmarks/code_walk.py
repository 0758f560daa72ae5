"""How far one training step and one config travel through the code: the project files a walk
enters, and how often it returns to a file it had left.

    python benchmarks/code_walk.py [--data DIR] [--config configs/tiny_gpt.yaml] [key=value ...]

Trains a tiny model for 4 steps in one process (world 1) and traces, with `sys.settrace`, two
walks through the project's own modules (common/, pipeline/, model/, launch/):
- the config's: from `launch.train.cli.main`'s start to the first step (parsing, resolution,
  the data, the model, the engine, the run directory);
- the step's: the second pass of `fit`'s loop, from the second `train_step` to the third (the
  step, the guard, the throughput window, the log line, the checkpoint's cadence); the first
  builds state lazily, which a steady step does not.
A walk is the sequence of files control is in, a project frame at a time: "files entered" are the
distinct files, "returns" the moves into a file the walk had already left. Library frames
(torch, DeepSpeed) are transparent: a call through them into project code counts from the
project file that called. Run it in two checkouts for a before and after.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "pipeline", "model", "launch")


class Walk:
    """The sequence of project files that `sys.settrace` sees control in."""

    def __init__(self):
        self.files: list[str] = []
        self._names: dict[str, str | None] = {}  # co_filename -> project file or None

    def _project_file(self, frame) -> str | None:
        filename = frame.f_code.co_filename
        if filename not in self._names:
            try:
                relative = Path(filename).resolve().relative_to(ROOT)
                name = relative.as_posix() if relative.parts[0] in PACKAGES else None
            except ValueError:
                name = None
            self._names[filename] = name
        return self._names[filename]

    def _enter(self, name: str) -> None:
        if not self.files or self.files[-1] != name:
            self.files.append(name)

    def tracer(self, frame, event, arg):
        # Only project frames are followed: a library frame costs one dictionary lookup.
        if event == "call" and (name := self._project_file(frame)) is not None:
            self._enter(name)
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "return":  # back to the nearest project frame that called, through libraries
            caller = frame.f_back
            while caller is not None:
                if (name := self._project_file(caller)) is not None:
                    self._enter(name)
                    break
                caller = caller.f_back
        return self._local

    def figures(self) -> tuple[int, int, list[str]]:
        seen: set[str] = set()
        returns = 0
        for name in self.files:
            returns += name in seen
            seen.add(name)
        return len(seen), returns, sorted(seen)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="data/gettext-en-de")
    parser.add_argument("--config", default="configs/tiny_gpt.yaml")
    parser.add_argument("--run-dir", default="/tmp/code_walk_run")
    args, overrides = parser.parse_known_args(argv)
    sys.path.insert(0, str(ROOT))
    import shutil

    from launch.train import cli as train_cli
    from launch.train import loop

    shutil.rmtree(args.run_dir, ignore_errors=True)
    config_walk, step_walk = Walk(), Walk()
    calls = {"n": 0}
    train_step = loop.train_step

    def traced_step(run, batches):
        calls["n"] += 1
        if calls["n"] in (1, 3):
            sys.settrace(None)  # the config's walk ends at the first step, the step's at the third
        elif calls["n"] == 2:
            sys.settrace(step_walk.tracer)
        return train_step(run, batches)

    loop.train_step = traced_step
    cli = [
        args.config,
        f"data.data_dir={args.data}",
        f"run_dir={args.run_dir}",
        "max_steps=4",
        "eval_every=0",
        "log_every=1",
        "checkpoint.every_steps=0",
        "wandb.mode=disabled",
        "compile=false",
        *overrides,
    ]
    sys.settrace(config_walk.tracer)
    try:
        train_cli.main(cli)
    finally:
        sys.settrace(None)
        shutil.rmtree(args.run_dir, ignore_errors=True)
    for label, walk in (
        ("config (main -> first step)", config_walk),
        ("one step (fit's loop, once)", step_walk),
    ):
        entered, returns, files = walk.figures()
        print(f"{label}: {entered} files entered, {returns} returns to a file already left")
        print("  " + ", ".join(files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
