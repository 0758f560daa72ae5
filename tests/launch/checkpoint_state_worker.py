"""A checkpoint saved through the trainer's own `Checkpointer` and read back through
`launch.checkpoint.restore.load_state`, on every rank of a torchrun job (test_checkpoint_state):
a real DeepSpeed engine (a tiny GPT under the ZeRO stage given) takes one step, the record is the
kind the trainer builds (every rank's random streams gathered), and a second engine, fresh, loads
it. Each rank writes OUT/rankN.json: the fields that differ between the state saved and the state
restored (none expected), whether the engine came back (weights and optimizer moments equal after one more step on
the same batch), and what the tracker's hook saw.

    python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        tests/launch/checkpoint_state_worker.py RUN_DIR OUT ZERO_STAGE
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from common.configure import config_to_dict  # noqa: E402
from launch import checkpoint as ckpt  # noqa: E402
from launch import distributed as dist  # noqa: E402
from launch.checkpoint.restore import load_state  # noqa: E402
from launch.checkpoint.save import Checkpointer, SaveTarget  # noqa: E402
from launch.checkpoint.state import CheckpointState, rng_state  # noqa: E402
from launch.config import BatchPlan, TrainConfig  # noqa: E402
from launch.deepspeed.config import (
    DeepSpeedConfig,
    deepspeed_config,  # noqa: E402
)
from launch.deepspeed.engine import Engine  # noqa: E402
from launch.optim import build_optimizer, build_scheduler  # noqa: E402
from launch.optim_config import OptimConfig
from model import ModelConfig, build_model  # noqa: E402
from pipeline.load.config import LoaderConfig  # noqa: E402


def same(a, b) -> bool:
    """Equal all the way down: tensors, numpy arrays, tuples (numpy's and Python's RNG states)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and np.array_equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same(x, y) for x, y in zip(a, b))
        )
    return type(a) is type(b) and a == b


def engine_for(cfg: TrainConfig, plan: BatchPlan) -> Engine:
    torch.manual_seed(0)
    model = build_model(cfg.model)
    optimizer = build_optimizer(model, cfg.optim)
    return Engine(
        model,
        optimizer,
        build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
        deepspeed_config(cfg, plan),
    )


def main(run_dir: Path, out: Path, stage: int) -> None:
    torch.set_num_threads(1)
    denv = dist.read_env()
    dist.init_process_group(denv, timeout_s=120)
    plan = BatchPlan(2, 1, denv.world_size)
    cfg = TrainConfig(
        max_steps=10,
        model=ModelConfig(
            arch="gpt", vocab_size=64, d_model=32, n_layers=2, n_heads=2, max_seq_len=16,
            dropout=0.0,
        ),
        data=LoaderConfig(micro_batch_size=2),
        run_dir=str(run_dir),
        optim=OptimConfig(lr=1e-2),
        deepspeed=DeepSpeedConfig(zero_stage=stage),
    )  # fmt: skip
    engine = engine_for(cfg, plan)
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(denv.rank))
    output = engine(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
    engine.backward(output.loss)
    engine.step()
    torch.manual_seed(1234 + denv.rank)  # every rank's streams its own
    np.random.seed(99 + denv.rank)
    state = CheckpointState(
        step=1,
        tokens_seen=64,
        loader={"version": 3, "epoch": 0, "samples_consumed": 4, "order": [3, 1, 2]},
        rng=dist.all_gather_object(rng_state()),
        config=config_to_dict(cfg),
        tokenizer_sha256="ab" * 32,
        wandb_run_id="run-1",
        world_size=denv.world_size,
        global_batch_size=plan.global_batch_size,
        micro_batch_size=plan.micro_batch_size,
        grad_accum=plan.grad_accum,
        guard={"skipped": 1, "history": [2.5, 2.25]},
        tokens_by_source={"web": 40, "books": 24},
        dataset={"manifest_sha256": "cd" * 32, "mixture": {"web": 0.6, "books": 0.4}},
        target_tokenizer_sha256="ef" * 32,
    )
    saved_steps = []
    n_parameters = sum(p.numel() for p in build_model(cfg.model).parameters())
    target = SaveTarget(str(run_dir), 2, n_parameters, stage, "fp32")
    checkpointer = Checkpointer(
        engine,
        target,
        denv,
        lambda: state,
        saved_steps.append,
        every_steps=1,
        stop_at=10,
        last_saved=0,
    )
    checkpointer.maybe_save(1)

    fresh = engine_for(dataclasses.replace(cfg, seed=7), plan)
    restored = load_state(fresh, target.root, ckpt.latest_tag(target.root))
    differing = [
        f.name
        for f in dataclasses.fields(CheckpointState)
        if not same(getattr(state, f.name), getattr(restored, f.name))
    ]
    # The engines: one more step on the same batch each, then their fp32 weights and AdamW moments
    # whole (`full_state`, a collective; ZeRO-2 links a parameter to its moments at a step).
    for each in (engine, fresh):
        output = each(input_ids=tokens[:, :-1], labels=tokens[:, 1:])
        each.backward(output.loss)
        each.step()
    listing = json.loads((target.root / ckpt.tag_for(1) / "client_state.json").read_text())
    report = {
        "fields": [f.name for f in dataclasses.fields(CheckpointState)],
        "differing": differing,
        "engine_back": same(engine.full_state(), fresh.full_state()),
        "listing_is_the_states": listing == json.loads(json.dumps(state.listing())),
        "hook_saw": saved_steps,
        "last_saved": checkpointer.last_saved,
        "intact": ckpt.verify(target.root / ckpt.tag_for(1)) is None,
    }
    (out / f"rank{denv.rank}.json").write_text(json.dumps(report))
    dist.destroy()


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]))
