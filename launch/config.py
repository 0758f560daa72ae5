"""The entry points' configurations, assembled from their components' own sections: train,
main, export, average, evaluate, translate, report.

Each component's section sits beside its code with the checks of its own fields: the model's
(`model.config.ModelConfig`), the loader's (`pipeline.load.config.LoaderConfig`), the optimizer's
and schedule's (`launch.optim_config`), DeepSpeed's (`launch.deepspeed.config`), the checkpoint's
(`launch.checkpoint.config`), W&B's (`launch.tracking.WandbConfig`) and the guard's
(`launch.train.guard.GuardConfig`). Checks that need two sections, or the task table, are the
resolution route's (`launch.resolve.config_problems`). The batch arithmetic is done once in
`BatchPlan`. No torch here: --help and the configuration reference load these schemas alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, List

from omegaconf import MISSING

from common.configure import UserError
from launch.checkpoint.config import CheckpointConfig, checkpoint_problems
from launch.deepspeed.config import (
    DeepSpeedConfig,
    InferenceDeepSpeedConfig,
    StageDeepSpeedConfig,
    deepspeed_problems,
)
from launch.optim_config import OptimConfig, ScheduleConfig, optim_problems, schedule_problems
from launch.tracking import WandbConfig, wandb_problems
from launch.train.guard import GuardConfig, guard_problems
from model.config import ModelConfig
from pipeline.load.config import LoaderConfig, loader_problems
from pipeline.load.config import global_batch_size as samples_per_step

COMPILE_SCOPES = ("auto", "model", "blocks")  # compile_scope (`compile_scope_for`)


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


def field_problems(cfg: TrainConfig) -> list[str]:
    """The problems of the run's own fields, then of each section's (each section's own checks,
    beside its code), every message starting with its key; empty if none. What needs two
    sections or the task table is checked on the resolution route
    (`launch.resolve.config_problems`)."""
    checks = [
        (cfg.max_steps > 0, "max_steps: must be positive"),
        (cfg.grad_accum > 0, "grad_accum: must be positive"),
        (cfg.global_batch_size >= 0, "global_batch_size: must be 0 (use grad_accum) or positive"),
        (
            not (cfg.global_batch_size and cfg.grad_accum != 1),
            "global_batch_size: set it or grad_accum, not both (grad_accum is derived from it)",
        ),
        (cfg.lm_eval.every >= 0, "lm_eval.every: must be 0 (off) or positive"),
        (cfg.lm_eval.limit >= 0, "lm_eval.limit: must be 0 (all) or positive"),
        (cfg.profile_start >= 0, "profile_start: must be 0 (off) or a step number"),
        (cfg.profile_steps >= 1, "profile_steps: must be at least 1"),
        (
            cfg.compile_scope in COMPILE_SCOPES,
            f"compile_scope: {cfg.compile_scope!r} is not one of {', '.join(COMPILE_SCOPES)}",
        ),
    ]
    return [
        *(message for ok, message in checks if not ok),
        *loader_problems(cfg.data),
        *deepspeed_problems(cfg.deepspeed),
        *optim_problems(cfg.optim),
        *schedule_problems(cfg.schedule),
        *checkpoint_problems(cfg.checkpoint),
        *guard_problems(cfg.guard),
        *wandb_problems(cfg.wandb),
    ]


# The schemas of the other launch entry points. Each takes `[CONFIG.yaml] [key.sub=value ...]`
# (`common.configure.parse_cli`) except the main job, which, like training, takes a YAML;
# a field set to MISSING has no default and must be given.


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
