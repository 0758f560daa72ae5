"""launch.train.reduce on 2 real gloo ranks: the gradients reduced in buckets during the last
backward equal the sum of the ranks' own, times the scale the reduced figures give; the figures
come back summed; an unused parameter and a tied one are reduced too; the earlier micro batches'
backwards start nothing."""

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from launch.train.reduce import BucketedReduction, applies


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.hidden = nn.Sequential(*(nn.Linear(8, 8) for _ in range(5)))
        self.unused = nn.Linear(3, 3)

    def forward(self, ids):
        x = self.hidden(self.embed(ids))
        return (x @ self.embed.weight.T).square().mean()  # the embedding twice: tied


def batches(rank: int, micro: int) -> torch.Tensor:
    return torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(10 * rank + micro))


def worker(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = Tied()
    # own gradients of both micro batches, every rank's, for the reference
    for micro in range(2):
        model(batches(rank, micro)).backward()
    local = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    reduction = BucketedReduction(model, bucket_mb=50 * 4 / 2**20)  # ~50 floats a bucket
    model(batches(rank, 0)).backward()  # not armed: accumulates, sends nothing
    assert all(handle is None for handle in reduction.handles)
    reduction.arm()
    model(batches(rank, 1)).backward()
    started = sum(handle is not None for handle in reduction.handles)
    figures = torch.tensor([1.0 + rank, 10.0 * rank, 3.0], dtype=torch.float64)
    summed = reduction.finish(figures, lambda f: 1.0 / f[2])
    reduced = {name: p.grad.clone() for name, p in model.named_parameters()}
    torch.save(
        {
            "local": local,
            "reduced": reduced,
            "summed": summed,
            "buckets": len(reduction.buckets),
            "started_in_backward": started,
        },
        f"{out}/rank{rank}.pt",
    )
    dist.destroy_process_group()


def test_bucketed_reduction_equals_the_sum_of_the_ranks_gradients_scaled(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    assert ranks[0]["buckets"] >= 4
    # every bucket went out while the backward ran but the last (the figures', in `finish`) and
    # the first (the unused layer's, which never reports in)
    assert ranks[0]["started_in_backward"] == ranks[0]["buckets"] - 2
    for out in ranks:
        assert out["summed"].tolist() == [3.0, 10.0, 6.0]
        for name, grad in out["reduced"].items():
            if name.startswith("unused"):
                assert torch.equal(grad, torch.zeros_like(grad)), name
                continue
            expected = (ranks[0]["local"][name] + ranks[1]["local"][name]) / 6.0
            torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-7, msg=name)
    assert all(
        torch.equal(ranks[0]["reduced"][n], ranks[1]["reduced"][n]) for n in ranks[0]["reduced"]
    )


@pytest.mark.parametrize(
    "stage, precision, world, offload, expected",
    [
        (0, "fp32", 2, False, True),
        (0, "fp32", 1, False, False),
        (0, "bf16", 2, False, True),  # autocast over fp32 weights
        (0, "fp16", 2, False, False),
        (1, "fp32", 2, False, False),
        (0, "fp32", 2, True, False),
    ],
)
def test_it_applies_to_zero0_with_fp32_gradients_on_more_than_one_rank(
    stage, precision, world, offload, expected
):
    assert applies(stage, precision, world, offload) is expected
