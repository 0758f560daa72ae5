"""Reading a checkpoint's weights without running code from it: torch's weights-only unpickler
with the few classes DeepSpeed's files hold allowed, also for the torch.load calls inside
DeepSpeed's consolidation."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

import torch

from common.configure import UserError
from common.weights import load_failure
from launch.checkpoint import is_universal, is_zero_partitioned, require_intact


def consolidated_state_dict(checkpoint_dir: str | Path, tag: str) -> dict[str, torch.Tensor]:
    """fp32 weights of a DeepSpeed checkpoint of any ZeRO stage, on CPU, without a process group.
    The checkpoint is verified first (`launch.checkpoint.require_intact`) and read without running
    any code it may hold: a torch file whose pickle names anything but tensors, plain data and
    `checkpoint_globals` is refused, and every load is weights-only, DeepSpeed's included. Any
    failure is one UserError line."""
    tag_dir = Path(checkpoint_dir) / tag
    if is_universal(checkpoint_dir, tag):  # its fp32 weights lack the tied names under ZeRO-3
        raise UserError(
            f"checkpoint {tag_dir} is a universal copy; use the checkpoint it was converted from"
        )
    require_intact(checkpoint_dir, tag)
    with _weights_only_loads():
        _refuse_code_in(tag_dir)
        try:
            if is_zero_partitioned(tag_dir):
                state = _zero_fp32_state_dict(tag_dir)
            else:  # stage 0: the module's state dict is saved whole
                state = torch.load(
                    tag_dir / "mp_rank_00_model_states.pt", map_location="cpu", weights_only=True
                )["module"]
        # torch.load's and DeepSpeed's own errors, of a file that verified or was not verified
        except Exception as err:
            raise UserError(f"checkpoint {tag_dir} could not be read: {load_failure(err)}") from err
    return {name: tensor.float().contiguous() for name, tensor in state.items()}


def _zero_fp32_state_dict(tag_dir: Path) -> dict[str, torch.Tensor]:
    """The fp32 master weights of a ZeRO checkpoint, by DeepSpeed's `zero_to_fp32`; also of one
    written by its BF16_Optimizer (ZeRO-1 in bf16, as the GPU configs train), which that script
    refuses ("not a zero checkpoint": its optimizer state has no `zero_stage`) although its files
    hold what it reads for ZeRO-1 and 2: each rank's flat fp32 partition of every parameter group,
    laid out as theirs (the groups flattened in order, padded to 2 x world size, cut into equal
    parts), and the partition count."""
    from deepspeed.checkpoint.constants import (
        OPTIMIZER_STATE_DICT,
        PARTITION_COUNT,
        SINGLE_PARTITION_OF_FP32_GROUPS,
        ZERO_STAGE,
    )
    from deepspeed.utils import zero_to_fp32

    files = zero_to_fp32.get_optim_files(str(tag_dir))
    first = torch.load(files[0], map_location="cpu", mmap=True, weights_only=True)[
        OPTIMIZER_STATE_DICT
    ]
    if ZERO_STAGE in first or SINGLE_PARTITION_OF_FP32_GROUPS not in first:
        return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name
        )
    world_size = (
        max(first[PARTITION_COUNT])
        if isinstance(first[PARTITION_COUNT], list)
        else first[PARTITION_COUNT]
    )
    if world_size != len(files):
        raise ValueError(
            f"expected {world_size} optimizer files (the partition count), found {len(files)}"
        )
    del first
    groups = [
        torch.load(f, map_location="cpu", mmap=True, weights_only=True)[OPTIMIZER_STATE_DICT][
            SINGLE_PARTITION_OF_FP32_GROUPS
        ]
        for f in files
    ]
    models = zero_to_fp32.parse_model_states(zero_to_fp32.get_model_state_files(str(tag_dir)))
    return zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint(
        world_size, groups, models, False
    )


def checkpoint_globals() -> list:
    """What our checkpoints hold besides tensors and plain data, which torch's weights-only
    unpickler may then build: DeepSpeed's ZeRO optimizer state (the stage as an enum, its loss
    scaler, each parameter's place in a flat partition: `stage_1_and_2.py`, `stage3.py`) and
    numpy arrays (the trainer saves each rank's numpy RNG state). Building them runs no code
    of the file's choosing: an enum lookup, objects given attributes, an array given its bytes."""
    import numpy as np
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    reconstruct = (
        np._core.multiarray._reconstruct
        if hasattr(np, "_core")
        else np.core.multiarray._reconstruct
    )
    # numpy 2 builds each dtype as an instance of its own class; numbers only (not object arrays).
    dtypes = [
        type(np.dtype(kind))
        for kind in (
            np.bool_,
            np.int8,
            np.int16,
            np.int32,
            np.int64,
            np.uint8,
            np.uint16,
            np.uint32,
            np.uint64,
            np.float16,
            np.float32,
            np.float64,
        )
    ]
    return [
        ZeroStageEnum,
        LossScaler,
        DynamicLossScaler,
        fragment_address,
        np.ndarray,
        np.dtype,
        *dtypes,
        reconstruct,
        (reconstruct, "numpy.core.multiarray._reconstruct"),  # its name in files numpy 1 wrote
        (reconstruct, "numpy._core.multiarray._reconstruct"),
    ]


@contextlib.contextmanager
def _weights_only_loads() -> Iterator[None]:
    """Every torch.load inside, DeepSpeed's `weights_only=False` ones included, weights-only with
    `checkpoint_globals` allowed: torch reads TORCH_FORCE_WEIGHTS_ONLY_LOAD at each call. The
    environment is the process's: for one-process readers (export, evaluation, translation)."""
    # torch refuses both set
    names = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")
    saved = {name: os.environ.pop(name, None) for name in names}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    try:
        with torch.serialization.safe_globals(checkpoint_globals()):
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
            raise UserError(
                f"checkpoint {tag_dir}: {path.relative_to(tag_dir)} cannot be read: {err}"
            ) from err
        # not a whole torch file, or a pickle past parsing: the load says so
        except (RuntimeError, ValueError):
            continue
        if unsafe:
            raise UserError(
                f"checkpoint {tag_dir}: {path.relative_to(tag_dir)} holds "
                f"{', '.join(sorted(unsafe))}, which unpickling would call (our checkpoints hold "
                "tensors and plain data): refusing to load it"
            )
