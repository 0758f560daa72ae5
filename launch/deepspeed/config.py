"""DeepSpeed's section of the configs (`deepspeed.*` of training, the main job and evaluation)
with its checks, and the DeepSpeed JSON of a run derived once from the run config and its batch
plan (`launch.config.BatchPlan`); a user's conflicting keys refused by name. torch is imported
where a JSON is built, not with the schema."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.configure import UserError

if TYPE_CHECKING:
    from launch.config import BatchPlan, TrainConfig

PRECISIONS = ("fp32", "bf16", "fp16", "auto")  # deepspeed.precision
ZERO_STAGES = (0, 1, 2, 3)  # deepspeed.zero_stage, of training and of inference alike


@dataclass
class DeepSpeedConfig:
    # 0, 1, 2 or 3. 0 on more than one rank: the trainer reduces the gradients during the
    # backward (launch.train.reduce), the fastest for models whose states fit one device
    zero_stage: int = 2
    offload_optimizer: bool = False  # ZeRO-Offload of optimizer states to CPU (stage >= 1)
    offload_params: bool = False  # parameters to CPU (stage 3)
    # fp32 | bf16 | fp16 (fp16 with dynamic loss scaling, GPU only) | auto: bf16 where this machine
    # multiplies bf16 matrices at least as fast as fp32 ones (a GPU with bf16; a CPU with AMX or
    # AVX512-BF16, measured once), else fp32 (an AVX2 CPU's bf16 GEMMs are ~100x slower). bf16 is
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
class StageDeepSpeedConfig:
    zero_stage: int = 2  # deepspeed.zero_stage of every training run


@dataclass
class InferenceDeepSpeedConfig:
    zero_stage: int = 0  # 0, 1, 2 or 3; only 3 partitions anything at inference (the parameters)
    config_file: str = ""  # a DeepSpeed JSON merged over the derived one (ZeRO-3)


def zero_stage_problem(stage: int) -> str | None:
    """The one check of `deepspeed.zero_stage`, for training and inference alike."""
    if stage in ZERO_STAGES:
        return None
    return f"deepspeed.zero_stage: {stage} is not 0, 1, 2 or 3"


def deepspeed_problems(ds: DeepSpeedConfig) -> list[str]:
    """`deepspeed.*`'s problems in training, each message starting with its key."""
    checks = [
        (zero_stage_problem(ds.zero_stage) is None, zero_stage_problem(ds.zero_stage)),
        (
            ds.precision in PRECISIONS,
            f"deepspeed.precision: {ds.precision!r} is not one of {', '.join(PRECISIONS)}",
        ),
        (
            not ds.offload_params or ds.zero_stage == 3,
            "deepspeed.offload_params: needs zero_stage 3",
        ),
        (
            not ds.offload_optimizer or ds.zero_stage >= 1,
            "deepspeed.offload_optimizer: needs zero_stage >= 1",
        ),
    ]
    return [message for ok, message in checks if not ok]


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def deepspeed_config(cfg: TrainConfig, plan: BatchPlan, *, load_universal: bool = False) -> dict:
    """DeepSpeed's JSON for a run; `load_universal`: the engine will load a universal
    checkpoint (`to_universal`), which DeepSpeed must know before the engine is built."""
    ds = cfg.deepspeed
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        # ZeRO-0 without fp16: `launch.optim.AdamW` clips (DeepSpeed's clipping there all-reduces
        # a norm that every rank has already)
        "gradient_clipping": 0.0
        if ds.zero_stage == 0 and ds.precision != "fp16"
        else cfg.optim.grad_clip,
        "steps_per_print": 10**9,  # the loop does its own logging
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # With offload the trainer hands in DeepSpeedCPUAdam (`cpu_adam`), or torch's AdamW where
        # DeepSpeed's CPU Adam op cannot be built; DeepSpeed would refuse the latter.
        "zero_force_ds_cpu_optimizer": False,
    }
    if ds.zero_stage > 0:
        zero: dict[str, Any] = {
            "stage": ds.zero_stage,
            "overlap_comm": _cuda(),
            "contiguous_gradients": True,
        }
        if ds.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": _cuda()}
        if ds.zero_stage == 3 and ds.zero3_persistence_threshold >= 0:
            zero["stage3_param_persistence_threshold"] = ds.zero3_persistence_threshold
        if ds.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": _cuda()}
        config["zero_optimization"] = zero
    if ds.precision == "bf16" and ds.zero_stage == 0:
        # Without ZeRO, DeepSpeed's bf16 accumulates the gradients in bf16 (`_bf16_accumulation`);
        # torch's autocast keeps the weights and gradients in fp32 and runs the matmuls in bf16
        # (the AMP recipe, which Hugging Face's bf16 uses too), and fp32 gradients are what the
        # trainer's overlapped reduction sends (`launch.train.reduce`).
        config["torch_autocast"] = {"enabled": True, "dtype": "bfloat16"}
    elif ds.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif ds.precision == "fp16":
        if not _cuda():
            raise UserError("deepspeed.precision: fp16 needs a GPU; use fp32 or bf16 on CPU")
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": ds.initial_scale_power,
            "loss_scale_window": 1000,
            "hysteresis": 2,
            "min_loss_scale": 1,
        }
    if ds.config_file:
        path = Path(ds.config_file)
        if not path.is_file():
            raise UserError(f"deepspeed.config_file: file not found: {path}")
        try:
            user = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"deepspeed.config_file: {path}: invalid JSON: {err}") from err
        for key in (
            "train_batch_size",
            "train_micro_batch_size_per_gpu",
            "gradient_accumulation_steps",
        ):
            if key in user and user[key] != "auto" and user[key] != config[key]:
                raise UserError(
                    f"deepspeed.config_file: {key}={user[key]} disagrees with the run config "
                    f"({config[key]}); set data.micro_batch_size / grad_accum instead"
                )
        if "load_universal" in (user.get("checkpoint") or {}):
            raise UserError(
                "deepspeed.config_file: checkpoint.load_universal is set by the trainer, from the "
                "checkpoint it resumes from; remove it"
            )
        config = _deep_merge(config, {k: v for k, v in user.items() if v != "auto"})
    config = _bf16_accumulation(config)
    if load_universal:
        config = _deep_merge(config, {"checkpoint": {"load_universal": True}})
    return config


# DeepSpeed's names for bf16 in `data_types` (DtypeEnum)
_BF16_NAMES = ("bf16", "bfloat16", "torch.bfloat16")


def _bf16_accumulation(config: dict) -> dict:
    """bf16 under ZeRO 1-3: gradients summed in fp32, over the micro batches of a step
    (`data_types.grad_accum_dtype`) and over the ranks (`communication_data_type`), not in
    bf16, whose 8-bit mantissa drops the small contributions of later micro batches and ranks.
    DeepSpeed's default for both is the model's dtype. Both, so that a step is the same sum
    whatever its split into ranks x micro batches: a run resumed on another world size keeps its
    global batch (`launch.train.resume.find_resume`), and with fp32 accumulation but a bf16
    reduction the next step would differ in the bf16 rounding (tests/launch/test_universal.py). The
    reduction then moves twice the bytes of a bf16 one.

    What DeepSpeed 0.19 makes of it, by stage (`DeepSpeedEngine._do_optimizer_sanity_check`):
    ZeRO-1 wraps AdamW in its BF16_Optimizer (fp32 gradient buffers beside the bf16 weights;
    with optimizer offload, its ZeRO optimizer, which keeps an fp32 `grad_accum` per parameter);
    ZeRO-2 and ZeRO-3 accumulate each rank's gradient partition in fp32. Without ZeRO (stage 0)
    it raises NotImplementedError: its bf16 wrapper (FP16_UnfusedOptimizer) accumulates in
    `param.grad`, in bf16; so `deepspeed.precision: bf16` at stage 0 is torch's autocast over
    fp32 weights instead (`deepspeed_config`), and a user's JSON that enables DeepSpeed's bf16
    there with fp32 accumulation is refused in one line. Values the user's JSON sets are kept.
    Set for every step count alike (grad_accum 1 too): the optimizer
    DeepSpeed builds, and so the checkpoint's layout, does not depend on the world size."""
    if config.get("bf16", {}).get("enabled") is not True:
        return config
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 0:
        if accum is not None and str(accum) not in _BF16_NAMES:
            raise UserError(
                f"deepspeed.config_file: data_types.grad_accum_dtype={accum} with bf16 needs ZeRO "
                f"(deepspeed.zero_stage >= 1); DeepSpeed accumulates in bf16 without it"
            )
        return config
    if accum is None:
        config = _deep_merge(config, {"data_types": {"grad_accum_dtype": "fp32"}})
    return (
        config
        if "communication_data_type" in config
        else {**config, "communication_data_type": "fp32"}
    )


def inference_config(micro_batch_size: int, world_size: int, user: dict | None = None) -> dict:
    """DeepSpeed JSON for ZeRO-3 evaluation, without an optimizer; `user` (a user's own JSON)
    is merged over it. Only stage 3 changes a forward (parameters are partitioned and gathered
    module by module); stages 1 and 2 partition optimizer states and gradients, which inference
    has none of, so below stage 3 evaluation needs no engine."""
    config: dict[str, Any] = {
        "train_batch_size": micro_batch_size * world_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_optimization": {"stage": 3, "overlap_comm": _cuda()},
    }
    batch_keys = (
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
        "gradient_accumulation_steps",
    )
    return _deep_merge(
        config, {k: v for k, v in (user or {}).items() if v != "auto" and k not in batch_keys}
    )


def _deep_merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            _deep_merge(merged[key], value)
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged
