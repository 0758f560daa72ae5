"""The GPU check set: tests marked `gpu`, which run where CUDA is (tests/conftest.py skips them
elsewhere), and one CPU smoke run of benchmarks/bench_gpu.py, which runs everywhere.

The conftest hides the GPUs from every process the suite starts (CUDA_VISIBLE_DEVICES=""), after
initialising CUDA in this one: the `gpu` tests here use the GPU in-process, and those that start
processes (torchrun, the benchmark) hand them `GPU_ENV`, the environment as it was.

Shapes: configs/gpt2_small.yaml's blocks (d_model 768, 12 heads, d_ff 3072, sequence 1024) and
configs/bert_base.yaml's (sequence 512), with 2 layers and tests/shardtools' 4,096-piece
vocabulary, so that each test takes seconds. Model inputs are made as the trainer makes them:
`pipeline.load.loader.ShardLoader` batches (pinned on CUDA) through `Task.model_inputs` and
`Task.to_device`, which drops the all-ones attention mask of packed blocks on the host.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from devices import GPU_ENV
from repo import ROOT
from trainruns import TINY

from common.configure import load_config
from launch.config import TrainConfig
from launch.main.plan import python_launcher
from launch.optim import parameter_groups
from launch.tasks import TASKS
from model import ModelConfig, build_model
from pipeline.load.loader import ShardLoader
from pipeline.load.plan import LoaderPlan
from tests.shardtools import VOCAB_SIZE, make_dataset

gpu = pytest.mark.gpu
# fewer layers, the test data's vocabulary
SMALL = {"model.n_layers": 2, "model.vocab_size": VOCAB_SIZE}
ARCHS = {"gpt": ("gpt2_small.yaml", "causal_lm"), "bert": ("bert_base.yaml", "mlm")}


def run_config(arch: str, **overrides) -> TrainConfig:
    """configs/gpt2_small.yaml (gpt) or configs/bert_base.yaml (bert) with SMALL and `overrides`."""
    settings = {**SMALL, **overrides}
    return load_config(
        TrainConfig, ROOT / "configs" / ARCHS[arch][0], [f"{k}={v}" for k, v in settings.items()]
    )


def trainer_inputs(
    data_dir: Path, task: str, micro_batch_size: int, seq_len: int, count: int, device: torch.device
) -> list[dict]:
    """`count` micro batches of model inputs, on `device`, made the way launch.train makes them."""
    make_dataset(data_dir, packed=[micro_batch_size * count], seq_len=seq_len)
    loader = ShardLoader(
        LoaderPlan(
            str(data_dir),
            task,
            "train",
            micro_batch_size=micro_batch_size,
            pin_memory=device.type == "cuda",
        )
    )
    try:
        batches = list(loader)[:count]
    finally:
        loader.close()
    return [TASKS[task].to_device(TASKS[task].model_inputs(batch), device) for batch in batches]


def fresh_model(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(cfg).to(device=device, dtype=dtype).train()


# ----------------------------------------------------------------------------- bf16 training


def progression_inputs(
    task: str, rows: int, seq_len: int, vocab: int, device: torch.device, seed: int
) -> dict:
    """Packed blocks a model can learn in a few steps (each token is the previous one plus 1,
    from a random start, above the reserved ids), made into inputs by the trainer's task code."""
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (rows, 1), generator=generator)
    ids = 6 + (start + torch.arange(seq_len)) % (vocab - 6)  # (rows, seq_len)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    return TASKS[task].to_device(TASKS[task].model_inputs(batch), device)


def train_losses(
    model: torch.nn.Module, batches: list[dict], steps: int, bf16: bool, lr: float = 6e-4
) -> list[float]:
    """Losses of `steps` AdamW steps (gpt2_small.yaml's betas, weight decay and clipping, constant
    lr) from `model`'s weights, which are left untouched.

    bf16 as DeepSpeed's bf16 mode trains (`launch.deepspeed.config.deepspeed_config`: the module cast to
    bf16, no autocast): weights and activations in bf16, every op included (LayerNorm, softmax,
    the fused loss's bf16 path), against fp32 master weights that AdamW steps and that are
    rounded to bf16 after each step. Not torch.autocast, which keeps fp32 weights and runs
    LayerNorm and the loss in fp32, and so would not test what the trainer runs; not AdamW on
    bf16 weights, which would lose the updates smaller than a bf16 ulp that the masters keep."""
    master = copy.deepcopy(model).float()
    work = copy.deepcopy(master).to(torch.bfloat16) if bf16 else master
    pairs = list(zip(master.parameters(), work.parameters()))
    optimizer = torch.optim.AdamW(parameter_groups(master, 0.1), lr=lr, betas=(0.9, 0.95), eps=1e-8)
    losses = []
    for step in range(steps):
        loss = work(**batches[step % len(batches)]).loss
        loss.backward()
        losses.append(loss.detach().float())
        if bf16:
            for p32, p16 in pairs:
                p32.grad, p16.grad = p16.grad.float(), None
        torch.nn.utils.clip_grad_norm_(master.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if bf16:
            with torch.no_grad():
                for p32, p16 in pairs:
                    p16.copy_(p32)
    return torch.stack(losses).tolist()


@contextlib.contextmanager
def exact_fp32():
    """fp32 matmuls without TF32 (torch's default, made sure of) for an fp32 reference."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def gradient_agreement(model: torch.nn.Module, inputs: dict) -> tuple[float, dict[str, float]]:
    """How the gradients of one forward + backward in bf16 (as `train_losses` runs it) agree with
    fp32's from the same weights: the cosine of all of them together (in float64) and of each
    tensor. The attention's key bias is left out: its gradient is zero in exact arithmetic
    (softmax ignores what a query adds to all its scores), so both runs give only rounding noise."""
    grads = {}
    for bf16 in (False, True):
        work = copy.deepcopy(model).float()
        if bf16:
            work = work.to(torch.bfloat16)
        with contextlib.nullcontext() if bf16 else exact_fp32():
            work(**inputs).loss.backward()
        grads[bf16] = {
            name: p.grad.double().flatten()
            for name, p in work.named_parameters()
            if not name.endswith("attn.k_proj.bias")
        }

    def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
        return float(a @ b / (a.norm() * b.norm()))

    per_tensor = {name: cosine(grads[False][name], grads[True][name]) for name in grads[False]}
    whole = cosine(torch.cat(list(grads[False].values())), torch.cat(list(grads[True].values())))
    return whole, per_tensor


# Calibrated on the CPU (bf16 CPU kernels, the fused loss's CPU bf16 path) with these shapes at
# 2 rows: over 12 steps the two runs' losses differed by 0.011 nats at most while the loss fell by
# 2.60 (first pass over the 4 batches against the last); the first step's gradients had a cosine
# of 0.99992 overall and 0.981 for the worst tensor (a LayerNorm bias). The tolerances leave room
# for the GPU's other kernels (cuBLAS, flash attention); the fall, that a bf16 run which does not
# train cannot pass.
BF16_LOSS_ATOL = 0.08  # nats, at every step
BF16_GRAD_COSINE = 0.999  # all gradients together
BF16_GRAD_COSINE_TENSOR = 0.95  # each tensor
# nats: mean loss of the fp32 run's first pass over the batches less its last pass's
BF16_MIN_FALL = 1.0
PROGRESSION_BATCHES = 4


def check_bf16_follows_fp32(
    device: torch.device, rows: int, steps: int
) -> tuple[list[float], list[float]]:
    cfg = run_config("gpt").model
    batches = [
        progression_inputs("causal_lm", rows, cfg.max_seq_len, cfg.vocab_size, device, seed)
        for seed in range(PROGRESSION_BATCHES)
    ]
    model = fresh_model(cfg, device, torch.float32)
    with exact_fp32():
        fp32 = train_losses(model, batches, steps, bf16=False)
    bf16 = train_losses(model, batches, steps, bf16=True)
    return fp32, bf16


@gpu
def test_bf16_training_follows_fp32_on_gpt2_small_blocks():
    """gpt2_small blocks, 2 layers, 8 x 1024 tokens a step: 12 AdamW steps (3 passes over 4
    batches) from one init in fp32 and in DeepSpeed-style bf16 (see `train_losses`): the bf16
    losses stay within BF16_LOSS_ATOL of the fp32 ones at every step, and the fp32 loss falls by
    more than BF16_MIN_FALL from the first pass to the last."""
    fp32, bf16 = check_bf16_follows_fp32(
        torch.device("cuda"), rows=8, steps=3 * PROGRESSION_BATCHES
    )
    table = "\n".join(
        f"{step:3d} {a:.4f} {b:.4f} {b - a:+.4f}" for step, (a, b) in enumerate(zip(fp32, bf16))
    )
    print(f"\nstep fp32 bf16 diff\n{table}")
    assert all(map(math.isfinite, fp32 + bf16)), table
    first, last = fp32[:PROGRESSION_BATCHES], fp32[-PROGRESSION_BATCHES:]
    assert sum(first) / len(first) - sum(last) / len(last) > BF16_MIN_FALL, table
    assert max(abs(a - b) for a, b in zip(fp32, bf16)) < BF16_LOSS_ATOL, table


@gpu
def test_bf16_gradients_agree_with_fp32_on_gpt2_small_blocks():
    """One forward + backward of gpt2_small blocks (2 layers, 8 x 1024 tokens) from the same
    weights: bf16's gradients point where fp32's do, all together and tensor by tensor (the
    attention, the MLP, the norms, and through the fused loss the tied embedding)."""
    cfg = run_config("gpt").model
    device = torch.device("cuda")
    inputs = progression_inputs("causal_lm", 8, cfg.max_seq_len, cfg.vocab_size, device, 0)
    whole, per_tensor = gradient_agreement(fresh_model(cfg, device, torch.float32), inputs)
    worst = sorted(per_tensor.items(), key=lambda item: item[1])[:5]
    print(f"\ncosine, all gradients: {whole:.6f}; worst tensors: {worst}")
    assert whole > BF16_GRAD_COSINE, (whole, worst)
    assert worst[0][1] > BF16_GRAD_COSINE_TENSOR, (whole, worst)


# ----------------------------------------------------------------------------- attention kernels

# The aten ops behind F.scaled_dot_product_attention, by backend (forward and backward alike;
# the CPU's flash op is `_scaled_dot_product_flash_attention_for_cpu`).
SDPA_OPS = {
    "flash": "aten::_scaled_dot_product_flash_attention",
    "efficient": "aten::_scaled_dot_product_efficient_attention",
    "cudnn": "aten::_scaled_dot_product_cudnn_attention",
    "math": "aten::_scaled_dot_product_attention_math",
}


def sdpa_backends(step) -> tuple[set[str], list[str]]:
    """(the SDPA backends `step()` ran, the names of its attention kernels), from the profiler."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    names = {event.key for event in prof.key_averages()}
    used = {
        backend for backend, op in SDPA_OPS.items() if any(name.startswith(op) for name in names)
    }
    kernels = sorted(
        name
        for name in names
        if not name.startswith("aten::") and re.search(r"flash|fmha|attention", name, re.I)
    )
    return used, kernels


def attention_backends(
    arch: str, inputs: list[dict], device: torch.device, dtype: torch.dtype
) -> dict:
    """The SDPA backends of a forward + backward on `inputs`: as torch picks them, and with only
    flash and memory-efficient attention allowed (`sdpa_kernel` raises if neither can run)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = fresh_model(run_config(arch).model, device, dtype)

    def step():
        model(**inputs[0]).loss.backward()

    step()  # warm-up: kernels, the allocator
    default, kernels = sdpa_backends(step)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
        fused, _ = sdpa_backends(step)
    return {"default": default, "fused_only": fused, "kernels": kernels}


@gpu
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_packed_batches_run_fused_attention_not_math(arch, tmp_path):
    """Packed GPT (causal) and BERT (bidirectional) batches, bf16, inputs as the trainer gives
    them (no mask: dropped on the host): attention runs a fused kernel, never the math path,
    both as torch picks it and with only flash / memory-efficient allowed."""
    _, task = ARCHS[arch]
    seq_len = run_config(arch).model.max_seq_len
    inputs = trainer_inputs(tmp_path, task, 4, seq_len, 1, torch.device("cuda"))
    assert "attention_mask" not in inputs[0], (
        "Task.to_device kept the all-ones mask of a packed batch"
    )
    found = attention_backends(arch, inputs, torch.device("cuda"), torch.bfloat16)
    print(f"\n{arch}: {found}")
    assert found["default"] and found["default"] <= {"flash", "efficient", "cudnn"}, found
    assert found["fused_only"] and found["fused_only"] <= {"flash", "efficient"}, found


@gpu
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_padded_batches_run_memory_efficient_attention_not_math(arch):
    """A batch with padding keeps its mask (a (B, 1, T, S) boolean SDPA mask), which flash
    attention does not take: it must run memory-efficient attention, not the math path."""
    _, task = ARCHS[arch]
    cfg = run_config(arch).model
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(6, cfg.vocab_size, (4, cfg.max_seq_len), generator=generator)
    mask = torch.ones_like(ids)
    mask[1, -100:] = mask[3, -7:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if task == "mlm":
        masked = (torch.rand(ids.shape, generator=generator) < 0.15) & (mask == 1)
        batch.update(original_ids=ids, masked_positions=masked)
    inputs = TASKS[task].to_device(TASKS[task].model_inputs(batch), torch.device("cuda"))
    assert "attention_mask" in inputs
    found = attention_backends(arch, [inputs], torch.device("cuda"), torch.bfloat16)
    print(f"\n{arch}: {found}")
    assert "math" not in found["default"] and found["default"], found
    assert found["fused_only"] == {"efficient"}, found


# ----------------------------------------------------------------------------- host-device syncs


def forward_backward_without_sync(arch: str, inputs: list[dict], dtype: torch.dtype) -> None:
    """A forward + backward on the GPU under `torch.cuda.set_sync_debug_mode("error")`, after an
    unchecked one (the first call's one-off work: the loss's GEMM probe, cuBLAS handles)."""
    model = fresh_model(run_config(arch).model, torch.device("cuda"), dtype)
    model(**inputs[0]).loss.backward()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(**inputs[1]).loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()


@gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_forward_backward_does_not_wait_for_the_device(arch, dtype, tmp_path):
    """GPT and BERT on trainer-made inputs (after Task.to_device: no mask, BERT's scored positions
    found on the host): nothing in the model's forward or backward, the fused LM loss and BERT's
    scored-position head included, makes the host wait for the GPU (a sync raises here)."""
    _, task = ARCHS[arch]
    seq_len = run_config(arch).model.max_seq_len
    inputs = trainer_inputs(tmp_path, task, 4, seq_len, 2, torch.device("cuda"))
    forward_backward_without_sync(arch, inputs, dtype)


@gpu
def test_a_training_step_does_not_wait_for_the_device_in_our_code(tiny_dataset, tmp_path):
    """launch.train's step on one GPU, bf16, ZeRO-1, grad_accum 2 (tests/sync_worker.py under
    torch's sync debug mode): no line of launch/, model/ or pipeline/ makes the host wait for
    the device, from one step's first micro batch to the next's (the figures come back through
    `HostCopy`, queued before the last backward; the gradient norm is read at log lines only),
    and nothing at all waits before a step's first forward. DeepSpeed's own waits (its overflow
    check of the gradient norm) are counted and printed."""
    from sync_worker import watch_syncs

    found = watch_syncs(
        tiny_dataset,
        tmp_path / "run",
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.d_ff=64",
        "model.max_seq_len=64",
        "data.micro_batch_size=4",
        "grad_accum=2",
        "deepspeed.precision=bf16",
        "deepspeed.zero_stage=1",
        env=GPU_ENV,
    )
    assert found["device"] == "cuda"
    syncs = [e for e in found["events"] if e["kind"] == "sync"]
    others = sorted({e["site"] for e in syncs if not e["ours"]})
    print(
        f"\nsyncs per step: ours {sum(e['ours'] for e in syncs) / found['steps']:g}, others "
        f"{sum(not e['ours'] for e in syncs) / found['steps']:g} at {others}"
    )
    assert not [e for e in syncs if e["ours"]], syncs
    assert not [e for e in syncs if e["before_forward"]], syncs


# ----------------------------------------------------------------------------- pinned batches


@gpu
@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("task", ["causal_lm", "mlm"])
def test_loader_pins_its_batches(task, num_workers, tmp_path):
    """A ShardLoader planned with pin_memory=True (launch.train on CUDA) yields page-locked
    tensors (whose copy to the GPU is asynchronous), with and without workers; without it, none."""
    make_dataset(tmp_path, packed=[16], seq_len=64)
    for pin in (True, False):
        loader = ShardLoader(
            LoaderPlan(
                str(tmp_path),
                task,
                "train",
                micro_batch_size=4,
                num_workers=num_workers,
                pin_memory=pin,
            )
        )
        try:
            batches = list(loader)
        finally:
            loader.close()
        assert len(batches) == 4
        pinned = {key: value.is_pinned() for batch in batches for key, value in batch.items()}
        assert set(pinned.values()) == {pin}, (pin, pinned)


@gpu
@pytest.mark.parametrize("task", ["causal_lm", "mlm"])
def test_every_tensor_the_trainer_copies_to_the_gpu_is_pinned(task, tmp_path):
    """What launch.train.step.train_step copies with non_blocking=True (`Task.to_device` of
    `Task.model_inputs` of a pinned loader batch) is page-locked, so no copy waits: the labels
    (and BERT's scored_index), made on the host after the loader pinned the batch, are pinned
    by to_device. Every host-to-device `Tensor.to` is watched through a TorchFunctionMode."""
    from torch.overrides import TorchFunctionMode

    sources: list[bool] = []

    class WatchCopies(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if (
                func is torch.Tensor.to
                and isinstance(out, torch.Tensor)
                and out.is_cuda
                and not args[0].is_cuda
            ):
                sources.append(args[0].is_pinned())
            return out

    make_dataset(tmp_path, packed=[8], seq_len=64)
    loader = ShardLoader(
        LoaderPlan(str(tmp_path), task, "train", micro_batch_size=4, pin_memory=True)
    )
    try:
        batch = next(iter(loader))
    finally:
        loader.close()
    inputs = TASKS[task].model_inputs(batch)
    with WatchCopies():
        moved = TASKS[task].to_device(inputs, torch.device("cuda"))
    assert len(sources) == len(moved) and all(sources), sources


# ----------------------------------------------------------------------------- the trainer on GPUs

# tests/trainruns.py's TINY, for processes that see the GPUs (later settings win).
TINY_RUN = [*TINY, "eval_batches=2", "deepspeed.precision=bf16", "log_every=1"]


def train_on_gpus(
    data: Path, run_dir: Path, *overrides: str, nproc: int
) -> subprocess.CompletedProcess:
    env = {**GPU_ENV, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    command = [
        *python_launcher(nproc),
        "-m",
        "launch.train",
        str(ROOT / "configs/tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *TINY_RUN,
        *overrides,
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def metric_rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@gpu
@pytest.mark.slow
def test_trainer_runs_on_one_gpu_in_bf16(tiny_dataset, tmp_path):
    """launch.train on one GPU, bf16, ZeRO-1 (gpt2_small.yaml's settings, tiny model): it trains
    on the GPU (GPU memory is logged, the peak is the GPU's), with finite losses and evaluation."""
    run_dir = tmp_path / "run"
    run = train_on_gpus(
        tiny_dataset,
        run_dir,
        "deepspeed.zero_stage=1",
        "max_steps=6",
        "eval_every=6",
        "checkpoint.every_steps=0",
        nproc=1,
    )
    assert "measured: CPU" not in run.stderr
    assert "optimizer: AdamW (fused kernel) in DeepSpeed's BF16_Optimizer" in run.stderr, (
        run.stderr[-3000:]
    )
    rows = metric_rows(run_dir)
    losses = [row["train/loss"] for row in rows if "train/loss" in row]
    assert len(losses) == 6 and all(map(math.isfinite, losses)), losses
    assert all(row["memory/gpu_max_allocated_mb"] > 0 for row in rows if "train/loss" in row)
    assert math.isfinite(rows[-1]["eval/loss"])


@gpu
def test_adamw_on_a_gpu_is_the_fused_kernel_and_follows_foreach():
    """`launch.optim.build_optimizer` asks for torch's fused AdamW on a GPU while the parameters
    are still on the CPU (DeepSpeed moves the model after): once moved, its steps run the fused
    kernel (state on the GPU) and follow the multi-tensor `foreach` kernels within float32 rounding."""
    from launch.optim import build_optimizer
    from launch.optim_config import OptimConfig

    cfg = run_config("gpt", **{"model.max_seq_len": 128}).model
    torch.manual_seed(0)
    fused_model = build_model(cfg).train()
    foreach_model = copy.deepcopy(fused_model).cuda()
    optim = OptimConfig(lr=3e-3, weight_decay=0.1)
    fused = build_optimizer(fused_model, optim)
    fused_model.cuda()  # in place, as DeepSpeed moves it: the optimizer keeps the same parameters
    foreach = torch.optim.AdamW(
        parameter_groups(foreach_model, optim.weight_decay),
        lr=optim.lr,
        betas=(optim.beta1, optim.beta2),
        eps=optim.eps,
        foreach=True,
    )
    assert all(group["fused"] for group in fused.param_groups)
    inputs = progression_inputs("causal_lm", 4, 128, cfg.vocab_size, torch.device("cuda"), seed=0)
    losses = []
    for _ in range(5):
        for model, optimizer in ((fused_model, fused), (foreach_model, foreach)):
            optimizer.zero_grad()
            loss = model(**inputs).loss
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    assert all(state["step"].device.type == "cuda" for state in fused.state.values())
    assert losses[-2] < losses[0], losses  # it learns
    assert all(abs(a - b) < 1e-4 for a, b in zip(losses[::2], losses[1::2])), losses
    for (name, a), b in zip(fused_model.named_parameters(), foreach_model.parameters()):
        # softmax ignores it: a gradient of rounding noise, which Adam scales up
        if name.endswith("k_proj.bias"):
            continue
        assert torch.allclose(a, b, rtol=0, atol=5e-5), (name, (a - b).abs().max().item())


@gpu
def test_tf32_setting_decides_how_float32_gemms_run():
    """`tf32: true` (the default): an fp32 GEMM on an Ampere-or-newer GPU runs on TF32 tensor
    cores, whose inputs rounded to 10 mantissa bits put its relative error against float64 near
    4e-4 (each input within 2^-11); `false`: IEEE float32, about 1e-7 at K = 1024. Older GPUs have
    no TF32, and `set_fp32_matmul` says so."""
    from launch.metrics import set_fp32_matmul

    before = torch.backends.cuda.matmul.allow_tf32
    generator = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(1024, 1024, device="cuda", generator=generator) for _ in range(2))
    exact = a.double() @ b.double()

    def relative_error() -> float:
        return ((a @ b).double() - exact).norm().item() / exact.norm().item()

    try:
        tf32 = set_fp32_matmul(True)
        assert tf32 == (torch.cuda.get_device_capability() >= (8, 0))
        with_tf32 = relative_error()
        assert not set_fp32_matmul(False)
        ieee = relative_error()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    print(f"\nfp32 GEMM relative error: tf32 setting {with_tf32:.2e}, ieee {ieee:.2e}")
    assert ieee < 1e-5
    if tf32:
        assert with_tf32 > 1e-4


@gpu
@pytest.mark.slow
def test_trainer_fp32_run_takes_the_tf32_peak(tiny_dataset, tmp_path):
    """An fp32 run on an Ampere-or-newer GPU with the default `tf32: true` measures MFU against
    the TF32 peak, and says so; `tf32=false` against the float32 one."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("no TF32 before compute capability 8.0")
    for setting in ("true", "false"):
        run = train_on_gpus(
            tiny_dataset,
            tmp_path / setting,
            "deepspeed.precision=fp32",
            f"tf32={setting}",
            "max_steps=2",
            "eval_every=0",
            "checkpoint.every_steps=0",
            nproc=1,
        )
        # the start line
        (line,) = [line for line in run.stderr.splitlines() if " parameters, world " in line]
        peak = line.split(", peak ", 1)[1]
        assert "fp32" in peak and ("(TF32)" in peak) == (setting == "true"), line


@gpu
@pytest.mark.slow
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs"
)
def test_zero3_two_gpus_checkpoint_then_evaluation(tiny_dataset, tmp_path):
    """Two ranks on two GPUs (NCCL), ZeRO-3 with every tensor partitioned, bf16: a job stopped
    at step 2 writes a checkpoint; a second job resumes from it, trains to step 4 and evaluates
    (every rank runs the same forwards, which ZeRO-3's parameter gathers need): both exit 0 and
    the evaluation loss is finite."""
    run_dir = tmp_path / "run"
    common = ["deepspeed.zero_stage=3", "max_steps=4", "eval_every=0", "checkpoint.every_steps=0"]
    first = train_on_gpus(tiny_dataset, run_dir, *common, "stop_after_steps=2", nproc=2)
    assert "world 2" in first.stderr and "ZeRO-3" in first.stderr, first.stderr[-2000:]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    second = train_on_gpus(tiny_dataset, run_dir, *common, nproc=2)
    assert "resumed from" in second.stderr, second.stderr[-2000:]
    final = json.loads((run_dir / "final.json").read_text())
    assert final["step"] == 4 and math.isfinite(final["eval/loss"]) and final["eval/loss"] > 0, (
        final
    )


# ----------------------------------------------------------------------------- the GPU benchmark

BENCH = ROOT / "benchmarks" / "bench_gpu.py"
ROW = re.compile(
    r"^V=([\d,]+) ZeRO-(\d): ([\d,]+) tokens/s, MFU ([\d.]+)% \(ours\) ([\d.]+)% \(llm\.c\), "
    r"peak memory ([\d.]+) GiB .*LM loss ([\d.]+)% of it fused \(([\d.]+)% materialised\)",
    re.M,
)


def bench_rows(stdout: str) -> dict[tuple[int, int], tuple[float, ...]]:
    return {
        (int(m[1].replace(",", "")), int(m[2])): tuple(
            float(x.replace(",", "")) for x in m.groups()[2:]
        )
        for m in ROW.finditer(stdout)
    }


def run_bench(*args: str, env: dict) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, str(BENCH), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**env, "WANDB_MODE": "offline"},
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return run


def test_gpu_benchmark_smoke_run_on_cpu():
    """benchmarks/bench_gpu.py --tiny on the CPU (the suite hides GPUs): every vocabulary and
    ZeRO stage prints tokens/s, both MFUs, peak memory and the LM loss's share, and the device."""
    started = time.monotonic()
    run = run_bench("--tiny", env=dict(os.environ))
    out = run.stdout
    print(f"\n{out}\n({time.monotonic() - started:.0f} s)")
    assert "device: cpu" in out and "tiny shapes" in out
    assert re.search(r"^peak: [\d.]+ TFLOP/s \(measured: CPU", out, re.M), out
    rows = bench_rows(out)
    assert set(rows) == {(v, s) for v in (50257, 8000) for s in range(4)}, out
    for tokens_per_s, mfu, mfu_llmc, memory, share, share_materialised in rows.values():
        assert (
            tokens_per_s > 0
            and mfu > 0
            and mfu_llmc > 0
            and memory > 0
            and share > 0
            and share_materialised > 0
        )
    assert (
        len(
            re.findall(
                r"^V=[\d,]+: LM loss alone, .* fused [\d.]+ ms .* materialised logits [\d.]+ ms",
                out,
                re.M,
            )
        )
        == 2
    )
    assert len(re.findall(r"^\| [\d,]+ \| [0-3] \|", out, re.M)) == 8
    assert "target: >= 45% MFU" in out and "not measured here" in out


@pytest.mark.slow
def test_gpu_benchmark_compiles_what_the_trainer_compiles(tmp_path):
    """`bench_gpu.py --compile` compiles through `launch.train.setup.compile_model`, as `compile: true`
    does (each block's forward; the loss, embeddings and the model's own forward stay eager),
    not the whole model with its loss loop: it measures the trainer's program. With it here:
    `--micro-batch` and `--profile-step`."""
    raw = tmp_path / "bench.json"
    run = run_bench(
        "--tiny",
        "--compile",
        "--stages",
        "1",
        "--vocabs",
        "256",
        "--micro-batch",
        "3",
        "--profile-step",
        "--min-seconds",
        "2",
        "--json",
        str(raw),
        env=dict(os.environ),
    )
    (line,) = [
        line
        for line in run.stdout.splitlines()
        if line.startswith("compiled by launch.train.setup.compile_model")
    ]
    assert line.endswith("the forward of blocks.0, blocks.1"), line
    assert set(bench_rows(run.stdout)) == {(256, 1)}, run.stdout
    # --micro-batch sets the rows' shape; --profile-step prints one step's time by family and kernel
    assert "\n3 x 64 tokens per micro batch" in run.stdout, run.stdout
    # --min-seconds: timed steps beyond --steps (2 with --tiny) until that long
    assert "2 timed optimizer steps (more until 2 s)" in run.stdout, run.stdout
    (result,) = json.loads(raw.read_text())
    # more steps were timed, unless the 2 of --steps alone already took 2 s (a loaded machine)
    assert result["seconds"] >= 2, result
    assert result["micro_batches"] > 2 or result["steps_seconds"] >= 2, result
    profile = run.stdout[run.stdout.index("profile of one optimizer step") :]
    assert re.search(r"^  attention +[\d.]+ ms", profile, re.M) and re.search(
        r"\[attention\] ", profile
    ), profile


@gpu
@pytest.mark.slow
def test_gpu_benchmark_runs_on_the_gpu():
    """The benchmark at gpt2_small shapes on the GPU, one configuration, 2 steps: it measures
    the GPU (figures for a quick look; the full run is in docs/gpu.md, Figures)."""
    run = run_bench(
        "--stages", "1", "--vocabs", "50257", "--steps", "2", "--loss-reps", "2", env=GPU_ENV
    )
    print(f"\n{run.stdout}")
    assert "device: cuda" in run.stdout and "gpt2_small shapes" in run.stdout
    rows = bench_rows(run.stdout)
    assert set(rows) == {(50257, 1)}, run.stdout
    tokens_per_s, mfu, mfu_llmc, memory, share, share_materialised = rows[(50257, 1)]
    assert tokens_per_s > 0 and 0 < mfu < 100 and 0 < mfu_llmc < 100 and memory > 0
    assert re.search(
        r"^target: >= 45% MFU \(llm.c's count\) .*: (met|NOT met|not measured here)",
        run.stdout,
        re.M,
    )
