"""One job of tests/launch/test_optim.py: torch AdamW's kernels (`optim.implementation`) under
`launch.deepspeed.engine.Engine`, 2 ranks under torchrun, for several ZeRO stages and precisions
in one process.

    python -m torch.distributed.run --nproc_per_node 2 tests/launch/adamw_worker.py OUT 0-fp32,2-bf16,...

For each combination two engines are built from the same weights, one stepping each kernel of
KERNELS, and take one optimizer step on the same batch; rank 0 writes OUT/STAGE-PRECISION.json:
each kernel's loss, the largest change of a weight by the step, and, over what torch's AdamW
steps on every rank (DeepSpeed's flat fp32 partitions under ZeRO 1-3, the model's parameters
under ZeRO-0), the largest |difference| of the weights and of both moments, each with the
largest |value| it is relative to. ZeRO-3 runs last: building a ZeRO-3
engine replaces torch.nn.functional.linear for the rest of the process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import distributed  # noqa: E402
from launch.config import BatchPlan, TrainConfig  # noqa: E402
from launch.deepspeed.config import (
    DeepSpeedConfig,
    deepspeed_config,  # noqa: E402
)
from launch.deepspeed.engine import Engine  # noqa: E402
from launch.optim import build_optimizer, build_scheduler  # noqa: E402
from launch.optim_config import OptimConfig, ScheduleConfig
from model import ModelConfig, build_model  # noqa: E402
from pipeline.load.config import LoaderConfig  # noqa: E402

MODEL = ModelConfig(
    arch="gpt", vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16, dropout=0.0
)
KERNELS = ("for_loop", "fused")
MICRO = 2


def build(stage: int, precision: str, kernel: str) -> Engine:
    cfg = TrainConfig(
        max_steps=10,
        model=MODEL,
        data=LoaderConfig(micro_batch_size=MICRO),
        optim=OptimConfig(lr=1e-2, implementation=kernel),
        schedule=ScheduleConfig(warmup_steps=0),
        deepspeed=DeepSpeedConfig(
            zero_stage=stage, precision=precision, zero3_persistence_threshold=0
        ),
    )
    torch.manual_seed(0)
    model = build_model(MODEL)
    optimizer = build_optimizer(model, cfg.optim, skip_non_finite=stage == 0)
    return Engine(
        model,
        optimizer,
        build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
        deepspeed_config(cfg, BatchPlan(MICRO, 1, torch.distributed.get_world_size())),
    )


def full_state(engine: Engine) -> dict[str, list[torch.Tensor]]:
    """What torch's AdamW steps on this rank, with both moments, copied: DeepSpeed's flat fp32
    partitions (ZeRO 1-3; under ZeRO-0, the model's parameters)."""
    optimizer = engine._engine.basic_optimizer
    # ZeRO-3 hands AdamW each sub-group's flat partition for the step only.
    params = getattr(engine._engine.optimizer, "fp32_partitioned_groups_flat", None) or [
        p for group in optimizer.param_groups for p in group["params"]
    ]
    return {
        "weights": [p.detach().float().clone() for p in params],
        **{
            key: [
                optimizer.state[p][key].float().clone()
                if p in optimizer.state
                else torch.zeros(p.shape)
                for p in params
            ]
            for key in ("exp_avg", "exp_avg_sq")
        },
    }


def largest(values: list[float]) -> float:
    """The largest of `values` over every rank (each rank steps its own partitions)."""
    found = torch.tensor(max(values, default=0.0), dtype=torch.float64)
    torch.distributed.all_reduce(found, op=torch.distributed.ReduceOp.MAX)
    return float(found)


def main(out: Path, combos: list[str]) -> None:
    denv = distributed.read_env()
    distributed.set_threads(1, denv)
    distributed.init_process_group(denv, 120)
    generator = torch.Generator().manual_seed(100 + denv.rank)
    tokens = torch.randint(0, MODEL.vocab_size, (MICRO, MODEL.max_seq_len + 1), generator=generator)
    for combo in sorted(combos, key=lambda c: c.startswith("3-")):
        stage, precision = int(combo.split("-")[0]), combo.split("-")[1]
        states, losses, described = {}, {}, {}
        for kernel in KERNELS:
            engine = build(stage, precision, kernel)
            before = full_state(engine)["weights"]
            loss = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:]).loss
            engine.backward(loss)
            engine.step()
            losses[kernel], states[kernel], described[kernel] = (
                float(loss.detach()),
                full_state(engine),
                engine.describe(),
            )
            update = largest(
                [float((x - y).abs().max()) for x, y in zip(states[kernel]["weights"], before)]
            )
        a, b = (states[k] for k in KERNELS)
        result = {"losses": losses, "described": described, "update": update}
        for key in a:
            result[key] = {
                "diff": largest([float((x - y).abs().max()) for x, y in zip(a[key], b[key])]),
                "scale": largest([float(x.abs().max()) for x in a[key]]),
            }
        if denv.is_main:
            (out / f"{combo}.json").write_text(json.dumps(result))
        torch.distributed.barrier()
    distributed.destroy()


if __name__ == "__main__":
    # run_rank ends the process with os._exit, as every rank of ours: a plain exit let rank 1
    # abort in the native threads' teardown ("terminate called without an active exception",
    # SIGABRT after its last combination was written), seen in a fresh-clone run under 2 workers.
    distributed.run_rank(lambda: main(Path(sys.argv[1]), sys.argv[2].split(",")))
