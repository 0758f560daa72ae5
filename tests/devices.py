"""The devices the suite runs on, settled as conftest starts (it imports this first)."""

import os

import torch

# The suite runs on the CPU wherever it runs, so that its figures (exact loss equalities, gloo)
# mean the same on a GPU machine as in CI, and a 1-GPU machine can run its 2-rank jobs. CUDA is
# initialised here first, so the `gpu` tests of this process still see the GPUs; those that
# start processes of their own give them GPU_ENV, the environment as it was.
GPU_ENV = dict(os.environ)
HAS_CUDA = torch.cuda.is_available()
if HAS_CUDA:
    torch.cuda.init()
    # Counted now, while the GPUs are visible: torch caches the count once CUDA is initialised,
    # and counts again from CUDA_VISIBLE_DEVICES before (0 after the line below: every
    # get_device_properties, and inductor's device checks, would then fail "Invalid device id").
    assert torch.cuda.device_count() > 0
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    # Inductor compiles in this process, not in workers started with the GPUs hidden.
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
