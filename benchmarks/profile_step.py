"""Where a training micro batch's time goes, ours against Hugging Face's, eager and compiled; prints figures, asserts nothing.

    python benchmarks/profile_step.py [--arch gpt|bert] [--shape tiny|small] [--precision fp32|bf16]
                                      [--variants ours,ours_blocks,ours_model,hf,hf_compiled]
                                      [--steps 10] [--rounds 3] [--profile VARIANTS]

One process, one thread, no DeepSpeed and no optimizer: forward and backward of one micro batch
(8 x 128 random tokens, vocabulary 8,000; BERT with 15% of them scored) through our model
(`model.build_model` of configs/tiny_{arch}.yaml with the shape of `bench_train.py`) and
`transformers`' model converted from it (`model.hf`), in the training precision (the weights cast
to it, as DeepSpeed does). Variants: ours eager, ours compiled as `compile_scope=blocks` and
`compile_scope=model` compile it (`launch.train.setup.compile_model`), theirs eager and compiled
as their users do (`model.compile()`). Rounds of `--steps` micro batches alternate the variants
after an untimed one (where they compile); the median ms per micro batch is printed.
`--profile` then records 5 micro batches of each named variant with torch.profiler and prints
one table: the ops' own time per micro batch grouped by what they do (GEMMs by where they are,
SDPA's kernels, inductor's fused kernels, the rest).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_train import CONFIGS, SHAPES  # noqa: E402

VOCAB, BATCH, LENGTH = 8000, 8, 128
VARIANTS = ("ours", "ours_blocks", "ours_model", "hf", "hf_compiled")
GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def build(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """The variants' models, and ours' and theirs' inputs."""
    import torch

    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.train.setup import compile_model
    from model import build_model, hf
    from model.loss import IGNORE_INDEX

    overrides = [f"model.{key}={value}" for key, value in SHAPES[args.shape].items()]
    cfg = load_config(
        TrainConfig, ROOT / CONFIGS[args.arch], [*overrides, f"model.vocab_size={VOCAB}"]
    )
    torch.manual_seed(0)
    initial = build_model(cfg.model)
    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(5, VOCAB, (BATCH, LENGTH), generator=generator)
    # ours: labels aligned with the predicting positions; theirs shifts its own
    if args.arch == "gpt":
        ours_in = {
            "input_ids": ids,
            "labels": torch.cat([ids[:, 1:], torch.full((BATCH, 1), IGNORE_INDEX)], 1),
        }
        hf_in = {"input_ids": ids, "labels": ids}
    else:
        labels = torch.full_like(ids, IGNORE_INDEX)
        scored = torch.rand(BATCH, LENGTH, generator=generator) < 0.15
        labels[scored] = ids[scored]
        hf_in = {"input_ids": ids, "labels": labels}
        # as launch.tasks
        ours_in = {**hf_in, "scored_index": (labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(1)}
    models = {}
    for variant in args.variants.split(","):
        model = copy.deepcopy(initial)
        if variant.startswith("hf"):
            model = hf.gpt_to_hf(model) if args.arch == "gpt" else hf.bert_to_hf(model)
            if variant == "hf_compiled":
                model.compile()
        elif variant != "ours":
            compile_model(model, variant.removeprefix("ours_"))
        models[variant] = model.to(dtype).train()
    return models, ours_in, hf_in


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="gpt", choices=tuple(CONFIGS))
    parser.add_argument("--shape", default="small", choices=("tiny", "small"))
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--steps", type=int, default=10, help="micro batches per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--profile", default="", help="variants to profile after timing (comma-separated)"
    )
    args = parser.parse_args(argv)
    for variant in {*args.variants.split(","), *filter(None, args.profile.split(","))}:
        if variant not in VARIANTS:
            parser.error(f"unknown variant {variant!r} (have {', '.join(VARIANTS)})")
    import torch

    torch.set_num_threads(1)
    models, ours_in, hf_in = build(args)

    def step(variant: str) -> float:
        model = models[variant]
        loss = model(**(hf_in if variant.startswith("hf") else ours_in)).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        return float(loss)

    times: dict[str, list[float]] = {variant: [] for variant in models}
    for round_index in range(args.rounds + 1):
        for variant in models:
            start = time.perf_counter()
            for _ in range(args.steps):
                loss = step(variant)
            if round_index:  # round 0 warms up and compiles
                times[variant].append((time.perf_counter() - start) / args.steps)
            else:
                print(f"{variant}: loss {loss:.4f}", flush=True)
    for variant, seconds in times.items():
        print(
            f"{args.arch} {args.shape} {args.precision} {variant:12s} {1000 * statistics.median(seconds):7.1f} ms "
            f"per micro batch (rounds: {', '.join(f'{1000 * s:.1f}' for s in seconds)})"
        )
    if args.profile:
        print(profile_table(step, args.profile.split(",")))
    return 0


def category(name: str, shapes: str) -> str:
    if name in GEMMS:
        if str(VOCAB) in shapes:
            return "GEMM: vocabulary (logits and their gradients)"
        return (
            "GEMM: attention (recomputed scores)"
            if name in ("aten::bmm", "aten::baddbmm")
            else "GEMM: blocks"
        )
    if "flash_attention" in name:
        return "SDPA flash backward" if "backward" in name else "SDPA flash forward"
    if "CompiledFxGraph" in name:
        return "inductor's fused kernels"
    return "other ops (element-wise, copies, dispatch)"


def profile_table(step, variants: list[str], repeat: int = 5) -> str:
    from torch.profiler import ProfilerActivity, profile

    rows: dict[str, dict[str, float]] = {}
    for variant in variants:
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for _ in range(repeat):
                step(variant)
        rows[variant] = {}
        for event in prof.key_averages(group_by_input_shape=True):
            key = category(event.key, str(event.input_shapes))
            rows[variant][key] = (
                rows[variant].get(key, 0.0) + event.self_cpu_time_total / 1000 / repeat
            )
    keys = sorted({key for row in rows.values() for key in row})
    lines = [
        "| ms per micro batch (op self time) | " + " | ".join(rows) + " |",
        "|---|" + "---:|" * len(rows),
    ]
    lines += [
        f"| {key} | " + " | ".join(f"{row.get(key, 0.0):.1f}" for row in rows.values()) + " |"
        for key in keys
    ]
    lines.append(
        "| total | " + " | ".join(f"{sum(row.values()):.1f}" for row in rows.values()) + " |"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
