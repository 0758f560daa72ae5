"""The decoder families beyond Llama, against transformers' own classes (tiny, random, built from a
config): Qwen2.5's q/k/v biases, Qwen3's per-head query/key norms and heads of their own width,
Mistral's sliding window, OLMo 2's query/key norms over whole projections and norms after the
sublayers. Converted into ours they give transformers' logits (left padding included) and its
greedy tokens with the cache; ours convert back into the same class. The window composes with
document masks (SDPA and FlexAttention) and with the cache; fields we do not compute are refused
by name."""

import dataclasses
import warnings

import decoder_parity
import pytest
import torch

transformers = pytest.importorskip("transformers")

from model import GPT, ModelConfig  # noqa: E402
from model.attention import self_attention_mask  # noqa: E402
from model.hf_decoders import (  # noqa: E402
    FAMILIES,
    config_from_hf_decoder,
    gpt_from_hf_decoder,
    gpt_state_dict_from_hf_decoder,
    hf_decoder_config,
)

V = 64
CLASSES = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral", "olmo2": "Olmo2"}
# What each family's tiny config sets apart: Qwen3's heads wider than d_model / n_heads, Mistral's
# window shorter than the sequences below, Qwen2.5's tied head as its small models have.
SHAPES = {
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=5),
    "olmo2": {},
}


def hf_model(family: str, **overrides):
    shape = dict(vocab_size=V, intermediate_size=48, num_hidden_layers=2)
    return decoder_parity.tiny_hf_model(
        CLASSES[family], 0.05, **{**shape, **SHAPES[family], **overrides}
    )


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, V, shape, generator=torch.Generator().manual_seed(seed))


def left_padded(rows: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return decoder_parity.left_padded(rows, length, seed, V)


@pytest.mark.parametrize("family", CLASSES)
def test_transformers_model_into_ours_and_back(family):
    decoder_parity.assert_into_ours_and_back(
        hf_model(family), family, f"{CLASSES[family]}ForCausalLM", V
    )


def test_each_family_sets_its_own_fields():
    got = {family: gpt_from_hf_decoder(hf_model(family)).cfg for family in CLASSES}
    assert (got["qwen2"].qkv_bias, got["qwen2"].bias, got["qwen2"].tie_embeddings) == (
        True,
        False,
        True,
    )
    assert (got["qwen3"].qk_norm, got["qwen3"].head_dim, got["qwen3"].attention_width) == (
        "head",
        16,
        64,
    )
    assert got["mistral"].sliding_window == 5 and got["mistral"].qk_norm == "none"
    assert (got["olmo2"].qk_norm, got["olmo2"].norm_position) == ("projection", "post_branch")
    # keys ours has for them: q/k/v biases without an output bias; the two norms per attention
    qwen2 = GPT(got["qwen2"]).state_dict()
    assert "blocks.0.attn.q_proj.bias" in qwen2 and "blocks.0.attn.out_proj.bias" not in qwen2
    assert GPT(got["qwen3"]).state_dict()["blocks.0.attn.q_norm.weight"].shape == (16,)
    assert GPT(got["olmo2"]).state_dict()["blocks.0.attn.k_norm.weight"].shape == (16,)


@pytest.mark.parametrize("family", CLASSES)
def test_greedy_generation_with_the_cache_equals_transformers(family):
    """Left-padded prompts of 6 and 14 new tokens each: Mistral's window of 5 slides over them."""
    decoder_parity.assert_greedy_equal(hf_model(family), V)


def windowed(window: int, **overrides) -> GPT:
    torch.manual_seed(0)
    cfg = dict(
        arch="gpt", vocab_size=V, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, d_ff=48,
        max_seq_len=32, dropout=0.0, positions="rope", norm="rmsnorm", activation="swiglu",
        bias=False, sliding_window=window,
    )  # fmt: skip
    model = GPT(ModelConfig(**{**cfg, **overrides}).validate())
    with torch.no_grad():  # larger weights than init's, for continuations that do not repeat
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model.eval()


def test_window_mask_by_hand():
    mask, causal = self_attention_mask(None, 5, 5, True, torch.device("cpu"), window=2)
    assert not causal
    assert mask.int().tolist() == [
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [0, 1, 1, 0, 0],
        [0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1],
    ]
    # one new query against 4 cached keys: the last two only
    mask, _ = self_attention_mask(None, 1, 5, True, torch.device("cpu"), window=2)
    assert mask.int().tolist() == [[0, 0, 0, 1, 1]]
    # a window as long as the keys is no window: SDPA's own causal mask
    assert self_attention_mask(None, 5, 5, True, torch.device("cpu"), window=5) == (None, True)


def test_the_window_matters_and_cached_generation_equals_recomputation():
    model, unlimited = windowed(4), windowed(0)
    x = ids(2, 12, seed=2)
    with torch.no_grad():
        a, b = model(x).logits, unlimited(x).logits
    torch.testing.assert_close(a[:, :4], b[:, :4], rtol=1e-5, atol=1e-6)  # within the window
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3
    prompts, mask = left_padded(3, 5, seed=3)
    cached = model.generate(prompts, mask, max_new_tokens=15)
    # without a cache: the whole sequence again for each new token
    seq, seq_mask = prompts, mask
    with torch.no_grad():
        for _ in range(15):
            nxt = model(seq, seq_mask).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(nxt)], dim=1)
    assert torch.equal(cached, seq)
    assert not torch.equal(cached, unlimited.generate(prompts, mask, max_new_tokens=15))


def test_window_with_document_masks_equals_each_document_alone():
    """A packed row of three documents (the window of 3 shorter than each), SDPA's dense mask and
    FlexAttention's rule (its eager form on the CPU) alike."""
    model = windowed(3)
    lengths = [7, 9, 8]
    x = ids(1, sum(lengths), seed=5)
    document_ids = torch.cat([torch.full((n,), d) for d, n in enumerate(lengths)])[None]
    with torch.no_grad():
        packed = {}
        for kernel in ("sdpa", "flex_attention"):
            model.document_attention = kernel
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                packed[kernel] = model(x, document_ids=document_ids).logits
        start = 0
        for n in lengths:
            alone = model(x[:, start : start + n]).logits
            for kernel, logits in packed.items():
                torch.testing.assert_close(
                    logits[:, start : start + n], alone, rtol=1e-5, atol=1e-5, msg=kernel
                )
            start += n


@pytest.mark.parametrize(
    "family, field, value, message",
    [
        (
            "qwen2",
            "rope_parameters",
            {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0},
            "rope_type='yarn'",
        ),
        (
            "qwen3",
            "rope_parameters",
            {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
            "rope_type='linear'",
        ),
        (
            "mistral",
            "rope_parameters",
            {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
            "rope_type='dynamic'",
        ),
        ("qwen3", "attention_bias", True, r"Qwen3Config.attention_bias=True"),
        ("olmo2", "attention_bias", True, r"Olmo2Config.attention_bias=True"),
        ("qwen2", "use_sliding_window", True, r"Qwen2Config.use_sliding_window=True"),
    ],
)
def test_fields_we_do_not_compute_are_refused_by_name(family, field, value, message):
    name = CLASSES[family]
    config = getattr(transformers, f"{name}Config")(vocab_size=V, **{field: value})
    with pytest.raises(ValueError, match=message):
        config_from_hf_decoder(config)


def test_llama_biases_on_attention_alone_are_refused():
    config = transformers.LlamaConfig(vocab_size=V, attention_bias=True, mlp_bias=False)
    with pytest.raises(ValueError, match="attention_bias=True with mlp_bias=False"):
        config_from_hf_decoder(config)


def test_a_weight_with_no_place_in_ours_is_refused():
    theirs = hf_model("mistral")
    state = dict(theirs.state_dict())
    state["model.layers.0.self_attn.sinks"] = torch.zeros(4)  # gpt-oss has these
    with pytest.raises(ValueError, match=r"no place in ours: model.layers.0.self_attn.sinks"):
        gpt_state_dict_from_hf_decoder(state, 2, FAMILIES["mistral"])


def test_exports_that_no_family_computes_are_refused():
    base = windowed(0).cfg
    with pytest.raises(ValueError, match="positions='rope'"):
        hf_decoder_config(dataclasses.replace(base, positions="learned", qk_norm="head"))
    with pytest.raises(ValueError, match="sliding_window=4: Hugging Face's Qwen3ForCausalLM"):
        hf_decoder_config(dataclasses.replace(base, qk_norm="head", sliding_window=4))
    with pytest.raises(ValueError, match="head_dim=16: Hugging Face's Qwen2ForCausalLM"):
        hf_decoder_config(dataclasses.replace(base, qkv_bias=True, head_dim=16))
    # without a family of its own, a windowed GPT is a Mistral; a named one stays what it is
    assert type(hf_decoder_config(windowed(4).cfg)).__name__ == "MistralConfig"
    named = dataclasses.replace(base, family="mistral")
    assert type(hf_decoder_config(named)).__name__ == "MistralConfig"
    assert type(hf_decoder_config(base)).__name__ == "LlamaConfig"
