"""What a rank's start pays for: DeepSpeed's Muon module, which every ZeRO engine imports, is loaded
with its torch.compile wrappers made at their first call (launch.deepspeed.engine)."""

import subprocess
import sys

from conftest import ROOT

PROBE = """
import sys, torch
from launch.deepspeed.engine import MUON_MODULE, load_muon_compiling_on_first_call
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
    run = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.splitlines()[-3:] == ["inductor loaded: False", "compiled at first call: True", "same as eager: True"]
