"""Configuration schemas of the launch entry points: train, main, export,
evaluate, translate, report.

The run config embeds the model's (`model.config.ModelConfig`) and the loader's
(`pipeline.load.config.LoaderConfig`) schemas; DeepSpeed's JSON is derived from it
(`launch.deepspeed.config.deepspeed_config`), with the batch arithmetic done once in `BatchPlan`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, List

from omegaconf import MISSING

from common.configure import UserError
from model.config import ModelConfig
from pipeline.load.config import LoaderConfig
from pipeline.load.config import global_batch_size as samples_per_step

if TYPE_CHECKING:  # the task table imports torch; the schemas here do not need it
    from launch.tasks import Task

PRECISIONS = ("fp32", "bf16", "fp16", "auto")
ZERO_STAGES = (0, 1, 2, 3)  # deepspeed.zero_stage, of training and of inference alike
DECAYS = ("cosine", "linear", "constant", "inverse_sqrt")


# optim.implementation (launch.optim.adamw_kernels)
ADAMW_IMPLEMENTATIONS = ("auto", "fused", "foreach", "for_loop")
COMPILE_SCOPES = ("auto", "model", "blocks")  # compile_scope (`compile_scope_for`)


@dataclass
class OptimConfig:
    # peak learning rate, reached after schedule.warmup_steps; with schedule.decay inverse_sqrt
    # a scale on the paper's schedule (1.0 = Vaswani et al.: peak (d_model * warmup_steps)^-0.5)
    lr: float = 3e-4
    weight_decay: float = 0.1  # never on norms, biases or embeddings
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator epsilon
    grad_clip: float = 1.0  # 0 disables clipping
    # torch AdamW's kernel: auto (the fused one, on a GPU and on a CPU) | fused | foreach | for_loop
    implementation: str = "auto"


@dataclass
class ScheduleConfig:
    warmup_steps: int = 100  # linear warmup to optim.lr over this many optimizer steps
    # cosine | linear | constant | inverse_sqrt: optim.lr * d_model^-0.5 * min(n^-0.5, n *
    # warmup_steps^-1.5)
    # at optimizer step n = 1, 2, ... (Vaswani et al. 2017; linear rise, then 1/sqrt decay)
    decay: str = "cosine"
    min_lr_ratio: float = 0.1  # the final lr as a fraction of optim.lr (cosine and linear)


@dataclass
class DeepSpeedConfig:
    # 0, 1, 2 or 3. 0 on more than one rank: the trainer reduces the gradients during the
    # backward (launch.train.reduce), the fastest for models whose states fit one device
    zero_stage: int = 2
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage >= 1)
    offload_params: bool = False  # parameters to CPU (stage 3)
    # fp32 | bf16 | fp16 (fp16 with dynamic loss scaling, GPU only) | auto: bf16 where this machine
    # multiplies bf16 matrices at least as fast as fp32 ones (a GPU with bf16; a CPU with AMX or
    # AVX512-BF16, measured once), else fp32 (an AVX2 CPU's bf16 GEMMs are ~50x slower). bf16 is
    # DeepSpeed's under ZeRO (bf16 weights, fp32 masters), torch's autocast at stage 0 (fp32
    # weights and gradients, bf16 matmuls)
    precision: str = "fp32"
    initial_scale_power: int = 16  # fp16 only: the dynamic loss scale starts at 2**this
    # ZeRO-3 keeps tensors under this many elements whole on every rank; -1: DeepSpeed's
    # default (100,000). Tiny test models need 0, or ZeRO-3 partitions none of their tensors.
    zero3_persistence_threshold: int = -1
    # A user's own DeepSpeed JSON, merged over the derived dict (its batch keys must agree).
    config_file: str = ""


@dataclass
class CheckpointConfig:
    every_steps: int = 500  # 0: only at the end
    keep_last: int = 2  # complete checkpoints kept; older ones are deleted


@dataclass
class WandbConfig:
    """Weights & Biases. A key set here wins over its environment variable, which wins over the
    default (`launch.tracking.wandb_settings`), so that `WANDB_MODE=online sbatch ...` works with
    the shipped configs, which leave these unset."""

    mode: str = ""  # online | offline | disabled; "" = $WANDB_MODE, else offline
    project: str = ""  # W&B project; "" = $WANDB_PROJECT, else pretrain-pipeline
    entity: str = ""  # W&B team or user; "" = $WANDB_ENTITY, else your default entity
    # W&B run group (a main job's stages share one); "" = $WANDB_RUN_GROUP, else none
    group: str = ""
    name: str = ""  # W&B run name; "" = the name of run_dir
    tags: list = field(default_factory=list)  # W&B run tags


@dataclass
class GuardConfig:
    """Guarded steps: a step is skipped on every rank when its loss is not finite on
    any rank, or spikes."""

    # End the job (with a checkpoint of the last good weights) after more skipped steps in a row
    # than this.
    max_consecutive_skips: int = 5
    # Skip a step whose loss exceeds the mean of the last spike_window steps by this many standard
    # deviations; 0: off.
    spike_factor: float = 0.0
    spike_warmup_steps: int = 100  # applied steps before the spike test starts
    # applied steps whose losses give the running mean and standard deviation
    spike_window: int = 100


@dataclass
class InitConfig:
    """Starting weights: a run's from one exported model (`launch.init_model`), or a translation
    model's stacks apart from exported pretraining checkpoints (`model.warm_start`)."""

    encoder: str = ""  # translation: exported BERT (or GPT) directory; "" = random
    decoder: str = ""  # translation: exported GPT (or BERT) directory; "" = random
    # an export of ours, or a Hugging Face directory (GPT-2, Llama, Qwen2.5, Qwen3, Mistral,
    # OLMo 2, BERT, BERT + GPT-2 encoder-decoder) of the task's model; the model config is the
    # directory's; step 0, fresh optimizer. "" = random (or encoder/decoder)
    model: str = ""


@dataclass
class LmEvalTrainConfig:
    """lm-evaluation-harness tasks run on the model in training, logged as lm_eval/TASK/METRIC."""

    # optimizer steps between two scorings (on every rank, logged by rank 0); 0 = never
    every: int = 0
    tasks: List[str] = field(default_factory=lambda: ["cloze", "choice"])  # cloze | choice
    split: str = "valid"  # the held-out split of data.data_dir the tasks are built from
    limit: int = 100  # the first N docs of each task (a cheap, fixed sample); 0 = all


@dataclass
class TrainConfig:
    task: str = "causal_lm"  # causal_lm | mlm | translation
    run_dir: str = "runs/default"  # checkpoints, metrics.jsonl, config.yaml, tokenizer, final.json
    seed: int = 1234  # initial weights (the same on every rank); dropout uses seed + rank
    max_steps: int = 1000  # optimizer steps (the schedule runs to here)
    # End this job after this many steps of the run (with a checkpoint), e.g. to fit a
    # time slot; the next job resumes. 0: run to max_steps.
    stop_after_steps: int = 0
    # torch.profiler over optimizer steps profile_start+1 .. profile_start+profile_steps of this
    # process: a table on stderr (device time by kernel family, the longest kernels, the wall
    # time they leave idle, the host operators) and a Chrome trace per rank in RUN_DIR/profile/.
    # 0: off. For finding where a step's time goes, e.g. a GPU waiting on the host.
    profile_start: int = 0
    profile_steps: int = 3
    grad_accum: int = 1  # micro batches per optimizer step; global batch = micro x this x ranks
    # Sequences per optimizer step, whatever the world size: grad_accum is derived from it
    # (global / (micro x ranks)), so a job requeued onto another number of nodes keeps it. 0: use
    # grad_accum.
    global_batch_size: int = 0
    eval_every: int = 200  # 0: only at the end
    eval_batches: int = 50  # per rank; 0 = the whole split
    log_every: int = 10  # optimizer steps between logged metrics
    # auto: continue from run_dir's latest complete checkpoint if there is one;
    # none: start fresh (refused if run_dir already holds checkpoints); or a checkpoint path.
    resume: str = "auto"
    # Threads per rank for torch on CPU; 0 = cores / local ranks.
    threads_per_rank: int = 0
    # A rank that stops answering fails the job after this long instead of hanging it.
    dist_timeout_s: int = 600
    # torch.compile (inductor) the model for training, in place (the state dict keeps its keys);
    # evaluation runs eagerly. In bf16 on a CPU, attention over up to 128 keys then recomputes its
    # probabilities in backward (`model.attention.attention`). Needs a C++ compiler on CPU (g++, or
    # $CXX), Triton on a GPU.
    compile: bool = False
    # What `compile` compiles: model = the whole forward with the loss in the graph (fuses the
    # embeddings, the last norm and the loss's element-wise work with the blocks); blocks = each
    # transformer block's forward, the rest eager. auto: model for tasks causal_lm and mlm under
    # ZeRO 0-2 on a CPU (fixed block lengths), blocks for translation (a length per batch would
    # recompile the loss's chunk loop), under ZeRO-3 (its parameter gathers break a whole-model
    # graph) and on a GPU (not yet run there).
    compile_scope: str = "auto"
    # CUDA: float32 matrix products (the GEMMs of fp32 runs) on TF32 tensor cores
    # (torch.backends.cuda.matmul.allow_tf32; Ampere and newer), 10 mantissa bits
    # in the products and float32 accumulation. false: full IEEE float32 ("ieee"). No effect on a
    # CPU, nor on the 16-bit GEMMs of bf16/fp16 runs.
    tf32: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    data: LoaderConfig = field(default_factory=LoaderConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    init: InitConfig = field(default_factory=InitConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    lm_eval: LmEvalTrainConfig = field(default_factory=LmEvalTrainConfig)


@dataclass(frozen=True)
class BatchPlan:
    """micro batch x accumulation x world size, computed once for the loop and DeepSpeed."""

    micro_batch_size: int
    grad_accum: int
    world_size: int

    @property
    def global_batch_size(self) -> int:
        return samples_per_step(self.micro_batch_size, self.grad_accum, self.world_size)


def batch_plan(cfg: TrainConfig, world_size: int) -> BatchPlan:
    """The batch arithmetic of a run on `world_size` ranks: `grad_accum` as given, or derived
    from `global_batch_size`, which must then be a multiple of micro batch x ranks."""
    micro = cfg.data.micro_batch_size
    if not cfg.global_batch_size:
        return BatchPlan(micro, cfg.grad_accum, world_size)
    accum, remainder = divmod(cfg.global_batch_size, micro * world_size)
    if remainder or not accum:
        fits = [
            m
            for m in range(1, cfg.global_batch_size + 1)
            if cfg.global_batch_size % (m * world_size) == 0
        ]
        hint = (
            f"; data.micro_batch_size={min(fits, key=lambda m: abs(m - micro))} fits"
            if fits
            else f"; no micro batch fits {world_size} ranks"
        )
        raise UserError(
            f"global_batch_size: {cfg.global_batch_size} is not a multiple of "
            f"data.micro_batch_size x ranks = {micro} x {world_size}{hint}"
        )
    return BatchPlan(micro, accum, world_size)


def compile_scope_for(cfg: TrainConfig, cuda: bool) -> str:
    """What `compile: true` compiles for this run, `compile_scope` with auto resolved: 'model' or
    'blocks'. auto stays at blocks on a GPU, where the whole-model graph (the loss's GEMMs with a
    float32 output inside it) has not yet been run (docs/design.md#what-compile-compiles)."""
    if cfg.compile_scope != "auto":
        return cfg.compile_scope
    return (
        "model"
        if cfg.task in ("causal_lm", "mlm") and cfg.deepspeed.zero_stage < 3 and not cuda
        else "blocks"
    )


def check_config(cfg: TrainConfig) -> Task:
    """The run's task, or a UserError with the first of `config_problems`.

    The model config's own checks (`ModelConfig.validate`) run once, where the model is built:
    `model.vocab_size: 0` is only resolved from the data then."""
    from launch.tasks import TASKS

    problems = config_problems(cfg)
    if problems:
        raise UserError(problems[0])
    return TASKS[cfg.task]


def _wandb_check(wandb: WandbConfig) -> tuple[bool, str]:
    """The W&B mode as the run would take it (the key, else WANDB_MODE): one W&B knows."""
    from launch.tracking import wandb_settings

    try:
        wandb_settings(wandb)
        return True, ""
    except UserError as err:
        return False, str(err)


def _optim_checks(optim: OptimConfig) -> list[tuple[bool, str]]:
    """AdamW's ranges, which torch checks only as the optimizer is built (after the process group
    is up, in a traceback); NaN fails every comparison, so each is refused here too."""
    return [
        (
            math.isfinite(optim.lr) and optim.lr >= 0,
            f"optim.lr: {optim.lr} must be a finite number, 0 or more",
        ),
        (
            math.isfinite(optim.weight_decay) and optim.weight_decay >= 0,
            f"optim.weight_decay: {optim.weight_decay} must be a finite number, 0 or more",
        ),
        (0 <= optim.beta1 < 1, f"optim.beta1: {optim.beta1} must be in [0, 1)"),
        (0 <= optim.beta2 < 1, f"optim.beta2: {optim.beta2} must be in [0, 1)"),
        (
            math.isfinite(optim.eps) and optim.eps >= 0,
            f"optim.eps: {optim.eps} must be a finite number, 0 or more",
        ),
        (
            math.isfinite(optim.grad_clip) and optim.grad_clip >= 0,
            f"optim.grad_clip: {optim.grad_clip} must be 0 (off) or a positive finite number",
        ),
    ]


def config_problems(cfg: TrainConfig) -> list[str]:
    """Every cross-field problem the types cannot express, each message starting with its key;
    empty if none. All of them, not only the first: a dry run (`launch.preflight`)
    lists them at once."""
    from launch.tasks import TASKS

    task = TASKS.get(cfg.task)
    checks = [
        (task is not None, f"task: {cfg.task!r} is not one of {', '.join(TASKS)}"),
        (cfg.max_steps > 0, "max_steps: must be positive"),
        (cfg.grad_accum > 0, "grad_accum: must be positive"),
        (cfg.global_batch_size >= 0, "global_batch_size: must be 0 (use grad_accum) or positive"),
        (
            not (cfg.global_batch_size and cfg.grad_accum != 1),
            "global_batch_size: set it or grad_accum, not both (grad_accum is derived from it)",
        ),
        (cfg.data.micro_batch_size > 0, "data.micro_batch_size: must be positive"),
        (
            zero_stage_problem(cfg.deepspeed.zero_stage) is None,
            zero_stage_problem(cfg.deepspeed.zero_stage),
        ),
        (
            cfg.deepspeed.precision in PRECISIONS,
            f"deepspeed.precision: {cfg.deepspeed.precision!r} is not one "
            f"of {', '.join(PRECISIONS)}",
        ),
        (
            not cfg.deepspeed.offload_params or cfg.deepspeed.zero_stage == 3,
            "deepspeed.offload_params: needs zero_stage 3",
        ),
        (
            not cfg.deepspeed.offload_optimizer or cfg.deepspeed.zero_stage >= 1,
            "deepspeed.offload_optimizer: needs zero_stage >= 1",
        ),
        (
            cfg.optim.implementation in ADAMW_IMPLEMENTATIONS,
            f"optim.implementation: {cfg.optim.implementation!r} is not one of "
            f"{', '.join(ADAMW_IMPLEMENTATIONS)}",
        ),
        (
            cfg.optim.implementation == "auto" or not cfg.deepspeed.offload_optimizer,
            "optim.implementation: with deepspeed.offload_optimizer DeepSpeed's "
            "CPU Adam steps; leave it auto",
        ),
        *_optim_checks(cfg.optim),
        (
            cfg.schedule.warmup_steps >= 0,
            f"schedule.warmup_steps: {cfg.schedule.warmup_steps} must be 0 or more",
        ),
        (
            math.isfinite(cfg.schedule.min_lr_ratio) and cfg.schedule.min_lr_ratio >= 0,
            f"schedule.min_lr_ratio: {cfg.schedule.min_lr_ratio} must "
            "be a finite number, 0 or more",
        ),
        (
            cfg.schedule.decay in DECAYS,
            f"schedule.decay: {cfg.schedule.decay!r} is not one of {', '.join(DECAYS)}",
        ),
        (
            cfg.schedule.decay != "inverse_sqrt" or cfg.schedule.warmup_steps > 0,
            "schedule.warmup_steps: inverse_sqrt needs a positive warmup "
            "(the formula divides by it)",
        ),
        (cfg.checkpoint.keep_last >= 1, "checkpoint.keep_last: must be at least 1"),
        (cfg.guard.max_consecutive_skips >= 0, "guard.max_consecutive_skips: must be 0 or more"),
        (cfg.guard.spike_factor >= 0, "guard.spike_factor: must be 0 (off) or positive"),
        (cfg.guard.spike_window >= 2, "guard.spike_window: must be at least 2"),
        (0 <= cfg.data.max_bad_fraction <= 1, "data.max_bad_fraction: must be in [0, 1]"),
        (cfg.lm_eval.every >= 0, "lm_eval.every: must be 0 (off) or positive"),
        (cfg.lm_eval.limit >= 0, "lm_eval.limit: must be 0 (all) or positive"),
        (cfg.profile_start >= 0, "profile_start: must be 0 (off) or a step number"),
        (cfg.profile_steps >= 1, "profile_steps: must be at least 1"),
        (
            cfg.compile_scope in COMPILE_SCOPES,
            f"compile_scope: {cfg.compile_scope!r} is not one of {', '.join(COMPILE_SCOPES)}",
        ),
        (
            not (cfg.compile_scope == "model" and cfg.deepspeed.zero_stage == 3),
            "compile_scope: model needs deepspeed.zero_stage 0-2 (ZeRO-3 gathers parameters in "
            "hooks that break the graph); use blocks or auto",
        ),
    ]
    checks.append(_wandb_check(cfg.wandb))
    if task is not None:  # the rules below depend on what the task is
        checks.append(
            (
                cfg.model.arch == task.arch,
                f"model.arch: task {cfg.task} trains {task.arch}, not {cfg.model.arch}",
            )
        )
        warm_startable = [name for name, t in TASKS.items() if t.warm_startable]
        checks.append(
            (
                task.warm_startable or not (cfg.init.encoder or cfg.init.decoder),
                f"init: warm starting is for task {' or '.join(warm_startable)}",
            )
        )
    if cfg.lm_eval.every:
        checks.append(
            (
                cfg.task == "causal_lm",
                f"lm_eval.every: the lm-eval tasks score a causal_lm, not {cfg.task}",
            )
        )
    return [message for ok, message in checks if not ok]


def zero_stage_problem(stage: int) -> str | None:
    """The one check of `deepspeed.zero_stage`, for training and inference alike."""
    if stage in ZERO_STAGES:
        return None
    return f"deepspeed.zero_stage: {stage} is not 0, 1, 2 or 3"


# The schemas of the other launch entry points. Each takes `[CONFIG.yaml] [key.sub=value ...]`
# (`common.configure.parse_cli`) except the main job, which, like training, takes a YAML;
# a field set to MISSING has no default and must be given.


@dataclass
class StageDeepSpeedConfig:
    zero_stage: int = 2  # deepspeed.zero_stage of every training run


@dataclass
class InferenceDeepSpeedConfig:
    zero_stage: int = 0  # 0, 1, 2 or 3; only 3 partitions anything at inference (the parameters)
    config_file: str = ""  # a DeepSpeed JSON merged over the derived one (ZeRO-3)


@dataclass
class MainConfig:
    """The whole chain (`python -m launch.main CONFIG.yaml [key.sub=value ...]`)."""

    RENAMED: ClassVar[dict] = {"zero_stage": "deepspeed.zero_stage"}

    # every stage's outputs and logs; the summary and plots in its report/
    out_dir: str = "runs/main"
    # PrepareConfig YAML of the data stage
    prepare_config: str = "configs/prepare_gettext_en_de.yaml"
    # key.sub=value overrides of the prepare config, before the job's own (output_dir: data_dir),
    # e.g. [seq_len=1024]
    prepare_overrides: List[str] = field(default_factory=list)
    # the dataset; overrides the configs' output_dir and data.data_dir
    data_dir: str = "data/gettext-en-de"
    nproc: int = 2  # ranks of the pretraining and fine-tuning runs
    # of every training run
    deepspeed: StageDeepSpeedConfig = field(default_factory=StageDeepSpeedConfig)
    gpt_config: str = "configs/tiny_gpt.yaml"  # TrainConfig YAML of the GPT pretraining
    bert_config: str = "configs/tiny_bert.yaml"  # TrainConfig YAML of the BERT pretraining
    # TrainConfig YAML of the fine-tuning runs
    translation_config: str = "configs/tiny_translation.yaml"
    # key.sub=value overrides of one stage's training config, after the job's own (data_dir,
    # run_dir, steps, ZeRO stage): e.g. [model.max_seq_len=1024] for a BERT whose YAML has fewer
    # positions than the data's blocks
    gpt_overrides: List[str] = field(default_factory=list)
    # as gpt_overrides, for the BERT pretraining
    bert_overrides: List[str] = field(default_factory=list)
    # as gpt_overrides, for every fine-tuning run
    translation_overrides: List[str] = field(default_factory=list)
    pretrain_steps: int = 500  # max_steps of each pretraining run
    # max_steps of the BERT pretraining if not pretrain_steps (0): a BERT step predicts only the
    # masked tokens and costs less than a GPT step, so equal steps are not an equal budget
    bert_pretrain_steps: int = 0
    finetune_steps: int = 400  # max_steps of each fine-tuning run
    # encoder/decoder starts of the fine-tuning runs
    starts: List[str] = field(default_factory=lambda: ["random/random", "bert/gpt"])
    beam: int = 4  # beam size of the evaluation
    # splits scored with BLEU and chrF
    eval_splits: List[str] = field(default_factory=lambda: ["valid", "test"])
    wandb_mode: str = ""  # wandb.mode of every training run; "" = $WANDB_MODE, else offline
    # The W&B group the job's runs share; "" = $WANDB_RUN_GROUP, else out_dir's name and the time it
    # first ran
    wandb_group: str = ""


# export's and average's `overwrite` replaced an out that was not an export: a user's files.
OVERWRITE_RETIRED = (
    "an earlier export in out is replaced without it, and nothing else ever is (choose another "
    "out, or move its files away yourself)"
)


@dataclass
class ExportConfig:
    """A run's checkpoint to plain weights
    (`python -m launch.export checkpoint=RUN_DIR out=DIR`)."""

    RETIRED: ClassVar[dict] = {"overwrite": OVERWRITE_RETIRED}

    # a run directory, its checkpoints/ or one step_* checkpoint, of any ZeRO stage
    checkpoint: str = MISSING
    # the model directory written: model.safetensors, config.json, tokenizer.model, provenance.json
    out: str = MISSING
    # ours | hf: Hugging Face's save_pretrained layout (GPT-2, Llama, Qwen2.5, Qwen3, Mistral,
    # OLMo 2, BERT or a BERT + GPT-2 encoder-decoder), its fast tokenizer beside the weights
    format: str = "ours"


@dataclass
class AverageConfig:
    """The mean of a run's last checkpoints
    (`python -m launch.average checkpoint=RUN last=N out=DIR`)."""

    RENAMED: ClassVar[dict] = {"run_dir": "checkpoint"}
    RETIRED: ClassVar[dict] = {"overwrite": OVERWRITE_RETIRED}

    # a training run directory (its checkpoints/ holds the step_* checkpoints)
    checkpoint: str = MISSING
    # how many of its newest complete checkpoints are averaged (Vaswani et al.: 5 base, 20 big)
    last: int = 5
    out: str = MISSING  # the model directory written, as launch.export writes it


@dataclass
class EvaluateConfig:
    """BLEU and chrF of a translation model on one split
    (`python -m launch.evaluate checkpoint=...`)."""

    RENAMED: ClassVar[dict] = {
        "zero_stage": "deepspeed.zero_stage",
        "deepspeed_config": "deepspeed.config_file",
    }

    checkpoint: str = MISSING  # an exported model directory (launch.export) or a training run
    data_dir: str = ""  # the prepared dataset; "" = the one the checkpoint was trained on
    split: str = "valid"  # train | valid | test
    beam: int = 4  # beam size (1: greedy)
    length_penalty: float = 1.0  # beam scores are divided by length ** this (0: no normalisation)
    max_len: int = 0  # most tokens per hypothesis, </s> included; 0 = the model's max_seq_len
    # A source's own limit, min(max_len, max_len_a x its tokens (</s> included) + max_len_b), at
    # which its hypotheses stop as at max_len (fairseq's --max-len-a/-b); 0 and 0 = max_len for all.
    # 1.5 / 10 cuts runaway repetitions; 99.99% of the default corpus's training targets fit it.
    max_len_a: float = 1.5
    max_len_b: int = 10  # see max_len_a
    micro_batch_size: int = 32  # sources per batch and rank
    limit: int = 0  # the split's first N pairs only; 0 = all
    out: str = ""  # output directory; "" = CHECKPOINT/eval-SPLIT
    # ZeRO stage and a user JSON
    deepspeed: InferenceDeepSpeedConfig = field(default_factory=InferenceDeepSpeedConfig)
    threads_per_rank: int = 0  # threads per rank for torch on CPU; 0 = cores / local ranks
    dist_timeout_s: int = 600  # a rank that stops answering fails the job after this long


@dataclass
class LmEvalConfig:
    """A GPT's scores on lm-evaluation-harness tasks built from held-out text
    (`python -m launch.lm_eval checkpoint=DIR`)."""

    checkpoint: str = MISSING  # an exported GPT directory (launch.export, format=ours or format=hf)
    # cloze | choice (docs/design.md#scoring-with-lm-evaluation-harness)
    tasks: List[str] = field(default_factory=lambda: ["cloze", "choice"])
    # the prepared dataset the tasks are built from; "" = the one the model was trained on
    data_dir: str = ""
    split: str = "valid"  # the held-out split read: valid | test
    limit: int = 0  # the first N docs of each task; 0 = all
    seed: int = 1234  # draws the choice task's distractors and their order
    # ours: our model through launch.lm_eval's OurLM; hf: lm-eval's HFLM over a Hugging Face export;
    # auto: hf where the directory is a Hugging Face one (its config.json has no "model" section)
    format: str = "auto"
    out: str = ""  # the results JSON written; "" = CHECKPOINT/lm_eval-SPLIT.json
    micro_batch_size: int = 16  # requests per forward
    device: str = ""  # torch device; "" = cuda if available, else cpu
    bootstrap_iters: int = 0  # lm-eval's bootstrap resamples for standard errors; 0 = none
    # W&B run of the scores (mode disabled: none)
    wandb: WandbConfig = field(default_factory=WandbConfig)


@dataclass
class TranslateConfig:
    """Text in, translations out, one per line (`python -m launch.translate checkpoint=...`)."""

    checkpoint: str = MISSING  # an exported model directory (launch.export) or a training run
    input: str = "-"  # UTF-8 text, one sentence per line; - = standard input
    beam: int = 4  # beam size (1: greedy)
    length_penalty: float = 1.0  # beam scores are divided by length ** this (0: no normalisation)
    max_len: int = 0  # most tokens per translation, </s> included; 0 = the model's max_seq_len
    # a line's own limit: min(max_len, max_len_a x its tokens + max_len_b); 0 and 0 = off
    max_len_a: float = 1.5
    max_len_b: int = 10  # see max_len_a
    micro_batch_size: int = 32  # lines per batch; output is flushed after each
    device: str = ""  # torch device; "" = cuda if available, else cpu
    threads: int = 0  # torch threads on CPU; 0 = torch's default


@dataclass
class ReportConfig:
    """Loss curves of finished runs (`python -m launch.report out=OUT.png runs=[RUN_DIR,...]`)."""

    out: str = MISSING  # the PNG written
    # run directories with a metrics.jsonl, e.g. [runs/tiny_gpt,runs/tiny_bert]
    runs: List[str] = MISSING
