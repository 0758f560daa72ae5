"""Our GPT <-> Hugging Face's Llama-shaped decoders: LlamaForCausalLM, Qwen2ForCausalLM (Qwen2.5),
Qwen3ForCausalLM, MistralForCausalLM and Olmo2ForCausalLM, and the mixtures of experts
OlmoeForCausalLM, Qwen3MoeForCausalLM and MixtralForCausalLM (`model.moe`).

All five are a pre-LN (OLMo 2: post_branch) stack of RMSNorm, rotary attention with grouped
key/value heads and a SwiGLU MLP; a `Family` says what sets each apart (q/k/v biases, query/key
norms, a sliding window, where the norms sit) as our ModelConfig fields, and which of its own
config fields we refuse by name. The family read is kept in `ModelConfig.family`, so that an
export writes the class it came from (a Mistral without a window computes what a Llama does).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Mapping

import torch
from torch import Tensor

from model.config import ModelConfig
from model.gpt import GPT
from model.hf import require, special_ids
from model.hf_moe import moe_from_hf, moe_to_hf, require_moe

StateDict = Dict[str, Tensor]

# What every family fixes.
DECODER_CONVENTIONS = dict(arch="gpt", positions="rope", norm="rmsnorm", activation="swiglu")
# Per-layer keys, ours -> theirs, but the two norms (`Family.norms`) and the MLP's gate and up.
DECODER_LAYER = {
    "attn.q_proj": "self_attn.q_proj",
    "attn.k_proj": "self_attn.k_proj",
    "attn.v_proj": "self_attn.v_proj",
    "attn.out_proj": "self_attn.o_proj",
    "attn.q_norm": "self_attn.q_norm",
    "attn.k_norm": "self_attn.k_norm",
    "mlp.proj": "mlp.down_proj",
}
PRE_NORMS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}
# An MoE layer's keys, ours -> theirs: the router and the stacked experts.
MOE_LAYER = {
    "mlp.gate.weight": "mlp.gate.weight",
    "mlp.experts.gate_up_proj": "mlp.experts.gate_up_proj",
    "mlp.experts.down_proj": "mlp.experts.down_proj",
}


@dataclass(frozen=True)
class Family:
    name: str  # as the docs and messages say it
    model_type: str  # Hugging Face's, and our ModelConfig.family
    model_class: str
    config_class: str
    # Our ModelConfig fields the family fixes (beyond DECODER_CONVENTIONS).
    fixed: dict = field(default_factory=dict)
    # Our norms -> theirs.
    norms: dict = field(default_factory=lambda: PRE_NORMS)
    # Their config fields and the only values we take (None: absent or unset is fine too).
    refused_unless: dict = field(default_factory=dict)
    # Whether the family's config has attention_bias (q, k, v and o together), mlp_bias, a
    # head_dim of its own, and a sliding_window we compute (Mistral's, on every layer).
    has_attention_bias: bool = False
    has_mlp_bias: bool = False
    has_head_dim: bool = True
    has_window: bool = False
    # A mixture of experts: its config's name of the expert count, of the experts' width, and
    # whether it has norm_topk_prob (else the top-k weights are always normalized) and
    # decoder_sparse_step (else every layer is MoE).
    experts_key: str = ""
    expert_width_key: str = "intermediate_size"
    has_norm_topk: bool = True
    has_sparse_step: bool = False


FAMILIES = {
    "llama": Family(
        "Llama",
        "llama",
        "LlamaForCausalLM",
        "LlamaConfig",
        fixed=dict(norm_position="pre", qk_norm="none", qkv_bias=False),
        refused_unless={"pretraining_tp": 1},
        has_attention_bias=True,
        has_mlp_bias=True,
    ),
    "qwen2": Family(
        "Qwen2.5",
        "qwen2",
        "Qwen2ForCausalLM",
        "Qwen2Config",
        fixed=dict(norm_position="pre", qk_norm="none", qkv_bias=True, bias=False),
        refused_unless={"use_sliding_window": False},
        has_head_dim=False,
    ),
    "qwen3": Family(
        "Qwen3",
        "qwen3",
        "Qwen3ForCausalLM",
        "Qwen3Config",
        fixed=dict(norm_position="pre", qk_norm="head", qkv_bias=False, bias=False),
        refused_unless={"use_sliding_window": False, "attention_bias": False},
    ),
    "mistral": Family(
        "Mistral",
        "mistral",
        "MistralForCausalLM",
        "MistralConfig",
        fixed=dict(norm_position="pre", qk_norm="none", qkv_bias=False, bias=False),
        has_window=True,
    ),
    "olmo2": Family(
        "OLMo 2",
        "olmo2",
        "Olmo2ForCausalLM",
        "Olmo2Config",
        fixed=dict(norm_position="post_branch", qk_norm="projection", qkv_bias=False, bias=False),
        norms={"attn_norm": "post_attention_layernorm", "mlp_norm": "post_feedforward_layernorm"},
        refused_unless={"attention_bias": False},
    ),
    "olmoe": Family(
        "OLMoE",
        "olmoe",
        "OlmoeForCausalLM",
        "OlmoeConfig",
        fixed=dict(norm_position="pre", qk_norm="projection", qkv_bias=False, bias=False),
        refused_unless={"attention_bias": False, "clip_qkv": None},
        has_head_dim=False,
        experts_key="num_experts",
    ),
    "qwen3_moe": Family(
        "Qwen3-MoE",
        "qwen3_moe",
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        fixed=dict(norm_position="pre", qk_norm="head", qkv_bias=False, bias=False),
        refused_unless={
            "use_sliding_window": False,
            "attention_bias": False,
            "mlp_only_layers": [],
        },
        experts_key="num_local_experts",
        expert_width_key="moe_intermediate_size",
        has_sparse_step=True,
    ),
    "mixtral": Family(
        "Mixtral",
        "mixtral",
        "MixtralForCausalLM",
        "MixtralConfig",
        fixed=dict(norm_position="pre", qk_norm="none", qkv_bias=False, bias=False),
        refused_unless={"router_jitter_noise": 0.0},
        has_window=True,
        experts_key="num_local_experts",
        has_norm_topk=False,
    ),
}


def family_of(cfg: ModelConfig) -> Family:
    """The family our GPT exports as: `cfg.family` where set, else the one its options call for
    (post_branch norms: OLMo 2; per-head query/key norms: Qwen3; q/k/v biases alone: Qwen2.5; a
    sliding window: Mistral; otherwise Llama). ValueError if that family cannot compute it."""
    moe = cfg.moe.experts > 0
    if cfg.family:
        family = FAMILIES[cfg.family]
    elif moe:
        family = FAMILIES[{"projection": "olmoe", "head": "qwen3_moe"}.get(cfg.qk_norm, "mixtral")]
    elif cfg.norm_position == "post_branch":
        family = FAMILIES["olmo2"]
    elif cfg.qk_norm == "head":
        family = FAMILIES["qwen3"]
    elif cfg.qkv_bias and not cfg.bias:
        family = FAMILIES["qwen2"]
    elif cfg.sliding_window:
        family = FAMILIES["mistral"]
    else:
        family = FAMILIES["llama"]
    require(cfg, family.model_class, **DECODER_CONVENTIONS, **family.fixed)
    if moe != bool(family.experts_key):
        raise ValueError(
            f"moe.experts={cfg.moe.experts}: Hugging Face's {family.model_class} is "
            + ("a mixture of experts" if family.experts_key else "dense")
        )
    if moe:
        require_moe(cfg, family)
    if not family.has_window and cfg.sliding_window:
        raise ValueError(
            f"sliding_window={cfg.sliding_window}: Hugging Face's {family.model_class} "
            "attends to every earlier position"
        )
    if not family.has_head_dim and cfg.head_size * cfg.n_heads != cfg.d_model:
        raise ValueError(
            f"head_dim={cfg.head_dim}: Hugging Face's {family.model_class} has heads of "
            "d_model / n_heads"
        )
    return family


def _rope_theta(hf_config, family: Family) -> float:
    """The rotary base, refusing the scaled variants (Llama 3.1's, YaRN, linear, dynamic...)."""
    params = getattr(hf_config, "rope_parameters", None) or {
        "rope_type": "default",
        "rope_theta": hf_config.rope_theta,
    }
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"{family.config_class} rope_type={params['rope_type']!r} is not supported "
            "(plain rotary positions only)"
        )
    return float(params["rope_theta"])


def config_from_hf_decoder(hf_config, **overrides) -> ModelConfig:
    """Our GPT config for the config of a Llama, Qwen2.5, Qwen3, Mistral or OLMo 2; `overrides`
    applied last (special ids: a family's own only fit its own vocabulary). A field we do not
    compute (rope scaling, another bias layout, per-layer windows) is refused by name."""
    family = FAMILIES.get(hf_config.model_type)
    if family is None:
        raise ValueError(f"a Hugging Face {hf_config.model_type} config is not a decoder family")
    what = family.config_class
    refusals = {"hidden_act": "silu", **family.refused_unless}
    for name, ok in refusals.items():
        if getattr(hf_config, name, ok) not in (ok, None):
            raise ValueError(f"{what}.{name}={getattr(hf_config, name)!r} is not supported")
    bias = False
    if family.has_attention_bias:
        attention_bias = bool(getattr(hf_config, "attention_bias", False))
        mlp_bias = bool(getattr(hf_config, "mlp_bias", False)) if family.has_mlp_bias else False
        if attention_bias != mlp_bias:
            raise ValueError(
                f"{what}.attention_bias={attention_bias} with mlp_bias={mlp_bias} is not "
                "supported (biases on every projection or on none)"
            )
        bias = attention_bias
    default_head = hf_config.hidden_size // hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) if family.has_head_dim else None
    window = getattr(hf_config, "sliding_window", None) if family.has_window else None
    kv_heads = hf_config.num_key_value_heads or hf_config.num_attention_heads
    fields = dict(DECODER_CONVENTIONS, **family.fixed)
    fields.update(bias=bias)
    d_ff = hf_config.intermediate_size
    if family.experts_key:
        fields["moe"], d_ff = moe_from_hf(hf_config, family)
    cfg = ModelConfig(
        **fields,
        family=family.model_type,
        vocab_size=hf_config.vocab_size,
        d_model=hf_config.hidden_size,
        n_layers=hf_config.num_hidden_layers,
        n_heads=hf_config.num_attention_heads,
        n_kv_heads=0 if kv_heads == hf_config.num_attention_heads else kv_heads,
        head_dim=0 if head_dim in (None, default_head) else head_dim,
        d_ff=d_ff,
        max_seq_len=hf_config.max_position_embeddings,
        dropout=float(hf_config.attention_dropout or 0.0),
        rope_theta=_rope_theta(hf_config, family),
        layer_norm_eps=hf_config.rms_norm_eps,
        sliding_window=int(window or 0),
        tie_embeddings=bool(hf_config.tie_word_embeddings),
        init_std=hf_config.initializer_range,
        **special_ids(hf_config),
    )
    return dataclasses.replace(cfg, **overrides).validate()


def hf_decoder_config(cfg: ModelConfig):
    """The Hugging Face config of our GPT's family (`family_of`)."""
    import transformers

    family = family_of(cfg)
    extra = {}
    if family.has_attention_bias:
        extra["attention_bias"] = cfg.bias
    if family.has_mlp_bias:
        extra["mlp_bias"] = cfg.bias
    if family.has_head_dim:
        extra["head_dim"] = cfg.head_size
    if family.has_window:
        extra["sliding_window"] = cfg.sliding_window or None
    if "use_sliding_window" in family.refused_unless:
        extra["use_sliding_window"] = False
    extra["intermediate_size"] = cfg.d_ff
    if family.experts_key:
        extra.update(moe_to_hf(cfg, family))
    return getattr(transformers, family.config_class)(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_heads,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        initializer_range=cfg.init_std,
        rms_norm_eps=cfg.layer_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
        attention_dropout=cfg.dropout,
        tie_word_embeddings=cfg.tie_embeddings,
        bos_token_id=cfg.bos_id,
        eos_token_id=cfg.eos_id,
        pad_token_id=cfg.pad_id,
        **extra,
    )


def _key_pairs(n_layers: int, family: Family) -> list[tuple[str, str]]:
    """(our key, theirs) of every weight and bias that converts as it is; the LM head and the
    gated MLP's halves aside."""
    pairs = [
        ("embed.tok.weight", "model.embed_tokens.weight"),
        ("norm.weight", "model.norm.weight"),
    ]
    for i in range(n_layers):
        for ours, theirs in {**DECODER_LAYER, **family.norms}.items():
            for kind in ("weight", "bias"):
                pairs.append((f"blocks.{i}.{ours}.{kind}", f"model.layers.{i}.{theirs}.{kind}"))
        if family.experts_key:
            pairs += [(f"blocks.{i}.{a}", f"model.layers.{i}.{b}") for a, b in MOE_LAYER.items()]
    return pairs


def _gate_up(n_layers: int) -> list[tuple[str, str, str]]:
    """(our mlp.fc key, their gate_proj key, their up_proj key): our fc is gate over up."""
    triples = []
    for i in range(n_layers):
        theirs = f"model.layers.{i}.mlp."
        for kind in ("weight", "bias"):
            triples.append(
                (
                    f"blocks.{i}.mlp.fc.{kind}",
                    f"{theirs}gate_proj.{kind}",
                    f"{theirs}up_proj.{kind}",
                )
            )
    return triples


def gpt_state_dict_from_hf_decoder(
    hf: Mapping[str, Tensor], n_layers: int, family: Family
) -> StateDict:
    """A decoder family's state dict in our GPT's keys and layout. A weight of theirs that finds
    no place in ours is refused (ValueError naming it) rather than dropped."""
    ours = {mine: hf[theirs] for mine, theirs in _key_pairs(n_layers, family) if theirs in hf}
    ours["lm_head.weight"] = hf.get("lm_head.weight", hf["model.embed_tokens.weight"])
    used = {theirs for _, theirs in _key_pairs(n_layers, family)} | {"lm_head.weight"}
    for fc, gate, up in _gate_up(n_layers):
        if gate in hf:
            ours[fc] = torch.cat([hf[gate], hf[up]])  # (2 d_ff, ...)
        used.update({gate, up})
    unplaced = sorted(set(hf) - used - {"model.rotary_emb.inv_freq"})
    if unplaced:
        raise ValueError(
            f"{family.model_class} weights with no place in ours: {', '.join(unplaced[:3])}"
            + (", ..." if len(unplaced) > 3 else "")
        )
    return {k: v.contiguous() for k, v in ours.items()}


def gpt_state_dict_to_hf_decoder(
    ours: Mapping[str, Tensor], n_layers: int, family: Family
) -> StateDict:
    """Our GPT's state dict in its family's keys and layout."""
    hf = {theirs: ours[mine] for mine, theirs in _key_pairs(n_layers, family) if mine in ours}
    hf["lm_head.weight"] = ours["lm_head.weight"]
    for fc, gate, up in _gate_up(n_layers):
        if fc in ours:
            hf[gate], hf[up] = ours[fc].chunk(2)
    return {k: v.contiguous() for k, v in hf.items()}


def gpt_from_hf_decoder(hf_model, **overrides) -> GPT:
    """Our GPT with the weights of a LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
    MistralForCausalLM or Olmo2ForCausalLM."""
    cfg = config_from_hf_decoder(hf_model.config, **overrides)
    model = GPT(cfg)
    state = gpt_state_dict_from_hf_decoder(
        hf_model.state_dict(), cfg.n_layers, FAMILIES[cfg.family]
    )
    model.load_state_dict(state)
    return model


def gpt_to_hf_decoder(model: GPT):
    """The Hugging Face model of our GPT's family (`family_of`) with its weights."""
    import transformers

    family = family_of(model.cfg)
    hf_model = getattr(transformers, family.model_class)(hf_decoder_config(model.cfg))
    hf_model.load_state_dict(
        gpt_state_dict_to_hf_decoder(model.state_dict(), model.cfg.n_layers, family)
    )
    return hf_model
