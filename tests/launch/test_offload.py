"""ZeRO-Offload of the optimizer (deepspeed.offload_optimizer, with offload_params under ZeRO-3):
DeepSpeed's CPU Adam in AdamW mode over our parameter groups (`launch.deepspeed.engine.cpu_adam`), torch's
AdamW only if its op cannot be built; 2 ranks under torchrun on CPU train and resume exactly.

DeepSpeed builds the CPU Adam op with the host's C++ compiler at its first use, 29 s on a quiet
2-core EPYC (45 s with the debug information DeepSpeed asks for), and caches it
(TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions): the first test here pays for that once per
machine."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo import ROOT
from trainruns import metrics, train

# absolute, on each logged loss; measured: 0, or 1 float32 ulp (4.8e-7) at one step
RESUME_TOLERANCE = 1e-5


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0},
    ]


def test_the_fallback_is_torch_adamw_over_the_same_groups_with_one_warning_line(
    monkeypatch, capsys
):
    from deepspeed.ops.adam import cpu_adam as deepspeed_cpu_adam

    from launch.deepspeed.engine import cpu_adam

    def no_compiler(self, *args, **kwargs):
        raise RuntimeError("simulated: no C++ compiler\nmore detail")

    monkeypatch.setattr(deepspeed_cpu_adam.CPUAdamBuilder, "load", no_compiler)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)] + [
        torch.nn.Parameter(torch.randn(4))
    ]
    optimizer = cpu_adam(_groups(params), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["lr"] == 1e-3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert (
        line.startswith("warning: DeepSpeed's CPU Adam op is unavailable")
        and "no C++ compiler" in line
    )


@pytest.mark.slow
def test_cpu_adam_takes_torch_adamws_steps_group_by_group():
    """AdamW mode: decoupled weight decay, each group's own; the same updates as torch's AdamW."""
    from launch.deepspeed.engine import cpu_adam

    torch.manual_seed(0)
    start = [torch.randn(8, 8), torch.randn(8), torch.randn(8, 8), torch.randn(8)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = cpu_adam(_groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer).__name__ == "DeepSpeedCPUAdam"
    torch_adamw = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for params, opt in ((ours, optimizer), (reference, torch_adamw)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            opt.step()
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=1e-6, rtol=0)
    assert not torch.equal(ours[0], start[0])
    # What was compiled: DeepSpeed's flags less -g (`build_cpu_adam_without_debug_info`).
    from torch.utils.cpp_extension import _get_build_directory

    ninja = (Path(_get_build_directory("cpu_adam", False)) / "build.ninja").read_text()
    (cflags,) = [line for line in ninja.splitlines() if line.startswith("cflags = ")]
    assert " -O3 " in cflags and " -g " not in f"{cflags} ", cflags


def test_cpu_adam_is_compiled_with_deepspeeds_flags_less_debug_info():
    from deepspeed.ops.adam import cpu_adam as deepspeed_cpu_adam

    from launch.deepspeed.patches import build_cpu_adam_without_debug_info

    build_cpu_adam_without_debug_info()
    build_cpu_adam_without_debug_info()  # idempotent: not wrapped twice
    builder = deepspeed_cpu_adam.CPUAdamBuilder
    theirs, ours = builder.cxx_args.deepspeeds(builder()), builder().cxx_args()
    # when DeepSpeed drops -g itself, this function can go
    assert "-g" in theirs and "-O3" in theirs
    assert ours == [arg for arg in theirs if arg != "-g"]
    assert not hasattr(builder.cxx_args.deepspeeds, "deepspeeds")


CPUINFO_PROBE = """
import subprocess, torch
from launch.deepspeed.engine import cpu_adam
starts = []
popen_init = subprocess.Popen.__init__
def counting(self, args, *rest, **kwargs):
    starts.append(" ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args))
    popen_init(self, args, *rest, **kwargs)
subprocess.Popen.__init__ = counting
for _ in range(2):
    optimizer = cpu_adam([{"params": [torch.nn.Parameter(torch.ones(4))], "weight_decay": 0.0}], lr=0.1, betas=(0.9, 0.95), eps=1e-8)
print(type(optimizer).__name__, sum("cpuinfo" in start for start in starts))
"""


@pytest.mark.slow
def test_cpu_adam_asks_py_cpuinfo_once_per_process():
    """py-cpuinfo starts a Python subprocess per question (~0.5 s); DeepSpeed asked it four
    times for each CPU Adam it built and constructed."""
    run = subprocess.run(
        [sys.executable, "-c", CPUINFO_PROBE],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split()[-2:] == ["DeepSpeedCPUAdam", "1"], run.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    "offload",
    [
        ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=true"],
        [
            "deepspeed.zero_stage=3",
            "deepspeed.offload_optimizer=true",
            "deepspeed.offload_params=true",
        ],
    ],
    ids=["zero2-offload_optimizer", "zero3-offload_optimizer-offload_params"],
)
def test_offload_trains_with_cpu_adam_and_resumes_exactly(tiny_dataset, tmp_path, offload):
    common = ["max_steps=10", "log_every=1", "eval_every=0", "checkpoint.every_steps=5", *offload]
    straight = tmp_path / "straight"
    runs = [train("tiny_gpt.yaml", tiny_dataset, straight, *common)]
    # The uninterrupted run's step-5 checkpoint resumed in another run_dir: the resume under test
    # with one job less than stopping a second run at step 5 (each job starts DeepSpeed on 2 ranks).
    stopped = tmp_path / "stopped"
    step_5 = straight / "checkpoints" / "step_00000005"
    runs.append(train("tiny_gpt.yaml", tiny_dataset, stopped, *common, f"resume={step_5}"))
    assert f"resumed from {step_5}" in runs[-1].stderr
    for run in runs:  # the optimizer DeepSpeed steps, as the trainer reports it
        assert "optimizer: DeepSpeedCPUAdam in DeepSpeed's DeepSpeedZeroOptimizer" in run.stderr
        assert (
            "states offloaded to CPU" in run.stderr
            and "warning: DeepSpeed's CPU Adam" not in run.stderr
        )
    expected = {r["step"]: r["train/loss"] for r in metrics(straight) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in metrics(stopped) if "train/loss" in r}
    print("\nstep  uninterrupted  resumed at step 5")
    for step in range(1, 11):
        print(f"{step:4d}  {expected[step]:.8f}     " + (f"{got[step]:.8f}" if step in got else ""))
    assert sorted(got) == list(range(6, 11))  # the resumed job trained steps 6-10, nothing again
    losses = [expected[step] for step in range(1, 11)]
    assert losses[-1] < 0.9 * losses[0], losses  # it trains
    assert [got[s] for s in range(6, 11)] == pytest.approx(losses[5:], abs=RESUME_TOLERANCE, rel=0)


CPUINFO = """processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu sse2 avx2 avx512f avx512bw amx_tile

processor\t: 1
vendor_id\t: GenuineIntel
model name\t: something else entirely
"""


def test_the_jit_cache_is_keyed_by_the_cpu_type():
    """DeepSpeed builds CPU Adam with -march=native: the cache folder differs for CPUs that differ
    in what that compiles for, even under one model name, and is the same for the same CPU."""
    from launch.deepspeed.patches import cpu_key, use_cpu_keyed_jit_cache

    key = cpu_key(CPUINFO)
    assert key.startswith("intel-r-xeon-r-platinum-8480-") and key == cpu_key(
        CPUINFO.replace("sse2 avx2", "avx2 sse2")
    )
    # the same model name, no AVX-512
    assert cpu_key(CPUINFO.replace(" avx512f avx512bw amx_tile", "")) != key
    assert cpu_key(CPUINFO.replace("model\t\t: 143", "model\t\t: 106")) != key
    # the first processor names it
    assert cpu_key(CPUINFO.replace("something else entirely", "other")) == key
    arm = "processor : 0\nFeatures : fp asimd sve\nCPU implementer : 0x41\nCPU part : 0xd40\n"
    assert cpu_key(arm) != cpu_key(arm.replace(" sve", ""))

    env = {}
    folder = use_cpu_keyed_jit_cache(env, CPUINFO)
    assert folder == env["TORCH_EXTENSIONS_DIR"] and folder.endswith(f"_{key}")
    assert use_cpu_keyed_jit_cache(env, CPUINFO) == folder  # idempotent: not nested twice
    assert (
        use_cpu_keyed_jit_cache({"TORCH_EXTENSIONS_DIR": "/shared/ext"}, CPUINFO)
        == f"/shared/ext/{os.path.basename(folder)}"
    )
    other = use_cpu_keyed_jit_cache({}, CPUINFO.replace(" amx_tile", ""))
    assert other != folder and os.path.dirname(other) == os.path.dirname(folder)


def test_cpu_adam_builds_into_this_cpus_folder(monkeypatch, tmp_path):
    """cpu_adam sets the folder before DeepSpeed builds, and torch's build directory for the op
    is inside it (the build itself is replaced by a failure here; the slow tests build for real)."""
    from deepspeed.ops.adam import cpu_adam as deepspeed_cpu_adam
    from torch.utils.cpp_extension import _get_build_directory

    from common.machine import cpu_key
    from launch.deepspeed.engine import cpu_adam

    seen = []

    def record_build_dir(self, *args, **kwargs):
        seen.append(_get_build_directory(self.name, False))
        raise RuntimeError("simulated: no C++ compiler")

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(deepspeed_cpu_adam.CPUAdamBuilder, "load", record_build_dir)
    cpu_adam(
        _groups([torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]),
        lr=1e-3,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    key = cpu_key(open("/proc/cpuinfo").read())
    (build_dir,) = seen
    assert os.path.dirname(os.path.dirname(build_dir)) == str(tmp_path)
    assert os.path.basename(os.path.dirname(build_dir)).endswith(f"_{key}")
