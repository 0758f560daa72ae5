"""What one optimizer step produced (`launch.train.step.train_step`), summed over the ranks where
it is a count: what the guard judges and records, and the throughput window adds up."""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class StepResult:
    loss: float  # per scored token, over the step's finite micro batches; NaN when none was
    tokens: float
    flops: float  # model FLOPs (ours), all ranks
    flops_llmc: float  # llm.c's count; NaN for a Seq2Seq pair
    samples: float
    stop: bool  # a stop request reached some rank during the step
    skipped: str  # why DeepSpeed dropped the update ("" when it did not)
    spike_limit: float  # the loss above which the guard skips, at this step
    non_finite_here: dict = field(default_factory=dict)  # this rank's NaN / +inf / -inf counts
    served: list = field(default_factory=list)  # handles on this rank's batches (their keys)
    filler_fraction: float = 0.0  # this epoch's batches that stood in for unreadable data
    rank_tokens_max_min: float = 1.0  # the most tokens a rank had this step over the fewest
    # A mixture of experts: the routers' auxiliary loss per scored token (weighted, as added to
    # the objective; NaN without experts), each MoE layer's most tokens on one expert over the
    # mean, and the share of token-to-expert assignments dropped past capacity.
    aux_loss: float = math.nan
    expert_load_max_mean: list = field(default_factory=list)
    dropped_fraction: float = 0.0
