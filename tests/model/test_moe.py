"""Mixtures of experts (`model.moe`) against transformers' own classes (tiny, random, built from a
config): OLMoE (unnormalized top-k weights, query/key norms over whole projections), Qwen3-MoE
(per-head query/key norms, wider heads, dense layers between MoE ones) and Mixtral. Converted into
ours they give transformers' logits (left padding included), its greedy tokens with the cache and
its load-balancing loss; ours convert back into the same class. The routing itself is checked
against a token-by-token computation, dropless and past capacity; fields a family cannot hold
and bad settings are refused by name."""

import dataclasses

import decoder_parity
import pytest
import torch

transformers = pytest.importorskip("transformers")

from model import GPT, ModelConfig  # noqa: E402
from model.blocks import moe_layers  # noqa: E402
from model.config import MoEConfig  # noqa: E402
from model.hf_decoders import (  # noqa: E402
    config_from_hf_decoder,
    gpt_from_hf_decoder,
    hf_decoder_config,
)

V = 64
CLASSES = {"olmoe": "Olmoe", "qwen3_moe": "Qwen3Moe", "mixtral": "Mixtral"}
SHAPES = {
    "olmoe": dict(intermediate_size=24, num_experts=6, norm_topk_prob=False),
    # every second layer MoE, the others dense MLPs of their own width; heads wider than 32/4
    "qwen3_moe": dict(
        intermediate_size=40,
        moe_intermediate_size=24,
        num_experts=6,
        head_dim=16,
        decoder_sparse_step=2,
        norm_topk_prob=True,
    ),  # fmt: skip
    "mixtral": dict(intermediate_size=24, num_local_experts=6, sliding_window=None),
}


def hf_model(family: str, **overrides):
    """Large enough weights (noise 0.2) that the routers' choices differ from token to token."""
    shape = dict(vocab_size=V, num_hidden_layers=4, num_experts_per_tok=2)
    return decoder_parity.tiny_hf_model(
        CLASSES[family], 0.2, **{**shape, **SHAPES[family], **overrides}
    )


@pytest.mark.parametrize("family", CLASSES)
def test_transformers_moe_into_ours_and_back(family):
    ours = decoder_parity.assert_into_ours_and_back(
        hf_model(family), family, f"{CLASSES[family]}ForCausalLM", V
    )
    assert ours.cfg.moe.experts == 6


def test_each_family_sets_its_own_moe_fields():
    got = {family: gpt_from_hf_decoder(hf_model(family)).cfg for family in CLASSES}
    assert got["olmoe"].moe.normalize_top_k is False and got["olmoe"].qk_norm == "projection"
    qwen = got["qwen3_moe"]
    assert (qwen.moe.every, qwen.moe.d_ff, qwen.d_ff, qwen.head_dim) == (2, 24, 40, 16)
    assert [qwen.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert got["mixtral"].moe.normalize_top_k is True and got["mixtral"].qk_norm == "none"
    state = GPT(qwen).state_dict()
    assert state["blocks.1.mlp.experts.gate_up_proj"].shape == (6, 48, 32)
    assert state["blocks.0.mlp.fc.weight"].shape == (80, 32)  # dense: gate over up, 2 x 40


@pytest.mark.parametrize("family", CLASSES)
def test_greedy_generation_with_the_cache_equals_transformers(family):
    decoder_parity.assert_greedy_equal(hf_model(family), V)


def test_load_balancing_loss_equals_transformers():
    """One MoE layer (transformers sums the counts of every layer before its product; ours adds
    each layer's loss, which is the same for one)."""
    theirs = hf_model("mixtral", num_hidden_layers=1, router_aux_loss_coef=0.3)
    ours = gpt_from_hf_decoder(theirs)
    x = torch.randint(3, V, (2, 16), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = theirs(x, output_router_logits=True)
        mine = ours(x, labels=x)
    assert ours.cfg.moe.aux_loss_coef == 0.3
    torch.testing.assert_close(mine.aux_loss, 0.3 * out.aux_loss, rtol=1e-5, atol=1e-6)
    # balanced routing scores 1 (each expert 1/E of the probability and of the choices x k)
    assert 0.3 <= float(mine.aux_loss) < 0.3 * 6


def moe_model(**moe) -> GPT:
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="gpt", vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=40, max_seq_len=32,
        dropout=0.0, positions="rope", norm="rmsnorm", activation="swiglu", bias=False,
        moe=MoEConfig(**{"experts": 4, "top_k": 2, **moe}),
    )  # fmt: skip
    model = GPT(cfg.validate())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def by_hand(layer, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """The layer's output token by token: each token's experts in its top-k order, an expert
    taking first choices before second ones up to `capacity`."""
    flat = x.reshape(-1, x.shape[-1])
    logits = flat @ layer.gate.weight.t()
    scores = torch.softmax(logits, -1) if layer.gate.score == "softmax" else torch.sigmoid(logits)
    weights, index = scores.topk(layer.top_k, dim=-1)
    if layer.gate.normalize:
        weights = weights / weights.sum(-1, keepdim=True)
    taken = [0] * layer.n_experts
    out = torch.zeros_like(flat)
    for slot in range(layer.top_k):
        for t in range(flat.shape[0]):
            e = int(index[t, slot])
            if capacity is not None and taken[e] >= capacity:
                continue
            taken[e] += 1
            out[t] += weights[t, slot] * layer.experts.expert(e, flat[t : t + 1])[0]
    if layer.shared_expert is not None:
        out += layer.shared_expert(flat)
    return out.reshape(x.shape)


@pytest.mark.parametrize(
    "moe",
    [
        {},
        {"normalize_top_k": False, "top_k": 3},
        {"score": "sigmoid", "shared_d_ff": 16},
        {"capacity_factor": 0.5},
        {"capacity_factor": 8.0},
    ],
    ids=["dropless", "top3-unnormalized", "sigmoid-shared", "capacity-0.5", "capacity-8"],
)
def test_routing_equals_a_token_by_token_computation(moe):
    model = moe_model(**moe)
    layer = moe_layers(model)[0]
    x = torch.randn(3, 10, 32, generator=torch.Generator().manual_seed(2))
    capacity = None
    if moe.get("capacity_factor"):
        capacity = -(-int(moe["capacity_factor"] * 30 * layer.top_k) // layer.n_experts)
    with torch.no_grad():
        got = layer(x)
    torch.testing.assert_close(got, by_hand(layer, x, capacity), rtol=1e-5, atol=1e-6)
    assert layer.load.sum() + layer.dropped == 30 * layer.top_k
    if capacity is not None:
        assert int(layer.load.max()) <= capacity
        assert (int(layer.dropped) > 0) == (moe["capacity_factor"] < 1)


def test_router_and_every_expert_get_gradients_and_the_loss_falls():
    model = moe_model(z_loss_coef=1e-3).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(3, V, (4, 24), generator=torch.Generator().manual_seed(7))
    losses = []
    for _ in range(30):
        out = model(x, labels=x)
        (out.loss + out.aux_loss).backward()
        if not losses:
            layer = moe_layers(model)[0]
            assert layer.gate.weight.grad.abs().sum() > 0
            assert (layer.experts.gate_up_proj.grad.abs().sum(dim=(1, 2)) > 0).all()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(out.loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "moe, message",
    [
        ({"top_k": 5}, "moe.top_k=5: must be between 1 and moe.experts=4"),
        ({"every": 0}, "moe.every=0: must be >= 1"),
        ({"score": "relu"}, "moe.score='relu': expected one of ('softmax', 'sigmoid')"),
        ({"capacity_factor": -1.0}, "moe.capacity_factor=-1.0: must be >= 0 (0 = dropless)"),
    ],
)
def test_bad_moe_settings_are_refused_by_name(moe, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        moe_model(**moe)


def test_a_dense_activation_cannot_have_experts():
    with pytest.raises(ValueError, match="experts are gated MLPs; activation='gelu'"):
        ModelConfig(arch="gpt", activation="gelu", moe=MoEConfig(experts=4)).validate()


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("qwen3_moe", {"mlp_only_layers": [1]}, "Qwen3MoeConfig.mlp_only_layers=[1]"),
        ("mixtral", {"router_jitter_noise": 0.1}, "MixtralConfig.router_jitter_noise=0.1"),
        ("olmoe", {"clip_qkv": 8.0}, "OlmoeConfig.clip_qkv=8.0"),
    ],
)
def test_router_layouts_we_do_not_compute_are_refused(family, overrides, message):
    config = hf_model(family).config
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        config_from_hf_decoder(config)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"shared_d_ff": 16}, "moe.shared_d_ff=16: Hugging Face's MixtralForCausalLM has no"),
        ({"score": "sigmoid"}, "moe.score='sigmoid': Hugging Face's MixtralForCausalLM scores"),
        ({"capacity_factor": 1.25}, "moe.capacity_factor=1.25: Hugging Face's Mixtral"),
        ({"normalize_top_k": False}, "moe.normalize_top_k=False: Hugging Face's Mixtral"),
        ({"every": 2}, "moe.every=2: every layer of Hugging Face's MixtralForCausalLM"),
    ],
)
def test_an_export_refuses_what_the_family_cannot_hold(change, message):
    cfg = moe_model().cfg
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, **change))
    with pytest.raises(ValueError, match=message):
        hf_decoder_config(cfg)
