"""The mixture-of-experts part of a Hugging Face decoder family's config (OLMoE, Qwen3-MoE,
Mixtral), both ways, and what of ours such a family cannot compute (`model.hf_decoders`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from model.config import ModelConfig, MoEConfig

if TYPE_CHECKING:
    from model.hf_decoders import Family


def require_moe(cfg: ModelConfig, family: Family) -> None:
    """What an MoE family cannot compute of ours, refused by name."""
    moe, what = cfg.moe, f"Hugging Face's {family.model_class}"
    unsupported = [
        (moe.score != "softmax", f"moe.score={moe.score!r}: {what} scores with a softmax"),
        (moe.shared_d_ff, f"moe.shared_d_ff={moe.shared_d_ff}: {what} has no shared expert"),
        (moe.capacity_factor, f"moe.capacity_factor={moe.capacity_factor}: {what} is dropless"),
        (
            not family.has_norm_topk and not moe.normalize_top_k,
            f"moe.normalize_top_k=False: {what} always normalizes the top-k weights",
        ),
        (
            not family.has_sparse_step and moe.every != 1,
            f"moe.every={moe.every}: every layer of {what} is a mixture of experts",
        ),
        (
            family.expert_width_key == "intermediate_size"
            and any(not cfg.is_moe_layer(i) for i in range(cfg.n_layers)),
            f"{what} has no dense layers",
        ),
    ]
    for bad, message in unsupported:
        if bad:
            raise ValueError(message)


def moe_from_hf(hf_config, family: Family) -> tuple[MoEConfig, int]:
    """Our MoE section for an MoE family's config, and the dense layers' width."""
    experts = int(getattr(hf_config, family.experts_key))
    width = int(getattr(hf_config, family.expert_width_key))
    moe = MoEConfig(
        experts=experts,
        top_k=int(hf_config.num_experts_per_tok),
        every=int(getattr(hf_config, "decoder_sparse_step", 1)) if family.has_sparse_step else 1,
        d_ff=width,
        normalize_top_k=bool(hf_config.norm_topk_prob) if family.has_norm_topk else True,
        aux_loss_coef=float(hf_config.router_aux_loss_coef),
    )
    return moe, int(hf_config.intermediate_size)


def moe_to_hf(cfg: ModelConfig, family: Family) -> dict:
    """An MoE family's config fields for our MoE section."""
    fields = {
        family.experts_key: cfg.moe.experts,
        "num_experts_per_tok": cfg.moe.top_k,
        "router_aux_loss_coef": cfg.moe.aux_loss_coef,
        family.expert_width_key: cfg.expert_d_ff,
    }
    if family.has_norm_topk:
        fields["norm_topk_prob"] = cfg.moe.normalize_top_k
    if family.has_sparse_step:
        fields.update(decoder_sparse_step=cfg.moe.every, mlp_only_layers=[])
    return fields
