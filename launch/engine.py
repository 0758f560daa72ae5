"""DeepSpeed ZeRO (Rajbhandari et al. 2020): the only module of the project that imports deepspeed.

The training loop talks to `Engine` (forward, backward, step, save, load); the DeepSpeed JSON
is derived from the run config here, from the batch arithmetic computed once in
`launch.config.BatchPlan`. AdamW and its parameter groups are built by the caller
(`launch.optim`) and handed in, as is the learning-rate schedule, which DeepSpeed then
steps at every accumulation boundary and saves with the checkpoint.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from launch.config import BatchPlan, TrainConfig
from pipeline.configure import UserError


def deepspeed_config(cfg: TrainConfig, plan: BatchPlan) -> dict:
    ds = cfg.deepspeed
    config: dict[str, Any] = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "steps_per_print": 10**9,  # the loop does its own logging
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
        # Our AdamW (torch's) is used with offload too: DeepSpeedCPUAdam needs a compiled op.
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
        config = _deep_merge(config, {k: v for k, v in user.items() if v != "auto"})
    return config


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


class Engine:
    """A DeepSpeed engine seen through the few calls the loop makes. Without an optimizer
    (evaluation: `inference_config`) only `module`, `device` and forwards are of use."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, scheduler, config: dict):
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.config = config
        self._engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)

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

    def grad_norm(self) -> float:
        norm = self._engine.get_global_grad_norm()
        return float(norm) if norm is not None else float("nan")

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Every rank must call this: ZeRO partitions are written by their owners."""
        self._engine.save_checkpoint(str(directory), tag=tag, client_state=client_state, save_latest=False)

    def load(self, directory: str | Path, tag: str) -> dict:
        path, client_state = self._engine.load_checkpoint(str(directory), tag=tag, load_optimizer_states=True,
                                                          load_lr_scheduler_states=True)
        if path is None:
            raise UserError(f"checkpoint {Path(directory) / tag} could not be loaded")
        return client_state or {}


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a DeepSpeed checkpoint of any ZeRO stage, on CPU, without a process group."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    tag_dir = Path(checkpoint_dir) / tag
    if list(tag_dir.glob("*optim_states.pt")) and any("zero_pp_rank" in p.name for p in tag_dir.glob("*")):
        state = get_fp32_state_dict_from_zero_checkpoint(str(checkpoint_dir), tag=tag)
    else:  # stage 0: the module's state dict is saved whole
        model_file = tag_dir / "mp_rank_00_model_states.pt"
        state = torch.load(model_file, map_location="cpu", weights_only=False)["module"]
    return {name: tensor.float().contiguous() for name, tensor in state.items()}
