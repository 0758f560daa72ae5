"""GPT, BERT and Seq2Seq on tiny CPU configs: config validation, shared key names, causality,
padding invariance, losses, initialisation, checkpointing, overfitting one batch, and that
`import model` pulls in neither deepspeed nor ray."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_module
from model import BERT, GPT, ModelConfig, Seq2Seq, StackConfig, build_model
from model.config import MoEConfig

ROOT = Path(__file__).resolve().parents[2]
V = 40  # ids 0..4 are pad, unk, <s>, </s>, <mask>


def tiny(arch: str = "gpt", **overrides) -> ModelConfig:
    base = dict(
        arch=arch,
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=24,
        dropout=0.0,
    )
    return ModelConfig(**{**base, **overrides})


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, V, shape, generator=torch.Generator().manual_seed(seed))


# The Llama shape: rotary positions, RMSNorm, SwiGLU, grouped-query attention (2 key/value
# heads for 4 query heads), no biases, an output layer of its own.
LLAMA = dict(
    positions="rope",
    norm="rmsnorm",
    activation="swiglu",
    n_kv_heads=2,
    bias=False,
    tie_embeddings=False,
)
VARIANTS = {
    "pre-learned": {},
    "post-sinusoidal-relu": dict(norm_position="post", positions="sinusoidal", activation="relu"),
    "llama": LLAMA,
}


# --- configuration ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(arch="t5"), "arch='t5'"),
        (dict(d_model=30), "d_model=30 is not divisible by n_heads=4"),
        (dict(n_heads=0), "n_heads=0"),
        (dict(activation="swish"), "activation='swish'"),
        (dict(norm_position="middle"), "norm_position='middle'"),
        (dict(positions="rotary"), "positions='rotary'"),
        (dict(dropout=1.0), "dropout=1.0"),
        (dict(vocab_size=0), "vocab_size=0"),
        (dict(bos_id=V), f"bos_id={V}"),
        (dict(layer_norm_eps=0.0), "layer_norm_eps=0.0"),
        (dict(n_decoder_layers=2), "only arch=seq2seq has a decoder"),
        (
            dict(encoder=StackConfig(norm_position="post")),
            "encoder.norm_position='post': per-stack overrides",
        ),
        (
            dict(arch="seq2seq", decoder=StackConfig(n_heads=5)),
            "not divisible by decoder.n_heads=5",
        ),
        (dict(arch="seq2seq", encoder=StackConfig(activation="tanh")), "encoder.activation='tanh'"),
        (dict(arch="seq2seq", label_smoothing=1.0), "label_smoothing=1.0"),
        (dict(n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=4"),
        (dict(n_kv_heads=-1), "n_kv_heads=-1"),
        (
            dict(arch="seq2seq", decoder=StackConfig(n_kv_heads=3)),
            "decoder.n_kv_heads=3 does not divide n_heads=4",
        ),
        (dict(norm="batchnorm"), "norm='batchnorm'"),
        (dict(positions="rope", d_model=36), "d_model=36 / n_heads=4: heads of 9 dimensions"),
        (dict(positions="rope", rope_theta=0.0), "rope_theta=0.0"),
        (
            dict(arch="seq2seq", share_embeddings=True, tie_embeddings=False),
            "needs tie_embeddings=True",
        ),
    ],
)
def test_config_validation(overrides, message):
    with pytest.raises(ValueError, match="^model config: ") as err:
        build_model(tiny(**overrides))
    assert message in str(err.value)


def test_config_is_an_omegaconf_structured_config():
    from omegaconf import OmegaConf
    from omegaconf.errors import ValidationError

    base = OmegaConf.structured(ModelConfig)
    merged = OmegaConf.merge(
        base, OmegaConf.from_dotlist(["arch=seq2seq", "decoder.norm_position=post", "d_ff=128"])
    )
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, ModelConfig) and isinstance(cfg.decoder, StackConfig)
    assert (
        cfg.for_stack("decoder").norm_position == "post"
        and cfg.for_stack("encoder").norm_position == "pre"
    )
    with pytest.raises(ValidationError):
        OmegaConf.merge(base, OmegaConf.from_dotlist(["n_layers=many"]))


def test_for_stack_resolves_overrides():
    cfg = tiny(
        "seq2seq",
        n_layers=3,
        n_decoder_layers=1,
        decoder=StackConfig(n_heads=2, activation="gelu_tanh"),
    )
    enc, dec = cfg.for_stack("encoder"), cfg.for_stack("decoder")
    assert (enc.n_layers, enc.n_heads, enc.activation) == (3, 4, "gelu")
    assert (dec.n_layers, dec.n_heads, dec.activation) == (1, 2, "gelu_tanh")
    assert tiny(d_ff=0).d_ff == 4 * 32


def test_gated_d_ff_default_is_llamas_rule():
    # 2/3 of 4 x d_model, rounded up to a multiple of 256: Llama 7B's 11008 at d_model 4096.
    assert [ModelConfig(d_model=d, activation="swiglu").d_ff for d in (4096, 768, 256, 32)] == [
        11008,
        2048,
        768,
        256,
    ]
    assert ModelConfig(d_model=256, activation="geglu").d_ff == 768
    # an explicit width is kept
    assert ModelConfig(d_model=256, activation="swiglu", d_ff=700).d_ff == 700
    # A Seq2Seq stack with an activation of its own gets its own width by the same rule.
    cfg = tiny("seq2seq", d_model=256, n_heads=4, d_ff=0, decoder=StackConfig(activation="swiglu"))
    assert (cfg.for_stack("encoder").d_ff, cfg.for_stack("decoder").d_ff) == (1024, 768)


def test_build_model_dispatches_on_arch():
    assert type(build_model(tiny("gpt"))) is GPT
    assert type(build_model(tiny("bert"))) is BERT
    assert type(build_model(tiny("seq2seq"))) is Seq2Seq


# --- one set of names ------------------------------------------------------------------------


def test_all_stacks_share_key_names():
    gpt, bert, s2s = (
        build_model(tiny("gpt")),
        build_model(tiny("bert")),
        build_model(tiny("seq2seq")),
    )
    gpt_keys, bert_keys = set(gpt.state_dict()), set(bert.state_dict())
    stack_keys = {k for k in gpt_keys if not k.startswith("lm_head")}
    assert stack_keys == {k for k in bert_keys if not k.startswith("head.")}
    assert "blocks.1.attn.q_proj.weight" in stack_keys and "blocks.0.mlp_norm.bias" in stack_keys
    assert "norm.weight" in stack_keys and "embed.tok.weight" in stack_keys

    decoder = s2s.decoder.state_dict()
    assert {k for k in decoder if "cross_attn" not in k} == gpt_keys
    assert {k for k in decoder if "cross_attn" in k} >= {
        "blocks.0.cross_attn.q_proj.weight",
        "blocks.0.cross_attn_norm.weight",
    }
    missing, unexpected = s2s.decoder.load_state_dict(gpt.state_dict(), strict=False)
    assert all("cross_attn" in k for k in missing) and not unexpected
    missing, unexpected = s2s.encoder.load_state_dict(bert.state_dict(), strict=False)
    assert not missing and all(k.startswith("head.") for k in unexpected)


def test_llama_shape_keys_and_shapes():
    """The same key names as every other stack; no biases, no position keys, smaller k and v
    projections, the gated MLP's two input matrices in one `fc`, an LM head of its own."""
    gpt = build_model(tiny("gpt", **LLAMA))
    keys = set(gpt.state_dict())
    assert not any(k.endswith(".bias") for k in keys) and not any("pos" in k for k in keys)
    assert {k.rsplit(".", 1)[0] for k in keys if k.startswith("blocks.0.")} == {
        "blocks.0.attn_norm",
        "blocks.0.attn.q_proj",
        "blocks.0.attn.k_proj",
        "blocks.0.attn.v_proj",
        "blocks.0.attn.out_proj",
        "blocks.0.mlp_norm",
        "blocks.0.mlp.fc",
        "blocks.0.mlp.proj",
    }
    block = gpt.blocks[0]
    assert isinstance(block.attn_norm, torch.nn.RMSNorm) and isinstance(gpt.norm, torch.nn.RMSNorm)
    assert block.attn.k_proj.weight.shape == (2 * 8, 32) and block.attn.q_proj.weight.shape == (
        32,
        32,
    )
    assert block.mlp.fc.weight.shape == (2 * 64, 32) and block.mlp.proj.weight.shape == (32, 64)
    assert gpt.lm_head.weight is not gpt.embed.tok.weight and "lm_head.weight" in keys
    assert gpt.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    bert = build_model(tiny("bert", **LLAMA))
    assert bert.head.decoder.bias is None and bert.head.dense.bias is None
    assert bert.head.decoder.weight is not bert.embed.tok.weight
    # LayerNorm without biases, a gated GELU (GeGLU): ModernBERT's layout.
    modern = build_model(tiny("bert", positions="rope", activation="geglu", bias=False))
    assert modern.blocks[0].attn_norm.bias is None and isinstance(
        modern.blocks[0].attn_norm, torch.nn.LayerNorm
    )
    assert not any(k.endswith(".bias") for k in modern.state_dict())


def test_sinusoidal_stack_has_no_position_parameters():
    model = build_model(tiny(positions="sinusoidal"))
    assert not any("pos" in k for k in model.state_dict())


def test_output_embeddings_are_tied():
    gpt, bert, s2s = (
        build_model(tiny("gpt")),
        build_model(tiny("bert")),
        build_model(tiny("seq2seq")),
    )
    assert gpt.lm_head.weight is gpt.embed.tok.weight
    assert bert.head.decoder.weight is bert.embed.tok.weight
    assert s2s.decoder.lm_head.weight is s2s.decoder.embed.tok.weight


# --- masks -----------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", VARIANTS)
def test_gpt_is_causal(variant):
    torch.manual_seed(0)
    model = build_model(tiny("gpt", **VARIANTS[variant])).eval()
    x = ids(2, 10)
    y = x.clone()
    y[:, 6] = 5 + (x[:, 6] - 4) % (V - 5)
    a, b = model(x).logits, model(y).logits
    torch.testing.assert_close(a[:, :6], b[:, :6])
    assert not torch.allclose(a[:, 6:], b[:, 6:])


def test_bert_is_bidirectional():
    model = build_model(tiny("bert")).eval()
    x = ids(1, 8)
    y = x.clone()
    y[0, 6] = 5 + (x[0, 6] - 4) % (V - 5)
    assert not torch.allclose(model(x).logits[:, :6], model(y).logits[:, :6])


@pytest.mark.parametrize("variant", VARIANTS)
def test_seq2seq_decoder_is_causal(variant):
    torch.manual_seed(0)
    model = build_model(tiny("seq2seq", **VARIANTS[variant])).eval()
    src, tgt = ids(2, 7, seed=1), ids(2, 9, seed=2)
    changed = tgt.clone()
    changed[:, 4] = 5 + (tgt[:, 4] - 4) % (V - 5)
    a = model(src, None, tgt).logits
    b = model(src, None, changed).logits
    torch.testing.assert_close(a[:, :4], b[:, :4])
    assert not torch.allclose(a[:, 4:], b[:, 4:])


def _padded(
    x: torch.Tensor, pad: int, left: bool, seed: int = 3
) -> tuple[torch.Tensor, torch.Tensor]:
    """x (1, T) padded with `pad` garbage tokens (not pad_id, to prove the mask does the work)."""
    garbage = ids(1, pad, seed=seed)
    parts = [garbage, x] if left else [x, garbage]
    masks = [torch.zeros(1, pad, dtype=torch.long), torch.ones_like(x)]
    return torch.cat(parts, 1), torch.cat(masks if left else masks[::-1], 1)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize(
    "arch, left", [("gpt", False), ("gpt", True), ("bert", False), ("bert", True)]
)
def test_padding_does_not_change_real_outputs(arch, left, variant):
    torch.manual_seed(0)
    model = build_model(tiny(arch, **VARIANTS[variant])).eval()
    x = ids(1, 6)
    alone = model(x).logits  # (1, 6, V)
    padded, mask = _padded(x, 4, left)
    other = ids(1, 10, seed=9)  # a second, unpadded row in the same batch
    out = model(torch.cat([padded, other]), torch.cat([mask, torch.ones_like(mask)])).logits
    assert torch.isfinite(out).all()
    real = out[0, 4:] if left else out[0, :6]
    torch.testing.assert_close(real, alone[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], model(other).logits[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
def test_seq2seq_padding_does_not_change_real_outputs(variant):
    torch.manual_seed(0)
    model = build_model(tiny("seq2seq", **VARIANTS[variant])).eval()
    src, tgt = ids(1, 5, seed=1), ids(1, 6, seed=2)
    alone = model(src, None, tgt).logits
    src_padded, src_mask = _padded(src, 3, left=False)
    tgt_padded, tgt_mask = _padded(tgt, 2, left=False, seed=4)
    out = model(src_padded, src_mask, tgt_padded, tgt_mask).logits
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out[0, :6], alone[0], atol=1e-5, rtol=1e-5)


def test_all_padding_rows_give_finite_outputs_and_gradients():
    model = build_model(tiny("seq2seq"))
    src, tgt = ids(2, 5), ids(2, 4)
    src_mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    labels = tgt.clone()
    labels[1] = -100
    out = model(src, src_mask, tgt, labels=labels)
    out.loss.backward()
    assert torch.isfinite(out.loss) and torch.isfinite(model(src, src_mask, tgt).logits).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


# --- losses ----------------------------------------------------------------------------------


def test_gpt_loss_scores_each_position_against_its_label_and_ignores_minus_100():
    # Labels are aligned with the positions that predict them (launch.tasks shifts them once);
    # tests/launch/test_tasks.py checks the shift against the next-token loss.
    model = build_model(tiny("gpt")).eval()
    x = ids(2, 8)
    labels = ids(2, 8, seed=1)
    labels[0, 5:] = -100
    out = model(x, labels=labels)
    assert out.logits is None and out.scored_logits is None  # a loss is computed without the logits
    logits = model(x).logits
    expected = F.cross_entropy(logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(out.loss, expected)


def test_bert_loss_counts_only_masked_positions():
    model = build_model(tiny("bert")).eval()
    x = ids(2, 8)
    labels = torch.full_like(x, -100)
    labels[0, 2], labels[1, 5] = 7, 9
    out = model(x, labels=labels)
    full = model(x).logits  # (B, T, V): the head on every position
    assert out.logits is None
    # (N, V): only the scored ones
    torch.testing.assert_close(out.scored_logits, full[[0, 1], [2, 5]])
    expected = (
        F.cross_entropy(full[0, 2], torch.tensor(7)) + F.cross_entropy(full[1, 5], torch.tensor(9))
    ) / 2
    torch.testing.assert_close(out.loss, expected)


def test_seq2seq_loss_is_label_smoothed_and_unshifted():
    model = build_model(tiny("seq2seq", label_smoothing=0.1)).eval()
    src, tgt = ids(2, 5), ids(2, 6)
    labels = tgt.clone()
    labels[1, 4:] = -100
    out = model(src, None, tgt, labels=labels)
    keep = labels.reshape(-1) != -100
    logp = model(src, None, tgt).logits.reshape(-1, V)[keep].log_softmax(-1)
    target = labels.reshape(-1)[keep]
    expected = (0.9 * -logp.gather(1, target[:, None]).squeeze(1) + 0.1 * -logp.mean(-1)).mean()
    torch.testing.assert_close(out.loss, expected)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_cross_entropy_matches_logits_then_cross_entropy(smoothing, bias, monkeypatch):
    # Chunks of 64 rows over 150 rows: a full chunk, and a last one that is partial.
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 64 * V)
    torch.manual_seed(0)
    h = torch.randn(3, 50, 16, dtype=torch.float64, requires_grad=True)
    head = loss_module.LMHead(16, V, bias=bias).double()
    targets = torch.randint(0, V, (3, 50))
    targets[1, 10:] = -100
    results = []
    for fused in (True, False):
        h.grad = None
        head.zero_grad()
        if fused:
            loss = head(h, targets, smoothing)
        else:
            loss = F.cross_entropy(
                head(h).reshape(-1, V),
                targets.reshape(-1),
                ignore_index=-100,
                label_smoothing=smoothing,
            )
        (2.5 * loss).backward()  # a scaled loss: the saved gradients are scaled by grad_output
        results.append([loss, h.grad, head.weight.grad] + ([head.bias.grad] if bias else []))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b)
    with torch.no_grad():
        torch.testing.assert_close(head(h, targets, smoothing), results[1][0])


def test_loss_with_no_targets_is_zero_not_nan():
    model = build_model(tiny("gpt"))
    x = ids(1, 4)
    out = model(x, labels=torch.full_like(x, -100))
    assert out.loss.item() == 0.0


# --- initialisation and checkpointing --------------------------------------------------------


def test_init_follows_gpt2_and_bert():
    n_layers = 2
    gpt = build_model(tiny("gpt", d_model=128, n_heads=4, d_ff=128, n_layers=n_layers))
    bert = build_model(
        tiny("bert", d_model=128, n_heads=4, d_ff=128, n_layers=n_layers, norm_position="post")
    )
    scaled = 0.02 / math.sqrt(2 * n_layers)
    assert gpt.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert gpt.blocks[1].mlp.proj.weight.std().item() == pytest.approx(scaled, rel=0.05)
    assert gpt.blocks[0].attn.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert bert.blocks[0].attn.out_proj.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert gpt.embed.tok.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert (
        gpt.blocks[0].attn.q_proj.bias.abs().max() == 0 and bert.head.decoder.bias.abs().max() == 0
    )
    assert torch.equal(bert.blocks[0].attn_norm.weight, torch.ones(128))


@pytest.mark.parametrize("arch", ["gpt", "seq2seq"])
def test_activation_checkpointing_gives_the_same_gradients(arch):
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(tiny(arch, activation_checkpointing=checkpointing, dropout=0.1)).train()
        x = ids(2, 6)
        torch.manual_seed(1)
        out = model(x, None, x, labels=x) if arch == "seq2seq" else model(x, labels=x)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("arch", ["gpt", "bert", "seq2seq"])
def test_activation_checkpointing_gives_the_same_gradients_in_the_llama_shape(arch):
    """The rotary (cos, sin) reach each recomputed block as an argument; dropout replays."""
    grads = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_model(
            tiny(arch, activation_checkpointing=checkpointing, dropout=0.1, **LLAMA)
        ).train()
        x = ids(2, 6)
        torch.manual_seed(1)
        out = model(x, None, x, labels=x) if arch == "seq2seq" else model(x, labels=x)
        out.loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b)


def test_dropout_is_off_in_eval_mode():
    model = build_model(tiny("gpt", dropout=0.5))
    x = ids(1, 6)
    model.train()
    assert not torch.equal(model(x).logits, model(x).logits)
    model.eval()
    assert torch.equal(model(x).logits, model(x).logits)


# --- overfitting one batch -------------------------------------------------------------------


def _overfit(model, batch: dict, steps: int) -> tuple[float, float]:
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    model.train()
    first = None
    for _ in range(steps):
        loss = model(**batch).loss
        first = loss.item() if first is None else first
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return first, loss.item()


def test_gpt_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(tiny("gpt"))
    x = ids(4, 12)
    first, last = _overfit(model, dict(input_ids=x, labels=x), 300)
    assert first > 3.0 and last < 0.05


def test_llama_shaped_gpt_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(tiny("gpt", **LLAMA))
    x = ids(4, 12)
    first, last = _overfit(model, dict(input_ids=x, labels=x), 300)
    assert first > 3.0 and last < 0.05


def test_bert_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(tiny("bert", norm_position="post", layer_norm_eps=1e-12))
    x = ids(4, 12)
    masked = torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.25
    first, last = _overfit(
        model, dict(input_ids=x.masked_fill(masked, 4), labels=x.masked_fill(~masked, -100)), 300
    )
    assert first > 3.0 and last < 0.05


def test_seq2seq_overfits_one_batch():
    torch.manual_seed(0)
    model = build_model(
        tiny("seq2seq", label_smoothing=0.0, decoder=StackConfig(norm_position="post"))
    )
    src, tgt = ids(4, 8, seed=1), ids(4, 7, seed=2)
    bos, eos = torch.full((4, 1), 2), torch.full((4, 1), 3)
    batch = dict(
        src_ids=src,
        src_mask=torch.ones_like(src),
        decoder_input_ids=torch.cat([bos, tgt], 1),
        labels=torch.cat([tgt, eos], 1),
    )
    first, last = _overfit(model, batch, 300)
    assert first > 3.0 and last < 0.05


# --- import hygiene --------------------------------------------------------------------------


def test_import_model_loads_neither_deepspeed_nor_ray():
    code = (
        "import sys, model\n"
        "from model import ModelConfig, build_model\n"
        "for arch in ('gpt', 'bert', 'seq2seq'):\n"
        "    build_model(ModelConfig(arch=arch, vocab_size=16, d_model=8, n_layers=1, n_heads=2, max_seq_len=8))\n"
        "import model.hf, model.warm_start, model.flops, model.generation\n"
        "bad = [m for m in ('deepspeed', 'ray', 'wandb', 'transformers', 'launch', 'pipeline') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env
    )
    assert result.returncode == 0, result.stderr


def test_model_sources_import_no_forbidden_package():
    forbidden = ("deepspeed", "ray", "wandb", "launch", "pipeline")
    for path in (ROOT / "model").glob("*.py"):
        for line in path.read_text().splitlines():
            words = line.split()
            if words[:1] in (["import"], ["from"]) and len(words) > 1:
                assert words[1].split(".")[0] not in forbidden, f"{path.name}: {line.strip()}"


def test_config_dataclass_fields_are_plain_types():
    allowed = {
        "str",
        "int",
        "float",
        "bool",
        "Optional[int]",
        "Optional[str]",
        "Optional[float]",
        "StackConfig",
        "MoEConfig",
    }
    for cls in (ModelConfig, StackConfig, MoEConfig):
        for f in dataclasses.fields(cls):
            assert f.type in allowed, f"{cls.__name__}.{f.name}: {f.type}"
