"""`Engine`, the facade the training loop talks to (forward, backward, step, save, load) over
DeepSpeed's engine; CPU Adam for ZeRO-Offload; ZeRO-3 leaf modules. DeepSpeed's start-up patches:
`launch.deepspeed.patches`."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any, Iterator

import torch

from common.configure import UserError
from launch.checkpoint import is_universal
from launch.deepspeed.patches import patch_deepspeed
from launch.deepspeed.safe_load import checkpoint_globals

# What `launch.optim.build_optimizer` sets in a parameter group from `optim.*` (beta1/beta2, eps,
# weight_decay, and the kernel of `implementation`), which a checkpoint's optimizer state replaces
# with the writer's at a load: `Engine.set_hyperparameters` sets them back. The rate is the
# schedule's (`lr`, `initial_lr`).
HYPERPARAMETERS = ("betas", "eps", "weight_decay", "fused", "foreach")


class Engine:
    """A DeepSpeed engine seen through the few calls the loop makes. Without an optimizer
    (evaluation: `inference_config`) only `module`, `device` and forwards are of use.

    A training engine says on rank 0, in one line, which optimizer DeepSpeed steps, inside which
    of its wrappers, and in which dtype the gradients are accumulated (`describe`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None,
        scheduler,
        config: dict,
    ):
        patch_deepspeed()  # before DeepSpeed builds any op or starts its communication
        import deepspeed

        deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
        self.config = config
        self._engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config
        )
        if optimizer is not None and self._engine.global_rank == 0:
            print(self.describe(), file=sys.stderr)

    @property
    def optimizer_name(self) -> str:
        """The class of the optimizer DeepSpeed steps (ours, inside its wrapper): e.g. AdamW,
        DeepSpeedCPUAdam."""
        return type(self._engine.basic_optimizer).__name__

    def describe(self) -> str:
        wrapper = type(self._engine.optimizer).__name__
        inside = (
            ""
            if self._engine.optimizer is self._engine.basic_optimizer
            else f" in DeepSpeed's {wrapper}"
        )
        offload = ", states offloaded to CPU" if self._engine.zero_cpu_offload() else ""
        accum = str(self._engine.get_data_types()[1]).removeprefix("torch.")
        reduce = str(self._engine.communication_data_type).removeprefix("torch.")
        groups = getattr(self._engine.basic_optimizer, "param_groups", None) or [{}]
        kernels = " (fused kernel)" if groups[0].get("fused") else ""
        autocast = (
            "; forward under torch's autocast to bfloat16, weights in float32"
            if self.config.get("torch_autocast", {}).get("enabled")
            else ""
        )
        return (
            f"optimizer: {self.optimizer_name}{kernels}{inside}{offload}; gradients accumulated in "
            f"{accum}, reduced in {reduce}{autocast}"
        )

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
        return sum(
            hasattr(p, "ds_id") and not getattr(p, "ds_persist", False) for p in params
        ), len(params)

    def reduce_gradients_elsewhere(self) -> None:
        """ZeRO-0: the trainer all-reduces the gradients itself (`launch.train.reduce`), during
        the backward; DeepSpeed's reduction after it is turned off."""
        assert self._engine.zero_optimization_stage() == 0
        self._engine.enable_backward_allreduce = False

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
        """Optimizer steps DeepSpeed dropped: a non-finite gradient norm (fp16
        overflow included)."""
        return int(self._engine.skipped_steps)

    @property
    def loss_scale(self) -> float | None:
        """fp16's dynamic loss scale; None in fp32 and bf16, which have none."""
        if not self._engine.fp16_enabled():
            return None
        return float(
            getattr(
                self._engine.optimizer,
                "cur_scale",
                getattr(self._engine.optimizer, "loss_scale", 1.0),
            )
        )

    def save(self, directory: str | Path, tag: str, client_state: dict) -> None:
        """Every rank must call this: ZeRO partitions are written by their owners. A write that
        fails with an OSError (ENOSPC on a full disk) is raised, naming its file, once DeepSpeed's
        save has returned (`_write_failures_kept`): raised inside it, it would skip the save's
        closing barrier and leave the other ranks waiting there."""
        failures: list[OSError] = []
        with _write_failures_kept(self._engine, failures):
            self._engine.save_checkpoint(
                str(directory), tag=tag, client_state=client_state, save_latest=False
            )
        if failures:
            raise failures[0]

    def load(self, directory: str | Path, tag: str) -> dict:
        """Module, optimizer, schedule and step from a checkpoint: one this world size wrote, or
        a universal one (`to_universal`) if the engine was built with `load_universal`."""
        checkpoint = Path(directory) / tag
        universal = bool(self.config.get("checkpoint", {}).get("load_universal"))
        if universal != is_universal(directory, tag):
            raise UserError(
                f"checkpoint {checkpoint} is {'' if is_universal(directory, tag) else 'not '}a "
                f"universal checkpoint, but the engine was built with load_universal={universal}"
            )
        stage = self._engine.zero_optimization_stage()
        # A universal copy keeps its writer's model-states file, whose name differs between
        # ZeRO-3 and the stages below; DeepSpeed looks for its own stage's name only.
        model_states = (
            "zero_pp_rank_0_mp_rank_00_model_states.pt"
            if stage == 3
            else "mp_rank_00_model_states.pt"
        )
        if universal and not (checkpoint / model_states).is_file():
            raise UserError(
                f"checkpoint {checkpoint}: a universal copy written under ZeRO-"
                f"{'1/2' if stage == 3 else '3'} does not load under "
                f"ZeRO-{stage} (no {model_states})"
            )
        try:
            # DeepSpeed unpickles its files in full here (weights_only=False): the run directory is
            # trusted (docs/design.md, "Checkpoints are trusted"); export and evaluation read
            # without that.
            path, client_state = self._engine.load_checkpoint(
                str(directory), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        except Exception as err:
            if "DP world size" not in str(err):  # ZeRO's refusal of another world size
                raise
            raise UserError(
                f"checkpoint {checkpoint}: {str(err).splitlines()[0]} "
                f"(convert it with launch.deepspeed.universal.to_universal)"
            ) from err
        if path is None:
            raise UserError(f"checkpoint {checkpoint} could not be loaded")
        if universal and stage == 3:
            self._repair_zero3_universal_load(checkpoint)
        return client_state or {}

    def hyperparameters(self) -> list[dict]:
        """Each parameter group's hyperparameters as this job's config built the optimizer
        (`HYPERPARAMETERS`): taken before `load`, whose optimizer state replaces them with the
        checkpoint's, to be set back by `set_hyperparameters`."""
        return [
            {key: group[key] for key in HYPERPARAMETERS if key in group}
            for group in self._engine.basic_optimizer.param_groups
        ]

    def set_hyperparameters(self, hyper: list[dict], lr: float) -> tuple[float, float]:
        """After `load`: this job's hyperparameters (`hyperparameters()`, taken before it) back in
        each group, and `lr` the schedule's peak (the LambdaLR's base rates, which the
        checkpoint's scheduler state replaced), the rate of the next step recomputed from it
        at the restored step count, as the scheduler's own step computes it (with this job's
        schedule: the lambda is never saved). Unchanged values give the same floats, so a resume
        that changes nothing stays exact. Returns the next step's rate before and after."""
        basic = self._engine.basic_optimizer
        if len(hyper) != len(basic.param_groups):  # the same optimizer, before and after
            raise RuntimeError(
                f"{len(hyper)} parameter groups before the load, {len(basic.param_groups)} after"
            )
        before = self.lr
        for group, values in zip(basic.param_groups, hyper):
            group.update(values)
        scheduler = self._engine.lr_scheduler
        if scheduler is not None:
            scheduler.base_lrs = [lr] * len(scheduler.base_lrs)
            rates = [
                base_lr * lmbda(scheduler.last_epoch)
                for lmbda, base_lr in zip(scheduler.lr_lambdas, scheduler.base_lrs)
            ]
            for group, rate in zip(scheduler.optimizer.param_groups, rates):
                group["initial_lr"], group["lr"] = lr, rate
            scheduler._last_lr = list(rates)
        return before, self.lr

    def _repair_zero3_universal_load(self, checkpoint: Path) -> None:
        """Undo two slips of DeepSpeed's ZeRO-3 universal load (`stage3.py`,
        `load_hp_checkpoint_state_from_checkpoint_dir_stage3`): it gives every parameter group
        the hyperparameters of the first (our no-decay group would get weight decay), and one
        `step` tensor shared by all groups, which AdamW then advances once per group per step."""
        basic = self._engine.basic_optimizer
        with torch.serialization.safe_globals(checkpoint_globals()):
            saved = torch.load(
                checkpoint / "zero" / "optimizer_state.pt", map_location="cpu", weights_only=True
            )["param_groups"]
        if len(saved) != len(basic.param_groups):
            raise UserError(
                f"checkpoint {checkpoint} has {len(saved)} optimizer parameter groups, this "
                f"model {len(basic.param_groups)}"
            )
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
        # the caller's AdamW, whose state ZeRO keeps per partition
        basic = self._engine.basic_optimizer
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
                moments = [
                    safe_get_full_optimizer_state(param, key) for key in ("exp_avg", "exp_avg_sq")
                ]
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
        return {
            "weights": weights,
            "exp_avg": exp_avg,
            "exp_avg_sq": exp_avg_sq,
            "global_steps": self._engine.global_steps,
            "adam_steps": sorted(adam_steps),
            "lr": self.lr,
        }


def cpu_adam(
    param_groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float
) -> torch.optim.Optimizer:
    """AdamW for ZeRO-Offload, whose fp32 master weights and Adam moments live in CPU memory:
    DeepSpeed's DeepSpeedCPUAdam in AdamW mode (decoupled weight decay, bias correction, as
    torch's AdamW), over the caller's parameter groups, each with its own weight decay.

    Its C++ op is built by DeepSpeed with the host's compiler at first use and cached in a
    folder of this CPU type (`launch.deepspeed.patches.use_cpu_keyed_jit_cache`). If it cannot be
    built, torch's AdamW (the same update, slower) takes its place, with a one-line warning. Under a
    process group the ranks agree first: if the op fails on any rank, every rank falls back, so that
    all partitions are stepped by the same optimizer."""
    failure = None
    patch_deepspeed(cpu_adam=True)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        # Copies: a failed construction leaves the groups as they were, for the fallback.
        optimizer: torch.optim.Optimizer = DeepSpeedCPUAdam(
            [dict(group) for group in param_groups], lr=lr, betas=betas, eps=eps, adamw_mode=True
        )
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
        print(
            f"warning: DeepSpeed's CPU Adam op is unavailable ({failure}); the offloaded optimizer "
            "is torch's AdamW, which is slower",
            file=sys.stderr,
        )
    return torch.optim.AdamW(param_groups, lr=lr, betas=betas, eps=eps)


@contextlib.contextmanager
def _write_failures_kept(engine, failures: list[OSError]) -> Iterator[None]:
    """Inside, DeepSpeed's checkpoint writes (its checkpoint engine's `save`, its copy of the
    recovery scripts) append their OSError to `failures` instead of raising it, and write nothing
    once one has, while the rest of the save, collectives included, goes on as on the other
    ranks. torch.save is handed an open file, not the path: a full disk's errno then reaches us
    (from a path, torch's C++ writer says only "basic_ios::clear: iostream error")."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine

    writer = engine.checkpoint_engine
    # DeepSpeed's default engine calls torch.save with this format choice; another engine writes its
    # own way.
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
                failures.append(
                    OSError(err.errno, err.strerror or str(err), err.filename or str(save_path))
                )

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


def deepspeed_accelerator() -> tuple[str, str]:
    """(DeepSpeed's version, the accelerator it detected: 'cuda' where it will train on the GPU).
    For the GPU check's probes (benchmarks/gpu_check.py), which import DeepSpeed
    only through here."""
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
