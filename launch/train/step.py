"""One optimizer step over grad_accum micro batches (`train_step`), guarded: every rank agrees
whether to apply it (`launch.train.guard`), the figures reduced in one collective."""

from __future__ import annotations

import math

import torch

from launch import distributed as dist
from launch import stop
from launch.stop import StopRequested, stoppable
from launch.tasks import host_value
from launch.train.guard import (
    FP16_OVERFLOW,
    NON_FINITE_KINDS,
)
from launch.train.state import Run
from launch.train.step_result import StepResult
from model import llmc_flops_per_token
from model.blocks import moe_layers


def train_step(run: Run, batches) -> StepResult | None:
    """One optimizer step: grad_accum micro batches, forward and backward through the engine;
    None, with no step taken, when a stop request cut some rank's wait for its batches short.

    The loss is the mean over every scored token of the step, all ranks and micro batches
    together (fairseq's normalisation; Hugging Face's average_tokens_across_devices): each micro
    batch's mean loss is weighted by its scored tokens n, and the gradient divided by the step's
    N over all ranks. A mean per micro batch instead would weigh a token of a 32-pair batch of
    short sentences ten times one of a batch of long ones, which length-grouped batches
    (`data.length_grouping`) make common. Packed blocks score the same number of tokens in every
    batch: there the two agree.

    Guarded: one reduction over the ranks carries the step's figures, whether any rank's loss is
    not finite, whether any rank was asked to stop, and each rank's tokens; every rank takes the
    same decision from them, on the device (the host reads the figures once, after the optimizer
    step, in the same copy as this rank's own count of NaN, +inf and -inf losses, which
    `guard_step` gathers only for a skipped step's record). A step to skip (a non-finite loss
    anywhere, or a loss spike) gets NaN gradients on every rank: DeepSpeed then finds a
    non-finite gradient norm and drops the update, the gradients and the schedule's step on
    every rank (ZeRO 1-3, bf16 and fp16 by their own check; ZeRO-0 in fp32, and in bf16 as
    autocast, through `launch.optim.AdamW`). The weights after a skipped step are those before it.

    Who reduces: with `run.reduction` (ZeRO-0 on more than one rank) the trainer, in
    buckets during the last backward, the figures in the last bucket and the division by N and
    the skip applied to the reduced gradients (`launch.train.reduce`): one collective round per
    step. Otherwise DeepSpeed reduces the gradients after the backward, so N is summed before the
    forwards (each weight n A W / N before DeepSpeed divides by A and averages over W) and the
    figures before the last backward, whose loss a skip makes NaN."""
    device = run.engine.device
    tokens, flops, flops_llmc, samples = 0, 0.0, 0.0, 0
    # The losses stay on the device until the one reduction of the step: reading each micro
    # batch's loss on the host would wait for the device at every micro batch.
    loss_sum = finite_scored = torch.zeros((), dtype=torch.float32, device=device)
    non_finite_here = torch.zeros(len(NON_FINITE_KINDS), dtype=torch.float32, device=device)
    taken = _micro_batches(run, batches)
    if taken is None:
        return None
    micro, served = taken
    moe = MoEFigures(moe_layers(run.engine.module), device)
    scored = [float(host_value(run.task.target_mask(inputs).sum())) for inputs in micro]
    if run.reduction is None:
        # Summed over the ranks and left on the device, as is every weight made from it below:
        # the host issues this step's forwards without waiting for the previous step to finish.
        step_scored = dist.all_reduce_sum_tensor([sum(scored)])[0].to(device)
        share = (run.plan.grad_accum * run.denv.world_size) / step_scored.clamp(min=1.0)
    else:
        share = torch.ones((), device=device)  # N divides the reduced gradients
    for index, inputs in enumerate(micro):
        output = run.engine(**run.task.to_device(inputs, device))
        loss = output.loss.detach().float()
        finite = torch.isfinite(loss)
        non_finite_here = (
            non_finite_here + torch.stack([loss.isnan(), loss.isposinf(), loss.isneginf()]).float()
        )
        loss_sum = loss_sum + torch.where(finite, loss * scored[index], torch.zeros_like(loss))
        finite_scored = finite_scored + finite.float() * scored[index]
        tokens += run.task.tokens(inputs)
        flops += run.task.flops(run.cfg.model, inputs)
        flops_llmc += run.task.tokens(inputs) * llmc_flops_per_token(
            run.cfg.model, run.n_parameters, inputs["labels"].shape[1]
        )
        samples += inputs["labels"].shape[0]
        # A mixture of experts' router losses join the objective, weighted as the LM loss is (by
        # the micro batch's scored tokens); the LM loss alone is what the step reports.
        objective = output.loss if output.aux_loss is None else output.loss + output.aux_loss
        weighted = objective * (scored[index] * share).to(output.loss.dtype)
        moe.add(output.aux_loss, scored[index])
        if index < run.plan.grad_accum - 1:
            run.engine.backward(weighted)
            run.engine.step()
    fillers = run.data.train.stats["epoch_filler_batches"]
    figures_here = [
        loss_sum,
        finite_scored,
        non_finite_here.sum(),
        tokens,
        flops,
        flops_llmc,
        samples,
        fillers,
        float(_stop_requested(run)),
        sum(scored),
        # each rank's tokens in its own slot: how evenly the step's work was spread
        *(tokens if r == run.denv.rank else 0 for r in range(run.denv.world_size)),
        *moe.figures(),  # none without experts
    ]
    spike_limit = run.guard.spike_limit()
    if run.reduction is None:
        figures = dist.all_reduce_sum_tensor(figures_here).to(device)
        skip = _skip(figures, spike_limit)
        weighted = weighted * torch.where(
            skip, torch.full_like(weighted, math.nan), torch.ones_like(weighted)
        )
        # Queued before the backward; read after the step, which has waited past it.
        on_host = HostCopy(torch.cat([figures, non_finite_here.to(figures.dtype)]))
        run.engine.backward(weighted)
    else:
        run.reduction.arm()
        run.engine.backward(weighted)
        # per scored token of the step, all ranks: DeepSpeed's backward divided by A already
        accumulated = float(run.plan.grad_accum)
        figures = run.reduction.finish(
            dist.scalars_tensor(figures_here),
            lambda summed: torch.where(
                _skip(summed, spike_limit),
                math.nan,
                accumulated / summed[9].clamp(min=1.0),
            ),
        ).to(device)
        on_host = HostCopy(torch.cat([figures, non_finite_here.to(figures.dtype)]))
    skipped_before = run.engine.skipped_steps
    run.engine.step()
    skipped = run.engine.skipped_steps > skipped_before
    return _step_result(run, on_host.values(), served, spike_limit, skipped, moe)


def _skip(figures: torch.Tensor, spike_limit: float) -> torch.Tensor:
    """The guard's decision from the step's summed figures: a non-finite loss on any rank, or a
    loss spike (0 / 0 is NaN: not a spike)."""
    return (figures[2] > 0) | (figures[0] / figures[1] > spike_limit)


def _step_result(
    run: Run, values: list[float], served: list, spike_limit: float, skipped: bool, moe
) -> StepResult:
    """The step's figures, summed over the ranks, read on the host: the StepResult."""
    *summed, nan, pos_inf, neg_inf = values
    loss_sum, finite_scored, non_finite, tokens, flops, flops_llmc, samples, fillers, stop = summed[
        :9
    ]
    world = run.denv.world_size
    rank_tokens = summed[10 : 10 + world]
    # per scored token, over the finite batches
    loss = loss_sum / finite_scored if finite_scored else math.nan
    return StepResult(
        loss=loss,
        tokens=tokens,
        flops=flops,
        flops_llmc=flops_llmc,
        samples=samples,
        stop=stop > 0,
        skipped=_skip_reason(run, bool(non_finite), loss > spike_limit, skipped),
        spike_limit=spike_limit,
        non_finite_here=dict(zip(NON_FINITE_KINDS, (int(nan), int(pos_inf), int(neg_inf)))),
        served=served,
        filler_fraction=fillers / (len(run.data.train) * run.denv.world_size),
        rank_tokens_max_min=max(rank_tokens) / max(min(rank_tokens), 1.0),
        **moe.read(summed[10 + world :], finite_scored),
    )


def _micro_batches(run: Run, batches) -> tuple[list[dict], list] | None:
    """The step's grad_accum micro batches as model inputs (on the host: counting their tokens
    costs no device sync) and the loader's handles on them (their sample keys are worked out
    only when needed); None on every rank when a stop request cut some rank's wait for its
    batches short, which every rank learns here, before the step's first collective."""
    served, micro = [], []
    try:
        with stoppable():
            for _ in range(run.plan.grad_accum):
                micro.append(run.task.model_inputs(next(batches)))
                served.append(run.data.train.served_batch())
        stopped = False
    except StopRequested:
        stopped = True
    if dist.any_rank(stopped):  # a rank without its batches has none to train on
        run.data.train.rewind()
        return None
    return micro, served


def _skip_reason(run: Run, non_finite: bool, spike: bool, skipped: bool) -> str:
    """Why DeepSpeed dropped the step's update ("" when it did not): the guard's reason, which
    it must have honoured, else fp16's overflow or a non-finite gradient norm."""
    reason = "non-finite loss" if non_finite else ("loss spike" if spike else "")
    if reason and not skipped:  # the guard's premise: a NaN backward makes DeepSpeed drop the step
        raise RuntimeError(
            f"step {run.step + 1}: DeepSpeed applied an update the guard asked to skip ({reason})"
        )
    if skipped and not reason:
        # fp16: DeepSpeed's loss scaler met an overflow and lowers the scale, which is how it
        # finds its scale (several in a row at the start are normal): counted, not guarded.
        reason = FP16_OVERFLOW if run.engine.loss_scale is not None else "non-finite gradient norm"
    return reason


class HostCopy:
    """A device tensor's copy to the host, queued now (into page-locked memory) and read later:
    reading waits for the copy alone, where a `.tolist()` after the optimizer step would wait
    for the step's update kernels too. On the host it is the tensor itself."""

    def __init__(self, tensor: torch.Tensor):
        self.event = None
        if tensor.device.type == "cuda":
            self.tensor = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.tensor.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.tensor = tensor

    def values(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.tensor.tolist()


def _stop_requested(run: Run) -> bool:
    return stop.requested() or (run.denv.is_main and stop.stop_file(run.cfg.run_dir))


class MoEFigures:
    """A mixture of experts' figures of a step, summed over its micro batches and (in the step's
    one reduction) over the ranks: the routers' auxiliary loss weighted by scored tokens (on the
    device), the assignments dropped past capacity and the tokens each expert of each MoE layer
    took (counted on the host by the routing itself)."""

    def __init__(self, layers: list, device: torch.device):
        self.layers = layers
        self.aux = torch.zeros((), dtype=torch.float32, device=device)
        self.dropped = 0
        self.load = [[0.0] * layer.n_experts for layer in layers]

    def add(self, aux_loss, scored: float) -> None:
        """After a micro batch's forward: its auxiliary loss and its layers' loads."""
        if not self.layers:
            return
        self.aux = self.aux + aux_loss.detach().float() * scored
        for counts, layer in zip(self.load, self.layers):
            for e, taken in enumerate(layer.load.tolist()):
                counts[e] += taken
            self.dropped += layer.dropped

    def figures(self) -> list:
        """What joins the step's reduction: nothing without experts."""
        if not self.layers:
            return []
        return [self.aux, self.dropped, *(taken for counts in self.load for taken in counts)]

    def read(self, values: list[float], scored: float) -> dict:
        """StepResult's MoE fields from the reduced `figures`."""
        if not self.layers:
            return {}
        aux, dropped, *flat = values
        by_layer, start = [], 0
        for counts in self.load:
            taken = flat[start : start + len(counts)]
            start += len(counts)
            mean = sum(taken) / len(taken)
            by_layer.append(max(taken) / mean if mean else math.nan)
        assigned = sum(flat) + dropped
        return {
            "aux_loss": aux / scored if scored else math.nan,
            "expert_load_max_mean": by_layer,
            "dropped_fraction": dropped / assigned if assigned else 0.0,
        }
