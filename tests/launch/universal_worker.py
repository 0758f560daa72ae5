"""One side of tests/launch/test_universal.py: train a tiny GPT under `launch.deepspeed.engine.Engine` and save
(`save`, 2 ranks under torchrun), or load a checkpoint on another world size and take the
same next step (`load`, 1 rank), for several ZeRO stages and precisions in one process.

    python tests/launch/universal_worker.py save OUT 0-fp32,2-bf16,...
    python tests/launch/universal_worker.py load OUT 0-fp32,2-bf16,...

Every job sees the same global batches (GLOBAL_BATCH sequences per optimizer step, drawn from
the step number), split into micro batches of MICRO: 2 ranks x 1 micro batch or 1 rank x 2,
so one optimizer step is the same computation in both. Rank 0 writes OUT/STAGE-PRECISION/
saved.pt (the state right after the save) and next.pt (the loss and state after one more
step); a `load` job writes resumed.pt (the state right after loading) and resumed_next.pt.

ZeRO-3 combinations run last: building a ZeRO-3 engine replaces torch.nn.functional.linear
for the rest of the process (DeepSpeed's memory-efficient linear, partition_parameters.py),
which changes bf16 results of the engines built after it in the last bits.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch import checkpoint as ckpt  # noqa: E402
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
GLOBAL_BATCH, MICRO, STEPS = 4, 2, 3
TAG = ckpt.tag_for(STEPS)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(
        0, MODEL.vocab_size, (GLOBAL_BATCH, MODEL.max_seq_len + 1), generator=generator
    )
    return tokens[:, :-1], tokens[:, 1:]  # (B, T) inputs and the next tokens


def _as_a_new_process() -> None:
    """Forget DeepSpeed's module-level record that an engine used torch autocast (stage 0 in bf16,
    `launch.deepspeed.config`): once set, ZeRO engines built after it in the process reduce their
    linear layers' gradients in bf16, which a job of one engine never does."""
    from deepspeed.runtime import torch_autocast

    torch_autocast.TORCH_AUTOCAST_INITIALIZED = False
    torch_autocast.TORCH_AUTOCAST_DTYPE = None


def build(stage: int, precision: str, world_size: int, *, load_universal: bool = False) -> Engine:
    grad_accum = GLOBAL_BATCH // (MICRO * world_size)
    cfg = TrainConfig(
        max_steps=10,
        grad_accum=grad_accum,
        model=MODEL,
        data=LoaderConfig(micro_batch_size=MICRO),
        optim=OptimConfig(lr=1e-2),
        schedule=ScheduleConfig(warmup_steps=2),
        deepspeed=DeepSpeedConfig(
            zero_stage=stage, precision=precision, zero3_persistence_threshold=0
        ),
    )
    plan = BatchPlan(MICRO, grad_accum, world_size)
    _as_a_new_process()
    torch.manual_seed(0)
    model = build_model(MODEL)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps)
    return Engine(
        model, optimizer, scheduler, deepspeed_config(cfg, plan, load_universal=load_universal)
    )


def train_step(engine: Engine, step: int, rank: int, world_size: int) -> float:
    """One optimizer step on global batch `step`; the mean loss of its micro batches over all ranks."""
    inputs, labels = global_batch(step)
    grad_accum = GLOBAL_BATCH // (MICRO * world_size)
    total = torch.zeros(())
    for k in range(grad_accum):
        rows = slice((rank * grad_accum + k) * MICRO, (rank * grad_accum + k + 1) * MICRO)
        output = engine(input_ids=inputs[rows], labels=labels[rows])
        engine.backward(output.loss)
        engine.step()
        total += output.loss.detach().float()
    if world_size > 1:
        dist.all_reduce(total)
    return float(total) / (grad_accum * world_size)


def save(out: Path, stage: int, precision: str) -> None:
    rank, world_size = dist.get_rank(), dist.get_world_size()
    engine = build(stage, precision, world_size)
    losses = [train_step(engine, step, rank, world_size) for step in range(STEPS)]
    root = out / "checkpoints"
    engine.save(root, TAG, {"step": STEPS, "world_size": world_size})
    dist.barrier()
    if rank == 0:  # as launch.checkpoint.save's save_checkpoint does
        (root / TAG / "client_state.json").write_text(
            json.dumps({"step": STEPS, "world_size": world_size}) + "\n"
        )
    saved = engine.full_state()
    loss = train_step(engine, STEPS, rank, world_size)
    after = engine.full_state()
    if rank == 0:
        torch.save({**saved, "losses": losses}, out / "saved.pt")
        torch.save({**after, "loss": loss}, out / "next.pt")


def load(out: Path, stage: int, precision: str, root: Path, tag: str) -> None:
    engine = build(stage, precision, 1, load_universal=ckpt.is_universal(root, tag))
    client = engine.load(root, tag)
    resumed = engine.full_state()
    loss = train_step(engine, client["step"], 0, 1)
    torch.save({**resumed, "client": client}, out / "resumed.pt")
    torch.save({**engine.full_state(), "loss": loss}, out / "resumed_next.pt")


def main() -> None:
    torch.set_num_threads(1)
    distributed.init_process_group(distributed.read_env(), timeout_s=300)
    mode, out = sys.argv[1], Path(sys.argv[2])
    combos = sorted(sys.argv[3].split(","), key=lambda combo: combo.startswith("3-"))
    for combo in combos:
        stage, precision = combo.split("-")
        directory = out / combo
        if mode == "save":
            save(directory, int(stage), precision)
        else:  # load: the test has converted where needed and names the checkpoint to load
            root, tag = json.loads((directory / "load_from.json").read_text())
            load(directory, int(stage), precision, Path(root), tag)
    distributed.destroy()


if __name__ == "__main__":
    # run_rank ends the process with os._exit: a plain exit let a rank abort in gloo's teardown
    # ("terminate called without an active exception"), seen once in a fresh-clone run.
    distributed.run_rank(main)
