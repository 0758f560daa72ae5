"""The fused LM loss (`model.loss.linear_cross_entropy`): the loss and gradients of
`F.cross_entropy` on materialised logits for any chunking (float64, float32), and in fp16 / bf16
with a loss scale as accurate as rounding to 16 bits allows, at thousands of rows on a CPU and
at GPT-2's shape on CUDA (marked gpu)."""

import pytest
import torch
import torch.nn.functional as F

import model.loss as loss_module
from model.loss import IGNORE_INDEX, linear_cross_entropy

LOSS_SCALE = 1024.0  # what DeepSpeed's fp16 scaler sends into backward as the loss's gradient


def make(
    n: int, c: int, v: int, dtype: torch.dtype, bias: bool, seed: int = 0, device: str = "cpu"
):
    """Hidden states ~ N(0, 1) (a final layer norm's output), a GPT-2-initialised projection
    (std 0.02), a small bias, targets with every 7th row ignored."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, c, generator=g)
    w = torch.randn(v, c, generator=g) * 0.02
    b = torch.randn(v, generator=g) * 0.1 if bias else None
    t = torch.randint(0, v, (n,), generator=g)
    t[::7] = IGNORE_INDEX
    return [
        None if x is None else x.to(device=device, dtype=dtype if x.is_floating_point() else None)
        for x in (h, w, b, t)
    ]


def fused(h, w, b, t, smoothing, **kwargs):
    return linear_cross_entropy(h, w, b, t, smoothing, **kwargs)


def reference(h, w, b, t, smoothing):
    return F.cross_entropy(
        F.linear(h, w, b), t, ignore_index=IGNORE_INDEX, label_smoothing=smoothing
    )


def loss_and_grads(loss_fn, h, w, b, t, smoothing, dtype=None, scale=1.0, **kwargs):
    """The loss and the gradients of fresh leaves (cast to `dtype`) from backward of loss * scale,
    divided by the scale in float32 or wider."""
    leaves = [
        None if x is None else x.detach().to(dtype or x.dtype).requires_grad_() for x in (h, w, b)
    ]
    loss = loss_fn(*leaves, t, smoothing, **kwargs)
    (loss * scale).backward()
    wide = torch.promote_types(leaves[0].dtype, torch.float32)
    return loss.detach(), [x.grad.to(wide) / scale for x in leaves if x is not None]


# --- chunking: exact in float64, every chunk size ---------------------------------------------


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 150, None])  # 150 rows: one chunk of the whole batch
def test_any_chunking_matches_cross_entropy_on_logits(rows, bias, smoothing):
    h, w, b, t = make(150, 16, 40, torch.float64, bias)
    h, t = h.reshape(3, 50, 16), t.reshape(3, 50)  # (B, T, C) as the models pass it
    t[1, 10:] = IGNORE_INDEX  # a run of ignored rows across chunk boundaries
    got = loss_and_grads(fused, h, w, b, t, smoothing, scale=2.5, chunk_rows=rows)
    want = loss_and_grads(
        lambda h, *a: reference(h.reshape(-1, 16), *a), h, w, b, t.reshape(-1), smoothing, scale=2.5
    )
    torch.testing.assert_close(got, want)  # float64 tolerances: rtol 1e-7
    with torch.no_grad():  # the no-grad path: the same chunks and kernels, so the same number
        assert torch.equal(fused(h, w, b, t, smoothing, chunk_rows=rows), got[0])


@pytest.mark.parametrize("rows", [64, 1000, 4096])
def test_float32_keeps_float32_precision(rows):
    # float32 inputs run float32 GEMMs with no rounding step of their own: errors are float32
    # accumulation-order differences against F.cross_entropy, well under 1e-5 relative.
    h, w, b, t = make(4096, 32, 300, torch.float32, bias=True)
    loss, grads = loss_and_grads(fused, h, w, b, t, 0.1, chunk_rows=rows)
    want_loss, want = loss_and_grads(reference, h, w, b, t, 0.1)
    torch.testing.assert_close(loss, want_loss, rtol=1e-6, atol=0)
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_loss_of_no_targets_is_zero_and_its_gradients_zero():
    h, w, b, t = make(64, 16, 40, torch.float16, bias=True)
    loss, grads = loss_and_grads(fused, h, w, b, torch.full_like(t, IGNORE_INDEX), 0.1)
    assert loss.item() == 0.0
    assert all(g.abs().max().item() == 0.0 for g in grads)


def test_gradients_only_for_the_inputs_that_need_them():
    h, w, b, t = make(200, 16, 40, torch.float64, bias=True)
    _, (gh, gw, gb) = loss_and_grads(reference, h, w, b, t, 0.0)
    for needs in ((True, False, False), (False, True, False), (False, False, True)):
        leaves = [x.clone().requires_grad_(need) for x, need in zip((h, w, b), needs)]
        linear_cross_entropy(*leaves, t, chunk_rows=64).backward()
        for leaf, need, ref in zip(leaves, needs, (gh, gw, gb)):
            if need:
                torch.testing.assert_close(leaf.grad, ref)
            else:
                assert leaf.grad is None


def test_backward_twice_gives_the_same_gradients():
    # backward scales the saved gradients out of place: a retained graph gives them again.
    h, w, _, t = make(100, 16, 40, torch.bfloat16, bias=False)
    h.requires_grad_()
    loss = linear_cross_entropy(h, w, None, t)
    (first,) = torch.autograd.grad(loss * 8.0, h, retain_graph=True)
    (second,) = torch.autograd.grad(loss * 8.0, h)
    assert torch.equal(first, second)


def test_chunk_sizes_per_device(monkeypatch):
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 1000 * 40)
    assert loss_module.rows_per_chunk(40, "cpu") == 1000
    rows = loss_module.rows_per_chunk(50257, "cuda")  # GPT-2's vocabulary: thousands of rows
    assert rows >= 2048 and rows % 128 == 0 and 4 * rows * 50257 <= loss_module.GPU_CHUNK_BYTES
    assert loss_module.chunk_peak_bytes(50257, "cuda") <= 2 * loss_module.GPU_CHUNK_BYTES


# --- fp16 / bf16 with a loss scale --------------------------------------------------------------


def assert_16bit_close(got, ref, dtype, name):
    """`got` (from 16-bit inputs) against the float32 reference `ref` on the same, upcast inputs.

    u is the unit roundoff (2^-11 fp16, 2^-8 bf16). The gradients leave as the input dtype, so
    rounding the result alone costs up to u relative per entry (u / 2 in norm, as measured).
    Rounding the (c, V) logit gradient to 16 bits before the GEMMs adds an absolute error that
    scales with the terms summed, not with their possibly cancelling sum, so the entrywise bound
    has a term in u x rms(ref); a CPU's bf16 GEMMs round their result once more (2u relative).
    Measured at 16k rows: norm error <= 1.01u, entrywise excess over 2u |ref| <= 2.2u x rms.
    Saving the gradients in fp16 before the loss scale (the old design) gave 25u in norm and
    flushed 1.4% of grad_h to zero, entries up to 2% of rms: all three checks fail on it."""
    u = torch.finfo(dtype).eps / 2
    rms = ref.pow(2).mean().sqrt().item()
    flushed = ((got == 0) & (ref.abs() > 4 * u * rms)).sum().item()
    assert flushed == 0, f"{name}: {flushed} entries zeroed that the reference has"
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel <= 2 * u, f"{name}: relative error {rel:.2e} > 2u = {2 * u:.2e}"
    torch.testing.assert_close(got, ref, rtol=2 * u, atol=4 * u * rms, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    "n, bias, smoothing, rows",
    [
        (16384, False, 0.0, None),  # GPT: no bias; CPU chunks of 8192 rows at V = 512
        (16384, True, 0.1, 1000),  # partial last chunk
        (4096, True, 0.1, 4096),  # one chunk of the whole batch
        (4096, False, 0.0, 64),
    ],
)
def test_16bit_gradients_with_a_loss_scale_match_float32(dtype, n, bias, smoothing, rows):
    h, w, b, t = make(n, 64, 512, dtype, bias)
    loss, grads = loss_and_grads(fused, h, w, b, t, smoothing, scale=LOSS_SCALE, chunk_rows=rows)
    want_loss, want = loss_and_grads(
        reference, h, w, b, t, smoothing, dtype=torch.float32, scale=LOSS_SCALE
    )
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)  # float32 logits and log-softmax
    for name, got, ref in zip(("grad_h", "grad_w", "grad_b"), grads, want):
        assert_16bit_close(got, ref, dtype, name)


@pytest.mark.parametrize("mode", ["addmm", "mm"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_out_dtype_gemm_branches_emulated_on_cpu(mode, dtype, monkeypatch):
    # The CUDA branches (16-bit operands into GEMMs with float32 results) on a CPU: torch.mm and
    # torch.addmm given out_dtype stand in with float32 copies of the operands (exact products,
    # float32 accumulation, as cuBLAS), after CUDA's dtype checks. What this checks is the
    # branches' plumbing (transposes, out= slices, in-place accumulation, bias); numbers on a GPU
    # are the gpu tests' business.
    mm, addmm = torch.mm, torch.addmm
    calls = []

    def fake_mm(a, b, out_dtype=None, *, out=None):
        if out_dtype is None:
            return mm(a, b, out=out)
        assert (
            a.dtype == b.dtype
            and a.dtype in (torch.float16, torch.bfloat16)
            and out_dtype == torch.float32
        )
        assert out is None or out.dtype == out_dtype
        calls.append("mm")
        return mm(a.float(), b.float(), out=out)

    def fake_addmm(c, a, b, out_dtype=None, *, out=None):
        if out_dtype is None:
            return addmm(c, a, b, out=out)
        assert (
            a.dtype == b.dtype
            and a.dtype in (torch.float16, torch.bfloat16)
            and out_dtype == torch.float32
        )
        assert c.dtype in (out_dtype, a.dtype) and (out is None or out.dtype == out_dtype)
        assert mode == "addmm", "the 'mm' mode never calls addmm with out_dtype"
        calls.append("addmm")
        return addmm(c, a.float(), b.float(), out=out)

    monkeypatch.setattr(torch, "mm", fake_mm)
    monkeypatch.setattr(torch, "addmm", fake_addmm)
    monkeypatch.setitem(loss_module._OUT_DTYPE_GEMMS, "cpu", mode)
    h, w, b, t = make(2000, 32, 300, dtype, bias=True)
    loss, grads = loss_and_grads(fused, h, w, b, t, 0.1, scale=LOSS_SCALE, chunk_rows=300)
    want_loss, want = loss_and_grads(
        reference, h, w, b, t, 0.1, dtype=torch.float32, scale=LOSS_SCALE
    )
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for name, got, ref in zip(("grad_h", "grad_w", "grad_b"), grads, want):
        assert_16bit_close(got, ref, dtype, name)
    # 7 chunks: logits, grad_h and (in 'mm' mode) grad_w and grad_b through mm, else addmm
    assert calls.count("mm") == 7 * (2 if mode == "addmm" else 4) and calls.count(
        "addmm"
    ) == 7 * 2 * (mode == "addmm")
    with torch.no_grad():
        torch.testing.assert_close(fused(h, w, b, t, 0.1, chunk_rows=300), loss, rtol=0, atol=0)


# --- CUDA, GPT-2's shape ------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_cuda_runs_16bit_gemms_with_float32_accumulation():
    # Without out_dtype GEMMs the loss falls back to float32 copies of its operands: correct, slow.
    assert loss_module._out_dtype_gemms(torch.device("cuda")) == "addmm"


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_gpt2_shape_16bit_gradients_match_float32(dtype, monkeypatch):
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)  # a float32 reference
    n, c, v = 16384, 768, 50257
    h, w, _, t = make(n, c, v, dtype, bias=False, device="cuda")
    # CUDA chunks: several
    loss, (gh, gw) = loss_and_grads(fused, h, w, None, t, 0.0, scale=LOSS_SCALE)
    # The reference in float32, in chunks of rows to bound its (rows, V) logits: its loss is the
    # sum over chunks of summed losses / the number of scored rows.
    h32, w32 = h.float().requires_grad_(), w.float().requires_grad_()
    count = (t != IGNORE_INDEX).sum()
    want_loss = 0.0
    for start in range(0, n, 4096):
        part = (
            F.cross_entropy(
                F.linear(h32[start : start + 4096], w32),
                t[start : start + 4096],
                ignore_index=IGNORE_INDEX,
                reduction="sum",
            )
            / count
        )
        (part * LOSS_SCALE).backward()
        want_loss += part.item()
    torch.testing.assert_close(loss.item(), want_loss, rtol=1e-5, atol=0)
    assert_16bit_close(gh, h32.grad / LOSS_SCALE, dtype, "grad_h")
    assert_16bit_close(gw, w32.grad / LOSS_SCALE, dtype, "grad_w")


# --- the fused chunk (compiled on CUDA): the same loss and gradients -----------------------------


@pytest.mark.parametrize("padding", [0, 24])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize(
    "out_dtype, scale",
    [(torch.float32, 1.0), (torch.bfloat16, 1.0), (torch.float16, loss_module.FP16_GRAD_SCALE)],
)
def test_the_fusable_chunk_computes_what_the_eager_one_does(out_dtype, scale, smoothing, padding):
    """`_loss_and_logit_grad_fusable` (what inductor compiles on CUDA) run eagerly against the
    eager kernels on the unpadded logits: the chunk's loss to float32 rounding, the logit
    gradient to one rounding of `out_dtype`; with padding columns (garbage logits, as the zero
    rows of a padded weight would not give, to show they are masked) of gradient 0."""
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    logits = torch.randn(300, vocab + padding, generator=g) * 3
    targets = torch.randint(0, vocab, (300,), generator=g)
    keep = torch.rand(300, generator=g) > 0.2
    want_loss, want = loss_module._loss_and_logit_grad(
        logits[:, :vocab].clone(), targets, keep, smoothing, scale, out_dtype, vocab
    )
    for fn in (loss_module._loss_and_logit_grad_fusable, loss_module._loss_and_logit_grad):
        got_loss, got = fn(logits.clone(), targets, keep, smoothing, scale, out_dtype, vocab)
        assert got.dtype == want.dtype == out_dtype and got.shape == (300, vocab + padding)
        torch.testing.assert_close(got_loss, want_loss, rtol=1e-5, atol=0)
        u = torch.finfo(out_dtype).eps
        torch.testing.assert_close(
            got[:, :vocab].float() / scale, want.float() / scale, rtol=u, atol=1e-6
        )
        assert not got[:, vocab:].any()


def test_the_padded_vocabulary_is_a_multiple_where_the_compiled_chunk_is_meant_to_run(monkeypatch):
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_DEVICES", ("cuda",))
    monkeypatch.setattr(loss_module, "_FUSED", {})
    # a CPU's eager kernels: no padding
    assert loss_module.padded_vocab(50257, torch.device("cpu")) == 50257
    assert loss_module.padded_vocab(50257, torch.device("cuda")) == 50304
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_DEVICES", ("cpu", "cuda"))
    assert loss_module.padded_vocab(50257, torch.device("cpu")) == 50304
    assert loss_module.padded_vocab(8000, torch.device("cpu")) == 8064
    monkeypatch.setattr(loss_module, "PAD_VOCAB_MULTIPLE", 0)
    assert loss_module.padded_vocab(50257, torch.device("cpu")) == 50257


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_compiled_chunk_keeps_loss_and_gradients(dtype, monkeypatch):
    """The loss with its chunks compiled by inductor (as on CUDA; here on the CPU, by letting the
    CPU take that path) over a padded vocabulary (500 -> 512): the same checks as the eager
    path's, float32 to float32 tolerances, 16-bit gradients with a loss scale as close to float32
    as `assert_16bit_close` asks, a partial last chunk included (a second compiled shape)."""
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_DEVICES", ("cpu", "cuda"))
    monkeypatch.setattr(loss_module, "_FUSED", {})
    h, w, b, t = make(2500, 64, 500, dtype, bias=True)  # 500: padded to 512
    loss, grads = loss_and_grads(fused, h, w, b, t, 0.1, scale=LOSS_SCALE, chunk_rows=1000)
    assert "fn" in loss_module._FUSED and "failed" not in loss_module._FUSED, loss_module._FUSED
    want_loss, want = loss_and_grads(
        reference, h, w, b, t, 0.1, dtype=torch.float32, scale=LOSS_SCALE
    )
    torch.testing.assert_close(loss, want_loss, rtol=1e-5, atol=0)
    for name, got, ref in zip(("grad_h", "grad_w", "grad_b"), grads, want):
        if dtype == torch.float32:
            torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")
        else:
            assert_16bit_close(got, ref, dtype, name)


def test_the_eager_fallback_masks_the_padding_too(monkeypatch):
    """Where compiling the chunk failed, the eager kernels run over the padded projection: the
    same loss and gradients as the unpadded eager path, in float64 to its tolerances."""
    monkeypatch.setattr(loss_module, "FUSED_CHUNK_DEVICES", ("cpu",))
    monkeypatch.setattr(loss_module, "_FUSED", {"failed": "as if inductor could not compile here"})
    h, w, b, t = make(300, 16, 40, torch.float64, bias=True)
    assert loss_module.padded_vocab(40, torch.device("cpu")) == 128
    got = loss_and_grads(fused, h, w, b, t, 0.1, scale=2.5, chunk_rows=64)
    want = loss_and_grads(reference, h, w, b, t, 0.1, scale=2.5)
    torch.testing.assert_close(got, want)
