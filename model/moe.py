"""A mixture of experts in place of a block's MLP: a router scores the experts for each token, the
token goes to its top_k, and their gated MLPs' outputs are summed, weighted by the scores.

The experts' weights are two stacked tensors, as Hugging Face's OLMoE, Qwen3-MoE and Mixtral
keep them (`gate_up_proj` (E, 2 F, D), gate over up; `down_proj` (E, D, F)), so that their
checkpoints convert as they are. Each forward leaves its router's auxiliary loss (load balance
and z-loss, weighted) in `aux_loss` and the experts' load in `load` for the caller to collect.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import ModelConfig


class Router(nn.Module):
    """Scores of the experts for each token (softmax over them, or a sigmoid each), its top_k
    and their weights (rescaled to sum to 1 with `normalize_top_k`)."""

    def __init__(
        self, d_model: int, experts: int, top_k: int, score: str, normalize: bool, std: float
    ):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, d_model))
        nn.init.normal_(self.weight, std=std)
        self.top_k, self.score, self.normalize = top_k, score, normalize

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (N, D) -> router logits (N, E), top_k weights (N, k) in x's dtype, indices (N, k)."""
        logits = F.linear(x, self.weight)
        scores = (
            torch.softmax(logits.float(), dim=-1)
            if self.score == "softmax"
            else torch.sigmoid(logits.float())
        )
        weights, index = torch.topk(scores, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return logits, weights.to(x.dtype), index


class Experts(nn.Module):
    """E gated MLPs, act(x Wg) * (x Wu) Wd, their weights stacked (the module's docstring)."""

    def __init__(self, experts: int, d_model: int, d_ff: int, activation: nn.Module, std: float):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * d_ff, d_model))
        self.down_proj = nn.Parameter(torch.empty(experts, d_model, d_ff))
        for weight in (self.gate_up_proj, self.down_proj):
            nn.init.normal_(weight, std=std)
        self.act = activation

    def expert(self, e: int, x: Tensor) -> Tensor:
        """Expert e's output for the rows x (n, D)."""
        gate, up = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.down_proj[e])

    def forward(self, x: Tensor, routes: list[tuple[int, Tensor, Tensor]]) -> Tensor:
        """The weighted sum, per token of x (N, D), of the outputs of the experts it is routed
        to: `routes` holds (expert, token indices, their weights) for each expert with tokens."""
        out = torch.zeros_like(x)
        for e, tokens, weights in routes:
            out.index_add_(0, tokens, (self.expert(e, x[tokens]) * weights[:, None]).to(x.dtype))
        return out


class MoE(nn.Module):
    """Router, experts and an optional shared expert; see the module's docstring."""

    def __init__(self, cfg: ModelConfig, activation: nn.Module, shared: Optional[nn.Module]):
        super().__init__()
        moe = cfg.moe
        self.n_experts, self.top_k = moe.experts, moe.top_k
        self.capacity_factor = moe.capacity_factor
        self.aux_loss_coef, self.z_loss_coef = moe.aux_loss_coef, moe.z_loss_coef
        self.gate = Router(
            cfg.d_model, moe.experts, moe.top_k, moe.score, moe.normalize_top_k, cfg.init_std
        )
        self.experts = Experts(moe.experts, cfg.d_model, cfg.expert_d_ff, activation, cfg.init_std)
        self.shared_expert = shared
        self.aux_loss: Optional[Tensor] = None  # of the last forward, weighted
        # (E,), on the host: the tokens each expert took in the last forward
        self.load: Optional[Tensor] = None
        self.dropped = 0  # assignments dropped past capacity in the last forward

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # (N, D)
        logits, weights, index = self.gate(flat)
        routes, load, dropped = self._routes(index, weights)
        out = self.experts(flat, routes)
        if self.shared_expert is not None:
            out = out + self.shared_expert(flat)
        self.load, self.dropped = load, dropped
        self.aux_loss = self._aux_loss(logits, index)
        return out.reshape(shape)

    def _routes(self, index: Tensor, weights: Tensor):
        """(expert, tokens, weights) per expert with tokens, first choices before second ones
        within an expert; past capacity (capacity_factor > 0) the later ones are dropped."""
        n, k = index.shape
        # assignment a = slot * N + token: sorted by expert, then slot, then token
        by_slot = index.t().reshape(-1)
        order = torch.argsort(by_slot, stable=True)
        counts = torch.bincount(by_slot, minlength=self.n_experts)
        flat_weights = weights.t().reshape(-1)
        capacity = (
            math.ceil(self.capacity_factor * n * k / self.n_experts)
            if self.capacity_factor
            else n * k
        )
        routes, taken, start = [], [], 0
        for e, count in enumerate(counts.tolist()):
            chosen = order[start : start + min(count, capacity)]
            start += count
            taken.append(len(chosen))
            if len(chosen):
                routes.append((e, chosen % n, flat_weights[chosen]))
        return routes, torch.tensor(taken, dtype=torch.float32), n * k - sum(taken)

    def _aux_loss(self, logits: Tensor, index: Tensor) -> Tensor:
        """aux_loss_coef x the load-balancing loss (E x sum_e f_e P_e: f_e the share of the
        tokens' top_k choices that go to e, times k, P_e the mean softmax probability of e;
        1 when balanced) + z_loss_coef x the z-loss."""
        probs = torch.softmax(logits.float(), dim=-1)
        n = logits.shape[0]
        chosen = torch.zeros_like(probs).scatter_(1, index, 1.0)  # (N, E) 1 where chosen
        fractions = chosen.sum(dim=0) / n
        balance = self.n_experts * torch.sum(fractions * probs.mean(dim=0))
        loss = self.aux_loss_coef * balance
        if self.z_loss_coef:
            loss = loss + self.z_loss_coef * torch.logsumexp(logits.float(), dim=-1).pow(2).mean()
        return loss
