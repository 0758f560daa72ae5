"""A translation micro batch through ours and through Marian, timed and profiled; prints figures, asserts nothing.

    python benchmarks/profile_translation_step.py [--data DIR] [--config configs/small_translation.yaml]
                                                  [--batches 20] [--rounds 3]

One process, one thread, no DeepSpeed and no optimizer: forward and backward of the first
`--batches` micro batches of rank 0 of 2's train shards (the loader as `launch.train` runs it:
CONFIG's micro batch and length grouping) through our Seq2Seq in bf16 weights (as DeepSpeed holds
them) and through `MarianMTModel` of the same shape (`bench_translation.marian_config`) under
bf16 autocast over float32 weights with a float32 label-smoothed cross-entropy, as
`Seq2SeqTrainer` runs it. Rounds alternate the two after an untimed one; then torch.profiler
records one pass over the batches each and the ops' own time per micro batch is printed, the
GEMMs split into those onto the vocabulary and the rest. What `bench_translation.py` measures
beyond this (DeepSpeed or DDP, the optimizer, the loader, two ranks on the machine) is the
difference between the two.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks.bench_translation import DEFAULT_DATA, marian_config  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "small_translation.yaml")
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if not (args.data / "manifest.json").exists():
        print(
            f"error: no prepared dataset at {args.data}: run `python -m pipeline.prepare "
            f"configs/prepare_gettext_en_de.yaml` (or `make main`)",
            file=sys.stderr,
        )
        return 2
    import torch
    import torch.nn.functional as F
    from torch.profiler import ProfilerActivity, profile
    from transformers import MarianMTModel

    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.tasks import TASKS
    from model import build_model
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    torch.set_num_threads(1)
    cfg = load_config(
        TrainConfig, args.config, [f"data.data_dir={args.data}", "data.num_workers=0"]
    )
    loader = ShardLoader(
        LoaderPlan.from_config(cfg.data, "translation", "train", rank=0, world_size=2)
    )
    cfg = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, vocab_size=loader.vocab_size)
    )
    task = TASKS["translation"]
    ours_batches = []
    for batch in loader:
        ours_batches.append(task.model_inputs(batch))
        if len(ours_batches) == args.batches:
            break
    real = sum(int(x["src_mask"].sum() + x["decoder_mask"].sum()) for x in ours_batches) / len(
        ours_batches
    )
    padded = sum(x["src_ids"].numel() + x["decoder_input_ids"].numel() for x in ours_batches) / len(
        ours_batches
    )
    print(
        f"{len(ours_batches)} micro batches of {cfg.data.micro_batch_size} pairs: {real:.0f} real tokens and "
        f"{padded:.0f} padded positions each on average"
    )
    theirs_batches = [
        {
            "input_ids": x["src_ids"],
            "attention_mask": x["src_mask"],
            "decoder_input_ids": x["decoder_input_ids"],
            "decoder_attention_mask": x["decoder_mask"],
            "labels": x["labels"],
        }
        for x in ours_batches
    ]
    tokenizer = json.loads((args.data / "manifest.json").read_text())["tokenizer"]
    torch.manual_seed(0)
    ours = build_model(cfg.model).to(torch.bfloat16).train()
    theirs = MarianMTModel(marian_config(cfg.model, tokenizer)).train()
    smoothing = cfg.model.label_smoothing

    def ours_step(x: dict) -> None:
        ours(**x).loss.backward()
        ours.zero_grad(set_to_none=True)

    def theirs_step(x: dict) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = theirs(**{k: v for k, v in x.items() if k != "labels"}).logits
        loss = F.cross_entropy(
            logits.float().flatten(0, 1), x["labels"].flatten(), label_smoothing=smoothing
        )
        loss.backward()
        theirs.zero_grad(set_to_none=True)

    sides = {"ours": (ours_step, ours_batches), "Marian": (theirs_step, theirs_batches)}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    for round_index in range(args.rounds + 1):
        for name, (step, batches) in sides.items():
            start = time.perf_counter()
            for x in batches:
                step(x)
            if round_index:
                seconds[name].append((time.perf_counter() - start) / len(batches))
    for name, times in seconds.items():
        print(
            f"{name:7s} {1000 * statistics.median(times):6.1f} ms per micro batch "
            f"(rounds: {', '.join(f'{1000 * t:.1f}' for t in times)})"
        )
    vocab = str(cfg.model.vocab_size)
    rows: dict[str, dict[str, float]] = {}
    for name, (step, batches) in sides.items():
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            for x in batches:
                step(x)
        rows[name] = {}
        for event in prof.key_averages(group_by_input_shape=True):
            key = event.key
            if key in ("aten::mm", "aten::addmm", "aten::bmm"):
                key = "GEMM: vocabulary" if vocab in str(event.input_shapes) else "GEMM: the rest"
            rows[name][key] = rows[name].get(key, 0.0) + event.self_cpu_time_total / 1000 / len(
                batches
            )
    # The two GEMM rows always, then the costliest other ops by name, the remainder summed in one
    # row
    # (where GEMMs are fast, as with AMX, the vocabulary's would otherwise fall below the cut).
    gemms = ["GEMM: vocabulary", "GEMM: the rest"]
    others = sorted(
        {k for row in rows.values() for k in row} - set(gemms),
        key=lambda k: -max(row.get(k, 0.0) for row in rows.values()),
    )
    shown, rest = others[:12], others[12:]
    print(
        "| ms per micro batch (op self time) | "
        + " | ".join(rows)
        + " |\n|---|"
        + "---:|" * len(rows)
    )
    for key in gemms + shown:
        print(
            f"| {key} | " + " | ".join(f"{row.get(key, 0.0):.1f}" for row in rows.values()) + " |"
        )
    print(
        f"| {len(rest)} other ops | "
        + " | ".join(f"{sum(row.get(k, 0.0) for k in rest):.1f}" for row in rows.values())
        + " |"
    )
    print(
        "| total (all ops) | "
        + " | ".join(f"{sum(row.values()):.1f}" for row in rows.values())
        + " |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
