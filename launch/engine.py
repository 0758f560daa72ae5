"""DeepSpeed ZeRO (Rajbhandari et al. 2020): the only module of the project that imports deepspeed.

The training loop talks to `Engine` (forward, backward, step, save, load); the DeepSpeed JSON
is derived from the run config here, from the batch arithmetic computed once in
`launch.config.BatchPlan`. AdamW and its parameter groups are built by the caller
(`launch.optim`) and handed in, as is the learning-rate schedule, which DeepSpeed then
steps at every accumulation boundary and saves with the checkpoint; with ZeRO-Offload that
AdamW is DeepSpeed's CPU Adam, built here (`cpu_adam`) for `launch.optim`.

ZeRO checkpoints are tied to the world size that wrote them (DeepSpeed #2898): `to_universal`
turns one into DeepSpeed's universal checkpoint (Lian et al. 2024, "Universal Checkpointing",
arXiv:2406.18820), a copy written beside it with every parameter's fp32 weights and Adam
moments whole, which an engine built with `deepspeed_config(..., load_universal=True)` loads
on any world size.

Reading a checkpoint runs no code from it wherever we read it ourselves (`consolidated_state_dict`
for export, evaluation and translation; the ZeRO-3 universal repair): torch's weights-only
unpickler, with the few classes DeepSpeed's files hold allowed (`_checkpoint_globals`), also for
the torch.load calls inside DeepSpeed's consolidation. `Engine.load` is DeepSpeed's
`load_checkpoint`, which unpickles in full: a run directory resumed from is trusted like code.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import torch

from launch.checkpoint import (INTEGRITY, UNIVERSAL_INFO, is_universal, is_zero_partitioned, require_intact,
                               universal_tag_for, verify, write_integrity)
from launch.config import BatchPlan, TrainConfig
from pipeline.configure import UserError
from pipeline.format import file_sha256


def deepspeed_config(cfg: TrainConfig, plan: BatchPlan, *, load_universal: bool = False) -> dict:
    """DeepSpeed's JSON for a run; `load_universal`: the engine will load a universal
    checkpoint (`to_universal`), which DeepSpeed must know before the engine is built."""
    ds = cfg.deepspeed
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "steps_per_print": 10**9,  # the loop does its own logging
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # With offload the trainer hands in DeepSpeedCPUAdam (`cpu_adam`), or torch's AdamW where
        # DeepSpeed's CPU Adam op cannot be built; DeepSpeed would refuse the latter.
        "zero_force_ds_cpu_optimizer": False,
    }
    if ds.zero_stage > 0:
        zero: dict[str, Any] = {"stage": ds.zero_stage, "overlap_comm": torch.cuda.is_available(), "contiguous_gradients": True}
        if ds.offload_optimizer:
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        if ds.zero_stage == 3 and ds.zero3_persistence_threshold >= 0:
            zero["stage3_param_persistence_threshold"] = ds.zero3_persistence_threshold
        if ds.offload_params:
            zero["offload_param"] = {"device": "cpu", "pin_memory": torch.cuda.is_available()}
        config["zero_optimization"] = zero
    if ds.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif ds.precision == "fp16":
        if not torch.cuda.is_available():
            raise UserError("deepspeed.precision: fp16 needs a GPU; use fp32 or bf16 on CPU")
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": ds.initial_scale_power,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    if ds.config_file:
        path = Path(ds.config_file)
        if not path.is_file():
            raise UserError(f"deepspeed.config_file: file not found: {path}")
        try:
            user = json.loads(path.read_text())
        except json.JSONDecodeError as err:
            raise UserError(f"deepspeed.config_file: {path}: invalid JSON: {err}") from err
        for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
            if key in user and user[key] != "auto" and user[key] != config[key]:
                raise UserError(f"deepspeed.config_file: {key}={user[key]} disagrees with the run config ({config[key]}); set data.micro_batch_size / grad_accum instead")
        if "load_universal" in (user.get("checkpoint") or {}):
            raise UserError("deepspeed.config_file: checkpoint.load_universal is set by the trainer, from the "
                            "checkpoint it resumes from; remove it")
        config = _deep_merge(config, {k: v for k, v in user.items() if v != "auto"})
    config = _bf16_accumulation(config)
    if load_universal:
        config = _deep_merge(config, {"checkpoint": {"load_universal": True}})
    return config


_BF16_NAMES = ("bf16", "bfloat16", "torch.bfloat16")  # DeepSpeed's names for bf16 in `data_types` (DtypeEnum)


def _bf16_accumulation(config: dict) -> dict:
    """bf16 under ZeRO 1-3: gradients summed in fp32, over the micro batches of a step
    (`data_types.grad_accum_dtype`) and over the ranks (`communication_data_type`), not in
    bf16, whose 8-bit mantissa drops the small contributions of later micro batches and ranks.
    DeepSpeed's default for both is the model's dtype. Both, so that a step is the same sum
    whatever its split into ranks x micro batches: a run resumed on another world size keeps its
    global batch (`launch.train.resume.find_resume`), and with fp32 accumulation but a bf16 reduction the
    next step would differ in the bf16 rounding (tests/test_universal.py). The reduction then
    moves twice the bytes of a bf16 one.

    What DeepSpeed 0.19 makes of it, by stage (`DeepSpeedEngine._do_optimizer_sanity_check`):
    ZeRO-1 wraps AdamW in its BF16_Optimizer (fp32 gradient buffers beside the bf16 weights;
    with optimizer offload, its ZeRO optimizer, which keeps an fp32 `grad_accum` per parameter);
    ZeRO-2 and ZeRO-3 accumulate each rank's gradient partition in fp32. Without ZeRO (stage 0)
    it raises NotImplementedError: its bf16 wrapper (FP16_UnfusedOptimizer) accumulates in
    `param.grad`, in bf16, so stage 0 is left at DeepSpeed's defaults (`Engine` warns when it
    accumulates), and a user's JSON asking for fp32 there is refused in one line. Values the
    user's JSON sets are kept. Set for every step count alike (grad_accum 1 too): the optimizer
    DeepSpeed builds, and so the checkpoint's layout, does not depend on the world size."""
    if config.get("bf16", {}).get("enabled") is not True:
        return config
    stage = int((config.get("zero_optimization") or {}).get("stage", 0))
    accum = (config.get("data_types") or {}).get("grad_accum_dtype")
    if stage == 0:
        if accum is not None and str(accum) not in _BF16_NAMES:
            raise UserError(f"deepspeed.config_file: data_types.grad_accum_dtype={accum} with bf16 needs ZeRO "
                            f"(deepspeed.zero_stage >= 1); DeepSpeed accumulates in bf16 without it")
        return config
    if accum is None:
        config = _deep_merge(config, {"data_types": {"grad_accum_dtype": "fp32"}})
    return config if "communication_data_type" in config else {**config, "communication_data_type": "fp32"}


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
        "zero_optimization": {"stage": 3, "overlap_comm": torch.cuda.is_available()},
    }
    batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
    return _deep_merge(config, {k: v for k, v in (user or {}).items() if v != "auto" and k not in batch_keys})


def _deep_merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def cpu_adam(param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float) -> torch.optim.Optimizer:
    """AdamW for ZeRO-Offload, whose fp32 master weights and Adam moments live in CPU memory:
    DeepSpeed's DeepSpeedCPUAdam in AdamW mode (decoupled weight decay, bias correction, as
    torch's AdamW), over the caller's parameter groups, each with its own weight decay.

    Its C++ op is built by DeepSpeed with the host's compiler at first use and cached
    (TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions). If it cannot be built, torch's AdamW
    (the same update, slower) takes its place, with a one-line warning. Under a process group
    the ranks agree first: if the op fails on any rank, every rank falls back, so that all
    partitions are stepped by the same optimizer."""
    failure = None
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # Copies: a failed construction leaves the groups as they were, for the fallback.
        optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam([dict(group) for group in param_groups], lr=lr,
                                                            betas=betas, eps=eps, adamw_mode=True)
    except Exception as err:  # the JIT build (no compiler, no headers) or the load of the op
        cause = err.__cause__ or err
        failure = f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0]}"
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        built = torch.tensor([failure is None], dtype=torch.int32)
        torch.distributed.all_reduce(built, op=torch.distributed.ReduceOp.MIN)
        if not built.item() and failure is None:
            failure = "it could not be built on another rank"
    if failure is None:
        return optimizer
    if not distributed or torch.distributed.get_rank() == 0:
        print(f"warning: DeepSpeed's CPU Adam op is unavailable ({failure}); the offloaded optimizer is torch's "
              f"AdamW, which is slower", file=sys.stderr)
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps)


class Engine:
    """A DeepSpeed engine seen through the few calls the loop makes. Without an optimizer
    (evaluation: `inference_config`) only `module`, `device` and forwards are of use.

    A training engine says on rank 0, in one line, which optimizer DeepSpeed steps, inside which
    of its wrappers, and in which dtype the gradients are accumulated (`describe`)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler, config: dict):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.config = config
        self._engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)
        if optimizer is not None and self._engine.global_rank == 0:
            print(self.describe(), file=sys.stderr)
            accum = self._engine.gradient_accumulation_steps()
            if self._engine.bfloat16_enabled() and not self._engine.zero_optimization() and accum > 1:
                print(f"warning: ZeRO-0 in bf16 accumulates the gradients of grad_accum={accum} micro batches in "
                      f"bf16 (DeepSpeed accumulates in fp32 only under ZeRO): set deepspeed.zero_stage=1 or more",
                      file=sys.stderr)

    @property
    def optimizer_name(self) -> str:
        """The class of the optimizer DeepSpeed steps (ours, inside its wrapper): e.g. AdamW, DeepSpeedCPUAdam."""
        return type(self._engine.basic_optimizer).__name__

    def describe(self) -> str:
        wrapper = type(self._engine.optimizer).__name__
        inside = "" if self._engine.optimizer is self._engine.basic_optimizer else f" in DeepSpeed's {wrapper}"
        offload = ", states offloaded to CPU" if self._engine.zero_cpu_offload() else ""
        accum = str(self._engine.get_data_types()[1]).removeprefix("torch.")
        reduce = str(self._engine.communication_data_type).removeprefix("torch.")
        return f"optimizer: {self.optimizer_name}{inside}{offload}; gradients accumulated in {accum}, reduced in {reduce}"

    @property
    def module(self) -> torch.nn.Module:
        return self._engine.module

    @property
    def device(self) -> torch.device:
        return self._engine.device

    def partitioned(self) -> tuple[int, int]:
        """(parameter tensors ZeRO-3 splits over the ranks, all parameter tensors); small ones
        stay whole on every rank below zero_optimization.stage3_param_persistence_threshold."""
        params = list(self._engine.module.parameters())
        return sum(hasattr(p, "ds_id") and not getattr(p, "ds_persist", False) for p in params), len(params)

    def __call__(self, **batch):
        return self._engine(**batch)

    def backward(self, loss: torch.Tensor) -> None:
        self._engine.backward(loss)

    def step(self) -> None:
        self._engine.step()

    def train(self, mode: bool = True) -> None:
        self._engine.train(mode)

    @property
    def lr(self) -> float:
        return float(self._engine.get_lr()[0])

    def grad_norm(self) -> torch.Tensor:
        """The last step's global gradient norm, unread: a 0-dim tensor where DeepSpeed keeps it
        (reading a GPU one after the step would wait for the optimizer's update); NaN if none."""
        norm = self._engine.get_global_grad_norm()
        if isinstance(norm, torch.Tensor):
            return norm.detach().reshape(())
        return torch.tensor(float("nan") if norm is None else float(norm), dtype=torch.float64)

    @property
    def skipped_steps(self) -> int:
        """Optimizer steps DeepSpeed dropped: a non-finite gradient norm (fp16 overflow included)."""
        return int(self._engine.skipped_steps)

    @property
    def loss_scale(self) -> float | None:
        """fp16's dynamic loss scale; None in fp32 and bf16, which have none."""
        if not self._engine.fp16_enabled():
            return None
        return float(getattr(self._engine.optimizer, "cur_scale", getattr(self._engine.optimizer, "loss_scale", 1.0)))

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Every rank must call this: ZeRO partitions are written by their owners. A write that
        fails with an OSError (ENOSPC on a full disk) is raised, naming its file, once DeepSpeed's
        save has returned (`_write_failures_kept`): raised inside it, it would skip the save's
        closing barrier and leave the other ranks waiting there."""
        failures: list[OSError] = []
        with _write_failures_kept(self._engine, failures):
            self._engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)
        if failures:
            raise failures[0]

    def load(self, directory: str | Path, tag: str) -> dict:
        """Module, optimizer, schedule and step from a checkpoint: one this world size wrote, or
        a universal one (`to_universal`) if the engine was built with `load_universal`."""
        checkpoint = Path(directory) / tag
        universal = bool(self.config.get("checkpoint", {}).get("load_universal"))
        if universal != is_universal(directory, tag):
            raise UserError(f"checkpoint {checkpoint} is {'' if is_universal(directory, tag) else 'not '}a "
                            f"universal checkpoint, but the engine was built with load_universal={universal}")
        stage = self._engine.zero_optimization_stage()
        # A universal copy keeps its writer's model-states file, whose name differs between
        # ZeRO-3 and the stages below; DeepSpeed looks for its own stage's name only.
        model_states = "zero_pp_rank_0_mp_rank_00_model_states.pt" if stage == 3 else "mp_rank_00_model_states.pt"
        if universal and not (checkpoint / model_states).is_file():
            raise UserError(f"checkpoint {checkpoint}: a universal copy written under ZeRO-"
                            f"{'1/2' if stage == 3 else '3'} does not load under ZeRO-{stage} (no {model_states})")
        try:
            # DeepSpeed unpickles its files in full here (weights_only=False): the run directory is
            # trusted (docs/design.md, "Checkpoints are trusted"); export and evaluation read without that.
            path, client_state = self._engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                                              load_lr_scheduler_states=True)
        except Exception as err:
            if "DP world size" not in str(err):  # ZeRO's refusal of another world size
                raise
            raise UserError(f"checkpoint {checkpoint}: {str(err).splitlines()[0]} "
                            f"(convert it with launch.engine.to_universal)") from err
        if path is None:
            raise UserError(f"checkpoint {checkpoint} could not be loaded")
        if universal and stage == 3:
            self._repair_zero3_universal_load(checkpoint)
        return client_state or {}

    def _repair_zero3_universal_load(self, checkpoint: Path) -> None:
        """Undo two slips of DeepSpeed's ZeRO-3 universal load (`stage3.py`,
        `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): it gives every parameter group
        the hyperparameters of the first (our no-decay group would get weight decay), and one
        `step` tensor shared by all groups, which AdamW then advances once per group per step."""
        basic = self._engine.basic_optimizer
        with torch.serialization.safe_globals(_checkpoint_globals()):
            saved = torch.load(checkpoint / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=True)["param_groups"]
        if len(saved) != len(basic.param_groups):
            raise UserError(f"checkpoint {checkpoint} has {len(saved)} optimizer parameter groups, this model {len(basic.param_groups)}")
        for group, saved_group in zip(basic.param_groups, saved):
            group.update({key: value for key, value in saved_group.items() if key != "params"})
        for state in basic.state.values():
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].clone()

    def full_state(self) -> dict[str, Any]:
        """Every parameter's fp32 master weights and AdamW moments, whole and by name, and the
        step counts: what a checkpoint must carry across world sizes. A collective under ZeRO-3
        (the partitions are gathered): every rank calls it."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        optimizer = self._engine.optimizer
        basic = self._engine.basic_optimizer  # the caller's AdamW, whose state ZeRO keeps per partition
        if getattr(optimizer, "_hp_optimizer_states_linked", False):
            # ZeRO-1/2 links each parameter to its moments once, right after stepping the first
            # parameter group, when the other groups have no moments yet (stage_1_and_2.py,
            # `_optimizer_step`): link again now that every group has them.
            optimizer._hp_optimizer_states_linked = False
            optimizer._lazy_init_hp_params_optimizer_state()
        # Below ZeRO, a mixed-precision wrapper keeps fp32 masters beside the bf16 parameters.
        masters = {}
        if hasattr(optimizer, "fp32_groups") and hasattr(optimizer, "fp16_groups"):
            for low, high in zip(optimizer.fp16_groups, optimizer.fp32_groups):
                masters.update({id(p): m for p, m in zip(low, high)})
        weights, exp_avg, exp_avg_sq = {}, {}, {}
        for name, param in self._engine.module.named_parameters():
            weight = safe_get_full_fp32_param(param)
            if weight is not None:
                moments = [safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")]
            else:
                master = masters.get(id(param), param)
                weight, state = master.detach(), basic.state.get(master, {})
                moments = [state.get("exp_avg"), state.get("exp_avg_sq")]
            shape = param.ds_shape if hasattr(param, "ds_shape") else param.shape
            weights[name] = weight.detach().float().cpu().reshape(shape).clone()
            for into, moment in zip((exp_avg, exp_avg_sq), moments):
                if moment is not None:
                    into[name] = moment.detach().float().cpu().reshape(shape).clone()
        adam_steps = {int(s["step"]) for s in basic.state.values() if "step" in s}
        return {"weights": weights, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq, "global_steps": self._engine.global_steps,
                "adam_steps": sorted(adam_steps), "lr": self.lr}


@contextlib.contextmanager
def _write_failures_kept(engine, failures: list[OSError]) -> Iterator[None]:
    """Inside, DeepSpeed's checkpoint writes (its checkpoint engine's `save`, its copy of the
    recovery scripts) append their OSError to `failures` instead of raising it, and write nothing
    once one has, while the rest of the save, collectives included, goes on as on the other
    ranks. torch.save is handed an open file, not the path: a full disk's errno then reaches us
    (from a path, torch's C++ writer says only "basic_ios::clear: iostream error")."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    writer = engine.checkpoint_engine
    # DeepSpeed's default engine calls torch.save with this format choice; another engine writes its own way.
    zip_format = writer.zipfile_serialization if type(writer) is TorchCheckpointEngine else None
    write, copy_scripts = writer.save, engine._copy_recovery_script

    def save(state_dict, path):
        if failures:
            return
        try:
            if zip_format is None:
                write(state_dict, path)
            else:
                with open(path, "wb") as file:
                    torch.save(state_dict, file, _use_new_zipfile_serialization=zip_format)
        except Exception as err:  # torch.save's RuntimeError from a failed write holds the OSError
            cause = _os_error(err)
            if cause is None:
                raise
            failures.append(OSError(cause.errno, cause.strerror or str(cause), str(path)))

    def copy_recovery_scripts(save_path):
        if not failures:
            try:
                copy_scripts(save_path)
            except OSError as err:
                failures.append(OSError(err.errno, err.strerror or str(err), err.filename or str(save_path)))

    writer.save, engine._copy_recovery_script = save, copy_recovery_scripts
    try:
        yield
    finally:
        del writer.save, engine._copy_recovery_script  # the class's methods again


def _os_error(err: BaseException | None) -> OSError | None:
    """The OSError that `err` is, or was raised from or while handling; None if none."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, OSError):
            return err
        seen.add(id(err))
        err = err.__cause__ or err.__context__
    return None


def checkpoint_size(parameters: int, zero_stage: int, precision: str) -> tuple[int, str]:
    """(about how many bytes a checkpoint takes, all ranks' files together; how that is
    counted), from the parameter count: per parameter, the weights of the model-states file (4
    bytes in fp32, 2 in bf16 or fp16; none under ZeRO-3, where the weights are the fp32 masters'
    partitions), the fp32 master weights (a copy, except in fp32 without ZeRO) and AdamW's two
    fp32 moments. What DeepSpeed writes, less its pickles' overhead (a few percent on a tiny
    model; tests/test_checkpoint_save.py compares the two)."""
    per_parameter = {}
    if zero_stage < 3:
        per_parameter["weights"] = 4 if precision == "fp32" else 2
    if zero_stage > 0 or precision != "fp32":
        per_parameter["fp32 master weights"] = 4
    per_parameter["Adam moments"] = 8
    each = sum(per_parameter.values())
    how = ", ".join(f"{name} {size}" for name, size in per_parameter.items())
    return parameters * each, f"{parameters:,} parameters x {each} bytes: {how}"


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a DeepSpeed checkpoint of any ZeRO stage, on CPU, without a process group.
    The checkpoint is verified first (`launch.checkpoint.require_intact`) and read without running
    any code it may hold: a torch file whose pickle names anything but tensors, plain data and
    `_checkpoint_globals` is refused, and every load is weights-only, DeepSpeed's included. Any
    failure is one UserError line."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(checkpoint_dir) / tag
    if is_universal(checkpoint_dir, tag):  # its fp32 weights lack the tied names under ZeRO-3
        raise UserError(f"checkpoint {tag_dir} is a universal copy; use the checkpoint it was converted from")
    require_intact(checkpoint_dir, tag)
    with _weights_only_loads():
        _refuse_code_in(tag_dir)
        try:
            if is_zero_partitioned(tag_dir):
                state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
            else:  # stage 0: the module's state dict is saved whole
                state = torch.load(tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True)["module"]
        except Exception as err:  # torch.load's and DeepSpeed's own errors, of a file that verified or was not verified
            raise UserError(f"checkpoint {tag_dir} could not be read: {_load_failure(err)}") from err
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def _checkpoint_globals() -> list:
    """What our checkpoints hold besides tensors and plain data, which torch's weights-only
    unpickler may then build: DeepSpeed's ZeRO optimizer state (the stage as an enum, its loss
    scaler, each parameter's place in a flat partition: `stage_1_and_2.py`, `stage3.py`) and
    numpy arrays (the trainer saves each rank's numpy RNG state). Building them runs no code
    of the file's choosing: an enum lookup, objects given attributes, an array given its bytes."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    reconstruct = np._core.multiarray._reconstruct if hasattr(np, "_core") else np.core.multiarray._reconstruct
    # numpy 2 builds each dtype as an instance of its own class; numbers only (not object arrays).
    dtypes = [type(np.dtype(kind)) for kind in (np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                                 np.uint32, np.uint64, np.float16, np.float32, np.float64)]
    return [ZeroStageEnum, LossScaler, DynamicLossScaler, fragment_address, np.ndarray, np.dtype, *dtypes, reconstruct,
            (reconstruct, "numpy.core.multiarray._reconstruct"),  # its name in files numpy 1 wrote
            (reconstruct, "numpy._core.multiarray._reconstruct")]


def _load_failure(err: Exception) -> str:
    """One line for a failed load: what the weights-only unpickler refused, or the error's first line."""
    message = str(err)
    refused = re.search(r"GLOBAL (\S+) was not an allowed global", message)
    if refused:
        return f"it holds {refused.group(1)}, which unpickling would call: refused"
    if "WeightsUnpickler error:" in message:
        detail = [line.strip() for line in message.split("WeightsUnpickler error:", 1)[1].splitlines() if line.strip()]
        return f"a weights-only load refused it: {detail[0] if detail else 'unknown'}"
    return f"{type(err).__name__}: {(message.strip().splitlines() or [''])[0]}"


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every torch.load inside, DeepSpeed's `weights_only=False` ones included, weights-only with
    `_checkpoint_globals` allowed: torch reads TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call. The
    environment is the process's: for one-process readers (export, evaluation, translation)."""
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")  # torch refuses both set
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(_checkpoint_globals()):
            yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _refuse_code_in(tag_dir: Path) -> None:
    """UserError naming the first torch file of a checkpoint whose pickle names a global that
    a weights-only load would refuse (inside `_weights_only_loads`, which allows ours): a planted
    `__reduce__` payload, say. Read from each file's pickle alone, before any load, so that the
    message names the file; the weights-only load stays the guard."""
    for path in sorted(tag_dir.rglob("*.pt")):
        try:
            unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except OSError as err:
            raise UserError(f"checkpoint {tag_dir}: {path.relative_to(tag_dir)} cannot be read: {err}") from err
        except (RuntimeError, ValueError):  # not a whole torch file, or a pickle past parsing: the load says so
            continue
        if unsafe:
            raise UserError(f"checkpoint {tag_dir}: {path.relative_to(tag_dir)} holds {', '.join(sorted(unsafe))}, which "
                            f"unpickling would call (our checkpoints hold tensors and plain data): refusing to load it")


def to_universal(root: str | Path, tag: str) -> tuple[Path, str]:
    """The (root, tag) that checkpoint `root/tag` loads from on any world size: itself, or a
    universal copy written beside it (`step_X.universal`), converted by DeepSpeed's
    `ds_to_universal` the first time and reused afterwards.

    What happens, by ZeRO stage and precision:
    - stage 0, fp32: nothing to convert. The module and the whole AdamW state are in
      `mp_rank_00_model_states.pt`, replicated, and load on any world size as they are.
    - stage 0, bf16: the same. DeepSpeed wraps AdamW in FP16_UnfusedOptimizer with bf16
      (`_do_optimizer_sanity_check`: its BF16_Optimizer, which partitions, serves only pipeline
      parallelism and ZeRO-1 with fp32 gradient accumulation); the fp32 masters and moments
      are whole in that file.
    - stages 1 and 2, fp32 or bf16: converted. Each rank's `*zero_pp_rank_R_*optim_states.pt`
      holds its flat partition of the fp32 masters and moments (ZeRO-1 in bf16: BF16_Optimizer's,
      which accumulates gradients in fp32, `_bf16_accumulation`).
    - stage 3, fp32 or bf16: converted. The parameters are partitioned as well.
    A checkpoint with per-rank optimizer files (BF16_Optimizer's too) is converted whatever
    wrote it. The copy is loaded by an engine built with `deepspeed_config(...,
    load_universal=True)` under the same ZeRO stage, or 1 for 2 and back (`Engine.load`,
    which also repairs DeepSpeed's ZeRO-3 universal load); a ZeRO-3 copy does not load
    under stages 1 and 2, nor theirs under 3.

    Run it on one process (rank 0) while the others wait: it needs no process group. The copy is
    built in a hidden sibling directory and renamed into place when complete, so a crash leaves
    no half copy, and the original is never touched. DeepSpeed's console output goes to
    `conversion.log` in the copy; a failure is raised as one UserError line.
    """
    root = Path(root)
    source = root / tag
    if not source.is_dir():
        raise UserError(f"checkpoint {source}: not found")
    if is_universal(root, tag) or not is_zero_partitioned(source):
        return root, tag
    universal_tag = universal_tag_for(tag)
    target = root / universal_tag
    if (target / UNIVERSAL_INFO).is_file():
        stale = _stale_copy(source, target)
        if stale is None:
            return root, universal_tag
        print(f"warning: universal copy {target} {stale}: converting {source} again", file=sys.stderr)
    # ds_to_universal writes a `latest_universal` pointer beside its output folder: that stays
    # inside the hidden directory, and our own `latest` pointer keeps naming the original.
    partial = root / f".{universal_tag}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    build = partial / universal_tag
    build.mkdir(parents=True)
    log = build / "conversion.log"
    try:
        _convert(source, build, log)
    except Exception as err:  # DeepSpeed's asserts, missing files, torch.load errors
        reason = (str(err).strip().splitlines() or [""])[0]
        raise UserError(f"checkpoint {source}: conversion to a universal checkpoint failed: "
                        f"{type(err).__name__}: {reason} (DeepSpeed's output: {log})") from err
    if target.exists():  # a copy without its info file, of an older hand conversion
        shutil.rmtree(target)
    os.replace(build, target)
    shutil.rmtree(partial, ignore_errors=True)
    return root, universal_tag


def _convert(source: Path, build: Path, log: Path) -> None:
    args = SimpleNamespace(input_folder=str(source), output_folder=str(build),
                           # In this process, one file at a time: no worker pool to fork from a
                           # process that may hold a process group.
                           num_extract_workers=1, num_merge_workers=1, keep_temp_folder=False, strict=True,
                           # Our checkpoints carry no Megatron `universal_checkpoint_info`; without
                           # tensor or pipeline parallelism its only content is a version, which
                           # this adds, so checkpoints written before this conversion existed work too.
                           inject_missing_state=True)
    # Imported outside the redirection: DeepSpeed's logger handler keeps the stream it finds at
    # import, and must not keep the log file, which closes after the conversion.
    import deepspeed
    from deepspeed.checkpoint import ds_to_universal

    with _output_to(log):
        ds_to_universal.main(args)
    client_state = source / "client_state.json"
    if client_state.is_file():
        shutil.copy2(client_state, build / client_state.name)
    write_integrity(build)
    info = {"source": source.name, "deepspeed": deepspeed.__version__, "source_integrity": _integrity_sha256(source)}
    (build / UNIVERSAL_INFO).write_text(json.dumps(info, indent=1) + "\n")  # written last: the copy is complete


def _stale_copy(source: Path, copy: Path) -> str | None:
    """Why universal copy `copy` of `source` must not be reused (None: it may): it was converted
    from other contents of the source's tag (one rewritten since), or fails verification.
    Copies made before either was recorded are reused as they are."""
    try:
        info = json.loads((copy / UNIVERSAL_INFO).read_text())
    except (OSError, ValueError) as err:
        return f"has an unreadable {UNIVERSAL_INFO} ({err})"
    recorded, now = info.get("source_integrity"), _integrity_sha256(source)
    if recorded and now and recorded != now:
        return f"was converted from an earlier {source.name}"
    if (copy / INTEGRITY).is_file():
        reason = verify(copy)
        if reason is not None:
            return f"fails verification ({reason})"
    return None


def _integrity_sha256(checkpoint: Path) -> str | None:
    """The sha256 of a checkpoint's integrity.json: its contents in one word."""
    path = checkpoint / INTEGRITY
    return file_sha256(path) if path.is_file() else None


@contextlib.contextmanager
def _output_to(path: Path) -> Iterator[None]:
    """Python's and the C level's stdout and stderr (tqdm bars, prints) into `path`.

    Import deepspeed before entering: its logger's handler keeps the `sys.stdout` it finds when
    it is created, and one created in here would write to this file after it closed."""
    with open(path, "ab", buffering=0) as sink, io.TextIOWrapper(open(path, "ab"), write_through=True) as text:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = [os.dup(1), os.dup(2)]
        try:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            with contextlib.redirect_stdout(text), contextlib.redirect_stderr(text):
                yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)


def estimate_model_state_memory(model: torch.nn.Module, zero_stage: int, offload_optimizer: bool, offload_params: bool,
                                gpus_per_node: int, num_nodes: int) -> dict:
    """Bytes of a model's parameters, gradients and Adam states per GPU and per node's CPU under
    ZeRO, by DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` and
    `estimate_zero3_model_states_mem_needs`, whose figures its `*_all_cold` functions print), for
    a dry run: no engine and no process group, and `model` may live on the meta device.

    DeepSpeed counts mixed precision: 16-bit weights and gradients beside fp32 master weights,
    gradients and Adam moments. It has no estimator for stages 0 and 1: stage 0 is stage 2 on
    one GPU (nothing split), stage 1 is stage 2 with the 16-bit gradients whole on every GPU.
    Returns gpu_bytes, cpu_bytes_per_node, parameters, largest_layer_parameters, estimator."""
    # DeepSpeed's import announces its accelerator on stdout, which a dry run's report owns.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    # parameters() yields a tied tensor once; DeepSpeed's own count (model_to_params) tells
    # tensors apart by data_ptr(), which is 0 for every tensor on the meta device.
    parameters = sum(p.numel() for p in model.parameters())
    largest_layer = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    gpus = gpus_per_node * num_nodes
    if zero_stage == 3:
        # zero_init=False: the trainer builds the whole model on every rank before DeepSpeed
        # partitions it. DeepSpeed's formula knows parameter offload only with optimizer offload.
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            parameters, largest_layer, gpus_per_node, num_nodes, cpu_offload=offload_optimizer or offload_params,
            cpu_offload_params=offload_params, zero_init=False)
        estimator = "deepspeed estimate_zero3_model_states_mem_needs"
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(parameters, gpus_per_node, num_nodes, cpu_offload=offload_optimizer)
        estimator = "deepspeed estimate_zero2_model_states_mem_needs"
        if zero_stage == 0:
            gpu = estimate_zero2_model_states_mem_needs(parameters, 1, 1, cpu_offload=False)[1]
            estimator += ", on one GPU (stage 0 splits nothing)"
        elif zero_stage == 1:
            gpu += 2 * parameters - (0 if offload_optimizer else 2 * parameters // gpus)
            estimator += ", plus the 16-bit gradients that stage 1 keeps whole"
    return {"gpu_bytes": int(gpu), "cpu_bytes_per_node": int(cpu), "parameters": parameters,
            "largest_layer_parameters": largest_layer, "estimator": estimator}


def deepspeed_accelerator() -> tuple[str, str]:
    """(DeepSpeed's version, the accelerator it detected: 'cuda' where it will train on the GPU).
    For the GPU check's probes (benchmarks/gpu_check.py), which import DeepSpeed only through here."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    return deepspeed.__version__, get_accelerator().device_name()


def zero3_leaf_modules(modules: list[torch.nn.Module]) -> None:
    """Make each of `modules` a ZeRO-3 leaf (DeepSpeed's `set_z3_leaf_module`), before the
    engine is built: ZeRO-3 then gathers all of its parameters around its own forward and puts
    no hooks on its submodules. A compiled forward of each leaf (`launch.train.setup.compile_model`)
    is then one graph; with hooks inside, each parameter gather is a graph break."""
    from deepspeed.utils import set_z3_leaf_module

    for module in modules:
        set_z3_leaf_module(module, True)
