"""Shared embeddings for translation (`model.share_embeddings`, Vaswani et al. 2017, section 3.4):
a Seq2Seq's source embedding, target embedding and output projection are one tensor, looked
up scaled by sqrt(d_model); it stays one tensor through a 2-rank ZeRO-3 run, its resume and its
export, and a warm start fills it from the documented source (`model.warm_start`)."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from repo import ROOT
from torch import nn
from warm_start_sources import SHA, V, bert_config, gpt_config, pretrained

from launch.optim import parameter_groups
from model import ModelConfig, build_model, seq2seq_config
from model.warm_start import WarmStartError, warm_start

SHARED = ("encoder.embed.tok.weight", "decoder.embed.tok.weight", "decoder.lm_head.weight")


def config(**overrides) -> ModelConfig:
    base = dict(
        arch="seq2seq",
        vocab_size=V,
        d_model=16,
        n_layers=2,
        n_heads=2,
        d_ff=32,
        max_seq_len=16,
        dropout=0.0,
        share_embeddings=True,
    )
    return ModelConfig(**{**base, **overrides}).validate()


def batch(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    src, tgt = torch.randint(5, V, (3, 7), generator=g), torch.randint(5, V, (3, 5), generator=g)
    src_mask = torch.ones_like(src)
    src_mask[0, 5:] = 0  # one padded source
    return {"src_ids": src, "src_mask": src_mask, "decoder_input_ids": tgt}


def test_one_tensor_counted_once_and_in_one_parameter_group():
    torch.manual_seed(0)
    model = build_model(config())
    encoder, decoder, head = (model.get_parameter(key) for key in SHARED)
    assert encoder is decoder is head
    unshared = build_model(config(share_embeddings=False))
    count = sum(p.numel() for p in model.parameters())
    # GPT already tied its head
    assert count == sum(p.numel() for p in unshared.parameters()) - 2 * V * 16 + V * 16
    groups = parameter_groups(model, weight_decay=0.1)
    placed = [p for group in groups for p in group["params"]]
    assert sum(p is encoder for p in placed) == 1 and len(placed) == len({id(p) for p in placed})
    # an embedding: no decay
    assert any(p is encoder for p in groups[1]["params"]) and groups[1]["weight_decay"] == 0.0
    # A state dict names it three times (as plain exports save tied weights), all equal, and loads
    # back.
    state = {k: v.clone() for k, v in model.state_dict().items()}
    assert all(torch.equal(state[k], state[SHARED[0]]) for k in SHARED)
    fresh = build_model(config())
    fresh.load_state_dict(state)
    assert torch.equal(fresh.get_parameter(SHARED[0]), encoder) and fresh.get_parameter(
        SHARED[1]
    ) is fresh.get_parameter(SHARED[2])
    # Three different matrices are refused, not resolved by load order.
    state[SHARED[1]] = state[SHARED[1]] + 1
    with pytest.raises(
        RuntimeError, match="share_embeddings: .* must hold one matrix; they differ"
    ):
        fresh.load_state_dict(state)


@pytest.mark.parametrize("positions", ["learned", "sinusoidal"])
def test_logits_and_gradient_equal_a_reference_with_three_copies_of_one_scaled_matrix(positions):
    torch.manual_seed(0)
    model = build_model(config(positions=positions))
    W = model.get_parameter(SHARED[0])
    # The reference: an unshared model (its stacks scale lookups by sqrt(d_model) only with
    # sinusoids) whose three places hold their own copies, the inputs pre-scaled by hand where
    # the stacks would not scale them.
    reference = build_model(config(positions=positions, share_embeddings=False))
    reference.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k not in SHARED}, strict=False
    )
    by_hand = math.sqrt(16) if positions == "learned" else 1.0
    reference.encoder.embed.tok.weight = nn.Parameter(W.detach() * by_hand)
    reference.decoder.embed.tok.weight = nn.Parameter(W.detach() * by_hand)
    # untied: the output layer, unscaled
    reference.decoder.lm_head.weight = nn.Parameter(W.detach().clone())
    assert model.encoder.embed.scale == model.decoder.embed.scale == 4.0

    inputs = batch()
    logits = model(**inputs).logits  # (B, T, V)
    expected = reference(**inputs).logits
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
    assert logits.abs().max() > 1e-3  # not a vacuous match of near-zero logits

    # One matrix gathers the gradients of all three places (the inputs' through the scale).
    logits.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    r = reference
    want = (
        by_hand * (r.encoder.embed.tok.weight.grad + r.decoder.embed.tok.weight.grad)
        + r.decoder.lm_head.weight.grad
    )
    torch.testing.assert_close(W.grad, want, rtol=1e-4, atol=1e-7)


def test_config_refuses_share_embeddings_without_two_embeddings():
    for arch in ("gpt", "bert"):
        with pytest.raises(
            ValueError, match=r"^model config: share_embeddings=True: only arch=seq2seq"
        ) as err:
            ModelConfig(arch=arch, vocab_size=V, share_embeddings=True).validate()
        assert "\n" not in str(err.value)
    # Two sources with different vocabularies: one line, naming the key.
    other = pretrained(gpt_config(vocab_size=V + 8), seed=3)
    with pytest.raises(
        WarmStartError, match=r"differ in vocab_size: \[40, 48\] \(share_embeddings=True needs one"
    ):
        seq2seq_config(bert_config(), other.config, share_embeddings=True)
    cfg = seq2seq_config(bert_config(), gpt_config(), share_embeddings=True)
    with pytest.raises(
        WarmStartError,
        match=r"vocabulary mismatch: decoder .*share_embeddings=True needs one vocabulary",
    ):
        warm_start(cfg, SHA, decoder=other)


@pytest.fixture(scope="module")
def sources():
    return pretrained(bert_config(), seed=1), pretrained(gpt_config(), seed=2)


def test_warm_start_takes_the_decoders_gpt_embedding_and_says_why(sources):
    bert, gpt = sources
    cfg = seq2seq_config(bert.config, gpt.config, share_embeddings=True)
    model, report = warm_start(cfg, SHA, encoder=bert, decoder=gpt)
    W = model.get_parameter(SHARED[0])
    assert all(model.get_parameter(key) is W for key in SHARED)
    assert torch.equal(W, gpt.state_dict["embed.tok.weight"]) and not torch.equal(
        W, bert.state_dict["embed.tok.weight"]
    )
    # Every key accounted for; the three shared names report the GPT's matrix.
    assert list(report.tensors) == list(model.state_dict())
    assert report.tensors[SHARED[0]].source == "decoder:embed.tok.weight"
    assert [report.tensors[k].note for k in SHARED[1:]] == [f"tied to {SHARED[0]}"] * 2
    assert all(report.tensors[k].status == "copied" for k in SHARED)
    assert "encoder:embed.tok.weight" in report.dropped
    assert report.keys("new") and all(".cross_attn" in k for k in report.keys("new"))
    text = str(report)
    (line,) = [line for line in text.splitlines() if line.startswith("shared ")]
    assert "<- decoder:embed.tok.weight (the decoder source trained it as its output layer" in line
    assert (
        "scaled by sqrt(d_model) = 5.65685" in line
        and "encoder:embed.tok.weight, if given, is dropped" in line
    )
    # The rest of the encoder is still BERT's.
    assert torch.equal(model.state_dict()["encoder.norm.weight"], bert.state_dict["norm.weight"])


def test_warm_start_without_a_decoder_source_takes_the_encoders(sources):
    bert, _ = sources
    cfg = seq2seq_config(bert.config, None, share_embeddings=True)
    model, report = warm_start(cfg, SHA, encoder=bert)
    assert torch.equal(model.get_parameter(SHARED[2]), bert.state_dict["embed.tok.weight"])
    assert all(
        report.tensors[k].source == "encoder:embed.tok.weight"
        and report.tensors[k].status == "copied"
        for k in SHARED
    )
    assert (
        "(there is no decoder source; the encoder source's is the one pretrained matrix)"
        in report.shared
    )
    # Without share_embeddings nothing of this appears.
    _, plain = warm_start(seq2seq_config(bert.config, None), SHA, encoder=bert)
    assert (
        not plain.shared
        and "shared " not in str(plain)
        and plain.tensors[SHARED[1]].status == "new"
    )


# ----------------------------------------------------------------------------- a 2-rank ZeRO-3 run


def _train(data: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    from trainruns import train

    return train(
        "tiny_translation.yaml",
        data,
        run_dir,
        "deepspeed.zero_stage=3",
        "model.share_embeddings=true",
        "max_steps=4",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=2",
        "model.dropout=0.1",
        *overrides,
    )


def _losses(run_dir: Path) -> dict:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


@pytest.mark.slow
def test_zero3_resume_and_export_keep_one_tensor(tiny_dataset, tmp_path):
    from launch.deepspeed.safe_load import consolidated_state_dict
    from launch.model_dir import load_model_dir, save_model_dir

    # Warm-start sources exported in the test, shaped like the run's stacks (trainruns.TINY).
    vocab = json.loads((tiny_dataset / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    tokenizer = tiny_dataset / "tokenizer.model"
    shape = dict(vocab_size=vocab, d_model=32, n_layers=2, n_heads=2, d_ff=64, max_seq_len=64)
    bert_cfg = ModelConfig(arch="bert", norm_position="post", activation="gelu", **shape)
    gpt_cfg = ModelConfig(arch="gpt", norm_position="pre", activation="gelu_tanh", **shape)
    torch.manual_seed(0)
    gpt = build_model(gpt_cfg)
    save_model_dir(
        tmp_path / "bert", build_model(bert_cfg).state_dict(), bert_cfg, tokenizer, {"task": "mlm"}
    )
    save_model_dir(tmp_path / "gpt", gpt.state_dict(), gpt_cfg, tokenizer, {"task": "causal_lm"})
    init = [f"init.encoder={tmp_path / 'bert'}", f"init.decoder={tmp_path / 'gpt'}"]

    # The uninterrupted run's step-2 checkpoint resumed in another run_dir: the resume under test,
    # one 2-rank job less than stopping a second run at step 2.
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    first = _train(tiny_dataset, straight, *init)
    step_2 = straight / "checkpoints" / "step_00000002"
    resumed = _train(tiny_dataset, stopped, *init, f"resume={step_2}")
    assert f"resumed from {step_2}" in resumed.stderr

    warm = (straight / "warm_start.txt").read_text()
    assert (
        "shared   share_embeddings: source, target and output embeddings <- decoder:embed.tok.weight"
        in warm
    )
    assert "copied   encoder.embed.tok.weight <- decoder:embed.tok.weight" in warm
    assert "dropped  encoder:embed.tok.weight" in warm
    from common.configure import load_config
    from launch.config import TrainConfig

    model_cfg = load_config(TrainConfig, stopped / "config.yaml").model
    assert model_cfg.share_embeddings
    # The engine trained one tensor: the run's parameter count is the shared model's.
    count = sum(p.numel() for p in build_model(model_cfg).parameters())
    assert (
        f"translation: {count:,} parameters" in first.stderr
        and f"translation: {count:,} parameters" in resumed.stderr
    )

    expected, got = _losses(straight), _losses(stopped)
    # the resumed job trained 3 and 4 only
    assert sorted(expected) == [1, 2, 3, 4] and sorted(got) == [3, 4]
    assert [got[s] for s in (3, 4)] == pytest.approx([expected[s] for s in (3, 4)], abs=1e-6, rel=0)

    # The checkpoint the resumed engine wrote records one tensor under the three names
    # (DeepSpeed's shared_params), and its values are those of the uninterrupted run's.
    state = consolidated_state_dict(stopped / "checkpoints", "step_00000004")
    assert state[SHARED[0]] is state[SHARED[1]] is state[SHARED[2]]
    reference = consolidated_state_dict(straight / "checkpoints", "step_00000004")
    torch.testing.assert_close(state[SHARED[0]], reference[SHARED[0]], rtol=0, atol=1e-6)
    assert not torch.equal(state[SHARED[0]], gpt.state_dict()["embed.tok.weight"])  # it trained

    # Export writes the tensor once; it loads back as one tensor of a share_embeddings model.
    out = tmp_path / "export"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(
        [sys.executable, "-m", "launch.export", f"checkpoint={stopped}", f"out={out}"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = [k for k in f.keys() if k in SHARED]
    assert stored == ["decoder.embed.tok.weight"]
    model, meta = load_model_dir(out)
    assert meta["model_config"].share_embeddings and meta["step"] == 4
    W = model.get_parameter(SHARED[0])
    assert all(model.get_parameter(k) is W for k in SHARED)
    assert torch.equal(W, state[SHARED[0]])


@pytest.mark.parametrize(
    "overrides", [dict(), dict(share_embeddings=False, positions="sinusoidal")]
)
def test_scaled_lookups_start_at_unit_variance(overrides):
    """Embeddings looked up scaled by sqrt(d_model) start at std d_model^-0.5 (tensor2tensor's and
    fairseq's initialisation), so the scaled lookup has unit variance; unscaled ones keep init_std."""
    torch.manual_seed(0)
    cfg = config(d_model=64, **overrides)
    model = build_model(cfg)
    for stack in (model.encoder, model.decoder):
        assert stack.embed.scale == 8.0
        lookup = stack.embed.tok.weight * stack.embed.scale
        assert abs(lookup.std().item() - 1.0) < 0.05
    learned = build_model(config(d_model=64, share_embeddings=False))
    assert learned.encoder.embed.scale == 1.0
    assert abs(learned.encoder.embed.tok.weight.std().item() - 0.02) < 0.002
