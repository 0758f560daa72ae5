"""Rotary positions and grouped-query attention (`model.positions.Rotary`, `rotate`, `model.attention.attention`).

Rotary: a query-key score depends on the two positions' difference only (all positions shifted
by k: the same scores), a rotation keeps a vector's length, the table stays float32 when the
parameters are 16-bit, and a Seq2Seq's cross-attention takes no rotation. Grouped key/value
heads: SDPA's own grouped path and the repeated heads give the same attention for every mask
the models pass, and the decoding cache keeps the key/value heads only. Packed documents with
rotary positions: tests/model/test_document_mask.py; against Hugging Face: tests/model/test_hf_parity.py.
"""

import pytest
import torch

import model.attention as attention_module
from model import KVCache, ModelConfig, build_model
from model.attention import attention, document_attention_mask, expand_kv, self_attention_mask
from model.positions import Rotary, rotate

D, MAX_LEN = 16, 64


def qk(T: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, T, D, generator=g, dtype=torch.float64), torch.randn(
        2, 3, T, D, generator=g, dtype=torch.float64
    )


def scores(q, k, q_positions, k_positions, rotary):
    q_rotated = rotate(q, *(t.double() for t in rotary(q_positions)))
    k_rotated = rotate(k, *(t.double() for t in rotary(k_positions)))
    return q_rotated @ k_rotated.transpose(-2, -1)  # (B, H, T, T)


@pytest.mark.parametrize("theta", [10000.0, 500000.0])
def test_scores_depend_only_on_relative_position(theta):
    rotary = Rotary(D, MAX_LEN, theta)
    q, k = qk()
    positions = torch.arange(8)[None]  # (1, T)
    at_zero = scores(q, k, positions, positions, rotary)
    for shift in (1, 5, 40):
        torch.testing.assert_close(
            scores(q, k, positions + shift, positions + shift, rotary),
            at_zero,
            rtol=1e-5,
            atol=1e-5,
        )
    # Not vacuous: shifting only the keys changes the scores, and so do the positions at all.
    assert not torch.allclose(scores(q, k, positions, positions + 3, rotary), at_zero, atol=1e-3)
    assert not torch.allclose(at_zero, q @ k.transpose(-2, -1), atol=1e-3)


def test_rotation_keeps_lengths_and_position_zero_is_the_identity():
    rotary = Rotary(D, MAX_LEN, 10000.0)
    q, _ = qk()
    positions = torch.arange(8)[None] * 7
    rotated = rotate(q, *(t.double() for t in rotary(positions)))
    torch.testing.assert_close(rotated.norm(dim=-1), q.norm(dim=-1))
    zero = torch.zeros(1, 8, dtype=torch.long)
    torch.testing.assert_close(rotate(q, *(t.double() for t in rotary(zero))), q)


def test_the_table_stays_float32_under_16_bit_parameters():
    """DeepSpeed's bf16 casts parameters, not buffers (as here): the angles keep float32 and
    the rotation hands back the queries' dtype."""
    model = build_model(
        ModelConfig(
            arch="gpt",
            vocab_size=40,
            d_model=32,
            n_layers=1,
            n_heads=2,
            max_seq_len=MAX_LEN,
            positions="rope",
            norm="rmsnorm",
            activation="swiglu",
        )
    )
    for p in model.parameters():
        p.data = p.data.bfloat16()
    assert model.rotary.cos.dtype == model.rotary.sin.dtype == torch.float32
    assert "rotary.cos" not in model.state_dict()  # recomputed, never saved
    logits = model(torch.randint(5, 40, (2, 50))).logits
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits).all()
    q = torch.randn(1, 2, 4, D, dtype=torch.bfloat16)
    assert rotate(q, *Rotary(D, 8, 10000.0)(torch.arange(4)[None])).dtype == torch.bfloat16


def test_seq2seq_cross_attention_takes_no_rotation():
    model = build_model(
        ModelConfig(
            arch="seq2seq",
            vocab_size=40,
            d_model=32,
            n_layers=1,
            n_heads=2,
            max_seq_len=16,
            positions="rope",
        )
    ).eval()
    seen = {}

    def record(name):
        return lambda module, args, kwargs: seen.__setitem__(name, kwargs.get("rotary"))

    block = model.decoder.blocks[0]
    block.attn.register_forward_pre_hook(record("self"), with_kwargs=True)
    block.cross_attn.register_forward_pre_hook(record("cross"), with_kwargs=True)
    model(torch.randint(5, 40, (1, 6)), None, torch.randint(5, 40, (1, 4)))
    assert isinstance(seen["self"], tuple) and seen["cross"] is None


# --- grouped-query attention -------------------------------------------------------------


def _masks(B: int, T: int):
    key_mask = torch.ones(B, T, dtype=torch.long)
    key_mask[0, :3] = 0  # a left-padded row
    documents = torch.tensor([[0] * (T // 2) + [1] * (T - T // 2)] * B)
    return {
        "none": (None, False),
        "causal": (None, True),
        "causal+padding": self_attention_mask(
            key_mask, T, T, causal=True, device=torch.device("cpu")
        ),
        "documents": (document_attention_mask(documents, None, causal=False), False),
    }


@pytest.mark.parametrize("mask_name", ["none", "causal", "causal+padding", "documents"])
@pytest.mark.parametrize("sdpa_takes_gqa", [True, False])
def test_grouped_heads_equal_repeated_heads(mask_name, sdpa_takes_gqa, monkeypatch):
    """Both routes `attention` may take (SDPA's grouped heads; heads repeated first, as on CUDA
    with a mask or on a torch without enable_gqa) against plain attention over repeated heads,
    outputs and gradients."""
    monkeypatch.setattr(attention_module, "SDPA_TAKES_GQA", sdpa_takes_gqa)
    B, H, Hkv, T = 2, 4, 2, 10
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, T, D, generator=g, requires_grad=True)
    k, v = (torch.randn(B, Hkv, T, D, generator=g, requires_grad=True) for _ in range(2))
    mask, is_causal = _masks(B, T)[mask_name]
    grouped = attention(q, k, v, mask, 0.0, is_causal)
    grouped.square().sum().backward()
    got = [grouped.detach()] + [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    repeated = torch.nn.functional.scaled_dot_product_attention(
        q, *expand_kv(k, v, H), attn_mask=mask, is_causal=is_causal
    )
    repeated.square().sum().backward()
    expected = [repeated.detach()] + [t.grad for t in (q, k, v)]
    for a, b in zip(got, expected, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # Query head h reads key/value head h // 2: heads 0 and 1 share one.
    assert torch.equal(expand_kv(k, v, H)[0][:, 1], k[:, 0]) and torch.equal(
        expand_kv(k, v, H)[0][:, 2], k[:, 1]
    )


def test_the_decoding_cache_keeps_only_the_key_value_heads():
    model = build_model(
        ModelConfig(
            arch="gpt",
            vocab_size=40,
            d_model=32,
            n_layers=2,
            n_heads=4,
            n_kv_heads=1,
            max_seq_len=16,
            positions="rope",
        )
    ).eval()
    cache = KVCache(2)
    with torch.no_grad():
        model(torch.randint(5, 40, (3, 5)), cache=cache)
    assert cache.layers[1].self_attn.k.shape == (3, 1, 5, 8)  # (B, n_kv_heads, T, Dh)


@pytest.mark.gpu
def test_grouped_heads_on_cuda_equal_the_cpu():
    """Each CUDA route of a Llama-shaped GPT (bf16 flash with grouped heads and no mask; heads
    repeated for a padding mask; FlexAttention's grouped heads for a document mask) against the
    CPU's float32 logits of the same weights."""
    torch.manual_seed(0)
    cfg = ModelConfig(
        arch="gpt",
        vocab_size=40,
        d_model=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        max_seq_len=32,
        dropout=0.0,
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
    )
    cpu = build_model(cfg).eval()
    gpu = build_model(cfg).cuda().eval()
    gpu.load_state_dict(cpu.state_dict())
    x = torch.randint(5, 40, (2, 24))
    mask = torch.ones_like(x)
    mask[1, 18:] = 0
    documents = torch.cat(
        [torch.zeros(2, 10, dtype=torch.long), torch.ones(2, 14, dtype=torch.long)], dim=1
    )
    real = mask.bool()
    with torch.no_grad():
        expected = {
            "plain": cpu(x).logits,
            "padding": cpu(x, mask).logits[real],
            "documents": cpu(x, document_ids=documents).logits,
        }
        got = {
            "padding": gpu(x.cuda(), mask.cuda()).logits[real.cuda()],
            "documents": gpu(x.cuda(), document_ids=documents.cuda()).logits,
        }
        assert gpu.attention_kernel == "flex_attention (document mask)"
        with torch.autocast("cuda", dtype=torch.bfloat16):
            got["plain"] = gpu(x.cuda()).logits.float()
    for name, tolerance in (("padding", 1e-4), ("documents", 1e-4), ("plain", 0.1)):
        torch.testing.assert_close(
            got[name].cpu(), expected[name], rtol=0, atol=tolerance, msg=name
        )
