"""`python -m launch.train CONFIG [key=value ...] --dry-run`: what a run would be, and every reason it would fail, in seconds.

For a login node before `sbatch`, and for the batch scripts (`slurm/common.sh`, once, before
any rank starts): no process group, no DeepSpeed engine, no GPU, nothing written. The config
is resolved the trainer's way; the model is built on the meta device, which costs no memory
and gives the exact parameter count. The report: world size and global batch as they would
be, tokens per step, steps per epoch and the epochs `max_steps` covers, parameters, FLOPs per
step and per token (`model.flops`), memory per GPU (DeepSpeed's estimator for the model
states, `launch.deepspeed.estimate.estimate_model_state_memory`, plus our estimate of the micro batch's
activations), and the dataset checked against its manifest, its tokenizer, the model and any
warm-start source. Every problem found is listed at once, each naming its key; the exit
status is 2 if there is any, else 0. Warnings (no evaluation, fp16 needing a GPU, ...) are
listed too but do not fail the run.

A warm-start source (`init.encoder`, `init.decoder`) is an exported directory; before it
exists, the training config that will produce it (a YAML) stands in: its model is checked
against the stack it would fill, with a warning that the run itself needs the export. The main
job's `--dry-run` (`launch.main.preflight`) checks a chain whose dataset is not prepared yet
against what its prepare config will make (`PlannedData`).

    python -m launch.preflight [--world-size N] [--ranks-per-node N] [--json] CONFIG.yaml [key.sub=value ...]

is the same report (`--dry-run` is not needed there). The world size is read from the
environment as `launch.distributed.read_env` reads it (torchrun, the deepspeed launcher,
srun), or given with `--world-size` to plan a job from a login node; `--ranks-per-node`
(default: the environment's, else 1) only sets how ranks group into nodes for DeepSpeed's
per-node CPU figures.
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from launch import checkpoint as ckpt
from launch import distributed as dist
from launch.config import BatchPlan, TrainConfig, batch_plan, config_problems
from launch.deepspeed.config import deepspeed_config
from launch.deepspeed.estimate import estimate_model_state_memory
from launch.export import CONFIG as EXPORT_CONFIG
from launch.export import WEIGHTS as EXPORT_WEIGHTS
from launch.preconditions import data_fits_model
from launch.tasks import TASKS, Task
from model import ModelConfig, build_model, training_flops
from model.config import GATED_ACTIVATIONS, STACKS
from model.loss import chunk_peak_bytes
from model.warm_start import SOURCE_CLASSES, architecture_fields
from pipeline import remote
from common.configure import UserError, config_from_dict, load_config, parse_cli, run_main, strip_launcher_args
from pipeline.format import TOKENIZER_FILE, ManifestError, read_manifest, shard_entries
from common.hashing import file_sha256
from pipeline.epoch import DEFAULT_SOURCE

USAGE = """usage: python -m launch.preflight [--world-size N] [--ranks-per-node N] [--json] CONFIG.yaml [key.sub=value ...]
   or: python -m launch.train CONFIG.yaml [key.sub=value ...] --dry-run [--world-size N] [--ranks-per-node N] [--json]

Resolve a training run and report it without starting it; every problem is listed, exit 2 if any."""
SHOWN_SHARDS = 3  # shard names quoted per problem line; the count says how many in all


@dataclass(frozen=True)
class Problem:
    key: str  # the config key to change (or the flag)
    message: str

    def __str__(self) -> str:
        return f"{self.key}: {self.message}"


@dataclass
class Report:
    """What a dry run found: labelled facts (in reading order), numbers for machines, problems, warnings."""

    facts: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    model_config: ModelConfig | None = None  # the model as resolved (vocabulary from the data); None if it cannot be

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(Problem(key, message))

    def problem_line(self, line: str) -> None:
        """A message that already starts with its key (`launch.config.config_problems`, UserErrors)."""
        key, _, message = line.partition(": ")
        if message:
            self.problem(key, message)
        else:
            self.problem("config", line)


@dataclass(frozen=True)
class World:
    size: int
    ranks_per_node: int
    source: str

    @property
    def nodes(self) -> int:
        return math.ceil(self.size / self.ranks_per_node)


@dataclass
class DataInfo:
    """What the dataset tells about the run; None where it could not be read."""

    vocab_size: int | None = None
    tokenizer_sha256: str | None = None
    samples: dict[str, int] = field(default_factory=dict)  # split -> samples of the task's shard set
    tokens: dict[str, int] = field(default_factory=dict)  # split -> tokens stored (translation: source + target)
    block_length: int | None = None  # the longest input the model will be given (for the token figures)


@dataclass(frozen=True)
class PlannedData:
    """A dataset that a prepare config will make (the main job's dry run, before its prepare stage):
    what it fixes in advance. Sample counts are unknown until the shards exist."""

    source: str  # the prepare config, for the messages
    vocab_size: int  # tokenizer.vocab_size
    tasks: tuple[str, ...]
    seq_len: int  # packed blocks
    max_tokens: int  # translation pairs: the most tokens a side


# ----------------------------------------------------------------------------- entry points


def main(argv: list[str] | None = None) -> int:
    return main_dry_run(sys.argv[1:] if argv is None else argv)


def main_dry_run(argv: list[str]) -> int:
    """`launch.train`'s `--dry-run`: argv is its command line without that flag
    (CONFIG.yaml [key.sub=value ...], plus this module's own flags anywhere). Prints the report;
    returns 2 if it found a problem, else 0."""
    from launch import init_model

    options, rest = _split_flags(strip_launcher_args(argv))
    # As the run resolves it: init.model's directory gives the model config (a misfit: one line).
    cfg = init_model.resolve(parse_cli(TrainConfig, rest, usage=USAGE), rest[1:])
    report = preflight(cfg, world_size=options["world_size"], ranks_per_node=options["ranks_per_node"])
    if options["json"]:
        print(json.dumps({"config": rest[0], "ok": not report.problems, "facts": report.facts, "figures": report.figures,
                          "problems": [asdict(p) for p in report.problems],
                          "warnings": [asdict(w) for w in report.warnings]}, indent=1))
    else:
        print(render(report, rest[0]))
    return 2 if report.problems else 0


def _split_flags(argv: list[str]) -> tuple[dict, list[str]]:
    """This module's flags (`--world-size N`, `--ranks-per-node N`, `--json`, each anywhere, `=` or
    a space before a value) apart from the trainer's own grammar."""
    options: dict[str, Any] = {"world_size": None, "ranks_per_node": None, "json": False}
    rest: list[str] = []
    args = iter(argv)
    for arg in args:
        name, eq, value = arg.partition("=")
        if name in ("--world-size", "--ranks-per-node"):
            value = value if eq else next(args, "")
            if not value.isdigit() or int(value) < 1:
                raise UserError(f"{name}: expects a positive integer, got {value!r}")
            options[name[2:].replace("-", "_")] = int(value)
        elif arg == "--json":
            options["json"] = True
        else:
            rest.append(arg)
    return options, rest


# ----------------------------------------------------------------------------- the checks, in the order a run meets them


def preflight(cfg: TrainConfig, world_size: int | None = None, ranks_per_node: int | None = None,
              planned: PlannedData | None = None) -> Report:
    """Resolve `cfg` as `launch.train.setup.setup` would, without a process group or an engine, and
    collect every problem instead of stopping at the first. `planned`: the dataset a prepare
    stage will make, taken for `data.data_dir` while that does not exist."""
    report = Report()
    for line in config_problems(cfg):
        report.problem_line(line)
    if 0 < cfg.max_steps <= cfg.schedule.warmup_steps:
        report.warn("schedule.warmup_steps", f"{cfg.schedule.warmup_steps:,} but max_steps is {cfg.max_steps:,}: the "
                                             "learning rate never reaches optim.lr")
    task = TASKS.get(cfg.task)
    world = resolve_world(world_size, ranks_per_node)
    if task is not None:
        report.facts["task"] = f"{task.name}: {task.arch} on the {task.dataset!r} shards"
    report.facts["world size"] = (f"{world.size} ({world.source}): {world.nodes} node{'s' * (world.nodes > 1)} x "
                                  f"{world.ranks_per_node} rank{'s' * (world.ranks_per_node > 1)}")
    report.figures.update(world_size=world.size, ranks_per_node=world.ranks_per_node, nodes=world.nodes)

    if planned is not None and not remote.is_url(cfg.data.data_dir) and not Path(cfg.data.data_dir).exists():
        data = planned_data(cfg, task, planned, report)
    else:
        data = check_data(cfg, task, report)
        if task is not None and data is not None:
            check_block_length(cfg, task, report)
    model_cfg = report.model_config = resolve_model_config(cfg, data, report)
    plan = None
    if cfg.data.micro_batch_size > 0 and cfg.grad_accum > 0:
        try:
            plan = batch_plan(cfg, world.size)
        except UserError as err:
            report.problem_line(str(err))
    if plan is not None:
        batch_figures(cfg, task, plan, data, report)
        if model_cfg is not None and task is not None:
            model_figures(cfg, task, plan, world, model_cfg, data, report)
        check_deepspeed(cfg, plan, report)
    check_warm_start(cfg, task, model_cfg, data, report)
    check_run_dir(cfg, world, report)
    return report


def resolve_world(world_size: int | None, ranks_per_node: int | None) -> World:
    """The world the job would have: `--world-size`, else the environment's."""
    if world_size is not None:
        return World(world_size, min(ranks_per_node or 1, world_size), "--world-size")
    denv = dist.read_env()
    return World(denv.world_size, min(ranks_per_node or denv.local_world_size, denv.world_size),
                 "the environment's; --world-size N plans another")


def check_data(cfg: TrainConfig, task: Task | None, report: Report) -> DataInfo | None:
    """The manifest, the tokenizer it names and every shard of the splits training reads (of a
    URL, the manifest and the tokenizer, fetched; its shards are checked when they are fetched)."""
    url = remote.is_url(cfg.data.data_dir)
    data_dir = cfg.data.data_dir if url else Path(cfg.data.data_dir)
    fetch = remote.FetchConfig.from_loader_config(cfg.data)
    if not url and not data_dir.is_dir():
        report.problem("data.data_dir", f"{data_dir}: no such directory (prepare it with pipeline.prepare)")
        return None
    try:
        manifest = read_manifest(data_dir, fetch)
    except UserError as err:
        report.problem("data.data_dir", str(err))
        return None
    tokenizer = manifest.get("tokenizer") or {}
    info = DataInfo(vocab_size=tokenizer.get("vocab_size"), tokenizer_sha256=tokenizer.get("sha256"))
    if info.vocab_size is None:
        report.problem("data.data_dir", f"{data_dir}: the manifest's tokenizer record has no vocab_size")
    tokenizer_file = remote.join(data_dir, TOKENIZER_FILE)
    tokenizer_state = "missing"
    if url:
        try:
            remote.local_file(tokenizer_file, fetch, sha256=info.tokenizer_sha256)
            tokenizer_state = "fetched, sha256 matches the manifest"
        except UserError as err:
            report.problem("data.data_dir", f"{err} (the manifest's tokenizer, which training copies into run_dir)")
    elif not Path(tokenizer_file).is_file():
        report.problem("data.data_dir", f"{tokenizer_file}: missing (the manifest's tokenizer, which training copies "
                                        "into run_dir)")
    elif (actual := file_sha256(tokenizer_file)) != info.tokenizer_sha256:
        tokenizer_state = "sha256 differs from the manifest's"
        report.problem("data.data_dir", f"{tokenizer_file}: sha256 {actual[:12]}... differs from the manifest's "
                                        f"{str(info.tokenizer_sha256)[:12]}...: not the tokenizer the shards were made with")
    else:
        tokenizer_state = "sha256 matches the manifest"
    report.facts["dataset"] = f"{data_dir}: manifest readable; {TOKENIZER_FILE} {tokenizer_state}, vocabulary {info.vocab_size}"
    if task is None:
        return info

    checked = []
    for split in ("train", "valid"):
        try:
            entries = shard_entries(manifest, task.name, split)
        except UserError as err:
            # Without a train split nothing runs; without a valid one the trainer only skips
            # evaluation; a damaged shard list (a repeat, a count below one) stops it in either.
            if split == "train" or isinstance(err, ManifestError):
                report.problem("data.data_dir", f"{data_dir}: {err}")
            else:
                report.warn("data.data_dir", f"{data_dir}: {err}")
            continue
        info.samples[split] = sum(int(entry["samples"]) for entry in entries)
        info.tokens[split] = sum(int(entry.get("tokens", 0)) for entry in entries)
        if split == "train" and cfg.data.mixture:
            check_mixture(cfg, task, entries, report)
        if url:
            checked.append(f"{split} {len(entries)} shards listed (remote: checked when fetched)")
            continue
        checked.append(f"{split} {len(entries) - _check_shards(data_dir, task.dataset, split, entries, report)}"
                       f"/{len(entries)} shards")
    report.facts["shards"] = f"{task.dataset}: {', '.join(checked) or 'none'} present with the manifest's sizes"

    dataset = manifest.get("datasets", {}).get(task.dataset, {})
    if task.dataset == "packed" and "seq_len" in dataset:
        info.block_length = int(dataset["seq_len"])
    elif task.dataset == "translation" and "max_tokens" in (manifest.get("config", {}).get("translation") or {}):
        # The longest pair side plus one special token: the source's </s>, the decoder input's <s>.
        info.block_length = int(manifest["config"]["translation"]["max_tokens"]) + 1
    return info


def planned_data(cfg: TrainConfig, task: Task | None, planned: PlannedData, report: Report) -> DataInfo:
    """What the run will read from a dataset not made yet: its vocabulary, and its inputs'
    lengths against `model.max_seq_len` (packed blocks exactly; translation pairs by their bound,
    which only a warning can hold against the model, since the pairs themselves may be shorter)."""
    report.facts["dataset"] = (f"{cfg.data.data_dir}: not there yet; {planned.source} will make it: vocabulary "
                               f"{planned.vocab_size}, blocks of {planned.seq_len}, pairs of at most {planned.max_tokens} "
                               "tokens a side (sample counts unknown until then)")
    info = DataInfo(vocab_size=planned.vocab_size)
    if task is None:
        return info
    if task.name not in planned.tasks:
        report.problem("data.data_dir", f"{planned.source} makes no {task.name} data (its tasks: {', '.join(planned.tasks)})")
    if task.dataset == "packed":
        info.block_length = planned.seq_len
        if planned.seq_len > cfg.model.max_seq_len:
            report.problem("model.max_seq_len", f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the packed "
                                                f"blocks of seq_len {planned.seq_len} that {planned.source} will make; set "
                                                f"model.max_seq_len={planned.seq_len} or more")
    else:
        info.block_length = planned.max_tokens + 1  # a side plus </s> (source) or <s> (decoder input)
        if info.block_length > cfg.model.max_seq_len:
            report.warn("model.max_seq_len", f"model.max_seq_len={cfg.model.max_seq_len} is shorter than the bound "
                                             f"of the pairs {planned.source} will make ({planned.max_tokens} tokens a "
                                             "side, + 1): the training run checks the pairs themselves")
    return info


def check_mixture(cfg: TrainConfig, task: Task, entries: list[dict], report: Report) -> None:
    """`data.mixture`'s sources against the train split's, as the loader checks them (`pipeline.loader`)."""
    samples: dict[str, int] = {}
    for entry in entries:
        name = str(entry.get("source", DEFAULT_SOURCE))
        samples[name] = samples.get(name, 0) + int(entry["samples"])
    for name, weight in cfg.data.mixture.items():
        if name not in samples:
            report.problem("data.mixture", f"{cfg.data.data_dir} {task.name}/train has no source {name!r}; its sources: "
                                           f"{', '.join(sorted(samples))}")
        elif not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight > 0):
            report.problem(f"data.mixture.{name}", f"a weight must be a positive number, got {weight!r}")


def _check_shards(data_dir: Path, dataset: str, split: str, entries: list[dict], report: Report) -> int:
    """Report the split's missing shards and those whose size is not the manifest's; how many are bad.
    Sizes only: hashing every shard is `pipeline.validate`'s job, not a seconds-long check's."""
    missing, resized = [], []
    for entry in entries:
        path = data_dir / entry["path"]
        if not path.is_file():
            missing.append(entry["path"])
        elif entry.get("bytes") is not None and path.stat().st_size != int(entry["bytes"]):
            resized.append(f"{entry['path']} ({path.stat().st_size} bytes, not {entry['bytes']})")
    for what, names in (("missing", missing), ("of another size than the manifest's", resized)):
        if names:
            shown = ", ".join(names[:SHOWN_SHARDS]) + (", ..." if len(names) > SHOWN_SHARDS else "")
            report.problem("data.data_dir", f"{dataset}/{split}: {len(names)} of {len(entries)} shards {what}: {shown}")
    return len(missing) + len(resized)


def resolve_model_config(cfg: TrainConfig, data: DataInfo | None, report: Report) -> ModelConfig | None:
    """The model config with the data's vocabulary (`model.vocab_size: 0`), checked by
    `ModelConfig.validate`; None when it cannot be built."""
    model_cfg = cfg.model
    data_vocab = data.vocab_size if data is not None else None
    if model_cfg.vocab_size == 0:
        if data_vocab is None:
            report.facts["parameters"] = "unknown: model.vocab_size 0 takes the data's vocabulary, which could not be read"
            return None
        model_cfg = replace(model_cfg, vocab_size=int(data_vocab))
    elif data_vocab is not None and model_cfg.vocab_size != data_vocab:
        report.problem("model.vocab_size", f"{model_cfg.vocab_size} but the tokenizer of {cfg.data.data_dir} has "
                                           f"{data_vocab} pieces (set model.vocab_size=0 to take it from the data)")
    try:
        model_cfg.validate()
    except ValueError as err:
        # validate stops at its first problem; name the field it blames (the one before its
        # first ": ", else the last one it mentions, as in "d_model=768 is not divisible by n_heads=5").
        message = str(err).removeprefix("model config: ")
        named = re.findall(r"([A-Za-z_][\w.]*)=", message.split(": ", 1)[0])
        report.problem(f"model.{named[-1]}" if named else "model", message)
        report.facts["parameters"] = "not counted: the model config has a problem (below)"
        return None
    return model_cfg


def check_block_length(cfg: TrainConfig, task: Task, report: Report) -> None:
    """The data's longest input against `model.max_seq_len`, by the trainer's own check
    (`launch.preconditions.data_fits_model`: packed blocks from the manifest, translation pairs
    from their recorded bound, or from the shards when the bound does not fit)."""
    try:
        manifest = read_manifest(cfg.data.data_dir)
    except UserError:
        return  # `check_data` reported it
    if problem := data_fits_model(cfg.data.data_dir, manifest, task.name, cfg.model):
        report.problem("model.max_seq_len", problem)


def batch_figures(cfg: TrainConfig, task: Task | None, plan: BatchPlan, data: DataInfo | None, report: Report) -> None:
    """Global batch, steps per epoch and epochs, cut as the loader cuts them: whole global batches
    (micro x accumulation x world) from the epoch's sample stream, the remainder left out."""
    unit = "pairs" if task is not None and task.dataset == "translation" else "sequences"
    global_batch = plan.global_batch_size
    report.facts["global batch"] = (f"{global_batch:,} {unit} = {plan.micro_batch_size} micro x {plan.grad_accum} "
                                    f"accumulation x {plan.world_size} ranks")
    report.figures["global_batch_size"] = global_batch
    if data is None or "train" not in data.samples:
        return
    train = data.samples["train"]
    steps = train // global_batch
    if steps == 0:
        report.problem("data.micro_batch_size", f"the train split of {cfg.data.data_dir} has {train:,} {unit}, fewer "
                                                f"than one global batch of {global_batch:,} ({plan.micro_batch_size} "
                                                f"x {plan.grad_accum} x {plan.world_size} ranks)")
        return
    report.facts["steps per epoch"] = f"{steps:,} ({train:,} train {unit}; {train - steps * global_batch:,} left out per epoch)"
    report.facts["epochs in max_steps"] = f"{cfg.max_steps / steps:,.2f} ({cfg.max_steps:,} steps)"
    report.figures.update(steps_per_epoch=steps, epochs=cfg.max_steps / steps)
    if "valid" in data.samples:
        valid = data.samples["valid"]
        if valid < global_batch:
            report.warn("data.micro_batch_size", f"the valid split has {valid:,} {unit}, fewer than one global batch "
                                                 f"({global_batch:,}): training would run without evaluation")
        else:
            batches = valid // global_batch
            report.facts["evaluation"] = (f"{valid:,} valid {unit}, {batches:,} global batch{'es' * (batches > 1)}; "
                                          f"every {cfg.eval_every or cfg.max_steps:,} steps")


def sequence_lengths(task: Task, model_cfg: ModelConfig, data: DataInfo | None) -> tuple[float, float, str]:
    """(encoder or only length, decoder length, what they are) of a typical training sample."""
    if task.dataset == "packed":
        if data is not None and data.block_length is not None:
            return data.block_length, 0, f"the data's {data.block_length}-token blocks"
        return model_cfg.max_seq_len, 0, "model.max_seq_len (the data's block length is unknown)"
    if data is not None and data.samples.get("train") and data.tokens.get("train"):
        side = data.tokens["train"] / data.samples["train"] / 2
        # The source gets </s>; the decoder reads <s> + target (task translation's inputs).
        return side + 1, side + 1, "the train split's mean pair, before padding to the batch's longest"
    return model_cfg.max_seq_len, model_cfg.max_seq_len, "model.max_seq_len on both sides (the data's is unknown)"


def model_figures(cfg: TrainConfig, task: Task, plan: BatchPlan, world: World, model_cfg: ModelConfig,
                  data: DataInfo | None, report: Report) -> None:
    """Parameters (exact, from the model built on the meta device), FLOPs per step and per token
    (`model.flops`, as the trainer counts them for MFU) and memory per GPU."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    source_len, target_len, lengths = sequence_lengths(task, model_cfg, data)
    # BERT's head runs on the masked positions only; the masking selects mlm_probability of the tokens.
    scored = cfg.data.mlm_probability * source_len if task.name == "mlm" else None
    flops_per_sample = training_flops(model_cfg, source_len, target_len, scored=scored)
    tokens_per_step = plan.global_batch_size * (source_len + target_len)
    flops_per_step = flops_per_sample * plan.global_batch_size
    states = estimate_model_state_memory(model, cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer,
                                         cfg.deepspeed.offload_params, world.ranks_per_node, world.nodes)
    activations = activation_bytes(model_cfg, task, plan.micro_batch_size, source_len, target_len,
                                   cfg.data.mlm_probability, cfg.deepspeed.precision)
    report.facts["tokens per step"] = f"{tokens_per_step:,.0f} ({source_len + target_len:,.1f} per sample at {lengths})"
    report.facts["parameters"] = f"{states['parameters']:,}"
    report.facts["FLOPs per step"] = f"{flops_per_step:.3e} (training: forward + backward, matmuls only)"
    report.facts["FLOPs per token"] = f"{flops_per_step / tokens_per_step:.3e}"
    report.facts["memory per GPU"] = (f"{_size(states['gpu_bytes'] + activations)} = model states "
                                      f"{_size(states['gpu_bytes'])} + activations {_size(activations)}")
    report.facts["model states"] = (
        f"ZeRO-{cfg.deepspeed.zero_stage}{_offload(cfg)}: {_size(states['gpu_bytes'])} per GPU, "
        f"{_size(states['cpu_bytes_per_node'])} CPU per node ({states['estimator']}; it counts 16-bit weights and "
        "gradients beside fp32 master weights and Adam moments)")
    report.facts["activations"] = (
        f"{_size(activations)} (micro batch {plan.micro_batch_size} at {lengths}, {cfg.deepspeed.precision}, "
        f"activation checkpointing {'on' if model_cfg.activation_checkpointing else 'off'}; our estimate)")
    report.figures.update(parameters=states["parameters"], tokens_per_step=tokens_per_step, flops_per_step=flops_per_step,
                          flops_per_token=flops_per_step / tokens_per_step, model_state_bytes_per_gpu=states["gpu_bytes"],
                          activation_bytes_per_gpu=activations, memory_bytes_per_gpu=states["gpu_bytes"] + activations,
                          cpu_bytes_per_node=states["cpu_bytes_per_node"])


def activation_bytes(model_cfg: ModelConfig, task: Task, micro_batch_size: int, source_len: float, target_len: float,
                     mlm_probability: float, precision: str) -> int:
    """Bytes the forward pass of one micro batch keeps for the backward pass, on a GPU: our
    estimate, since DeepSpeed's estimators count model states only.

    Per token and block, the tensors autograd saves, after the tally of Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", section 4.1, without model
    parallelism), in the training precision: in the attention sublayer the norm's input, the
    q/k/v projections' input, q, k and v, SDPA's output and the output projection's reshaped
    copy of it (5 d + 2 d_kv, d_kv = n_kv_heads x d / n_heads: grouped-query attention's k and v
    are smaller, and SDPA takes them so where it can, `model.blocks.attention`; on CUDA with a
    mask, or in float32, they are repeated to d each, which this leaves out); in the MLP sublayer the norm's
    input, the first projection's input and the hidden layer before and after its activation
    (2 d + 2 d_ff; a gated MLP keeps gate and value before, the activated gate and the product
    after: 2 d + 4 d_ff); and a one-byte mask per element for each residual dropout (2 d). With
    d_ff = 4 d in 16 bits that is 36 d bytes, their 34 d plus the copy; Llama's blocks (d_ff =
    8/3 d, no grouped heads, no dropout) keep 39.3 d. Rotary positions keep nothing of their own
    (the rotated q and k are SDPA's inputs). Korthikanti et al.'s (T x T) attention-score term
    is left out: torch's flash and memory-efficient SDPA kernels keep only per-row softmax
    statistics. A cross-attention
    sublayer adds 5 d per target token (its norm's and q-projection's inputs, q, SDPA's output
    and its copy) and the keys and values of the memory (2 d_kv per source token). With
    activation checkpointing a block keeps only its input, plus one block's tensors while it is
    recomputed. Embeddings: a dropout mask, and the norm's input in a post-LN stack. Heads: GPT's
    and the decoder's chunked loss (`model.loss`) keeps the final hidden states and their
    gradient (fp32, so that fp16's loss scale reaches it) per token, the (V x d) fp32 weight
    gradient it computes in the forward pass and one chunk of fp32 logits and their
    log-softmax at a time (sized for a GPU: `model.loss.chunk_peak_bytes`); BERT's head keeps four d-wide inputs per masked position and
    their logits (16-bit, then fp32 and its log-softmax). Padding (translation pairs are padded
    to the batch's longest) and the allocator's slack come on top.
    """
    element = 4 if precision == "fp32" else 2
    mask = 1 if model_cfg.dropout > 0 else 0

    def stack(cfg: ModelConfig, tokens: float, memory_tokens: float = 0.0) -> float:
        d, d_kv = cfg.d_model, cfg.kv_heads * cfg.head_dim
        hidden = (4 if cfg.activation in GATED_ACTIVATIONS else 2) * cfg.d_ff
        per_token = element * (5 * d + 2 * d_kv + 2 * d + hidden) + mask * 2 * d
        if memory_tokens:  # a decoder stack: cross-attention too
            per_token += element * 5 * d + mask * d
        block = per_token * tokens + element * 2 * d_kv * memory_tokens
        kept = element * d * tokens * cfg.n_layers + block if cfg.activation_checkpointing else block * cfg.n_layers
        embeddings = (mask + (element if cfg.norm_position == "post" else 0)) * d * tokens
        return kept + embeddings

    d, vocab = model_cfg.d_model, model_cfg.vocab_size
    lm_head_per_token = element * d + 4 * d  # the final hidden state, and its gradient kept in fp32
    lm_head_fixed = 4 * vocab * d + chunk_peak_bytes(vocab, "cuda")  # the fp32 weight gradient, one chunk
    if task.arch == "seq2seq":
        encoder = stack(model_cfg.for_stack("encoder"), source_len)
        decoder = stack(model_cfg.for_stack("decoder"), target_len, source_len)
        return int((encoder + decoder + lm_head_per_token * target_len) * micro_batch_size + lm_head_fixed)
    if task.arch == "bert":
        masked = mlm_probability * source_len
        head = masked * (element * 4 * d + vocab * (element + 8))
        return int((stack(model_cfg, source_len) + head) * micro_batch_size)
    return int((stack(model_cfg, source_len) + lm_head_per_token * source_len) * micro_batch_size + lm_head_fixed)


def check_deepspeed(cfg: TrainConfig, plan: BatchPlan, report: Report) -> None:
    """The DeepSpeed JSON derives from the config (and a user's own file merged over it)."""
    if cfg.deepspeed.precision == "fp16" and not torch.cuda.is_available():
        report.warn("deepspeed.precision", "fp16 runs on GPUs only (dynamic loss scaling): fine for this dry run, "
                                           "which sees no CUDA, but the job itself needs GPUs")
        cfg = replace(cfg, deepspeed=replace(cfg.deepspeed, precision="bf16"))  # to check the rest of the dict
    try:
        deepspeed_config(cfg, plan)
    except UserError as err:
        report.problem_line(str(err))


def check_warm_start(cfg: TrainConfig, task: Task | None, model_cfg: ModelConfig | None, data: DataInfo | None,
                     report: Report) -> None:
    """Each `init.encoder` / `init.decoder`: an exported directory (launch.export) made with the
    dataset's tokenizer, whose architecture fits its stack (what `model.warm_start` checks
    before loading; the weights are not read here), or the training config that will make it."""
    if task is None or not task.warm_startable:
        return  # config_problems has said that init is for another task
    for side in STACKS:
        given = getattr(cfg.init, side)
        if not given:
            continue
        key, path = f"init.{side}", Path(given)
        if path.suffix in (".yaml", ".yml") and path.is_file():
            source = _source_from_config(key, path, data, report)
            what = f"{path} (the model its run will export)"
        else:
            source = _source_from_export(key, path, cfg, data, report)
            what = str(path)
        if source is not None and model_cfg is not None:
            check_source_fits(report, key, what, source, side, model_cfg)


def _source_from_export(key: str, path: Path, cfg: TrainConfig, data: DataInfo | None, report: Report) -> ModelConfig | None:
    if not (path / EXPORT_CONFIG).is_file() or not (path / EXPORT_WEIGHTS).is_file():
        report.problem(key, f"{path}: not an exported model directory (no {EXPORT_CONFIG} and "
                            f"{EXPORT_WEIGHTS}; write one with launch.export)")
        return None
    try:
        meta = json.loads((path / EXPORT_CONFIG).read_text())
        source = config_from_dict(ModelConfig, meta["model"], source=str(path / EXPORT_CONFIG))
    except (json.JSONDecodeError, KeyError, TypeError, UserError) as err:
        report.problem(key, f"{path / EXPORT_CONFIG}: unreadable: {err}")
        return None
    sha256 = meta.get("tokenizer_sha256")
    if data is not None and data.tokenizer_sha256 and sha256 != data.tokenizer_sha256:
        report.problem(key, f"{path} was trained with another tokenizer (sha256 {str(sha256)[:12]}...) than "
                            f"{cfg.data.data_dir} ({data.tokenizer_sha256[:12]}...): its embeddings would not "
                            "mean the same tokens")
    return source


def _source_from_config(key: str, path: Path, data: DataInfo | None, report: Report) -> ModelConfig | None:
    """The model a training config will export, its vocabulary (0) the dataset's: a plan, which
    the run itself cannot load (a warning says so)."""
    try:
        source = load_config(TrainConfig, path).model
    except UserError as err:
        report.problem(key, str(err))
        return None
    report.warn(key, f"{path} is a training config: its model is checked here; the run needs the directory "
                     "launch.export writes from its checkpoint")
    if source.vocab_size == 0:
        if data is None or data.vocab_size is None:
            return None
        source = replace(source, vocab_size=int(data.vocab_size))
    return source


def check_source_fits(report: Report, key: str, what: str, source: ModelConfig, side: str, model_cfg: ModelConfig) -> None:
    """A warm-start source (`what`: where it comes from) against the Seq2Seq stack `side` it
    would fill: the fields `model.warm_start` requires equal; the problem names every one that differs."""
    if source.arch not in SOURCE_CLASSES:
        report.problem(key, f"{what} holds a {source.arch}; a warm start takes one of {', '.join(SOURCE_CLASSES)}")
        return
    stack = model_cfg.for_stack(side)
    differ = [name for name in architecture_fields(side) if getattr(source, name) != getattr(stack, name)]
    if differ:
        report.problem(key, f"{what} ({source.arch}) has " + ", ".join(f"{n}={getattr(source, n)!r}" for n in differ)
                       + f" but the Seq2Seq {side} has " + ", ".join(f"{n}={getattr(stack, n)!r}" for n in differ))
    else:
        report.facts[key] = f"{what}: {source.arch}, fits the {side}"


def check_run_dir(cfg: TrainConfig, world: World, report: Report) -> None:
    """run_dir can be written (or made), and what `resume` would continue from."""
    run_dir = Path(cfg.run_dir).absolute()
    existing = run_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        report.problem("run_dir", f"{existing} is not a directory, so {run_dir} cannot be made")
        return
    if not os.access(existing, os.W_OK | os.X_OK):
        made = "" if existing == run_dir else f", so {run_dir} cannot be made"
        report.problem("run_dir", f"{existing} is not writable{made}")
        return
    try:
        candidates = ckpt.resume_candidates(cfg.resume, run_dir)  # newest first, as the trainer tries them
    except UserError as err:
        report.problem("resume", str(err).removeprefix("resume: "))
        return
    resume_from = candidates[0] if candidates else None
    if resume_from is None:
        report.facts["run_dir"] = f"{run_dir} ({'exists' if run_dir.exists() else 'will be made'}); a fresh start"
        return
    root, tag = resume_from
    report.facts["run_dir"] = f"{run_dir}; resume from {root / tag}"
    saved = ckpt.saved_world_size(root, tag)
    if saved is not None and saved != world.size:
        report.warn("resume", f"{root / tag} was written by {saved} ranks, this job would have {world.size}: a ZeRO "
                              "checkpoint is tied to its world size (launch.deepspeed.universal.to_universal converts it)")


def _offload(cfg: TrainConfig) -> str:
    ds = cfg.deepspeed
    parts = [name for name, on in (("optimizer", ds.offload_optimizer), ("parameters", ds.offload_params)) if on]
    return f", {' and '.join(parts)} offloaded to CPU" if parts else ""


def _size(n: float) -> str:
    return f"{n / 2**30:,.2f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


# ----------------------------------------------------------------------------- output


def render(report: Report, config: str) -> str:
    """Aligned `label: value` lines, then the problems and warnings, each naming its key, then the verdict."""
    width = max(len(label) for label in report.facts) + 2 if report.facts else 0
    lines = [f"dry run of {config}: nothing started, nothing written"]
    lines += [f"  {label + ':':<{width}} {value}" for label, value in report.facts.items()]
    for title, items in (("problems", report.problems), ("warnings", report.warnings)):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  {item}" for item in items]
    if report.problems:
        count = len(report.problems)
        lines.append(f"verdict: {count} problem{'s' * (count > 1)}: this run would fail (exit 2)")
    else:
        lines.append("verdict: ready: nothing found that would stop this run (exit 0)")
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)
