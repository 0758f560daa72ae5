"""Training throughput of our GPT and BERT against Hugging Face's, and MFU; prints figures, asserts nothing.

    python benchmarks/bench_train.py [--data DIR] [--nproc 2] [--archs gpt,bert] [--shapes tiny,small]
                                     [--precisions fp32,bf16] [--compile off,on] [--steps 20]
                                     [--rounds 3] [--adamw auto|fused|foreach|for_loop]
                                     [--compile-scope auto|model|blocks] [--quick]
                                     [--micro-batch N] [--zero-stage 2]

1. Throughput: for each model shape and precision, one `torchrun` job of `--nproc` ranks builds
   our model (`model.GPT` / `model.BERT`) and `transformers`' `GPT2LMHeadModel` /
   `BertForMaskedLM` of identical shape with the same weights (converted by `model.hf`), wraps
   each in its own DeepSpeed engine from the same config (`launch.deepspeed.config.deepspeed_config` of
   configs/tiny_gpt.yaml or tiny_bert.yaml with the shape's overrides: ZeRO-2, the same micro
   batch, AdamW groups and schedule), and feeds both the same batches, read once from the
   dataset's train shards by `pipeline.load.loader.ShardLoader` and held in memory (the loader has
   its own benchmark). Timed rounds alternate ours, theirs, ours, theirs...: each round is
   `--steps` optimizer steps between barriers, after one untimed warm-up round of each. Tokens/s
   counts every input token of every rank; the table gives the median round and the ratio.
   With `--compile off,on` (the default) the same job also trains a compiled copy of each, from
   the same weights, in the same alternation (ours, theirs, ours compiled, theirs compiled, ...):
   ours as `compile: true` compiles it (`launch.train.setup.compile_model` with the run's
   `compile_scope`: auto, the whole model with its loss on a CPU; `--compile-scope blocks` for
   each block's forward only), theirs as their users would (`model.compile()`, the whole model,
   in place). Each compiled
   pair gives its own row and ratio; the untimed warm-up round is where they compile. On a CPU,
   each rank's off-CPU share of the timed steps is printed for both sides
   (`rank_clock.StepClock`: the time its main thread waited in collectives or for a core).
2. MFU: in the same job, before training, every rank measures a square (1024) GEMM in fp32 and
   in bf16 on its own threads, all ranks at once (as they train). MFU = model FLOPs per step
   (`model.flops.training_flops`, as the trainer logs it) x steps/s / the sum of the ranks'
   peaks of the training precision; MFU against the other precision's peak is printed too.

Shapes (vocabulary and sequence length from the dataset, dropout as in the config, 0):
    tiny   d_model 64, 2 layers, 4 heads, d_ff 256   (configs/tiny_*.yaml: the main job's models)
    small  d_model 256, 4 layers, 4 heads, d_ff 1024
    base   d_model 768, 12 layers, 12 heads, d_ff 3072 (GPT-2 small / BERT-base blocks; slow on CPU)
    1b     d_model 2048, 16 layers, 32 heads, d_ff 8192 (configs/llama_gpu_1b.yaml's; a GPU's)
Archs: gpt (against GPT2LMHeadModel), bert (BertForMaskedLM), llama (our GPT with Llama's blocks,
key/value heads a quarter of the heads, against LlamaForCausalLM).

On a GPU (benchmarks/gpu_check.sh's hf-bench stage): `--nproc 1`, NCCL, the rounds timed between
device synchronisations, MFU against the GPU's table peak (`launch.metrics.peak_flops`) and the
job's peak GPU memory printed; `--micro-batch` and `--zero-stage` set what the configs would.

Data: DIR defaults to data/gettext-en-de (made by `make main` or `python -m pipeline.prepare
configs/prepare_gettext_en_de.yaml`); without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from rank_clock import StepClock, shares  # noqa: E402

DEFAULT_DATA = ROOT / "data" / "gettext-en-de"
SHAPES = {
    "tiny": dict(d_model=64, n_layers=2, n_heads=4, d_ff=256),
    "small": dict(d_model=256, n_layers=4, n_heads=4, d_ff=1024),
    "base": dict(d_model=768, n_layers=12, n_heads=12, d_ff=3072),
    "1b": dict(d_model=2048, n_layers=16, n_heads=32, d_ff=8192),
}
CONFIGS = {
    "gpt": "configs/tiny_gpt.yaml",
    "bert": "configs/tiny_bert.yaml",
    "llama": "configs/tiny_gpt.yaml",
}
# The Llama arch: our GPT with Llama's blocks (configs/llama_gpu_1b.yaml's choices), against
# transformers' LlamaForCausalLM; key/value heads a quarter of the query heads.
LLAMA = dict(
    norm="rmsnorm", activation="swiglu", positions="rope", bias="false", tie_embeddings="true"
)
COMPILED = "+compile"  # the key suffix of a compiled model's figures


# ---------------------------------------------------------------- one torchrun job (every rank)


def open_rank(config: Path, overrides: list[str], n_batches: int):
    """One benchmark rank of a torchrun job (or a world of one): the TrainConfig of `config` with
    `overrides`, this rank's threads and process group set, and the first `n_batches` batches of
    this rank's train shards, held in memory; `model.vocab_size` is the dataset's.
    Returns (config, the rank's environment, the task, the batches as the loader gives them)."""
    import launch.distributed as dist
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.tasks import TASKS
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    cfg = load_config(TrainConfig, config, overrides)
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)
    dist.init_process_group(denv, cfg.dist_timeout_s)
    task = TASKS[cfg.task]
    loader = ShardLoader(
        LoaderPlan.from_config(
            cfg.data, task.name, "train", rank=denv.rank, world_size=denv.world_size
        )
    )
    batches = []
    for batch in loader:
        batches.append(batch)
        if len(batches) == n_batches:
            break
    # The model takes the data's vocabulary and at least its blocks' length.
    seq_len = max(cfg.model.max_seq_len, int(batches[0]["input_ids"].shape[1]))
    cfg = dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, vocab_size=loader.vocab_size, max_seq_len=seq_len),
    )
    return cfg, denv, task, batches


def worker(args: argparse.Namespace) -> None:
    import torch

    import launch.distributed as dist
    from launch.config import BatchPlan, compile_scope_for
    from launch.deepspeed.config import deepspeed_config
    from launch.deepspeed.engine import Engine
    from launch.metrics import measure_gemm_flops, peak_flops
    from launch.optim import build_optimizer, build_scheduler
    from launch.train.setup import compile_model
    from model import build_model, hf
    from model.hf_decoders import gpt_to_hf_decoder
    from model.loss import IGNORE_INDEX

    shape = dict(SHAPES[args.shape])
    if args.arch == "llama":
        shape.update(LLAMA, n_kv_heads=shape["n_heads"] // 4, rope_theta=500000.0)
    overrides = [f"model.{key}={value}" for key, value in shape.items()]
    if args.micro_batch:
        overrides.append(f"data.micro_batch_size={args.micro_batch}")
    cfg, denv, task, batches = open_rank(
        ROOT / CONFIGS[args.arch],
        [
            *overrides,
            f"data.data_dir={args.data}",
            f"deepspeed.precision={args.precision}",
            f"deepspeed.zero_stage={args.zero_stage}",
            f"max_steps={(args.rounds + 1) * args.steps * 2}",
            "data.num_workers=0",
            f"optim.implementation={args.adamw}",
            f"compile_scope={args.compile_scope}",
        ],
        args.steps,
    )

    cuda = torch.cuda.is_available()
    # Peaks first, every rank at once: the same contention as training. On a GPU the trainer's
    # figure (the vendor's dense peak of a known GPU), summed over the ranks.
    dist.barrier()
    if cuda:
        peaks = {p: peak_flops(p)[0] for p in ("fp32", "bf16")}
    else:
        peaks = {
            p: measure_gemm_flops(dtype, 1024, seconds=1.0)
            for p, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16))
        }
    peaks = dict(zip(peaks, dist.all_reduce_sum(list(peaks.values()))))

    torch.manual_seed(0)
    initial = build_model(cfg.model)
    n_params = sum(p.numel() for p in initial.parameters())
    models = {}
    for compiled in args.compile.split(","):
        suffix = COMPILED if compiled == "on" else ""
        ours = copy.deepcopy(initial)
        convert = {"gpt": hf.gpt_to_hf, "bert": hf.bert_to_hf, "llama": gpt_to_hf_decoder}
        theirs = convert[args.arch](ours)
        if args.arch == "bert":
            # BERT's token-type table (one type, zeros after conversion) is a bias ours does not
            # have:
            # frozen, the two models train the same parameters.
            theirs.bert.embeddings.token_type_embeddings.weight.requires_grad_(False)
        if suffix:
            # as launch.train does
            compile_model(ours, compile_scope_for(cfg, cuda))
            theirs.compile()  # what their users would do: the whole model, in place
        models["ours" + suffix], models["hf" + suffix] = ours, theirs
    plan = BatchPlan(cfg.data.micro_batch_size, cfg.grad_accum, denv.world_size)
    engines = {}
    for name, model in models.items():
        model.train()
        optimizer = build_optimizer(model, cfg.optim)
        engines[name] = Engine(
            model,
            optimizer,
            build_scheduler(optimizer, cfg.schedule, cfg.max_steps),
            deepspeed_config(cfg, plan),
        )
    inputs = [task.model_inputs(batch) for batch in batches]
    tokens = dist.all_reduce_sum([float(sum(task.tokens(x) for x in inputs))])[0]
    flops = dist.all_reduce_sum([float(sum(task.flops(cfg.model, x) for x in inputs))])[0]
    # Our labels are aligned with the predicting positions; GPT2LMHeadModel and LlamaForCausalLM
    # shift their own, so they are given the unshifted ids (the same targets). BERT's are the
    # same for both.
    theirs_inputs = [
        {**x, "labels": x["input_ids"].masked_fill(x["attention_mask"] == 0, IGNORE_INDEX)}
        if args.arch != "bert"
        else x
        for x in inputs
    ]
    device = next(iter(engines.values())).device  # `--compile on` builds no eager engine
    # Ours as the trainer feeds it (`Task.to_device`: packed blocks' all-ones mask dropped on the
    # host, so that a compiled graph takes SDPA's causal path too); theirs as their users do.
    on_device = {
        "ours": [task.to_device(x, device) for x in inputs],
        "hf": [{k: v.to(device) for k, v in x.items()} for x in theirs_inputs],
    }
    on_device.update({name + COMPILED: batches_of for name, batches_of in list(on_device.items())})

    def sync() -> None:
        if cuda:  # a barrier does not wait for the GPU's queued work
            torch.cuda.synchronize()
        dist.barrier()

    # each side's steps, timed on this rank's main thread; round 0 (warm-up) not counted
    clocks = {name: StepClock(skip=len(inputs)) for name in engines}

    def run_round(name: str, engine: Engine) -> tuple[float, float]:
        sync()
        start = time.perf_counter()
        for batch in on_device[name]:
            clocks[name].begin()  # the steps alone: the barriers' wait is outside it
            loss = engine(**batch).loss  # ours a NamedTuple, theirs a transformers ModelOutput
            engine.backward(loss)
            engine.step()
            clocks[name].end()
        sync()
        return time.perf_counter() - start, float(loss)

    seconds = {name: [] for name in engines}
    losses = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for round_index in range(args.rounds + 1):
        for name, engine in engines.items():
            elapsed, losses[name] = run_round(name, engine)
            if round_index:  # round 0 warms up: allocator, kernels, DeepSpeed buffers
                seconds[name].append(elapsed)
    ranks = dist.all_gather_object({name: c.figures()["off_cpu"] for name, c in clocks.items()})
    off = {name: [rank[name] for rank in ranks] for name in engines}
    if denv.is_main:
        result = {
            "arch": args.arch,
            "shape": args.shape,
            "precision": args.precision,
            "world_size": denv.world_size,
            "threads": torch.get_num_threads(),
            "micro_batch": cfg.data.micro_batch_size,
            "seq_len": int(batches[0]["input_ids"].shape[1]),
            "vocab_size": cfg.model.vocab_size,
            "parameters": n_params,
            "steps": len(inputs),
            "tokens_per_round": tokens,
            "flops_per_round": flops,
            "seconds": seconds,
            "off_cpu": off,
            "last_loss": losses,
            "peaks": peaks,
            "hf_class": type(theirs).__name__,
            "hf_attention": getattr(theirs.config, "_attn_implementation", None),
            "compile_scope": compile_scope_for(cfg, cuda),
            "zero_stage": cfg.deepspeed.zero_stage,
            "device": torch.cuda.get_device_name() if cuda else platform.processor() or "cpu",
            "peak_source": peak_flops(cfg.deepspeed.precision)[1] if cuda else "measured GEMM",
            "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
            "torch": torch.__version__,
        }
        Path(args.result).write_text(json.dumps(result))
    dist.destroy()


# ---------------------------------------------------------------- the driver


def run_job(args: argparse.Namespace, arch: str, shape: str, precision: str, result: Path) -> dict:
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(args.nproc),
        __file__,
        "--worker",
        "--arch",
        arch,
        "--shape",
        shape,
        "--precision",
        precision,
        "--data",
        str(args.data),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--compile",
        args.compile,
        "--adamw",
        args.adamw,
        "--compile-scope",
        args.compile_scope,
        "--zero-stage",
        str(args.zero_stage),
        "--micro-batch",
        str(args.micro_batch or 0),
        "--result",
        str(result),
    ]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "PYTHONWARNINGS": "ignore",
    }
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        # The worker's own error (a rank's traceback), not only torchrun's summary after it.
        lines = proc.stderr.strip().splitlines()
        errors = [line for line in lines if line.startswith("[rank") and "Error" in line]
        tail = "\n".join(errors[-2:] + lines[-15:])
        raise SystemExit(
            f"error: benchmark job {arch}/{shape}/{precision} failed (exit {proc.returncode}):\n{tail}"
        )
    return json.loads(result.read_text())


def modes(r: dict) -> list[str]:
    """The key suffixes of a job's pairs: "" (both eager) and/or COMPILED (both compiled)."""
    return [suffix for suffix in ("", COMPILED) if "ours" + suffix in r["seconds"]]


def summarize(r: dict, suffix: str = "") -> dict:
    """Figures of one pair, ours and theirs both eager (suffix "") or both compiled (COMPILED)."""
    ours, theirs = (
        statistics.median(r["seconds"]["ours" + suffix]),
        statistics.median(r["seconds"]["hf" + suffix]),
    )
    achieved = r["flops_per_round"] / ours
    return {
        "ours_tps": r["tokens_per_round"] / ours,
        "hf_tps": r["tokens_per_round"] / theirs,
        "ratio": theirs / ours,
        "achieved": achieved,
        "mfu": achieved / r["peaks"][r["precision"]],
        "mfu_fp32": achieved / r["peaks"]["fp32"],
        "mfu_bf16": achieved / r["peaks"]["bf16"],
    }


def table(results: list[dict]) -> str:
    lines = [
        "| model (ours vs HF) | shape | params | precision | ours tok/s | HF tok/s | ours / HF | ours GFLOP/s | "
        "GEMM peak fp32 / bf16 | MFU vs fp32 peak | MFU vs bf16 peak |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r, suffix in [(r, suffix) for r in results for suffix in modes(r)]:
        s = summarize(r, suffix)
        precision = r["precision"] + (", both compiled" if suffix else "")
        lines.append(
            f"| {r['arch'].upper()} vs {r['hf_class']} | {r['shape']} | {r['parameters'] / 1e6:.2f} M | {precision} | "
            f"{s['ours_tps']:,.0f} | {s['hf_tps']:,.0f} | **{s['ratio']:.2f}x** | {s['achieved'] / 1e9:.1f} | "
            f"{r['peaks']['fp32'] / 1e9:.0f} / {r['peaks']['bf16'] / 1e9:.0f} | {100 * s['mfu_fp32']:.1f}% | "
            f"{100 * s['mfu_bf16']:.1f}% |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="a prepared dataset (default: %(default)s)"
    )
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--archs", default="gpt,bert", help="of gpt, bert, llama")
    parser.add_argument(
        "--shapes", default="tiny,small", help=f"of {', '.join(SHAPES)} (default: %(default)s)"
    )
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument(
        "--compile",
        default="off,on",
        choices=("off", "on", "off,on"),
        help="eager pairs, compiled pairs or both in each job (default: %(default)s)",
    )
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed round")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each model")
    from launch.config import COMPILE_SCOPES  # no torch behind it: --help stays quick

    parser.add_argument(
        "--compile-scope",
        default="auto",
        choices=COMPILE_SCOPES,
        help="compile_scope of ours when compiled (default: %(default)s, the trainer's default)",
    )
    parser.add_argument(
        "--adamw",
        default="auto",
        choices=("auto", "fused", "foreach", "for_loop"),
        help="torch AdamW's kernel for both sides (optim.implementation; default: %(default)s)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="smoke run: tiny fp32 only, 4 steps, 1 round"
    )
    parser.add_argument(
        "--zero-stage", type=int, default=2, choices=(0, 1, 2, 3), help="default: %(default)s"
    )
    parser.add_argument(
        "--micro-batch", type=int, default=0, help="micro batch size (default: the config's)"
    )
    parser.add_argument("--json", type=Path, help="also write the raw results here")
    # Internal: one rank of one torchrun job.
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--arch", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    parser.add_argument("--precision", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    if not (args.data / "manifest.json").is_file():
        print(
            f"error: no prepared dataset at {args.data}; make it with `python -m pipeline.prepare "
            f"configs/prepare_gettext_en_de.yaml` (or `make main`)",
            file=sys.stderr,
        )
        return 2
    if args.quick:
        args.shapes, args.precisions, args.compile, args.steps, args.rounds = (
            "tiny",
            "fp32",
            "off",
            4,
            1,
        )
    for arch in args.archs.split(","):
        if arch not in CONFIGS:
            parser.error(f"--archs: unknown arch {arch!r} (have {', '.join(CONFIGS)})")
    shapes = args.shapes.split(",")
    for shape in shapes:
        if shape not in SHAPES:
            parser.error(f"--shapes: unknown shape {shape!r} (have {', '.join(SHAPES)})")
    import torch
    import transformers

    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, "
        f"transformers {transformers.__version__}; "
        f"{torch.cuda.get_device_name() if torch.cuda.is_available() else 'CPU'}; "
        f"{args.nproc} ranks x 1 thread, DeepSpeed ZeRO-{args.zero_stage}, "
        f"{args.rounds} timed rounds of {args.steps} steps per model, alternating; compile {args.compile}; "
        f"ours compile_scope {args.compile_scope}; AdamW {args.adamw}",
        flush=True,
    )
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for arch in args.archs.split(","):
            for shape in shapes:
                for precision in args.precisions.split(","):
                    started = time.time()
                    r = run_job(args, arch, shape, precision, Path(tmp) / "result.json")
                    for suffix in modes(r):
                        s = summarize(r, suffix)
                        ours, theirs = "ours" + suffix, "hf" + suffix
                        print(
                            f"{arch} {shape} {precision}{', both compiled' if suffix else ''}: ours {s['ours_tps']:,.0f} "
                            f"tok/s, HF {s['hf_tps']:,.0f} tok/s, {s['ratio']:.2f}x; MFU {100 * s['mfu']:.1f}% of "
                            f"{r['peaks'][precision] / 1e9:.1f} GFLOP/s ({precision} GEMM peak, all ranks); rounds ours "
                            f"{[round(x, 2) for x in r['seconds'][ours]]} s, HF {[round(x, 2) for x in r['seconds'][theirs]]} s; "
                            f"last losses ours {r['last_loss'][ours]:.3f}, HF {r['last_loss'][theirs]:.3f}",
                            flush=True,
                        )
                        if not torch.cuda.is_available():
                            print(
                                f"  off the CPU, per rank (1 - main thread's CPU / wall of the timed steps): "
                                f"ours {shares(r['off_cpu'][ours])}, HF {shares(r['off_cpu'][theirs])}",
                                flush=True,
                            )
                    speedup = ""
                    if len(modes(r)) == 2:
                        eager, compiled = summarize(r), summarize(r, COMPILED)
                        speedup = (
                            f"compiled / eager: ours {compiled['ours_tps'] / eager['ours_tps']:.2f}x, "
                            f"HF {compiled['hf_tps'] / eager['hf_tps']:.2f}x; "
                        )
                    print(f"  {speedup}{time.time() - started:.0f} s", flush=True)
                    results.append(r)
    print()
    print(table(results))
    peak_note = (
        f"{results[0]['peak_source']}, summed over the ranks"
        if torch.cuda.is_available() and results
        else "(1024 x 1024) @ (1024 x 1024) for 1 s on every rank at once in each job, summed "
        "over the ranks"
    )
    if torch.cuda.is_available():
        for r in results:
            print(
                f"{r['arch']} {r['shape']}: peak GPU memory of the job {r['max_memory_gib']:.2f} GiB"
            )
    print(
        f"\nPeaks: {peak_note} ({args.nproc} ranks). MFU = model FLOPs of the timed steps (model.flops, as the trainer logs it) / "
        f"time / peak. Tokens/s: every input token of every rank."
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
