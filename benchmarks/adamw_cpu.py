"""Do torch AdamW's CPU kernels train alike under DeepSpeed? Per-step losses; prints figures, asserts nothing.

    python benchmarks/adamw_cpu.py [--data data/gettext-en-de] [--kernels for_loop,fused] [--seeds 1234]
                                   [--lrs 1e-3] [--steps 80] [--nproc 2] [--out /tmp/adamw_cpu]
                                   [--config CONFIG] [key=value ...]

Issue #30's question: torch's fused AdamW diverged in bench_train's compiled bf16 BERT small
(loss 9.66 against 6.46, 3fbd40d). Either the kernel misbehaves on DeepSpeed's flat fp32
partitions, or that run sits on the edge of instability and any rounding difference tips it.

1. Step check (one process, a world of 1): a DeepSpeed ZeRO-2 bf16 engine of the model is built
   twice from the same weights, one per kernel, and fed the same batches; after each step the
   largest difference of their fp32 master partitions is printed, then the second engine's
   weights and moments are set to the first's, so every step sets the kernels the same inputs.
   A defect shows as a difference of the order of the update (lr); rounding as one of float32's
   ulps of the weights.
2. Curves: `launch.train` (CONFIG with the overrides, `optim.implementation=KERNEL seed=S
   optim.lr=LR`) on `--nproc` ranks for each kernel, seed and lr, the train loss of every step
   side by side: a defect diverges whatever the seed and lr; an unstable run diverges for some
   seeds or lrs with either kernel.

3. Speed (`--speed-elements N`, default 4,846,080: one rank's ZeRO-2 partition of the 9.7 M
   translation model on 2 ranks): one thread, each kernel's `step()` on one flat fp32 tensor of
   N elements with weight decay and a small one without, as DeepSpeed's partitions are; the
   kernels alternate, 3 rounds of 20 steps, the median round.

CONFIG (default): configs/tiny_bert.yaml at bench_train's small shape (d_model 256, 4 layers,
d_ff 1024), bf16, compiled: the row that diverged. With `--config`, that config as it is (curves
only), e.g. the main job's small_gpt, small_bert and small_translation.
torch's default on a CPU is `for_loop` (its `foreach` kernels are for CUDA tensors).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = "configs/tiny_bert.yaml"
SHAPE = [
    "model.d_model=256",
    "model.n_layers=4",
    "model.n_heads=4",
    "model.d_ff=1024",
    "deepspeed.precision=bf16",
    "deepspeed.zero_stage=2",
    "compile=true",
]


def step_check(args: argparse.Namespace) -> None:
    """Part 1, in this process (world of 1, gloo)."""
    import copy
    import dataclasses

    import torch
    from bench_train import open_rank

    import launch.distributed as dist
    from launch.config import BatchPlan
    from launch.deepspeed.config import deepspeed_config
    from launch.deepspeed.engine import Engine
    from launch.optim import build_optimizer, build_scheduler
    from launch.train.setup import compile_model
    from model import build_model

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=os.environ.get("MASTER_PORT", "29517"),
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        LOCAL_WORLD_SIZE="1",
    )
    cfg, _, task, raw = open_rank(
        ROOT / CONFIG,
        [
            *SHAPE,
            f"data.data_dir={args.data}",
            f"max_steps={args.steps}",
            "data.num_workers=0",
            *args.overrides,
        ],
        args.check_steps,
    )
    batches = [task.model_inputs(batch) for batch in raw]
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.model)
    engines = {}
    for kernel in args.kernels.split(","):
        model = copy.deepcopy(initial).train()
        if cfg.compile:
            compile_model(model)
        optim = dataclasses.replace(cfg.optim, implementation=kernel)
        optimizer = build_optimizer(model, optim)
        engines[kernel] = Engine(
            model,
            optimizer,
            build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
            deepspeed_config(cfg, BatchPlan(cfg.data.micro_batch_size, 1, 1)),
        )
    names = list(engines)
    a, b = (engines[n]._engine.optimizer for n in names[:2])
    print(
        f"step check: {' vs '.join(names)}, one process, ZeRO-2 bf16{', compiled' if cfg.compile else ''}; after "
        f"each step the largest |difference| of the fp32 master weights, then {names[1]}'s weights and moments are "
        f"set to {names[0]}'s, so that every step compares the kernels on the same inputs"
    )
    for step, batch in enumerate(batches, 1):
        losses = {}
        for name, engine in engines.items():
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            losses[name] = float(loss.detach())
        diff = max(
            float((pa - pb).abs().max())
            for pa, pb in zip(a.single_partition_of_fp32_groups, b.single_partition_of_fp32_groups)
        )
        update = max(
            float(a.state[pa]["exp_avg"].abs().max()) for pa in a.single_partition_of_fp32_groups
        )
        print(
            f"  step {step:3d}: loss {' / '.join(f'{losses[n]:.4f}' for n in names)}; master weights differ by at most "
            f"{diff:.2e} (lr {engines[names[0]].lr:.2e}, largest |exp_avg| {update:.2e})",
            flush=True,
        )
        with torch.no_grad():  # the same state again
            for pa, pb in zip(a.single_partition_of_fp32_groups, b.single_partition_of_fp32_groups):
                pb.copy_(pa)
                for key in ("exp_avg", "exp_avg_sq"):
                    b.state[pb][key].copy_(a.state[pa][key])
            for qa, qb in zip(
                engines[names[0]].module.parameters(), engines[names[1]].module.parameters()
            ):
                qb.copy_(qa)
    dist.destroy()


def speed(args: argparse.Namespace) -> None:
    """Part 3: milliseconds per optimizer step of each kernel, alternating."""
    import statistics
    import time

    import torch

    torch.set_num_threads(1)
    kernels = args.kernels.split(",")
    optimizers = {}
    for kernel in kernels:
        params = [
            torch.zeros(args.speed_elements, requires_grad=True),
            torch.zeros(20_000, requires_grad=True),
        ]
        for p in params:
            p.grad = torch.randn_like(p)
        groups = [
            {"params": params[:1], "weight_decay": 0.1},
            {"params": params[1:], "weight_decay": 0.0},
        ]
        from launch.optim import adamw_kernels

        optimizers[kernel] = torch.optim.AdamW(groups, lr=1e-3, **adamw_kernels(kernel))
        optimizers[kernel].step()  # the moments allocated
    times = {kernel: [] for kernel in kernels}
    for _ in range(3):
        for kernel, optimizer in optimizers.items():
            start = time.perf_counter()
            for _ in range(20):
                optimizer.step()
            times[kernel].append((time.perf_counter() - start) / 20 * 1e3)
    print(
        f"speed, {args.speed_elements:,} + 20,000 fp32 elements, one thread: "
        + ", ".join(f"{k} {statistics.median(v):.2f} ms/step" for k, v in times.items()),
        flush=True,
    )


def curves(args: argparse.Namespace) -> None:
    """Part 2: launch.train runs, then the losses side by side."""
    runs = {}
    for seed in args.seeds.split(","):
        for lr in args.lrs.split(","):
            for kernel in args.kernels.split(","):
                name = f"seed {seed} lr {lr} {kernel}"
                run_dir = args.out / f"s{seed}-lr{lr}-{kernel}"
                shape = SHAPE if args.config == CONFIG else []
                command = [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    "--nproc_per_node",
                    str(args.nproc),
                    "-m",
                    "launch.train",
                    args.config,
                    *shape,
                    f"data.data_dir={args.data}",
                    f"run_dir={run_dir}",
                    f"max_steps={args.steps}",
                    "log_every=1",
                    "eval_every=0",
                    "checkpoint.every_steps=0",
                    "wandb.mode=disabled",
                    f"optim.implementation={kernel}",
                    f"seed={seed}",
                    *([] if lr == "config" else [f"optim.lr={lr}"]),
                    *args.overrides,
                ]
                proc = subprocess.run(
                    command,
                    cwd=ROOT,
                    capture_output=True,
                    text=True,
                    env={**os.environ, "PYTHONWARNINGS": "ignore"},
                )
                if proc.returncode != 0:
                    raise SystemExit(
                        f"error: {name} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
                    )
                losses = {}
                for line in (run_dir / "metrics.jsonl").read_text().splitlines():
                    record = json.loads(line)
                    if "train/loss" in record:
                        losses[record["step"]] = record["train/loss"]
                runs[name] = losses
                print(
                    f"{name}: loss at step 10 / 30 / {args.steps}: {losses.get(10, float('nan')):.4f} / "
                    f"{losses.get(30, float('nan')):.4f} / {losses[max(losses)]:.4f}",
                    flush=True,
                )
    names = list(runs)
    print("\n| step | " + " | ".join(names) + " |\n|---:|" + "---:|" * len(names))
    for step in sorted(set().union(*runs.values())):
        if step in (1, 2, 5) or step % 10 == 0:
            print(
                f"| {step} | "
                + " | ".join(f"{runs[n].get(step, float('nan')):.4f}" for n in names)
                + " |"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=ROOT / "data" / "gettext-en-de")
    parser.add_argument(
        "--kernels", default="for_loop,fused", help="optim.implementation values to compare"
    )
    parser.add_argument(
        "--config",
        default=CONFIG,
        help="the curves' config (default: %(default)s at the small shape)",
    )
    parser.add_argument("--seeds", default="1234")
    parser.add_argument("--lrs", default="config", help="optim.lr values; config: the config's own")
    parser.add_argument(
        "--steps",
        type=int,
        default=80,
        help="optimizer steps of each curve (the schedule's length)",
    )
    parser.add_argument(
        "--check-steps", type=int, default=10, help="steps of the step check; 0 skips it"
    )
    parser.add_argument("--no-curves", action="store_true")
    parser.add_argument(
        "--speed-elements", type=int, default=4_846_080, help="part 3's partition; 0 skips it"
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("/tmp/adamw_cpu"))
    parser.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides of the config, for every run"
    )
    args = parser.parse_args(argv)
    if not (args.data / "manifest.json").is_file():
        print(f"error: no prepared dataset at {args.data}", file=sys.stderr)
        return 2
    import torch

    cpu = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")
            ),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    print(f"machine: {cpu}, {os.cpu_count()} cores, torch {torch.__version__}")
    if args.speed_elements:
        speed(args)
    if args.check_steps and args.config == CONFIG:
        step_check(args)
    if not args.no_curves:
        curves(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
