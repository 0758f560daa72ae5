"""The losses of the three models, and the ignore index of their labels.

The design and its reasons: docs/design.md#modellosspy.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

IGNORE_INDEX = -100  # the label torch's cross_entropy ignores by default
# CPU: float logits per chunk: 16 MiB, about what stays in a CPU's cache hierarchy
CHUNK_ELEMENTS = 1 << 22
# other devices: bytes of one chunk's float32 logits: 512 MiB, 2,560 rows at V = 50,257
GPU_CHUNK_BYTES = 1 << 29
# |d loss / d logit| <= 1 per row, so at most 2^14 after scaling: fp16 holds up to 65,504
FP16_GRAD_SCALE = 2.0**14

_LOW_PRECISION = (torch.float16, torch.bfloat16)
# device type -> which 16-bit GEMMs with float32 output it has (`_out_dtype_gemms`)
_OUT_DTYPE_GEMMS: dict = {}


def cross_entropy(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy of logits (..., V) over labels (...) that are not IGNORE_INDEX; 0 (not
    NaN) when there are none."""
    total = F.cross_entropy(
        # a bf16 log-softmax over the vocabulary loses precision
        logits.reshape(-1, logits.shape[-1]).float(),
        labels.reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
        label_smoothing=label_smoothing,
    )
    return total / (labels != IGNORE_INDEX).sum().clamp(min=1)


def rows_per_chunk(vocab_size: int, device: torch.device | str) -> int:
    """Rows per chunk of `linear_cross_entropy` on `device` (docs/design.md#modellosspy)."""
    if torch.device(device).type == "cpu":
        return max(64, CHUNK_ELEMENTS // vocab_size)
    return max(128, GPU_CHUNK_BYTES // (4 * vocab_size) // 128 * 128)


def chunk_peak_bytes(vocab_size: int, device: torch.device | str) -> int:
    """The transient memory of one chunk: its float32 logits and their
    log-softmax, live together."""
    return 8 * rows_per_chunk(vocab_size, device) * vocab_size


def _out_dtype_gemms(device: torch.device) -> str:
    """Which GEMMs of 16-bit operands give a float32 result on `device` in this torch: 'addmm'
    (`mm` with `out_dtype`, and `addmm` accumulating in place into a float32 matrix), 'mm' (the
    first only) or '' (neither: a CPU, or a torch before `out_dtype`). Probed once per device type,
    never while torch.compile traces (its fake tensors accept calls the real kernels refuse)."""
    if torch.compiler.is_compiling():
        return _OUT_DTYPE_GEMMS.get(device.type, "")
    if device.type not in _OUT_DTYPE_GEMMS:
        a = torch.ones(8, 8, dtype=torch.bfloat16, device=device)
        c = torch.zeros(8, 8, device=device)
        found = ""
        try:  # the errors: no such keyword, a dtype check, no kernel for the device
            torch.mm(a, a, out_dtype=torch.float32)
            found = "mm"
            torch.addmm(c, a, a, out_dtype=torch.float32, out=c)
            found = "addmm"
        except (TypeError, RuntimeError, NotImplementedError):
            pass
        _OUT_DTYPE_GEMMS[device.type] = found
    return _OUT_DTYPE_GEMMS[device.type]


class _Gemms:
    """The GEMMs of one call, with results in the accumulation dtype `acc` (float32, or float64
    for float64 inputs). `mode` says how they get there from the inputs' dtype:

    - 'native': the inputs are in `acc` already (float32 or float64).
    - 'addmm' / 'mm': 16-bit operands into GEMMs with float32 output and accumulator (CUDA);
      'addmm' also accumulates the weight gradient in place, 'mm' adds each chunk's product.
    - 'bf16': bf16 on a CPU, which has no bf16 GEMM with float32 output but a fast one with bf16
      output (twice the float32 rate here): the two gradient GEMMs run in bf16 and their (c, C)
      and (V, C) results are rounded to bf16 before float32 takes over; the logits, which the
      loss and softmax are sensitive to, come from float32 copies of the operands.
    - 'upcast': operands cast to float32 first: fp16 on a CPU, where fp16 GEMMs are slow, and
      either 16-bit dtype on a device without `out_dtype` GEMMs (a torch before they came).
    """

    def __init__(self, h: Tensor, weight: Tensor, bias: Optional[Tensor]):
        self.acc = torch.promote_types(h.dtype, torch.float32)
        self.bias = bias
        if h.dtype not in _LOW_PRECISION:
            self.mode = "native"
        else:
            self.mode = _out_dtype_gemms(h.device) or (
                "bf16" if h.dtype == torch.bfloat16 and h.device.type == "cpu" else "upcast"
            )
        # as the gradient GEMMs and the logits GEMM take it
        self.weight = self.logits_weight = weight
        if self.mode in ("bf16", "upcast"):  # one cast per call, not per chunk
            self.logits_weight = weight.to(self.acc)
            self.bias = None if bias is None else bias.to(self.acc)
            if self.mode == "upcast":
                self.weight = self.logits_weight

    def logits(self, hc: Tensor) -> Tensor:
        """The logits (c, V) in `acc` of the rows hc (c, C)."""
        if self.mode in ("addmm", "mm"):
            logits = torch.mm(hc, self.weight.t(), out_dtype=self.acc)
            if self.bias is not None:
                logits += self.bias
            return logits
        return F.linear(hc.to(self.acc), self.logits_weight, self.bias)

    def log_probs(self, hc: Tensor) -> Tensor:
        """Log-softmax (c, V) in `acc` of the logits of the rows hc (c, C)."""
        return torch.log_softmax(self.logits(hc), dim=-1)  # one fused kernel

    def mm(self, a: Tensor, b: Tensor, out: Tensor) -> None:
        """out = a @ b, out in `acc`, a and b in the inputs' dtype (b the weight
        as `self.weight`)."""
        if self.mode in ("addmm", "mm"):
            torch.mm(a, b, out_dtype=self.acc, out=out)
        elif self.mode == "bf16":
            out.copy_(torch.mm(a, b))
        else:
            torch.mm(a.to(self.acc), b, out=out)

    def addmm_(self, c: Tensor, a: Tensor, b: Tensor) -> None:
        """c += a @ b in place, c in `acc`, a and b in the inputs' dtype."""
        if self.mode == "addmm":
            torch.addmm(c, a, b, out_dtype=self.acc, out=c)
        elif self.mode == "mm":
            c += torch.mm(a, b, out_dtype=self.acc)
        elif self.mode == "bf16":
            c += torch.mm(a, b)
        else:
            # out=c, not c.addmm_: the same GEMM in place, and FLOP counters (torch's
            # FlopCounterMode, the MFU check in tests/model/test_flops.py) count aten.addmm, not
            # addmm_.
            torch.addmm(c, a.to(self.acc), b.to(self.acc), out=c)


def _chunk_loss(
    logp: Tensor, targets: Tensor, keep: Tensor, label_smoothing: float, vocab: int
) -> Tensor:
    """Summed loss of the kept rows of float log-probabilities (c, V'), of which the first `vocab`
    columns are the vocabulary (the rest padding, `PAD_VOCAB_MULTIPLE`)."""
    nll = -logp.gather(1, targets[:, None]).squeeze(1)  # (c,)
    if label_smoothing:
        # The target distribution (1 - e) one-hot + e / V, as in F.cross_entropy.
        nll = (1.0 - label_smoothing) * nll - label_smoothing * logp[:, :vocab].mean(dim=-1)
    return (nll * keep).sum()


def _loss_and_logit_grad(
    logits: Tensor,
    targets: Tensor,
    keep: Tensor,
    label_smoothing: float,
    scale: float,
    out_dtype: torch.dtype,
    vocab: int,
) -> tuple[Tensor, Tensor]:
    """One chunk's summed loss over its kept rows, and the gradient of its logits (c, V') times
    `scale`, in `out_dtype`: softmax - (1 - e) one-hot - e / V per row, before the 1 / count;
    columns from `vocab` on are padding, of probability and gradient 0. Eager kernels, in place
    where they can be (the logits are the caller's last reference)."""
    padded = logits.shape[-1] > vocab
    if padded:
        logits[:, vocab:] = -math.inf
    grad = torch.log_softmax(logits, dim=-1)
    del logits
    total = _chunk_loss(grad, targets, keep, label_smoothing, vocab)
    grad.exp_()
    grad[torch.arange(len(targets), device=grad.device), targets] -= 1.0 - label_smoothing
    if out_dtype == grad.dtype and scale == 1.0:
        if label_smoothing:
            grad[:, :vocab] -= label_smoothing / vocab
        return total, grad
    g = torch.empty_like(grad, dtype=out_dtype)  # scaled, smoothed and rounded in one pass
    if label_smoothing:
        torch.add(grad.new_full((), -label_smoothing / vocab * scale), grad, alpha=scale, out=g)
        if padded:
            g[:, vocab:] = 0
    else:
        torch.mul(grad, scale, out=g)
    return total, g


def _loss_and_logit_grad_fusable(
    logits: Tensor,
    targets: Tensor,
    keep: Tensor,
    label_smoothing: float,
    scale: float,
    out_dtype: torch.dtype,
    vocab: int,
) -> tuple[Tensor, Tensor]:
    """`_loss_and_logit_grad` written for inductor, which fuses it into a reduction over each row
    (max and sum of exponentials) and one element-wise pass that writes the 16-bit gradient:
    the float32 logits are read about three times and nothing of their size is written, where
    the eager kernels write and read a log-softmax and its exponential in float32 as well."""
    column = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    real = column < vocab
    logits = torch.where(real, logits, -math.inf)
    peak = logits.amax(dim=-1, keepdim=True)
    lse = peak + torch.log(torch.exp(logits - peak).sum(dim=-1, keepdim=True))  # (c, 1)
    nll = (lse - logits.gather(1, targets[:, None])).squeeze(1)  # (c,)
    if label_smoothing:
        mean = torch.where(real, logits, 0.0).sum(dim=-1) / vocab
        nll = (1.0 - label_smoothing) * nll - label_smoothing * (mean - lse.squeeze(1))
    total = (nll * keep).sum()
    smooth = torch.where(real, label_smoothing / vocab, 0.0)
    grad = torch.exp(logits - lse) - (1.0 - label_smoothing) * (column == targets[:, None]) - smooth
    return total, (grad * scale).to(out_dtype)


# Where a chunk runs as one compiled kernel pair (`_loss_and_logit_grad_fusable`): CUDA, where
# the passes over the (c, V) float32 logits are memory-bound (~18 GB per 16 x 1024 micro batch
# at V = 50,257 in eager kernels). A CPU keeps the eager kernels: inductor's C++ build costs
# seconds per process, more than the passes cost at the sizes a CPU trains.
FUSED_CHUNK_DEVICES = ("cuda",)
_FUSED: dict = {}  # "fn": the compiled function; "failed": why it could not be used
# There, the projection's weight is padded with zero rows to a multiple of this
# (GPT-2's 50,257 -> 50,304) and the padding's logits masked to -inf: cuBLAS's fast 16-bit GEMMs
# want every leading dimension a multiple of 8 elements, and the (rows, V) logits and their
# gradient have V as theirs. The model's vocabulary and its state dict are unchanged.
PAD_VOCAB_MULTIPLE = 128


def padded_vocab(vocab: int, device: torch.device) -> int:
    """The width of the logits chunks on `device`: padded where the compiled chunk is meant to run
    (also when compiling failed there: the eager kernels mask the padding as well), else `vocab`."""
    if not PAD_VOCAB_MULTIPLE or device.type not in FUSED_CHUNK_DEVICES:
        return vocab
    return -(-vocab // PAD_VOCAB_MULTIPLE) * PAD_VOCAB_MULTIPLE


def _chunk_function(device: torch.device):
    """The chunk function for `device`: compiled where FUSED_CHUNK_DEVICES says, else eager; eager
    too inside another compilation (it inlines there) and once compiling has failed."""
    if (
        device.type not in FUSED_CHUNK_DEVICES
        or "failed" in _FUSED
        or torch.compiler.is_compiling()
    ):
        return _loss_and_logit_grad
    if "fn" not in _FUSED:
        _FUSED["fn"] = torch.compile(_loss_and_logit_grad_fusable, fullgraph=True)
    return _FUSED["fn"]


def _run_chunk(logits: Tensor, *args) -> tuple[Tensor, Tensor]:
    fn = _chunk_function(logits.device)
    if fn is _loss_and_logit_grad:
        # handed over without a reference left here, so the eager kernels free it early
        box = [logits]
        del logits
        return fn(box.pop(), *args)
    try:
        return fn(logits, *args)
    # inductor or Triton unusable here (no compiler, an old driver): eager kernels
    except Exception as err:
        _FUSED["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        import warnings

        warnings.warn(
            f"model.loss: the compiled loss chunk failed ({_FUSED['failed']}); using eager kernels"
        )
        return _loss_and_logit_grad(logits, *args)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        h: Tensor,
        weight: Tensor,
        bias: Optional[Tensor],
        targets: Tensor,
        label_smoothing: float,
        rows: int,
    ) -> Tensor:
        # h (N, C), weight (V, C), bias (V,) or None, targets (N,) with IGNORE_INDEX ignored.
        vocab = weight.shape[0]
        width = padded_vocab(vocab, h.device)
        if width > vocab:  # zero rows: the padding's logits are masked, its gradient rows dropped
            weight = F.pad(weight, (0, 0, 0, width - vocab))
            bias = None if bias is None else F.pad(bias, (0, width - vocab))
        gemms = _Gemms(h, weight, bias)
        acc = gemms.acc
        valid = targets != IGNORE_INDEX  # (N,)
        count = valid.sum().clamp(min=1)
        safe = targets.clamp(min=0)
        # The logit gradient goes into the GEMMs times `scale`, and every row with weight `keep`
        # (0 or 1); 1 / (count * scale) and the row weights of grad_h are applied in backward.
        low = h.dtype in _LOW_PRECISION
        scale = FP16_GRAD_SCALE if h.dtype == torch.float16 else 1.0
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        grad_h = torch.empty(h.shape, dtype=acc, device=h.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        grad_b = (
            torch.zeros(width, dtype=acc, device=weight.device)
            if bias is not None and need_b
            else None
        )
        total = h.new_zeros((), dtype=acc)
        for start in range(0, h.shape[0], rows):
            stop = start + rows
            hc, tc, kc = h[start:stop], safe[start:stop], valid[start:stop]
            # d loss / d logits = softmax - (1 - e) one-hot - e / V for each kept row (/ count in
            # backward), in the input dtype for 16-bit inputs; the float32 logits are gone after.
            chunk_loss, g = _run_chunk(
                gemms.logits(hc), tc, kc, label_smoothing, scale, h.dtype if low else acc, vocab
            )
            total += chunk_loss
            if grad_h is not None:
                gemms.mm(g, gemms.weight, out=grad_h[start:stop])  # (c, C)
            if grad_w is not None:  # ignored rows are zeroed on the narrow (c, C) factor
                gemms.addmm_(grad_w, g.t(), hc * kc[:, None].to(hc.dtype))  # (V, C)
            if grad_b is not None:
                gemms.addmm_(grad_b[None], kc[None].to(g.dtype), g)  # (1, V)
            del g
        if width > vocab:
            grad_w = None if grad_w is None else grad_w[:vocab]
            grad_b = None if grad_b is None else grad_b[:vocab]
        inv = 1.0 / (count.to(acc) * scale)
        ctx.dtypes = (h.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.save_for_backward(grad_h, grad_w, grad_b, valid.to(acc)[:, None] * inv, inv)
        return total / count

    @staticmethod
    def backward(ctx, grad_loss: Tensor):
        grad_h, grad_w, grad_b, row_factor, inv = ctx.saved_tensors
        h_dtype, w_dtype, b_dtype = ctx.dtypes

        def scaled(grad: Optional[Tensor], factor: Tensor, dtype: torch.dtype) -> Optional[Tensor]:
            # One pass: the float product (loss scale included) rounded once to the input's dtype.
            return (
                None
                if grad is None
                else torch.mul(grad, factor, out=torch.empty_like(grad, dtype=dtype))
            )

        factor = inv * grad_loss
        return (
            scaled(grad_h, row_factor * grad_loss, h_dtype),
            scaled(grad_w, factor, w_dtype),
            scaled(grad_b, factor, b_dtype),
            None,
            None,
            None,
        )


def linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    bias: Optional[Tensor],
    targets: Tensor,
    label_smoothing: float = 0.0,
    *,
    chunk_rows: Optional[int] = None,
) -> Tensor:
    """Mean cross-entropy of `F.linear(h, weight, bias)` against `targets` over the rows whose
    target is not IGNORE_INDEX (0 when there are none), as `cross_entropy` gives for the same
    logits. h (..., C), targets (...); `chunk_rows` overrides the device's chunk size."""
    h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)  # (N, C), (N,)
    rows = chunk_rows or rows_per_chunk(weight.shape[0], h.device)
    if torch.is_grad_enabled() and (
        h.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)
    ):
        return _LinearCrossEntropy.apply(h, weight, bias, targets, label_smoothing, rows)
    gemms = _Gemms(h, weight, bias)
    valid = targets != IGNORE_INDEX
    safe = targets.clamp(min=0)
    total = h.new_zeros((), dtype=gemms.acc)
    for start in range(0, h.shape[0], rows):
        logp = gemms.log_probs(h[start : start + rows])
        total += _chunk_loss(
            logp,
            safe[start : start + rows],
            valid[start : start + rows],
            label_smoothing,
            weight.shape[0],
        )
    return total / valid.sum().clamp(min=1)


class LMHead(nn.Linear):
    """The projection onto the vocabulary: logits without targets, the loss with them."""

    def forward(
        self, h: Tensor, targets: Optional[Tensor] = None, label_smoothing: float = 0.0
    ) -> Tensor:
        if targets is None:
            return super().forward(h)  # (..., V)
        return linear_cross_entropy(h, self.weight, self.bias, targets, label_smoothing)
