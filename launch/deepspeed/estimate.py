"""DeepSpeed's estimate of the memory per GPU that a run's model states take, for the dry run (their
size on disk, a checkpoint's: `launch.checkpoint.space.checkpoint_size`)."""

from __future__ import annotations

import contextlib
import sys

import torch


def estimate_model_state_memory(
    model: torch.nn.Module,
    zero_stage: int,
    offload_optimizer: bool,
    offload_params: bool,
    gpus_per_node: int,
    num_nodes: int,
    precision: str = "bf16",
) -> dict:
    """Bytes of a model's parameters, gradients and Adam states per GPU and per node's CPU under
    ZeRO, by DeepSpeed's own estimators (`estimate_zero2_model_states_mem_needs` and
    `estimate_zero3_model_states_mem_needs`, whose figures its `*_all_cold` functions print), for
    a dry run: no engine and no process group, and `model` may live on the meta device.

    DeepSpeed counts mixed precision: 16-bit weights and gradients beside fp32 master weights,
    gradients and Adam moments. It has no estimator for stages 0 and 1: stage 1 is stage 2 with
    the 16-bit gradients whole on every GPU; stage 0 in fp16 is stage 2 on one GPU (nothing
    split), and stage 0 in fp32 or bf16 (torch's autocast, `launch.deepspeed.config`) keeps no
    16-bit copies, so our own count: fp32 weights, gradients and two moments, 16 bytes a parameter.
    Returns gpu_bytes, cpu_bytes_per_node, parameters, largest_layer_parameters, estimator."""
    # DeepSpeed's import announces its accelerator on stdout, which a dry run's report owns.
    with contextlib.redirect_stdout(sys.stderr):
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
        from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    # parameters() yields a tied tensor once; DeepSpeed's own count (model_to_params) tells
    # tensors apart by data_ptr(), which is 0 for every tensor on the meta device.
    parameters = sum(p.numel() for p in model.parameters())
    largest_layer = max(
        sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()
    )
    gpus = gpus_per_node * num_nodes
    if zero_stage == 3:
        # zero_init=False: the trainer builds the whole model on every rank before DeepSpeed
        # partitions it. DeepSpeed's formula knows parameter offload only with optimizer offload.
        cpu, gpu, _ = estimate_zero3_model_states_mem_needs(
            parameters,
            largest_layer,
            gpus_per_node,
            num_nodes,
            cpu_offload=offload_optimizer or offload_params,
            cpu_offload_params=offload_params,
            zero_init=False,
        )
        estimator = "deepspeed estimate_zero3_model_states_mem_needs"
    else:
        cpu, gpu = estimate_zero2_model_states_mem_needs(
            parameters, gpus_per_node, num_nodes, cpu_offload=offload_optimizer
        )
        estimator = "deepspeed estimate_zero2_model_states_mem_needs"
        if zero_stage == 0 and precision != "fp16":
            gpu = 16 * parameters
            estimator = (
                "our count: fp32 weights, gradients and Adam moments, 16 bytes a parameter, "
                "nothing split"
                + (
                    "; bf16 at stage 0 is torch's autocast, no 16-bit copies"
                    if precision == "bf16"
                    else ""
                )
            )
        elif zero_stage == 0:
            gpu = estimate_zero2_model_states_mem_needs(parameters, 1, 1, cpu_offload=False)[1]
            estimator += ", on one GPU (stage 0 splits nothing)"
        elif zero_stage == 1:
            gpu += 2 * parameters - (0 if offload_optimizer else 2 * parameters // gpus)
            estimator += ", plus the 16-bit gradients that stage 1 keeps whole"
    return {
        "gpu_bytes": int(gpu),
        "cpu_bytes_per_node": int(cpu),
        "parameters": parameters,
        "largest_layer_parameters": largest_layer,
        "estimator": estimator,
    }
