"""Translation fine-tuning vs Hugging Face's Seq2SeqTrainer + MarianMTModel: BLEU, chrF, tokens/s; prints figures, asserts nothing.

    python benchmarks/bench_translation.py [--data data/gettext-en-de] [--config configs/small_translation.yaml]
                                           [--steps 400] [--nproc 2] [--beam 4] [--split test] [--limit N]
                                           [--out runs/bench_translation] [--rounds 1] [--variant NAME:k=v,...]
                                           [--data-seeds S,S,...] [key.sub=value ...]

Both sides start from random weights, train `--steps` optimizer steps on `--nproc` ranks on the
dataset's translation train pairs, and are scored on `--split` with the same decoding settings and
the same sacrebleu call. The `key.sub=value` overrides apply to CONFIG, hence to both sides.

1. Ours: the real entry points, as `launch.main` runs them: `torch.distributed.run --standalone
   --nproc_per_node N -m launch.train` (through benchmarks/rank_clock.py, which times each step
   on each rank and changes nothing else) `CONFIG data.data_dir=DATA run_dir=OUT/ours max_steps=STEPS
   eval_every=0 checkpoint.every_steps=0 wandb.mode=disabled [overrides]` (no evaluation or
   checkpoint until the end, as for theirs), then `launch.evaluate checkpoint=OUT/ours split=SPLIT
   beam=BEAM` in one process (its scores.json). Train seconds: the trainer's own timing of its
   optimizer steps (`perf/tokens_per_s` of each logged window of OUT/ours/metrics.jsonl, turned
   back into seconds with the window's tokens); process start, model and engine building, the
   final evaluation and checkpoint are outside it. Final train loss: the last step's.
2. Theirs: this script's `--worker` under the same `torch.distributed.run --nproc_per_node N`: a
   `MarianMTModel` from a `MarianConfig` of CONFIG's shape (d_model, encoder/decoder layers, heads
   and d_ff, dropout on residual branches and attention probabilities, init std, LayerNorm eps
   1e-5 like ours; vocabulary, <pad>/<s>/</s> ids from the manifest's tokenizer; decoder start
   <s>; max_position_embeddings = max_seq_len; encoder/decoder embeddings shared only with
   `model.share_embeddings`, the output projection tied to the decoder's embedding as in ours),
   random init from `seed`, trained by `Seq2SeqTrainer` with DDP (gloo on CPU, `use_cpu`),
   per-device batch = `data.micro_batch_size`, `grad_accum`, `max_steps` = STEPS, torch AdamW with
   `optim.lr`, betas, eps and weight decay, `schedule.warmup_steps` then `cosine_with_min_lr` down
   to `schedule.min_lr_ratio` (our cosine's floor), `optim.grad_clip` as max_grad_norm,
   `model.label_smoothing` as label_smoothing_factor, `bf16` (CPU autocast) when
   `deepspeed.precision` is bf16, `data.num_workers` loader workers, the same threads per rank
   as ours (`launch.distributed.set_threads`), no evaluation, no checkpoint, the final model saved
   once. The pairs are `launch.evaluate.read_pairs(DATA, "train")`, shuffled by the Trainer's
   sampler (ours by our loader: the same pairs, another order); with `data.length_grouping`
   (ours: each step from `data.length_bands` bands of sizes, drawn shard by shard, dealt evenly
   to the ranks) the Trainer's own
   `train_sampling_strategy="group_by_length"` (random mega-batches of 50 micro batches, sorted
   by source length, cut into micro batches). Encoded as ours: source + </s>
   (cut to max_seq_len - 1 tokens first, as `launch.decoding.source_ids`), decoder input <s> +
   target, labels target + </s> (target cut to max_seq_len - 1), padded to the longest in the
   micro batch. The loss is the mean over the scored target tokens of the whole step, all ranks
   and micro batches (`average_tokens_across_devices=True`), as ours. Train seconds: rank 0's wall
   time from the first `on_step_begin` to the last `on_step_end` (a TrainerCallback), so the first
   batch's loading is outside it (ours counts it). Final train loss: the last step's, averaged
   over the ranks, as ours logs it.
3. Off the CPU: on a CPU, each rank's share of its optimizer steps (after the first 5) that its
   main thread was not running: waiting in collectives, for batches, or for a free core
   (`rank_clock.StepClock`: ours around `train_step`, theirs between the Trainer's step begin
   and end callbacks), per round and side.
4. Tokens: every non-pad source token (with its </s>) and target token (with its </s>) of every
   rank and micro batch, as `launch.tasks.Task.tokens` counts ours' `train/tokens_seen`; tokens/s
   = tokens / train seconds, and the ratio ours / theirs.
5. Scores: theirs is decoded in this process (all cores, as `launch.evaluate` in one process) in
   `launch.evaluate`'s batches (`launch.decoding.length_sorted_batches` of the same sources,
   EvaluateConfig's micro batch) with `generate(num_beams=BEAM, length_penalty=EvaluateConfig's,
   max_new_tokens=the max_len launch.evaluate uses, early_stopping=False)` (Hugging Face's stopping
   rule, which our beam search follows; `generate` has no per-source limit, so ours is decoded
   with `max_len_a=0 max_len_b=0`, the same max_len for every source), detokenized by `launch.decoding.detokenize` and scored
   by `launch.evaluate.score`, the function that scores ours: the same sacrebleu corpus BLEU and
   chrF, and signature.

Where Marian necessarily differs from ours (configs/small_translation.yaml), printed again at the end:
- positions: fixed sinusoids (Marian has no learned positions; ours are learned), so token embeddings
  are scaled by sqrt(d_model) (`scale_embedding`), as ours scales them under sinusoidal positions;
- norms: post-LN in both stacks, no norm after the embeddings and no final norm (ours: a post-LN
  encoder with a norm after the embeddings, BERT's; a pre-LN decoder with a final norm, GPT-2's);
- activation: one for both stacks, the encoder's (ours may differ per stack: gelu / gelu_tanh);
- the <pad> row of its embeddings is zero and never updated; a zero, untrained output bias buffer;
- weight decay on every weight but biases and LayerNorms (embeddings too; ours: linear layers'
  matrices only); warmup from lr 0 at the first step (ours (n + 1) / warmup);
- DDP (ours: DeepSpeed at CONFIG's `deepspeed.zero_stage`; at stage 0 bf16 is autocast over fp32
  weights as theirs, under ZeRO 1-3 DeepSpeed's bf16 weights with fp32 masters).

`--rounds N` trains every side N times, alternating (ours, each `--variant`, theirs, ours, ...),
so that a shared machine's drift reaches every side alike; the tokens/s ratio is that of the
medians, and BLEU is scored on round 1's models only (the rounds train the same from the same
seed). A `--variant NAME:key=value,...` is one more side of ours with those overrides (e.g.
another ZeRO stage), timed in every round and reported against ours and theirs.
`--data-seeds S,...` then trains and scores ours once more per `data.seed` (the sample order;
weights start from the same `seed`) and prints BLEU/chrF per order with their mean and sd: at
1,000 steps the order alone moves test BLEU by some 2 points, so one order's BLEU compares two
sample orders poorly (theirs is trained on its own sampler's one order).

Writes OUT/ours (run, log, eval-SPLIT/), OUT/theirs (log, model/, train.json, eval-SPLIT/ with
hypotheses and scores), OUT/NAME for each variant, OUT/ours-seedS for each extra order, OUT/round-K/ for rounds after the first, and
OUT/summary.json; all of them are replaced at each run.
Data: DATA defaults to data/gettext-en-de (made by `make main` or `python -m pipeline.prepare
configs/prepare_gettext_en_de.yaml`); without it the script says so and exits 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import rank_clock  # noqa: E402

from launch.main.plan import torchrun  # noqa: E402

DEFAULT_DATA = ROOT / "data" / "gettext-en-de"
DEFAULT_CONFIG = ROOT / "configs" / "small_translation.yaml"
# Marian's names for our activations (transformers.activations.ACT2FN).
MARIAN_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
DIFFERENCES = (
    "Marian vs ours: sinusoidal positions with embeddings x sqrt(d_model) (ours as CONFIG says); post-LN in both stacks, "
    "no embedding or final norm; one activation for both stacks (CONFIG's encoder's); <pad> embedding row frozen at 0; "
    "weight decay on embeddings too; warmup from lr 0; bf16 as autocast over fp32 weights; DDP instead of DeepSpeed ZeRO."
)


def resolve_config(args: argparse.Namespace):
    """CONFIG with the bench's keys and the user's overrides; the vocabulary and the special ids
    from the dataset, as the trainer resolves them."""
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.preconditions import with_data_tokenizer
    from launch.resolve import check_config
    from pipeline.specials import Specials

    cfg = load_config(
        TrainConfig,
        args.config,
        [f"data.data_dir={args.data}", f"max_steps={args.steps}", *args.overrides],
    )
    check_config(cfg)
    if cfg.task != "translation":
        raise SystemExit(f"error: {args.config}: task {cfg.task}, not translation")
    tokenizer = json.loads((Path(args.data) / "manifest.json").read_text())["tokenizer"]
    model_cfg, problem = with_data_tokenizer(
        dataclasses.replace(cfg.model, vocab_size=0),
        tokenizer["vocab_size"],
        Specials.from_manifest(tokenizer),
        args.data,
    )
    return dataclasses.replace(cfg, model=model_cfg)


def dataset_specials(data):
    """The special ids and frames of the dataset's tokenizer, as its manifest records them."""
    from pipeline.format import dataset_specials as specials_of
    from pipeline.format import read_manifest

    return specials_of(read_manifest(data))


# ---------------------------------------------------------------- theirs: one torchrun job (every
# rank)


def marian_config(model_cfg, tokenizer: dict):
    """A MarianConfig of our model's shape (see the module docstring for what cannot match)."""
    from transformers import MarianConfig

    encoder, decoder = model_cfg.for_stack("encoder"), model_cfg.for_stack("decoder")
    return MarianConfig(
        vocab_size=tokenizer["vocab_size"],
        decoder_vocab_size=tokenizer["vocab_size"],
        d_model=model_cfg.d_model,
        encoder_layers=encoder.n_layers,
        decoder_layers=decoder.n_layers,
        encoder_attention_heads=encoder.n_heads,
        decoder_attention_heads=decoder.n_heads,
        encoder_ffn_dim=encoder.d_ff,
        decoder_ffn_dim=decoder.d_ff,
        activation_function=MARIAN_ACTIVATIONS[encoder.activation],
        max_position_embeddings=model_cfg.max_seq_len,
        dropout=model_cfg.dropout,
        attention_dropout=model_cfg.dropout,
        activation_dropout=0.0,
        init_std=model_cfg.init_std,
        scale_embedding=True,
        pad_token_id=model_cfg.pad_id,
        bos_token_id=model_cfg.bos_id,
        eos_token_id=model_cfg.eos_id,
        decoder_start_token_id=model_cfg.bos_id,
        forced_eos_token_id=None,
        share_encoder_decoder_embeddings=model_cfg.share_embeddings,
        tie_word_embeddings=True,
    )


def scheduler_arguments(cfg) -> dict:
    """Our `schedule` as TrainingArguments (lr_scheduler_type and its kwargs, warmup)."""
    s = cfg.schedule
    if s.decay == "cosine":
        kind = (
            ("cosine_with_min_lr", {"min_lr_rate": s.min_lr_ratio})
            if s.min_lr_ratio
            else ("cosine", {})
        )
    elif s.decay == "linear" and not s.min_lr_ratio:
        kind = ("linear", {})
    elif s.decay == "constant":
        kind = ("constant_with_warmup", {})
    else:
        raise SystemExit(
            f"error: schedule.decay={s.decay} with min_lr_ratio={s.min_lr_ratio} has no Hugging Face "
            f"scheduler here; use cosine, linear with schedule.min_lr_ratio=0, or constant"
        )
    return {
        "lr_scheduler_type": kind[0],
        "lr_scheduler_kwargs": kind[1],
        "warmup_steps": s.warmup_steps,
    }


class PairDataset:
    """The train pairs cut as ours (see the module docstring): {"input_ids": source + </s>, "target": target},
    id lists; `input_ids` is where the Trainer's LengthGroupedSampler reads a pair's length."""

    def __init__(self, pairs, max_seq_len: int, specials):
        from launch.decoding import source_ids

        before, after = specials.source
        self.rows = [
            {
                "input_ids": source_ids(src, max_seq_len - len(before) - len(after), specials)[0],
                "target": [int(t) for t in tgt[: max_seq_len - 1]],
            }
            for src, tgt in pairs
        ]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int):
        return self.rows[index]


def collate(rows, specials) -> dict:
    """Marian's inputs of a micro batch, padded to its longest row: input_ids / attention_mask
    (source + </s>), decoder_input_ids (<s> + target), labels (target + </s>, IGNORE_INDEX on padding)."""
    import torch

    from model.loss import IGNORE_INDEX

    (start,), (end,) = specials.target
    pad_id = specials.pad_id

    def pad(seqs, value):
        out = torch.full((len(seqs), max(len(s) for s in seqs)), value, dtype=torch.long)
        for i, s in enumerate(seqs):
            out[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        return out

    input_ids = pad([row["input_ids"] for row in rows], pad_id)
    return {
        "input_ids": input_ids,
        "attention_mask": pad([[1] * len(row["input_ids"]) for row in rows], 0),
        "decoder_input_ids": pad([[start, *row["target"]] for row in rows], pad_id),
        "labels": pad([[*row["target"], end] for row in rows], IGNORE_INDEX),
    }


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed
    from transformers import (
        MarianMTModel,
        Seq2SeqTrainer,
        Seq2SeqTrainingArguments,
        TrainerCallback,
    )

    import launch.distributed as dist
    from launch.config import batch_plan
    from launch.evaluate import read_pairs
    from model.loss import IGNORE_INDEX

    cfg = resolve_config(args)
    denv = dist.read_env()
    dist.set_threads(cfg.threads_per_rank, denv)  # ours' rule: cores / local ranks
    plan = batch_plan(cfg, denv.world_size)
    specials = dataset_specials(args.data)
    dataset = PairDataset(read_pairs(args.data, "train"), cfg.model.max_seq_len, specials)
    tokenizer = json.loads((Path(args.data) / "manifest.json").read_text())["tokenizer"]
    torch.manual_seed(cfg.seed)
    model = MarianMTModel(marian_config(cfg.model, tokenizer))
    cpu = not torch.cuda.is_available()
    out = Path(args.out) / "theirs"

    class Clock(TrainerCallback):
        """Wall time from the first optimizer step's start to the last one's end, and each
        step's off-CPU time as `rank_clock` measures ours'."""

        start = end = None
        threads = 0
        steps = rank_clock.StepClock(skip=5)

        def on_train_begin(self, *_, **__):
            self.threads = torch.get_num_threads()  # after accelerate's set-up

        def on_step_begin(self, *_, **__):
            if self.start is None:
                self.start = time.perf_counter()
            self.steps.begin()

        def on_step_end(self, *_, **__):
            self.steps.end()
            self.end = time.perf_counter()

    class CountingTrainer(Seq2SeqTrainer):
        """Counts input tokens as ours does and keeps the loss of the current optimizer step."""

        tokens, padded, step_loss, loss_step = 0, 0, 0.0, -1

        def training_step(self, model, inputs, num_items_in_batch=None):
            self.tokens += int(inputs["attention_mask"].sum()) + int(
                (inputs["labels"] != IGNORE_INDEX).sum()
            )
            self.padded += inputs["input_ids"].numel() + inputs["labels"].numel()
            loss = super().training_step(model, inputs, num_items_in_batch)  # already / grad_accum
            if self.state.global_step != self.loss_step:
                self.loss_step, self.step_loss = self.state.global_step, 0.0
            self.step_loss += float(loss)
            return loss

    training_args = Seq2SeqTrainingArguments(
        output_dir=str(out),
        max_steps=cfg.max_steps,
        per_device_train_batch_size=plan.micro_batch_size,
        gradient_accumulation_steps=plan.grad_accum,
        learning_rate=cfg.optim.lr,
        adam_beta1=cfg.optim.beta1,
        adam_beta2=cfg.optim.beta2,
        adam_epsilon=cfg.optim.eps,
        weight_decay=cfg.optim.weight_decay,
        optim="adamw_torch",
        max_grad_norm=cfg.optim.grad_clip,
        label_smoothing_factor=cfg.model.label_smoothing,
        **scheduler_arguments(cfg),
        bf16=cfg.deepspeed.precision == "bf16",
        use_cpu=cpu,
        ddp_backend="gloo" if cpu else "nccl",
        ddp_find_unused_parameters=False,
        ddp_broadcast_buffers=False,
        average_tokens_across_devices=True,
        eval_strategy="no",
        save_strategy="no",
        logging_steps=cfg.log_every,
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
        dataloader_num_workers=cfg.data.num_workers,
        dataloader_pin_memory=not cpu,
        remove_unused_columns=False,
        train_sampling_strategy="group_by_length" if cfg.data.length_grouping else "random",
    )
    clock = Clock()
    trainer = CountingTrainer(
        model=model,
        args=training_args,
        train_dataset=dataset,
        data_collator=functools.partial(collate, specials=specials),
        callbacks=[clock],
    )
    trainer.train()
    tokens, padded, loss = dist.all_reduce_sum(
        [float(trainer.tokens), float(trainer.padded), trainer.step_loss]
    )
    ranks = dist.all_gather_object({"rank": denv.rank, **clock.steps.figures()})
    trainer.save_model(str(out / "model"))
    if denv.is_main:
        unwrapped = trainer.model
        positions = unwrapped.model.encoder.embed_positions.weight
        result = {
            "steps": trainer.state.global_step,
            "seconds": clock.end - clock.start,
            "tokens": tokens,
            "padding": padded / tokens,  # padded batch positions per real token
            "final_loss": loss / denv.world_size,
            "world_size": denv.world_size,
            "clock": ranks,
            "threads": clock.threads,
            "mixed_precision": str(trainer.accelerator.mixed_precision),
            "distributed": str(trainer.accelerator.distributed_type),
            "parameters": sum(
                p.numel()
                for p in {id(p): p for p in unwrapped.parameters()}.values()
                if p.requires_grad
            ),
            "positions_trained": bool(positions.requires_grad),
            "loss_log": [row for row in trainer.state.log_history if "loss" in row],
            "marian_config": unwrapped.config.to_diff_dict(),
        }
        (out / "train.json").write_text(json.dumps(result, indent=1) + "\n")
    if torch.distributed.is_initialized():
        torch.distributed.barrier()


# ---------------------------------------------------------------- the driver


def launch(command: list[str], log: Path, what: str) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "WANDB_MODE": "disabled",
    }
    started = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(
            command, cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT, text=True
        )
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-15:])
        raise SystemExit(f"error: {what} failed (exit {proc.returncode}), log {log}:\n{tail}")
    print(f"  {what}: {time.time() - started:.0f} s (log {log})", flush=True)


def run_ours(
    args: argparse.Namespace,
    out: Path,
    name: str = "ours",
    extra: tuple[str, ...] = (),
    scored: bool = True,
) -> dict:
    """One training job of ours into OUT/NAME (with `extra` overrides: a variant), then its scores."""
    from model import build_model

    run_dir = out / name
    launch(
        [
            *torchrun(args.nproc),
            str(ROOT / "benchmarks" / "rank_clock.py"),
            "--out",
            str(out / f"{name}-clock"),
            str(args.config),
            f"data.data_dir={args.data}",
            f"run_dir={run_dir}",
            f"max_steps={args.steps}",
            "eval_every=0",
            "checkpoint.every_steps=0",
            "wandb.mode=disabled",
            *args.overrides,
            *extra,
        ],
        out / f"{name}.log",
        f"{name}: launch.train",
    )
    rows = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if line.strip()
    ]
    windows = [row for row in rows if "perf/tokens_per_s" in row]
    seconds, seen = 0.0, 0
    for row in windows:  # each logged window: its tokens / its tokens per second
        seconds += (row["train/tokens_seen"] - seen) / row["perf/tokens_per_s"]
        seen = row["train/tokens_seen"]
    final = json.loads((run_dir / "final.json").read_text())
    result = {
        "steps": final["step"],
        "seconds": seconds,
        "tokens": seen,
        "final_loss": windows[-1]["train/loss"],
        "clock": rank_clock.read(out / f"{name}-clock"),
    }
    if not scored:
        return result
    eval_dir = run_dir / f"eval-{args.split}"
    launch(
        [
            sys.executable,
            "-m",
            "launch.evaluate",
            f"checkpoint={run_dir}",
            f"data_dir={args.data}",
            f"split={args.split}",
            f"beam={args.beam}",
            f"out={eval_dir}",
            f"limit={args.limit}",
            "max_len_a=0",
            "max_len_b=0",
        ],  # one max_len for every source, as theirs
        out / f"{name}-evaluate.log",
        f"{name}: launch.evaluate {args.split}",
    )
    scores = json.loads((eval_dir / "scores.json").read_text())
    # tied: counted once
    parameters = sum(p.numel() for p in build_model(resolve_config(args).model).parameters())
    return {
        **result,
        "parameters": parameters,
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "signature_bleu": scores["signature_bleu"],
        "signature_chrf": scores["signature_chrf"],
        "decode_seconds": scores["decode_seconds"],
        "n": scores["n"],
    }


def run_theirs(args: argparse.Namespace, out: Path, scored: bool = True) -> dict:
    (out / "theirs").mkdir(parents=True, exist_ok=True)
    launch(
        [
            *torchrun(args.nproc),
            __file__,
            "--worker",
            "--config",
            str(args.config),
            "--data",
            str(args.data),
            "--steps",
            str(args.steps),
            "--out",
            str(out),
            *args.overrides,
        ],
        out / "theirs.log",
        "theirs: Seq2SeqTrainer",
    )
    result = json.loads((out / "theirs" / "train.json").read_text())
    if not scored:
        return result
    started = time.time()
    result.update(evaluate_theirs(args, out / "theirs"))
    print(f"  theirs: generate and score {args.split}: {time.time() - started:.0f} s", flush=True)
    return result


def evaluate_theirs(args: argparse.Namespace, out: Path) -> dict:
    """Theirs decoded as `launch.evaluate` decodes ours, scored by the same function."""
    import torch
    from transformers import MarianMTModel
    from transformers.utils import logging as hf_logging

    from launch.config import EvaluateConfig
    from launch.decoding import check_decoding, detokenize, length_sorted_batches, source_ids
    from launch.evaluate import read_pairs, score
    from pipeline.tokenizer import load_tokenizer

    defaults = EvaluateConfig(checkpoint="")
    cfg = resolve_config(args)
    max_len = check_decoding(cfg.model, args.beam, defaults.max_len, defaults.micro_batch_size)
    torch.set_num_threads(
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    )
    hf_logging.disable_progress_bar()
    model = MarianMTModel.from_pretrained(out / "model").eval()
    pairs = read_pairs(args.data, args.split, args.limit)
    specials = dataset_specials(args.data)
    before, after = specials.source
    limit = cfg.model.max_seq_len - len(before) - len(after)
    sources = [source_ids(src, limit, specials)[0] for src, _ in pairs]
    pad_id, end = cfg.model.pad_id, cfg.model.eos_id
    hypotheses: dict[int, list[int]] = {}
    start = time.perf_counter()
    with torch.no_grad():
        for batch in length_sorted_batches([len(s) for s in sources], defaults.micro_batch_size):
            ids = torch.full(
                (len(batch), max(len(sources[i]) for i in batch)), pad_id, dtype=torch.long
            )
            mask = torch.zeros_like(ids)
            for row, i in enumerate(batch):
                ids[row, : len(sources[i])] = torch.tensor(sources[i])
                mask[row, : len(sources[i])] = 1
            generated = model.generate(
                input_ids=ids,
                attention_mask=mask,
                num_beams=args.beam,
                length_penalty=defaults.length_penalty,
                max_new_tokens=max_len,
                early_stopping=False,
                do_sample=False,
                num_return_sequences=1,
            )
            for row, i in enumerate(batch):
                tokens = generated[row, 1:].tolist()  # after the decoder start <s>
                hypotheses[i] = (
                    tokens[: tokens.index(end)]
                    if end in tokens
                    else [t for t in tokens if t != pad_id]
                )
    seconds = time.perf_counter() - start
    tokenizer = load_tokenizer(args.data)
    hyp_text = [detokenize(tokenizer, hypotheses[i]) for i in range(len(pairs))]
    ref_text = [detokenize(tokenizer, tgt) for _, tgt in pairs]
    scores = score(hyp_text, ref_text)
    eval_dir = out / f"eval-{args.split}"
    eval_dir.mkdir(parents=True, exist_ok=True)
    (eval_dir / "hypotheses.txt").write_text(
        "".join(line + "\n" for line in hyp_text), encoding="utf-8"
    )
    result = {
        "bleu": scores["bleu"],
        "chrf": scores["chrf"],
        "signature_bleu": scores["signature_bleu"],
        "signature_chrf": scores["signature_chrf"],
        "decode_seconds": round(seconds, 3),
        "n": len(pairs),
        "max_len": max_len,
        "length_penalty": defaults.length_penalty,
    }
    (eval_dir / "scores.json").write_text(
        json.dumps({**result, **{k: scores[k] for k in ("bleu_detail", "chrf_detail")}}, indent=1)
        + "\n"
    )
    return result


def tokens_per_s(r: dict) -> float:
    return r["tokens"] / r["seconds"]


def rounds_table(rounds: list[dict[str, dict]], medians: dict[str, float]) -> str:
    """Each round's tokens/s per side, in the order they ran, and the medians."""
    names = list(medians)
    lines = [
        "| round | " + " | ".join(f"{n} tokens/s" for n in names) + " |",
        "|---:|" + "---:|" * len(names),
    ]
    for k, sides in enumerate(rounds, 1):
        lines.append(
            f"| {k} | " + " | ".join(f"{tokens_per_s(sides[n]):,.0f}" for n in names) + " |"
        )
    lines.append("| median | " + " | ".join(f"{medians[n]:,.0f}" for n in names) + " |")
    return "\n".join(lines)


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """`NAME:key=value,key=value` -> (NAME, overrides)."""
    name, colon, rest = text.partition(":")
    overrides = tuple(o for o in rest.split(",") if o)
    if not colon or not name or not overrides or not all("=" in o for o in overrides):
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME:key=value[,key=value...]")
    return name, overrides


def parse_seeds(text: str) -> list[int]:
    """`1,2,3` -> [1, 2, 3]."""
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: expected distinct integers S,S,...")
    return seeds


def orders_table(orders: dict[int, dict], split: str) -> str:
    """Ours' scores per data order (data.seed), then their mean and sample standard deviation."""
    lines = [
        f"| data.seed | {split} BLEU | {split} chrF | final train loss |",
        "|---:|---:|---:|---:|",
    ]
    for seed, r in orders.items():
        lines.append(f"| {seed} | {r['bleu']:.1f} | {r['chrf']:.1f} | {r['final_loss']:.3f} |")
    for label, f in (("mean", statistics.mean), ("sd", statistics.stdev)):
        if label == "sd" and len(orders) < 2:
            break
        lines.append(
            f"| {label} | {f(r['bleu'] for r in orders.values()):.1f} | "
            f"{f(r['chrf'] for r in orders.values()):.1f} | "
            f"{f(r['final_loss'] for r in orders.values()):.3f} |"
        )
    return "\n".join(lines)


def table(sides: dict[str, dict], split: str) -> str:
    lines = [
        f"| side | steps | train seconds | tokens/s | final train loss | {split} BLEU | {split} chrF |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in sides.items():
        lines.append(
            f"| {name} | {r['steps']} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:,.0f} | "
            f"{r['final_loss']:.3f} | {r['bleu']:.1f} | {r['chrf']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--data", type=Path, default=DEFAULT_DATA, help="a prepared dataset (default: %(default)s)"
    )
    parser.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="our TrainConfig YAML (default: %(default)s)",
    )
    parser.add_argument(
        "--steps", type=int, default=400, help="optimizer steps of each side (default: %(default)s)"
    )
    parser.add_argument(
        "--nproc", type=int, default=2, help="ranks of each training job (default: %(default)s)"
    )
    parser.add_argument(
        "--beam", type=int, default=4, help="beam size of both evaluations (default: %(default)s)"
    )
    parser.add_argument(
        "--split",
        default="test",
        choices=("train", "valid", "test"),
        help="scored split (default: %(default)s)",
    )
    parser.add_argument(
        "--limit",
        type=int,
        default=0,
        help="score the split's first N pairs only; 0 = all (smoke runs)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=ROOT / "runs" / "bench_translation",
        help="(default: %(default)s)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="train each side this many times, alternating (ours, variants, theirs, ours, ...); tokens/s "
        "ratio of the medians; BLEU scored on round 1's models (default: %(default)s)",
    )
    parser.add_argument(
        "--variant",
        type=parse_variant,
        action="append",
        default=[],
        metavar="NAME:key=value,...",
        help="one more side of ours with these overrides (after CONFIG's and the shared ones), timed in "
        "every round; repeatable (e.g. zero1:deepspeed.zero_stage=1)",
    )
    parser.add_argument(
        "--data-seeds",
        type=parse_seeds,
        default=[],
        metavar="S,S,...",
        help="after the rounds, train and score ours once more for each of these data.seed values "
        "(sample orders; round 1's is CONFIG's), and print the BLEU over them all: at 1,000 steps "
        "one order's BLEU is a draw some 2 points wide (docs/results.md)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="key.sub=value overrides of CONFIG, for both sides"
    )
    # internal: one rank of theirs
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.data, args.config, args.out = (
        args.data.resolve(),
        args.config.resolve(),
        args.out.resolve(),
    )
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
    from common.configure import UserError
    from launch.config import batch_plan

    try:
        cfg = resolve_config(args)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    import torch
    import transformers

    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    variants = dict(args.variant)
    if len(variants) != len(args.variant) or {"ours", "theirs"} & set(variants):
        parser.error("--variant: names must differ from each other and from ours and theirs")
    for side in ("ours", "theirs", *variants, *(f"round-{k}" for k in range(2, args.rounds + 1))):
        shutil.rmtree(args.out / side, ignore_errors=True)
    m = cfg.model
    print(
        f"machine: {platform.machine()} {os.cpu_count()} cores, torch {torch.__version__}, transformers "
        f"{transformers.__version__}; {args.config.name}: d_model {m.d_model}, {m.n_layers}+{m.n_decoder_layers or m.n_layers} "
        f"layers, {m.n_heads} heads, d_ff {m.d_ff}, vocab {m.vocab_size}, {cfg.deepspeed.precision}, micro batch "
        f"{cfg.data.micro_batch_size} x {args.nproc} ranks, {args.steps} steps; {args.split} beam {args.beam}"
        f"{f', first {args.limit} pairs' if args.limit else ''}",
        flush=True,
    )
    rounds: list[dict[str, dict]] = []
    # alternating, so that the machine's drift reaches every side alike
    for k in range(1, args.rounds + 1):
        out = args.out if k == 1 else args.out / f"round-{k}"
        out.mkdir(parents=True, exist_ok=True)
        if args.rounds > 1:
            print(f"round {k} of {args.rounds}", flush=True)
        sides = {"ours": run_ours(args, out, scored=k == 1)}
        for name, extra in variants.items():
            sides[name] = run_ours(args, out, name, extra, scored=False)
        sides["theirs"] = run_theirs(args, out, scored=k == 1)
        rounds.append(sides)
    first = rounds[0]
    # Ours again on other sample orders: BLEU at this budget moves with the order alone.
    orders = {cfg.data.seed: first["ours"]}
    for seed in (x for x in args.data_seeds if x != cfg.data.seed):
        shutil.rmtree(args.out / f"ours-seed{seed}", ignore_errors=True)
        orders[seed] = run_ours(args, args.out, f"ours-seed{seed}", (f"data.seed={seed}",))
    medians = {name: statistics.median(tokens_per_s(r[name]) for r in rounds) for name in first}
    sides = {
        "ours (random/random)": first["ours"],
        "HF MarianMTModel + Seq2SeqTrainer": first["theirs"],
    }
    ours, theirs = sides.values()
    ratio = medians["ours"] / medians["theirs"]
    global_batch = batch_plan(cfg, args.nproc).global_batch_size
    print()
    print(table(sides, args.split))
    if args.rounds > 1 or variants:
        print(f"\n{rounds_table(rounds, medians)}")
        for name, extra in variants.items():
            print(
                f"variant {name} ({' '.join(extra)}): {medians[name] / medians['theirs']:.2f}x theirs, "
                f"{medians[name] / medians['ours']:.3f}x ours (medians of {args.rounds} round(s))"
            )
    if not torch.cuda.is_available():
        print(
            "\nOff the CPU, per rank (1 - the main thread's CPU time / wall time of its steps after the "
            "first 5: waiting in collectives, for batches, or for a free core):"
        )
        for k, r in enumerate(rounds, 1):
            print(
                f"  round {k}: "
                + "; ".join(
                    f"{name} {rank_clock.shares([x['off_cpu'] for x in r[name]['clock']])}"
                    for name in r
                )
            )
    print(
        f"\ntokens/s ours / theirs{f' (medians of {args.rounds} rounds)' if args.rounds > 1 else ''}: "
        f"**{ratio:.2f}x**; BLEU ours - theirs: {ours['bleu'] - theirs['bleu']:+.1f}; tokens "
        f"trained: ours {ours['tokens']:,.0f}, theirs {theirs['tokens']:,.0f} (the same steps of {global_batch} pairs, drawn "
        f"by each side's own sampler)"
    )
    print(
        "Tokens: source + target tokens (each with its </s>) of every rank. Train seconds: the optimizer steps only. "
        "Loss: nats per target token, label-smoothed, the last step's."
    )
    print(
        f"Parameters: ours {ours['parameters'] / 1e6:.2f} M, theirs {theirs['parameters'] / 1e6:.2f} M trained "
        f"(sinusoidal positions {'trained' if theirs['positions_trained'] else 'fixed'}). {DIFFERENCES}"
    )
    if len(orders) > 1:
        print(f"\nOurs over {len(orders)} sample orders (data.seed; round 1's first):")
        print(orders_table(orders, args.split))
    print(f"sacrebleu: {ours['signature_bleu']} | {ours['signature_chrf']}")
    if (ours["signature_bleu"], ours["signature_chrf"]) != (
        theirs["signature_bleu"],
        theirs["signature_chrf"],
    ):
        print(
            f"warning: theirs was scored with another signature: {theirs['signature_bleu']} | {theirs['signature_chrf']}"
        )
    summary = {
        "args": {
            k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "worker"
        },
        "ours": ours,
        "theirs": {k: v for k, v in theirs.items() if k not in ("marian_config", "loss_log")},
        "tokens_per_s_ratio": ratio,
        "table": table(sides, args.split),
        "rounds": [
            {
                name: {k: r[name][k] for k in ("steps", "seconds", "tokens", "final_loss", "clock")}
                for name in r
            }
            for r in rounds
        ],
        "median_tokens_per_s": medians,
        "variants": {name: list(extra) for name, extra in variants.items()},
        "data_orders": {
            str(seed): {k: r[k] for k in ("bleu", "chrf", "final_loss", "tokens", "seconds")}
            for seed, r in orders.items()
        },
        "signature": f"{ours['signature_bleu']} | {ours['signature_chrf']}",
        "marian_config": theirs["marian_config"],
    }
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"(also in {args.out / 'summary.json'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
