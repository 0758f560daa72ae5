"""Where one training step makes the host wait for the device: `python tests/sync_worker.py
DATA_DIR RUN_DIR [key=value ...]` sets up a one-rank run of configs/tiny_gpt.yaml as
`launch.train` does, trains two steps, then watches `STEPS` more (`train_step` and the
gradient norm `fit` reads after it) and prints one JSON object on a line of its own, after "SYNC_EVENTS ".

Two ways of watching, by where it runs:
- on a GPU, torch's sync debug mode: every operation that waits for the device warns, and the
  warning names the Python line that called it;
- on a CPU, where nothing waits, the calls that would wait if the tensor lived on a GPU: a
  TorchFunctionMode sees every `.item()`, `.cpu()`, `.tolist()`, `float()`, `int()`,
  `bool()` of a tensor, and names the line that called it.
Each event is recorded with its call site (file:line, function) and whether the step's first
forward had begun (a wait before it stalls the device between two steps).
Used by tests/launch/test_gpu_path.py (CPU) and tests/benchmarks/test_gpu.py (`gpu`).
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
STEPS = 2
TORCH_DIR = str(Path(torch.__file__).parent)
HOST_READS = {
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.tolist,
    torch.Tensor.numpy,
    torch.Tensor.__float__,
    torch.Tensor.__int__,
    torch.Tensor.__bool__,
    torch.Tensor.__index__,
}


class Events:
    def __init__(self):
        self.rows: list[dict] = []
        self.step = -1
        self.forwarded = False

    def add(self, kind: str, filename: str, lineno: int, function: str) -> None:
        path = Path(filename)
        ours = path.is_relative_to(ROOT) and path.parts[len(ROOT.parts)] in (
            "launch",
            "model",
            "pipeline",
        )
        site = f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name}:{lineno}"
        self.rows.append(
            {
                "step": self.step,
                "kind": kind,
                "site": site,
                "function": function,
                "ours": ours,
                "before_forward": not self.forwarded,
            }
        )


class HostReads(TorchFunctionMode):
    """Records each host read of a tensor with the first caller outside torch."""

    def __init__(self, events: Events):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            frame = sys._getframe(1)
            while frame is not None and (
                frame.f_code.co_filename.startswith(TORCH_DIR)
                or frame.f_code.co_filename == __file__
            ):
                frame = frame.f_back
            if frame is not None:
                self.events.add(
                    "read", frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name
                )
        return func(*args, **(kwargs or {}))


def watch_syncs(data_dir: Path, run_dir: Path, *overrides: str, env: dict | None = None) -> dict:
    """Run this worker in a process of its own (as a rank is) and return what it printed."""
    import subprocess

    env = {**(os.environ if env is None else env), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    run = subprocess.run(
        [sys.executable, __file__, str(data_dir), str(run_dir), *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    (line,) = [line for line in run.stdout.splitlines() if line.startswith("SYNC_EVENTS ")]
    return json.loads(line.split(" ", 1)[1])


def main(argv: list[str]) -> int:
    data_dir, run_dir, *overrides = argv
    from common.configure import parse_cli
    from launch.config import TrainConfig
    from launch.train import loop as trainer

    # Steps 1-2 warm up (the loss's GEMM probe, allocations, cuBLAS handles); 3 to 2 + STEPS are
    # watched, each from the start of its train_step to the start of the next; the last step's
    # end of run (evaluation, logging, checkpoint) is not.
    cfg = parse_cli(
        TrainConfig,
        [
            str(ROOT / "configs/tiny_gpt.yaml"),
            f"data.data_dir={data_dir}",
            f"run_dir={run_dir}",
            "wandb.mode=disabled",
            "data.num_workers=0",
            f"max_steps={3 + STEPS}",
            "log_every=1000",
            "eval_every=0",
            "checkpoint.every_steps=0",
            *overrides,
        ],
        usage="sync_worker",
    )
    run = trainer.setup(cfg)
    cuda = run.engine.device.type == "cuda"
    events = Events()
    reads = HostReads(events)

    def mark_forward(module, args, kwargs):
        events.forwarded = True

    run.engine.module.register_forward_pre_hook(mark_forward, with_kwargs=True)

    def on_warning(message, category, filename, lineno, file=None, line=None):
        # "called a synchronizing CUDA operation"
        if events.step >= 0 and "synchroniz" in str(message):
            events.add("sync", filename, lineno, "")

    train_step, calls = trainer.train_step, [0]

    def watched_step(run_, batches):
        calls[0] += 1
        watching = 3 <= calls[0] < 3 + STEPS
        events.step, events.forwarded = (calls[0] - 3 if watching else -1), False
        if cuda:
            torch.cuda.set_sync_debug_mode("warn" if watching else 0)
        elif watching and not reads.inside:
            reads.__enter__()
            reads.inside = True
        elif not watching and reads.inside:
            reads.__exit__(None, None, None)
            reads.inside = False
        return train_step(run_, batches)

    reads.inside = False
    trainer.train_step = watched_step
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = on_warning
        trainer.fit(run)
    print(
        "SYNC_EVENTS "
        + json.dumps(
            {
                "device": run.engine.device.type,
                "world_size": run.denv.world_size,
                "grad_accum": run.plan.grad_accum,
                "steps": STEPS,
                "events": events.rows,
            }
        )
    )
    sys.stdout.flush()
    from launch import distributed as dist

    dist.destroy()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
