"""One rank of tests/launch/test_reliability.py's uneven-shard test, under torchrun (gloo, CPU):

    torchrun --standalone --nproc_per_node 2 tests/launch/uneven_worker.py DATA_DIR OUT_DIR EPOCHS

Iterates the train split of DATA_DIR's packed shards for EPOCHS epochs through a `ShardLoader`
with 2 DataLoader workers, as the trainer does, and all-reduces after every batch, as a
training step does: a rank with a batch fewer than the others would leave them waiting in that
all-reduce at the epoch's end (the WebDataset hang), so this job only finishes if the ranks stay
in step. Each rank writes OUT_DIR/rank{R}.json: per epoch, the sample ids of its batches and the
batch count all-reduced over the ranks.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from launch.distributed import read_env, run_rank  # noqa: E402
from launch.launcher import die_with_parent  # noqa: E402
from pipeline.load.loader import ShardLoader  # noqa: E402
from pipeline.load.plan import LoaderPlan
from tests.shardtools import batch_ids  # noqa: E402

MICRO_BATCH, WORKERS, SEED = 4, 2, 5
# Short, so that ranks out of step fail the job with a timeout instead of hanging it.
COLLECTIVE_TIMEOUT_S = 60


def main(data_dir: str, out_dir: str, epochs: int) -> None:
    die_with_parent()  # a test that gives up on a hang kills torchrun; the ranks must not live on
    denv = read_env()
    dist.init_process_group(
        "gloo",
        rank=denv.rank,
        world_size=denv.world_size,
        timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
    )
    loader = ShardLoader(
        LoaderPlan(
            data_dir,
            "causal_lm",
            "train",
            micro_batch_size=MICRO_BATCH,
            rank=denv.rank,
            world_size=denv.world_size,
            num_workers=WORKERS,
            seed=SEED,
        )
    )
    report = []
    for epoch in range(epochs):
        ids, total = [], torch.zeros(1, dtype=torch.float64)
        for batch in loader:
            ids.append(batch_ids(batch))
            step = torch.ones(1, dtype=torch.float64)
            dist.all_reduce(step)  # every rank must reach this as often as every other
            total += step
        report.append(
            {
                "epoch": epoch,
                "loader_epoch": loader.epoch,
                "batches": ids,
                "len": len(loader),
                "all_reduced_batches": int(total.item()),
            }
        )
    dist.barrier()
    (Path(out_dir) / f"rank{denv.rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


if __name__ == "__main__":
    # os._exit: no gloo teardown abort
    run_rank(lambda: main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
