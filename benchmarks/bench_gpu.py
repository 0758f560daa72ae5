"""GPT-2 small (124M) training on one GPU: tokens/s, MFU by two counts, peak memory and the LM loss's share of a step, per ZeRO stage and vocabulary; prints figures, asserts nothing.

    python benchmarks/bench_gpu.py [--tiny] [--vocabs 50257,8000] [--stages 0,1,2,3] [--steps 5]
                                   [--warmup 1] [--precision bf16] [--[no-]compile] [--micro-batch N]
                                   [--grad-accum N] [--adamw fused,foreach --rounds 3]
                                   [--attention-backends] [--profile-step] [--json OUT]

What runs. configs/gpt2_small.yaml's model (d_model 768, 12 layers, 12 heads, d_ff 3072,
sequence 1024, dropout 0), its micro batch, grad_accum and `compile` (`--micro-batch`,
`--grad-accum`, `--[no-]compile` override them), with the vocabulary
set to each of `--vocabs` (50,257: GPT-2's, 124M parameters; 8,000: this project's default
tokenizer) and ZeRO set to each of `--stages`. For each, the model is built as the trainer's
`launch.train.setup.build_engine` builds it (`model.build_model`, `launch.optim.build_optimizer` and
`build_scheduler`, `launch.deepspeed.engine.Engine` over `launch.deepspeed.config.deepspeed_config` of the run
config) under a one-rank process group (NCCL on a GPU, gloo on the CPU), and trained on
random token ids made into model inputs by the trainer's own `launch.tasks` code (packed
blocks: no padding, so the attention mask is dropped on the host and SDPA takes its fused
causal path). Every micro batch is forward, backward and `engine.step()`, as in
`launch.train.step.train_step`; `--warmup` optimizer steps are run first and not timed, then
`--steps` optimizer steps (x grad_accum micro batches) between two device synchronisations.

Figures, one row per (vocabulary, stage):
- tokens/s: input tokens of the timed micro batches / their wall time.
- MFU (ours): `model.flops.training_flops` (6 N + 12 L T d per token, N the matmul weights,
  attention counted in full) x tokens/s / peak; MFU (llm.c): `llmc_flops_per_token`
  (6 N + 6 L d T, N all parameters, causal attention counted half). The peak is
  `launch.metrics.peak_flops`, as the trainer logs it: on a known GPU the vendor's dense
  figure from its table (H100 SXM bf16: 989 TFLOP/s), on an unknown one a measured GEMM, on
  the CPU a measured (1024 x 1024) GEMM on this process's threads; the output says which. On
  a GPU the achieved rate of a large bf16 GEMM is printed beside it for reference.
- peak memory: on a GPU `torch.cuda.max_memory_allocated` from the engine's construction to
  the end of the timed steps, less what was allocated before it (a previous configuration's
  leftovers, printed if any); on the CPU the peak resident set (VmHWM, reset per configuration
  through /proc/self/clear_refs; the process's maximum where that cannot be reset).
- LM loss share: the loss alone timed at the row's shapes, forward + backward, both ways: the
  fused `model.loss.linear_cross_entropy` (what the model runs: no (B T, V) logits) and
  `F.linear` + `model.loss.cross_entropy` (F.cross_entropy on float32 logits, materialised),
  each as a share of the row's time per micro batch; the second is the share it would take in
  a step otherwise the same. Its peak memory is the loss's own (GPU only).

`--tiny` (and automatically without CUDA): d_model 64, 2 layers, 4 heads, d_ff 256, sequence
64, micro batch 2, grad_accum 1, the same vocabularies, 2 steps: a smoke run that keeps every
path of the script alive on the CPU (tests/benchmarks/test_gpu.py runs it); its figures say nothing about a
GPU, and on a shared CPU not much about the CPU either.

Target (one H100, full shapes, bf16, vocabulary 50,257): at least 45% MFU by llm.c's count
(llm.c itself reports about 41% for this model); the verdict is printed when those are what was
measured. Compiling uses the trainer's own `launch.train.setup.compile_model` (what
`compile: true` does), so that the benchmark measures the program the trainer runs.

Choices measured against each other in one process, alternating: `--adamw fused,foreach` runs each
row once per AdamW implementation (torch's fused kernel, what `launch.optim.build_optimizer`
picks on a GPU, and its multi-tensor `foreach` kernels) per round, `--rounds` times, and prints
each one's median time per micro batch; `--attention-backends` times causal SDPA alone, forward +
backward at the rows' shapes, on each of torch's CUDA backends (cuDNN, flash, memory-efficient).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG = ROOT / "configs" / "gpt2_small.yaml"
TINY = dict(
    overrides=[
        "model.d_model=64",
        "model.n_layers=2",
        "model.n_heads=4",
        "model.d_ff=256",
        "model.max_seq_len=64",
        "data.micro_batch_size=2",
        "grad_accum=1",
    ],
    steps=2,
    loss_reps=2,
)
MFU_TARGET = 0.45  # GPT-2 124M, bf16, one H100, llm.c's count
BATCHES = 4  # distinct micro batches, cycled


# ---------------------------------------------------------------- memory


def _reset_peak_rss() -> bool:
    """Reset the process's peak resident set (Linux: VmHWM); False where it cannot be."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak_rss_bytes() -> int:
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class PeakMemory:
    """Peak memory of a stretch of work: GPU allocations, or the CPU's resident set."""

    def __init__(self, cuda: bool):
        self.cuda = cuda

    def __enter__(self) -> "PeakMemory":
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        else:
            self.before = 0
            self.resettable = _reset_peak_rss()
        return self

    def __exit__(self, *exc) -> None:
        import torch

        if self.cuda:
            torch.cuda.synchronize()
            self.peak = torch.cuda.max_memory_allocated() - self.before
        else:
            self.peak = _peak_rss_bytes()

    @property
    def what(self) -> str:
        if self.cuda:
            return "max_memory_allocated"
        return "peak RSS" if self.resettable else "process max RSS"


# ---------------------------------------------------------------- one configuration


def run_config(
    cfg, stage: int, args: argparse.Namespace, device, batches: list[dict], adamw: str | None = None
) -> dict:
    """Train `args.warmup` + `args.steps` optimizer steps of a fresh model under ZeRO `stage`; the
    engine and its model are gone when this returns (collected before the next configuration)."""
    import dataclasses

    import torch

    from launch.config import BatchPlan
    from launch.tasks import TASKS
    from model import llmc_flops_per_token

    cfg = dataclasses.replace(cfg, deepspeed=dataclasses.replace(cfg.deepspeed, zero_stage=stage))
    plan = BatchPlan(cfg.data.micro_batch_size, cfg.grad_accum, 1)
    task = TASKS[cfg.task]
    cuda = device.type == "cuda"
    with PeakMemory(cuda) as memory:
        timed = _train(
            cfg, plan, args, device, [task.to_device(inputs, device) for inputs in batches], adamw
        )
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    host = [batches[index % len(batches)] for index in range(timed["micro_batches"])]
    tokens = sum(task.tokens(inputs) for inputs in host)
    seq_len = host[0]["input_ids"].shape[1]
    return {
        "vocab_size": cfg.model.vocab_size,
        "zero_stage": stage,
        "adamw": adamw or "build_optimizer's",
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum": plan.grad_accum,
        "seq_len": seq_len,
        **timed,
        "tokens": tokens,
        "flops": sum(task.flops(cfg.model, inputs) for inputs in host),
        "flops_llmc": tokens * llmc_flops_per_token(cfg.model, timed["parameters"], seq_len),
        "peak_memory_bytes": memory.peak,
        "memory_before_bytes": memory.before,
        "memory_kind": memory.what,
    }


def _train(
    cfg, plan, args: argparse.Namespace, device, on_device: list[dict], adamw: str | None = None
) -> dict:
    """The engine as launch.train.setup.build_engine builds it, and the timed micro batches."""
    import torch

    from launch.deepspeed.config import deepspeed_config
    from launch.deepspeed.engine import Engine
    from launch.optim import build_optimizer, build_scheduler
    from model import build_model

    torch.manual_seed(cfg.seed)  # as build_engine: the same initial weights for every stage
    model = build_model(cfg.model)
    n_parameters = sum(p.numel() for p in model.parameters())
    optimizer = build_optimizer(model, cfg.optim, skip_non_finite=cfg.deepspeed.zero_stage == 0)
    if adamw is not None:  # one implementation rather than build_optimizer's pick
        for group in optimizer.param_groups:
            group.update(fused=adamw == "fused", foreach=adamw == "foreach")
    scheduler = build_scheduler(optimizer, cfg.schedule, cfg.max_steps)
    if args.compile:
        from launch.train.setup import compile_model

        # the trainer's own: the blocks compiled, the loss and embeddings eager
        compile_model(model)
    engine = Engine(model, optimizer, scheduler, deepspeed_config(cfg, plan))
    if engine.device.type != device.type:
        raise RuntimeError(
            f"DeepSpeed put the model on {engine.device}, the benchmark measures {device}"
        )

    def micro_batches(count: int) -> torch.Tensor | None:
        loss = None  # none run (--warmup 0)
        # as launch.train.step.train_step: forward, backward, step per micro batch
        for index in range(count):
            loss = engine(**on_device[index % len(on_device)]).loss
            engine.backward(loss)
            engine.step()
        return None if loss is None else loss.detach()

    micro_batches(args.warmup * plan.grad_accum)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    # Before the timed steps, so that its table is of the state they run in; it is printed by main
    # (DeepSpeed's prints go to stderr meanwhile).
    profile = (
        profile_step(lambda: micro_batches(plan.grad_accum), cuda) if args.profile_step else ""
    )
    count = args.steps * plan.grad_accum
    start = time.perf_counter()
    loss = micro_batches(count)
    if cuda:
        torch.cuda.synchronize()
    steps_seconds = time.perf_counter() - start
    # --min-seconds: more of the same until that long, so that a GPU is timed at the clock it
    # holds under sustained load (a second-long burst runs faster than minutes of training do).
    while time.perf_counter() - start < args.min_seconds:
        loss = micro_batches(plan.grad_accum)
        count += plan.grad_accum
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    # Engine.describe (which optimizer, inside which DeepSpeed wrapper, accumulating in which dtype)
    # is recent in launch/deepspeed/; without it the row only goes without that note.
    describe = getattr(engine, "describe", None)
    compiled = [
        name
        for name, module in model.named_modules()
        if hasattr(module.forward, "_torchdynamo_orig_callable")
    ]
    return {
        "parameters": n_parameters,
        "micro_batches": count,
        "seconds": seconds,
        "steps_seconds": steps_seconds,  # of the --steps alone, before --min-seconds' extra
        "last_loss": float(loss),
        "compiled": compiled,
        "profile": profile,
        "optimizer": describe() if describe else "optimizer: n/a",
    }


# ---------------------------------------------------------------- the LM loss alone


def time_loss(
    vocab: int,
    rows: int,
    seq_len: int,
    d_model: int,
    dtype,
    device,
    reps: int,
    variants: bool = False,
    profile: bool = False,
) -> dict:
    """Forward + backward of the LM loss over (rows, d_model) hidden states, both ways: the
    fused `linear_cross_entropy` and F.linear + `cross_entropy` on materialised logits.
    Milliseconds (median of `reps`) and, on a GPU, the loss's own peak memory."""
    import torch
    import torch.nn.functional as F

    from model.loss import IGNORE_INDEX, cross_entropy, linear_cross_entropy

    generator = torch.Generator(device=device).manual_seed(0)
    h = torch.randn(rows, d_model, generator=generator, device=device).to(dtype).requires_grad_()
    weight = (
        (torch.randn(vocab, d_model, generator=generator, device=device) * 0.02)
        .to(dtype)
        .requires_grad_()
    )
    targets = torch.randint(0, vocab, (rows,), generator=generator, device=device)
    # as the causal LM's labels: the last position of a block predicts nothing
    targets[seq_len - 1 :: seq_len] = IGNORE_INDEX
    import model.loss as loss_module

    ways = {
        "fused": (lambda: linear_cross_entropy(h, weight, None, targets), {}),
        "materialised": (lambda: cross_entropy(F.linear(h, weight), targets), {}),
    }
    if variants:  # the fused loss's choices, one at a time (model.loss's module settings)
        ways["fused_unpadded"] = (ways["fused"][0], {"PAD_VOCAB_MULTIPLE": 0})
        ways["fused_eager_chunk"] = (ways["fused"][0], {"FUSED_CHUNK_DEVICES": ()})
    cuda = device.type == "cuda"
    out = {}
    for name, (loss_fn, settings) in ways.items():
        saved = {key: getattr(loss_module, key) for key in settings}
        for key, value in settings.items():
            setattr(loss_module, key, value)
        try:
            times = []
            for rep in range(reps + 1):
                h.grad = weight.grad = None
                with PeakMemory(cuda) as memory:
                    start = time.perf_counter()
                    loss_fn().backward()
                    if cuda:
                        torch.cuda.synchronize()
                    elapsed = time.perf_counter() - start
                # the first warms up: kernels, the allocator, the GEMM dtype probe, compiling
                if rep:
                    times.append(elapsed)
            out[f"{name}_ms"] = 1e3 * statistics.median(times)
            out[f"{name}_peak_bytes"] = memory.peak if cuda else None
            if profile and name == "fused":
                print_profile(loss_fn, h, weight, cuda)
        finally:
            for key, value in saved.items():
                setattr(loss_module, key, value)
    h.grad = weight.grad = None
    return out


def time_attention(
    batch: int, heads: int, seq_len: int, head_dim: int, dtype, device, reps: int
) -> dict:
    """Causal SDPA alone, forward + backward of (batch, heads, seq_len, head_dim) queries, keys and
    values, on each of torch's CUDA backends: milliseconds (median of `reps`), or why it cannot run."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    generator = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(
            batch, heads, seq_len, head_dim, generator=generator, device=device, dtype=dtype
        ).requires_grad_()
        for _ in range(3)
    )
    out = {}
    for name, backend in (
        ("cudnn", SDPBackend.CUDNN_ATTENTION),
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
    ):
        times = []
        try:
            with sdpa_kernel([backend]):
                for rep in range(reps + 1):
                    q.grad = k.grad = v.grad = None
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    start = time.perf_counter()
                    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                    if rep:
                        times.append(time.perf_counter() - start)
            out[name] = f"{1e3 * statistics.median(times):.2f} ms"
        except RuntimeError as err:  # no kernel of that backend for these inputs or this device
            out[name] = f"n/a ({str(err).splitlines()[0][:60]})"
    return out


def print_profile(loss_fn, h, weight, cuda: bool) -> None:
    """torch.profiler's table of one forward + backward of the loss: where its time goes, by kernel."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    h.grad = weight.grad = None
    with profile(activities=activities) as prof:
        loss_fn().backward()
        if cuda:
            torch.cuda.synchronize()
    key = "cuda_time_total" if cuda else "cpu_time_total"
    print(
        prof.key_averages().table(sort_by=key, row_limit=14, max_name_column_width=70), flush=True
    )


def profile_step(step, cuda: bool) -> str:
    """torch.profiler over one optimizer step (grad_accum micro batches): the device time by
    kernel family and the 25 longest kernels (`launch.profiling`, as the trainer's
    `profile_start` prints it), so that an MFU gap can be placed. On the CPU the operators' own
    CPU time stands in (the path kept alive; not a GPU figure)."""
    from launch.profiling import Profiled

    with Profiled(cuda) as profiled:
        step()
    return profiled.summary("one optimizer step")


# ---------------------------------------------------------------- the driver


def make_batches(cfg, count: int) -> list[dict]:
    """Model inputs on the host of `count` micro batches of random token ids, made by the
    trainer's task code (`run_config` moves them with `Task.to_device`, which drops the all-ones
    attention mask); pinned on CUDA, as the trainer's loader pins its batches."""
    import torch

    from launch.tasks import TASKS

    generator = torch.Generator().manual_seed(cfg.seed)
    shape = (cfg.data.micro_batch_size, cfg.model.max_seq_len)
    out = []
    for _ in range(count):
        batch = {
            # random ids: which are special does not matter to the speed measured
            "input_ids": torch.randint(0, cfg.model.vocab_size, shape, generator=generator),
            "attention_mask": torch.ones(shape, dtype=torch.long),
        }
        if torch.cuda.is_available():
            batch = {key: value.pin_memory() for key, value in batch.items()}
        out.append(TASKS[cfg.task].model_inputs(batch))
    return out


def device_line(device, tiny: bool, args: argparse.Namespace) -> str:
    from importlib.metadata import version  # only launch/deepspeed/ imports deepspeed

    import torch

    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        what = (
            f"cuda: {props.name}, {props.total_memory / 2**30:.0f} GiB, {torch.cuda.device_count()} visible, "
            f"CUDA {torch.version.cuda}"
        )
    else:
        what = f"cpu: {platform.machine()} {os.cpu_count()} cores, {torch.get_num_threads()} threads, no CUDA"
    shapes = "tiny shapes (a smoke run: no GPU figures)" if tiny else "gpt2_small shapes"
    return (
        f"device: {what}; torch {torch.__version__}, deepspeed {version('deepspeed')}; {shapes}; "
        f"{args.precision}{', compiled' if args.compile else ''}"
    )


def row_figures(r: dict, loss: dict, peak: float) -> dict:
    """The row's rates and shares, added to `r`. The materialised loss's share is of the step it
    would make: this one with the fused loss's time swapped for its time."""
    per_micro = r["seconds"] / r["micro_batches"]
    fused, materialised = loss["fused_ms"] / 1e3, loss["materialised_ms"] / 1e3
    s = {
        "tokens_per_s": r["tokens"] / r["seconds"],
        "mfu": r["flops"] / r["seconds"] / peak,
        "mfu_llmc": r["flops_llmc"] / r["seconds"] / peak,
        "ms_per_micro_batch": 1e3 * per_micro,
        # above 1 only where the machine's load changed between the timings
        "loss_share": fused / per_micro,
        "loss_share_materialised": materialised / (max(per_micro - fused, 0.0) + materialised),
    }
    r.update(s)
    return s


def gib(n: float | None) -> str:
    return "n/a" if n is None else f"{n / 2**30:.2f} GiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tiny", action="store_true", help="tiny shapes (automatic without CUDA)")
    parser.add_argument(
        "--vocabs", default="50257,8000", help="vocabulary sizes (default: %(default)s)"
    )
    parser.add_argument("--stages", default="0,1,2,3", help="ZeRO stages (default: %(default)s)")
    parser.add_argument(
        "--steps", type=int, help="timed optimizer steps (default: 5; 2 with --tiny)"
    )
    parser.add_argument(
        "--warmup", type=int, default=1, help="untimed optimizer steps first (default: %(default)s)"
    )
    parser.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    parser.add_argument(
        "--min-seconds",
        type=float,
        default=0.0,
        help="time more optimizer steps than --steps until this many seconds (default: %(default)s)",
    )
    parser.add_argument(
        "--loss-reps",
        type=int,
        help="timed repetitions of the loss alone (default: 5; 2 with --tiny)",
    )
    parser.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        help="torch.compile (inductor) the blocks, as compile: true (default: the config's on a "
        "GPU; off with --tiny)",
    )
    parser.add_argument(
        "--loss-variants",
        action="store_true",
        help="also time the fused loss unpadded and with its eager chunk kernels",
    )
    parser.add_argument(
        "--profile-loss",
        action="store_true",
        help="print torch.profiler's kernel table of the fused loss at the first vocabulary",
    )
    parser.add_argument(
        "--profile-step",
        action="store_true",
        help="print the device time of one optimizer step by kernel family, and its top kernels",
    )
    parser.add_argument("--micro-batch", type=int, help="micro batch size (default: the config's)")
    parser.add_argument(
        "--grad-accum", type=int, help="micro batches per optimizer step (default: the config's)"
    )
    parser.add_argument(
        "--adamw",
        help="comma-separated AdamW implementations, each timed per row and round: "
        "fused, foreach (default: build_optimizer's pick)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="rounds over the --adamw choices (default: %(default)s)",
    )
    parser.add_argument(
        "--attention-backends",
        action="store_true",
        help="also time causal SDPA alone on each CUDA backend at the rows' shapes",
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    args = parser.parse_args(argv)

    import torch

    import launch.distributed as dist
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.metrics import measure_gemm_flops, peak_flops, set_fp32_matmul

    cuda = torch.cuda.is_available()
    tiny = args.tiny or not cuda
    if args.steps is None:
        args.steps = TINY["steps"] if tiny else 5
    if args.loss_reps is None:
        args.loss_reps = TINY["loss_reps"] if tiny else 5
    if args.steps < 1 or args.warmup < 0 or args.rounds < 1:
        parser.error("--steps and --rounds must be at least 1, --warmup at least 0")
    adamws = args.adamw.split(",") if args.adamw else [None]
    if any(a not in ("fused", "foreach", None) for a in adamws):
        parser.error(f"--adamw: {args.adamw!r}: the choices are fused and foreach")
    vocabs = [int(v) for v in args.vocabs.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    if any(s not in (0, 1, 2, 3) for s in stages):
        parser.error(f"--stages: {args.stages!r}: ZeRO stages are 0, 1, 2, 3")

    denv = dist.read_env()  # one rank: no launcher needed
    dist.set_threads(0, denv)
    dist.init_process_group(denv, 600)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    print(device_line(device, tiny, args), flush=True)
    shipped = load_config(TrainConfig, CONFIG, [])
    if args.compile is None:
        args.compile = shipped.compile and not tiny
    tf32 = set_fp32_matmul(shipped.tf32)  # as launch.train sets it
    peak, source = peak_flops(args.precision, tf32=tf32)
    print(
        f"peak: {peak / 1e12:.3f} TFLOP/s ({source}; launch.metrics.peak_flops, as the trainer's MFU)",
        flush=True,
    )
    if cuda:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
        measured = measure_gemm_flops(dtype, 8192, seconds=1.0, device="cuda")
        print(
            f"reference: an (8192 x 8192) {args.precision} GEMM runs at {measured / 1e12:.1f} TFLOP/s here "
            f"({100 * measured / peak:.0f}% of that peak)",
            flush=True,
        )

    results = []
    for vocab in vocabs:
        overrides = [
            f"model.vocab_size={vocab}",
            f"deepspeed.precision={args.precision}",
            "data.num_workers=0",
            f"max_steps={args.warmup + args.steps + 1}",
            *(TINY["overrides"] if tiny else []),
            *([f"data.micro_batch_size={args.micro_batch}"] if args.micro_batch else []),
            *([f"grad_accum={args.grad_accum}"] if args.grad_accum else []),
        ]
        cfg = load_config(TrainConfig, CONFIG, overrides)
        batches = make_batches(cfg, BATCHES)
        rows = cfg.data.micro_batch_size * cfg.model.max_seq_len
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(args.precision, torch.float32)
        loss = time_loss(
            vocab,
            rows,
            cfg.model.max_seq_len,
            cfg.model.d_model,
            dtype,
            device,
            args.loss_reps,
            args.loss_variants,
            args.profile_loss and vocab == vocabs[0],
        )
        print(
            f"V={vocab:,}: LM loss alone, forward + backward over {rows:,} rows: fused {loss['fused_ms']:.2f} ms "
            f"(peak {gib(loss['fused_peak_bytes'])}), materialised logits {loss['materialised_ms']:.2f} ms "
            f"(peak {gib(loss['materialised_peak_bytes'])})",
            flush=True,
        )
        if args.loss_variants:
            print(
                f"V={vocab:,}: fused loss variants: as run {loss['fused_ms']:.2f} ms (compiled chunk, vocabulary "
                f"padded to a multiple of {__import__('model.loss').loss.PAD_VOCAB_MULTIPLE} where compiled), "
                f"unpadded {loss['fused_unpadded_ms']:.2f} ms, eager chunk {loss['fused_eager_chunk_ms']:.2f} ms",
                flush=True,
            )
        if args.attention_backends:
            heads = cfg.model.n_heads
            times = time_attention(
                cfg.data.micro_batch_size,
                heads,
                cfg.model.max_seq_len,
                cfg.model.d_model // heads,
                dtype,
                device,
                args.loss_reps,
            )
            print(
                f"V={vocab:,}: causal SDPA alone, forward + backward of one layer: "
                + ", ".join(f"{name} {t}" for name, t in times.items()),
                flush=True,
            )
        runs = [
            (stage, adamw, round_)
            for stage in stages
            for round_ in range(args.rounds)
            for adamw in adamws
        ]
        for stage, adamw, round_ in runs:
            started = time.time()
            # DeepSpeed's own prints: stdout holds the figures
            with contextlib.redirect_stdout(sys.stderr):
                first = round_ == 0 and adamw == adamws[0]  # profiled once per row
                r = run_config(
                    cfg,
                    stage,
                    argparse.Namespace(
                        **{**vars(args), "profile_step": args.profile_step and first}
                    ),
                    device,
                    batches,
                    adamw,
                )
            r["loss"] = loss
            if r["profile"]:
                print(r["profile"], flush=True)
            if args.compile:
                print(
                    f"compiled by launch.train.setup.compile_model: the forward of {', '.join(r['compiled'])}",
                    flush=True,
                )
            s = row_figures(r, loss, peak)
            leftover = (
                f", {gib(r['memory_before_bytes'])} left before it"
                if r["memory_before_bytes"] > 2**27
                else ""
            )
            print(
                f"V={vocab:,} ZeRO-{stage}: {s['tokens_per_s']:,.0f} tokens/s, MFU {100 * s['mfu']:.1f}% (ours) "
                f"{100 * s['mfu_llmc']:.1f}% (llm.c), peak memory {gib(r['peak_memory_bytes'])} ({r['memory_kind']}"
                f"{leftover}), {s['ms_per_micro_batch']:.1f} ms per micro batch, LM loss {100 * s['loss_share']:.1f}% "
                f"of it fused ({100 * s['loss_share_materialised']:.1f}% materialised); {r['parameters']:,} "
                f"parameters, last loss {r['last_loss']:.3f}; {r['optimizer']}"
                f"{f'; AdamW {adamw}, round {round_ + 1}' if adamw else ''}; {time.time() - started:.0f} s",
                flush=True,
            )
            results.append(r)
        if len(adamws) > 1:
            for stage in stages:
                ms = {
                    a: statistics.median(
                        r["ms_per_micro_batch"]
                        for r in results
                        if r["vocab_size"] == vocab and r["zero_stage"] == stage and r["adamw"] == a
                    )
                    for a in adamws
                }
                print(
                    f"V={vocab:,} ZeRO-{stage}: AdamW, median ms per micro batch over {args.rounds} round(s), "
                    f"alternating: "
                    + ", ".join(f"{a} {t:.1f}" for a, t in ms.items())
                    + f"; {adamws[1]} / {adamws[0]} = {ms[adamws[1]] / ms[adamws[0]]:.3f}",
                    flush=True,
                )
    dist.destroy()

    r0 = results[0]
    print()
    timed = f"{args.steps} timed optimizer steps" + (
        f" (more until {args.min_seconds:g} s)" if args.min_seconds else ""
    )
    print(
        f"{r0['micro_batch_size']} x {r0['seq_len']} tokens per micro batch, grad_accum {r0['grad_accum']}, "
        f"{timed} after {args.warmup} untimed, {args.precision}, 1 rank; device: {device.type}"
    )
    print(
        "| vocab | ZeRO | params | tokens/s | MFU ours | MFU llm.c | peak memory | ms / micro batch | "
        "LM loss share (fused) | LM loss share (materialised) |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        print(
            f"| {r['vocab_size']:,} | {r['zero_stage']} | {r['parameters'] / 1e6:.1f} M | {r['tokens_per_s']:,.0f} | "
            f"{100 * r['mfu']:.1f}% | {100 * r['mfu_llmc']:.1f}% | {gib(r['peak_memory_bytes'])} | "
            f"{r['ms_per_micro_batch']:.1f} | {100 * r['loss_share']:.1f}% | {100 * r['loss_share_materialised']:.1f}% |"
        )
    print(
        f"\nMFU = model FLOPs (ours: model.flops.training_flops; llm.c: llmc_flops_per_token) x tokens/s / "
        f"{peak / 1e12:.3f} TFLOP/s ({source}). Peak memory: {r0['memory_kind']}. LM loss share: the loss "
        f"alone (forward + backward at these shapes) / time per micro batch; 'materialised' is F.cross_entropy "
        f"on float32 logits in a step otherwise the same (a share above 100% means the machine's load changed "
        f"between the two timings)."
    )
    gpt2 = [r for r in results if r["vocab_size"] == 50257]
    if (
        cuda
        and not tiny
        and args.precision == "bf16"
        and "H100" in torch.cuda.get_device_name()
        and gpt2
    ):
        best = max(gpt2, key=lambda r: r["mfu_llmc"])
        verdict = "met" if best["mfu_llmc"] >= MFU_TARGET else "NOT met"
        print(
            f"target: >= {100 * MFU_TARGET:.0f}% MFU (llm.c's count) for GPT-2 124M bf16 on one H100: {verdict} "
            f"(best {100 * best['mfu_llmc']:.1f}% at ZeRO-{best['zero_stage']}; {100 * best['mfu']:.1f}% by ours)"
        )
    else:
        print(
            f"target: >= {100 * MFU_TARGET:.0f}% MFU (llm.c's count) for GPT-2 124M bf16 on one H100: not measured here "
            f"({'tiny shapes on ' + device.type if tiny else 'not an H100, bf16 and vocabulary 50,257'})"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
