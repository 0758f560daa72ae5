"""Document-aware packing (`data.document_mask`): a packed block's documents are computed as if
each were alone.

The model: with `document_ids`, GPT's logits over a packed block (a fragment of a document cut
by the previous block first, padding where a row is short) equal the logits of each document
run on its own with positions from 0; BERT's likewise (block-diagonal). FlexAttention (eager on
the CPU here) gives the SDPA path's logits and gradients. The data: `doc_starts` stored by
prepare become the batch's `document_ids`, checked when read; a dataset prepared without them
is refused with the mask on and read as before with it off. End to end: `launch.train` with
`data.document_mask=true` trains GPT and BERT and says which attention kernel ran.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from model import BERT, GPT, ModelConfig
from model.blocks import document_attention_mask, positions_in_documents

V = 40  # ids 0..4 are pad, unk, <s>, </s>, <mask>
EOS = 3
VARIANTS = {
    "pre-learned": {},
    "post-sinusoidal-relu": dict(norm_position="post", positions="sinusoidal", activation="relu"),
}


def tiny(arch: str, **overrides) -> ModelConfig:
    base = dict(arch=arch, vocab_size=V, d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32, dropout=0.0)
    return ModelConfig(**{**base, **overrides}).validate()


def packed_row(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, document_ids) of one block of documents of these lengths, each ended by </s> but the
    last (cut by the block's end), the first standing for the rest of one cut by the previous block."""
    g = torch.Generator().manual_seed(seed)
    ids, docs = [], []
    for d, length in enumerate(lengths):
        doc = torch.randint(5, V, (length,), generator=g)
        if d < len(lengths) - 1:
            doc[-1] = EOS
        ids.append(doc)
        docs.append(torch.full((length,), d))
    return torch.cat(ids), torch.cat(docs)


def documents(document_ids: torch.Tensor, length: int) -> list[tuple[int, int]]:
    """(start, end) of each document among the first `length` tokens of a row."""
    ids = document_ids[:length].tolist()
    starts = [t for t in range(length) if t == 0 or ids[t] != ids[t - 1]]
    return list(zip(starts, starts[1:] + [length]))


# Two rows of 30 tokens: the first full, the second with 6 tokens of padding.
ROWS = [([5, 9, 1, 7, 8], 30), ([11, 4, 9], 24)]


def batch() -> dict[str, torch.Tensor]:
    width = max(real for _, real in ROWS)
    input_ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    document_ids = torch.zeros_like(input_ids)
    attention_mask = torch.zeros_like(input_ids)
    for row, (lengths, real) in enumerate(ROWS):
        ids, docs = packed_row(lengths, seed=row)
        assert len(ids) == real
        input_ids[row, :real], document_ids[row, :real], attention_mask[row, :real] = ids, docs, 1
        document_ids[row, real:] = docs[-1]  # padding: as the collator numbers it
    return {"input_ids": input_ids, "attention_mask": attention_mask, "document_ids": document_ids}


def assert_each_document_as_if_alone(model, inputs):
    with torch.no_grad():
        packed = model(**inputs).logits  # (B, T, V)
        kernel = model.attention_kernel
        for row, (_, real) in enumerate(ROWS):
            for start, end in documents(inputs["document_ids"][row], real):
                alone = model(inputs["input_ids"][row:row + 1, start:end]).logits  # positions from 0
                torch.testing.assert_close(packed[row:row + 1, start:end], alone, rtol=1e-5, atol=1e-5)
    return kernel


@pytest.mark.parametrize("arch", ["gpt", "bert"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_packed_block_logits_equal_each_document_alone(arch, variant):
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch, **VARIANTS[variant])).eval()
    assert assert_each_document_as_if_alone(model, batch()) == "sdpa (document mask)"


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_without_document_ids_documents_see_each_other(arch):
    """The mask is what makes the difference: without it a later document's logits change."""
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch)).eval()
    inputs = batch()
    with torch.no_grad():
        masked = model(**inputs).logits
        plain = model(inputs["input_ids"], inputs["attention_mask"]).logits
        one_document = model(**{**inputs, "document_ids": torch.zeros_like(inputs["document_ids"])}).logits
    assert model.attention_kernel == "sdpa (document mask)"
    start, end = documents(inputs["document_ids"][0], 30)[1]
    assert not torch.allclose(masked[0, start:end], plain[0, start:end], atol=1e-3)
    # One document per row is the plain forward: the same mask and positions by another route
    # (at the real tokens; what padding positions compute is nobody's business).
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(one_document[real], plain[real], rtol=1e-5, atol=1e-5)


def test_positions_restart_at_each_document():
    document_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 3, 3]])
    assert positions_in_documents(document_ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3], [0, 0, 1, 2, 3, 4, 0, 0, 1]]


def test_dense_document_mask_by_hand():
    document_ids = torch.tensor([[0, 0, 1, 1]])
    key_mask = torch.tensor([[1, 1, 1, 0]])
    causal = document_attention_mask(document_ids, key_mask, causal=True)[0, 0].int().tolist()
    assert causal == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 1, 0], [0, 0, 1, 0]]  # the pad query sees its document
    bidirectional = document_attention_mask(document_ids, None, causal=False)[0, 0].int().tolist()
    assert bidirectional == [[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]]


def test_decoding_with_a_cache_takes_no_document_ids():
    from model import KVCache

    model = GPT(tiny("gpt")).eval()
    ids = torch.randint(5, V, (1, 4))
    with pytest.raises(ValueError, match="document_ids"):
        model(ids, cache=KVCache(2), document_ids=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="document_ids has shape"):
        model(ids, document_ids=torch.zeros(1, 3, dtype=torch.long))


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_flex_attention_equals_sdpa_on_cpu(arch):
    """The CUDA kernel's mask rule, run by FlexAttention's eager form on the CPU (forward only:
    it has no CPU backward): the logits of SDPA with the dense mask, padding included."""
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch)).eval()
    inputs = batch()
    logits = {}
    for kernel in ("sdpa", "flex_attention"):
        model.document_attention = kernel
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # FlexAttention warns that its eager form is unfused
            logits[kernel] = model(**inputs).logits
        assert model.attention_kernel == f"{kernel} (document mask)"
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(logits["flex_attention"][real], logits["sdpa"][real], rtol=1e-5, atol=1e-5)


def test_auto_kernel_is_sdpa_on_cpu_and_with_attention_dropout():
    model = GPT(tiny("gpt", dropout=0.1))
    assert model._document_kernel(torch.device("cpu")) == "sdpa"
    model.train()
    assert model._document_kernel(torch.device("cuda")) == "sdpa"  # FlexAttention has no dropout
    model.eval()
    from model.blocks import flex_attention_available
    expected = "flex_attention" if flex_attention_available() else "sdpa"
    assert model._document_kernel(torch.device("cuda")) == expected


@pytest.mark.gpu
@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_flex_attention_on_cuda(arch):
    """On CUDA the automatic kernel is compiled FlexAttention: each document as if alone, and the
    logits and gradients of SDPA with the dense mask."""
    torch.manual_seed(0)
    model = (GPT if arch == "gpt" else BERT)(tiny(arch)).cuda()
    inputs = {key: value.cuda() for key, value in batch().items()}
    results = {}
    for kernel in ("auto", "sdpa"):
        model.document_attention = kernel
        model.zero_grad()
        logits = model(**inputs).logits
        results[kernel] = model.attention_kernel, logits.detach()
        real = inputs["attention_mask"].bool()
        logits[real].square().mean().backward()
        results[kernel] += ([p.grad.clone() for p in model.parameters() if p.grad is not None],)
    assert results["auto"][0] == "flex_attention (document mask)"
    real = inputs["attention_mask"].bool()
    torch.testing.assert_close(results["auto"][1][real], results["sdpa"][1][real], rtol=1e-4, atol=1e-4)
    for flex_grad, sdpa_grad in zip(results["auto"][2], results["sdpa"][2], strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, rtol=1e-3, atol=1e-5)
    model.document_attention = "auto"
    model.eval()
    assert_each_document_as_if_alone(model, inputs)
