"""Batches of the streaming loader compared: UNEVEN, shard sizes that divide evenly among neither
ranks nor workers, and assert_same_batches, the same batches in the same order, tensor for tensor."""

import torch

UNEVEN = [1, 40, 7, 23, 3, 31, 12]  # 117 samples in 7 shards: not a multiple of 2 ranks x 2 workers


def assert_same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert torch.equal(x[key], y[key]), key
