"""What a rank's start pays for: DeepSpeed's Muon module, which every ZeRO engine imports, is loaded
with its torch.compile wrappers made at their first call, and DeepSpeed's shared-memory all-reduce
op, which training never calls, is neither built nor loaded (launch.deepspeed.engine)."""

import os
import subprocess
import sys

from corpora import free_port
from repo import ROOT

PROBE = """
import sys, torch
from launch.deepspeed.patches import MUON_MODULE, load_muon_compiling_on_first_call
load_muon_compiling_on_first_call()
muon = sys.modules[MUON_MODULE]
from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam  # what DeepSpeed's checks import
assert issubclass(MuonWithAuxAdam, torch.optim.Optimizer)
print("inductor loaded:", any(name.startswith("torch._inductor.compile_fx") for name in sys.modules))
fn = muon.zeropower_via_newtonschulz5
torch.manual_seed(0)
g = torch.randn(6, 4)
with torch.compiler.set_stance("force_eager"):  # through torch.compile's wrapper, without compiling
    out = fn(g, steps=3)
compiled = [c.cell_contents for c in fn.__closure__ if hasattr(c.cell_contents, "_torchdynamo_orig_callable")]
print("compiled at first call:", len(compiled) == 1 and compiled[0]._torchdynamo_orig_callable is fn.__wrapped__)
print("same as eager:", torch.equal(out, fn.__wrapped__(g, steps=3)))
"""


def test_muon_is_loaded_without_inductor_and_compiles_at_its_first_call():
    run = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-3:] == [
        "inductor loaded: False",
        "compiled at first call: True",
        "same as eager: True",
    ]


SHM_PROBE = """
import torch
from launch.deepspeed.engine import Engine
import deepspeed.comm.comm as ds_comm
class Net(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x)
model = Net(4, 4)
config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 1}}
engine = Engine(model, torch.optim.AdamW(model.parameters(), lr=0.1), None, config)
loss = engine(x=torch.ones(1, 4)).sum()
engine.backward(loss)
engine.step()
print("shm op:", ds_comm.cdb.shm_comm_op)
"""


def test_a_rank_neither_builds_nor_loads_deepspeeds_shared_memory_op(tmp_path):
    """Training's collectives are torch.distributed's; DeepSpeed's shm all-reduce op serves
    tensor-parallel inference only, and its JIT build cost the first job of a fresh install ~35 s."""
    env = {
        **os.environ,
        "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops"),
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "OMP_NUM_THREADS": "1",
    }
    run = subprocess.run(
        [sys.executable, "-c", SHM_PROBE],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-1] == "shm op: None"
    assert not [p for p in (tmp_path / "ops").rglob("*") if "shm" in p.name], "the shm op was built"
