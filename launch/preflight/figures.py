"""What the run would be: the batch (tokens per step, steps per epoch), parameters, FLOPs,
and memory per GPU (DeepSpeed's estimate of the model states plus our count of a micro
batch's activations)."""

from __future__ import annotations

import torch

from common.storage import byte_size
from launch.config import BatchPlan, TrainConfig
from launch.deepspeed.estimate import estimate_model_state_memory
from launch.preflight.report import DataInfo, Report
from launch.resolve import World
from launch.tasks import Task
from model import ModelConfig, build_model, training_flops
from model.config import GATED_ACTIVATIONS
from model.loss import chunk_peak_bytes


def batch_figures(
    cfg: TrainConfig, task: Task | None, plan: BatchPlan, data: DataInfo | None, report: Report
) -> None:
    """Global batch, steps per epoch and epochs, cut as the loader cuts them: whole global batches
    (micro x accumulation x world) from the epoch's sample stream, the remainder left out."""
    unit = "pairs" if task is not None and task.dataset == "translation" else "sequences"
    global_batch = plan.global_batch_size
    report.facts["global batch"] = (
        f"{global_batch:,} {unit} = {plan.micro_batch_size} micro x {plan.grad_accum} "
        f"accumulation x {plan.world_size} ranks"
    )
    report.figures["global_batch_size"] = global_batch
    if data is None or "train" not in data.samples:
        return
    train = data.samples["train"]
    steps = train // global_batch
    if steps == 0:
        report.problem(
            "data.micro_batch_size",
            f"the train split of {cfg.data.data_dir} has {train:,} {unit}, fewer "
            f"than one global batch of {global_batch:,} ({plan.micro_batch_size} "
            f"x {plan.grad_accum} x {plan.world_size} ranks)",
        )
        return
    report.facts["steps per epoch"] = (
        f"{steps:,} ({train:,} train {unit}; {train - steps * global_batch:,} left out per epoch)"
    )
    report.facts["epochs in max_steps"] = f"{cfg.max_steps / steps:,.2f} ({cfg.max_steps:,} steps)"
    report.figures.update(steps_per_epoch=steps, epochs=cfg.max_steps / steps)
    if "valid" in data.samples:
        valid = data.samples["valid"]
        if valid < global_batch:
            report.warn(
                "data.micro_batch_size",
                f"the valid split has {valid:,} {unit}, fewer than one global batch "
                f"({global_batch:,}): training would run without evaluation",
            )
        else:
            batches = valid // global_batch
            report.facts["evaluation"] = (
                f"{valid:,} valid {unit}, {batches:,} global batch{'es' * (batches > 1)}; "
                f"every {cfg.eval_every or cfg.max_steps:,} steps"
            )


def sequence_lengths(
    task: Task, model_cfg: ModelConfig, data: DataInfo | None
) -> tuple[float, float, str]:
    """(encoder or only length, decoder length, what they are) of a typical training sample."""
    if task.dataset == "packed":
        if data is not None and data.block_length is not None:
            return data.block_length, 0, f"the data's {data.block_length}-token blocks"
        return model_cfg.max_seq_len, 0, "model.max_seq_len (the data's block length is unknown)"
    if data is not None and data.samples.get("train") and data.tokens.get("train"):
        side = data.tokens["train"] / data.samples["train"] / 2
        # The source gets </s>; the decoder reads <s> + target (task translation's inputs).
        return (
            side + 1,
            side + 1,
            "the train split's mean pair, before padding to the batch's longest",
        )
    return (
        model_cfg.max_seq_len,
        model_cfg.max_seq_len,
        "model.max_seq_len on both sides (the data's is unknown)",
    )


def model_figures(
    cfg: TrainConfig,
    task: Task,
    plan: BatchPlan,
    world: World,
    model_cfg: ModelConfig,
    data: DataInfo | None,
    report: Report,
) -> None:
    """Parameters (exact, from the model built on the meta device), FLOPs per step and per token
    (`model.flops`, as the trainer counts them for MFU) and memory per GPU."""
    with torch.device("meta"):
        model = build_model(model_cfg)
    source_len, target_len, lengths = sequence_lengths(task, model_cfg, data)
    # BERT's head runs on the masked positions only; the masking selects mlm_probability of the
    # tokens.
    scored = cfg.data.mlm_probability * source_len if task.name == "mlm" else None
    flops_per_sample = training_flops(model_cfg, source_len, target_len, scored=scored)
    tokens_per_step = plan.global_batch_size * (source_len + target_len)
    flops_per_step = flops_per_sample * plan.global_batch_size
    states = estimate_model_state_memory(
        model,
        cfg.deepspeed.zero_stage,
        cfg.deepspeed.offload_optimizer,
        cfg.deepspeed.offload_params,
        world.ranks_per_node,
        world.nodes,
        cfg.deepspeed.precision,
    )
    activations = activation_bytes(
        model_cfg,
        task,
        plan.micro_batch_size,
        source_len,
        target_len,
        cfg.data.mlm_probability,
        cfg.deepspeed.precision,
    )
    report.facts["tokens per step"] = (
        f"{tokens_per_step:,.0f} ({source_len + target_len:,.1f} per sample at {lengths})"
    )
    report.facts["parameters"] = f"{states['parameters']:,}"
    report.facts["FLOPs per step"] = (
        f"{flops_per_step:.3e} (training: forward + backward, matmuls only)"
    )
    report.facts["FLOPs per token"] = f"{flops_per_step / tokens_per_step:.3e}"
    report.facts["memory per GPU"] = (
        f"{byte_size(states['gpu_bytes'] + activations)} = model states "
        f"{byte_size(states['gpu_bytes'])} + activations {byte_size(activations)}"
    )
    report.facts["model states"] = (
        f"ZeRO-{cfg.deepspeed.zero_stage}{_offload(cfg)}: {byte_size(states['gpu_bytes'])} "
        f"per GPU, {byte_size(states['cpu_bytes_per_node'])} CPU per node "
        f"({states['estimator']}"
        + (
            ""
            if states["estimator"].startswith("our count")
            else "; it counts 16-bit weights and gradients beside fp32 master weights and Adam "
            "moments"
        )
        + ")"
    )
    report.facts["activations"] = (
        f"{byte_size(activations)} (micro batch {plan.micro_batch_size} at {lengths}, "
        f"{cfg.deepspeed.precision}, activation checkpointing "
        f"{'on' if model_cfg.activation_checkpointing else 'off'}; our estimate)"
    )
    report.figures.update(
        parameters=states["parameters"],
        tokens_per_step=tokens_per_step,
        flops_per_step=flops_per_step,
        flops_per_token=flops_per_step / tokens_per_step,
        model_state_bytes_per_gpu=states["gpu_bytes"],
        activation_bytes_per_gpu=activations,
        memory_bytes_per_gpu=states["gpu_bytes"] + activations,
        cpu_bytes_per_node=states["cpu_bytes_per_node"],
    )


def activation_bytes(
    model_cfg: ModelConfig,
    task: Task,
    micro_batch_size: int,
    source_len: float,
    target_len: float,
    mlm_probability: float,
    precision: str,
) -> int:
    """Bytes the forward pass of one micro batch keeps for the backward pass, on a GPU: our
    estimate, since DeepSpeed's estimators count model states only.

    Per token and block, the tensors autograd saves, after the tally of Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models", section 4.1, without model
    parallelism), in the training precision: in the attention sublayer the norm's input, the
    q/k/v projections' input, q, k and v, SDPA's output and the output projection's reshaped
    copy of it (5 d + 2 d_kv, d_kv = n_kv_heads x d / n_heads: grouped-query attention's k and v
    are smaller, and SDPA takes them so where it can, `model.attention.attention`; on CUDA with a
    mask, or in float32, they are repeated to d each, which this leaves out); in the MLP sublayer
    the norm's input, the first projection's input and the hidden layer before and after its
    activation (2 d + 2 d_ff; a gated MLP keeps gate and value before, the activated gate and the
    product after: 2 d + 4 d_ff); and a one-byte mask per element for each residual dropout (2 d).
    With d_ff = 4 d in 16 bits that is 36 d bytes, their 34 d plus the copy; Llama's blocks (d_ff =
    8/3 d, no grouped heads, no dropout) keep 39.3 d. Rotary positions keep nothing of their own
    (the rotated q and k are SDPA's inputs). Korthikanti et al.'s (T x T) attention-score term is
    left out: torch's flash and memory-efficient SDPA kernels keep only per-row softmax statistics.
    A cross-attention sublayer adds 5 d per target token (its norm's and q-projection's inputs, q,
    SDPA's output and its copy) and the keys and values of the memory (2 d_kv per source token).
    With activation checkpointing a block keeps only its input, plus one block's tensors while it is
    recomputed. Embeddings: a dropout mask, and the norm's input in a post-LN stack. Heads: GPT's
    and the decoder's chunked loss (`model.loss`) keeps the final hidden states and their gradient
    (fp32, so that fp16's loss scale reaches it) per token, the (V x d) fp32 weight gradient it
    computes in the forward pass and one chunk of fp32 logits and their log-softmax at a time (sized
    for a GPU: `model.loss.chunk_peak_bytes`); BERT's head keeps four d-wide inputs per masked
    position and their logits (16-bit, then fp32 and its log-softmax). Padding (translation pairs
    are padded to the batch's longest) and the allocator's slack come on top.
    """
    element = 4 if precision == "fp32" else 2
    mask = 1 if model_cfg.dropout > 0 else 0

    def stack(cfg: ModelConfig, tokens: float, memory_tokens: float = 0.0) -> float:
        d, d_kv = cfg.d_model, cfg.kv_heads * cfg.head_size
        hidden = (4 if cfg.activation in GATED_ACTIVATIONS else 2) * cfg.d_ff
        per_token = element * (5 * d + 2 * d_kv + 2 * d + hidden) + mask * 2 * d
        if memory_tokens:  # a decoder stack: cross-attention too
            per_token += element * 5 * d + mask * d
        block = per_token * tokens + element * 2 * d_kv * memory_tokens
        kept = (
            element * d * tokens * cfg.n_layers + block
            if cfg.activation_checkpointing
            else block * cfg.n_layers
        )
        embeddings = (mask + (element if cfg.norm_position == "post" else 0)) * d * tokens
        return kept + embeddings

    d, vocab = model_cfg.d_model, model_cfg.vocab_size
    lm_head_per_token = element * d + 4 * d  # the final hidden state, and its gradient kept in fp32
    # the fp32 weight gradient, one chunk
    lm_head_fixed = 4 * vocab * d + chunk_peak_bytes(vocab, "cuda")
    if task.arch == "seq2seq":
        encoder = stack(model_cfg.for_stack("encoder"), source_len)
        decoder = stack(model_cfg.for_stack("decoder"), target_len, source_len)
        return int(
            (encoder + decoder + lm_head_per_token * target_len) * micro_batch_size + lm_head_fixed
        )
    if task.arch == "bert":
        masked = mlm_probability * source_len
        head = masked * (element * 4 * d + vocab * (element + 8))
        return int((stack(model_cfg, source_len) + head) * micro_batch_size)
    return int(
        (stack(model_cfg, source_len) + lm_head_per_token * source_len) * micro_batch_size
        + lm_head_fixed
    )


def _offload(cfg: TrainConfig) -> str:
    ds = cfg.deepspeed
    parts = [
        name
        for name, on in (("optimizer", ds.offload_optimizer), ("parameters", ds.offload_params))
        if on
    ]
    return f", {' and '.join(parts)} offloaded to CPU" if parts else ""
