"""Decoding with a key/value cache: greedy and sampling for GPT, greedy and beam search for Seq2Seq.

Sampling: temperature, top-k (Fan et al. 2018) and top-p / nucleus (Holtzman et al. 2020).
Beam search follows fairseq's `SequenceGenerator` in its steps: each step keeps the 2K best
extensions, a hypothesis that ends with </s> among the K best is finished with score
sum(log p) / length ** length_penalty (length counts </s>), the others stay alive; at
`max_len` the alive ones finish too. It stops as Hugging Face's `BeamHypotheses` does: a source
is done once it holds K finished hypotheses and the best alive beam, normalized at its current
length, no longer beats the worst of them. fairseq's "done at K finished" let early, weak </s>
endings end the search (on the tiny translation test: beam 4 BLEU 87 where greedy gave 99).

`max_len_a` / `max_len_b` give each source its own limit, min(max_len, a x its length + b)
(fairseq's options of those names), at which its decoding stops as it does at `max_len`: a
hypothesis caught in a repetition loop is cut there rather than running on to `max_len`.

Every step runs the model on every row, finished or not. With `synced=True` a loop also runs
its maximum number of steps whatever the data, so that under ZeRO-3, where each forward
gathers parameters from all ranks, no rank stops early and leaves the others waiting
(transformers#20130; Hugging Face's `synced_gpus`). Decoding is deterministic: the model is
put in eval mode for the call, and sampling draws only from the `generator` given.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.cache import KVCache

if TYPE_CHECKING:
    from model.gpt import GPT
    from model.seq2seq import Seq2Seq


class Hypotheses(NamedTuple):
    """Seq2Seq output: one hypothesis per source, without <s> and </s>."""

    tokens: Tensor  # (B, L) long, padded with pad_id after each row's `lengths` tokens
    lengths: Tensor  # (B,) long
    scores: Tensor  # (B,) float: sum of log-probabilities (with </s>) / length ** length_penalty


@contextlib.contextmanager
def _eval_mode(model: nn.Module):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def choose_next(
    logits: Tensor,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: Optional[torch.Generator] = None,
) -> Tensor:
    """The next token of each row (B,) from logits (B, V): argmax, or a filtered sample."""
    if not do_sample:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)  # (B, V)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass;
        # the most likely token is therefore always kept.
        drop = probs.cumsum(dim=-1) - probs > top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)  # (B, V)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def _check_sampling(temperature: float, top_k: int, top_p: float) -> None:
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")


def _extend(
    step: Callable[[Tensor], Tensor],
    logits: Tensor,
    max_steps: int,
    pick: Callable[[Tensor], Tensor],
    eos_id: Optional[int],
    pad_id: int,
    synced: bool,
    limits: Optional[Tensor] = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Append one token per row per step; `step(token (B,))` returns the next logits (B, V).

    Returns tokens (B, n) with pad_id after a row's </s>, lengths (B,) counting </s>, and
    summed log-probabilities (B,).
    """
    B = logits.shape[0]
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    lengths = torch.zeros(B, dtype=torch.long, device=logits.device)
    scores = torch.zeros(B, device=logits.device)
    tokens = []
    limits = None if limits is None else limits.to(logits.device)
    for i in range(max_steps):
        token = pick(logits)  # (B,)
        logp = F.log_softmax(logits.float(), dim=-1).gather(1, token[:, None]).squeeze(1)  # (B,)
        scores += logp.masked_fill(done, 0.0)
        lengths += (~done).long()
        token = token.masked_fill(done, pad_id)
        tokens.append(token)
        if eos_id is not None:
            done |= token == eos_id
        if limits is not None:
            # a row's own limit (max_len_a/b) acts as max_steps does for all
            done |= limits == i + 1
        if i + 1 == max_steps or (not synced and bool(done.all())):
            break
        logits = step(token)
    return torch.stack(tokens, dim=1), lengths, scores


@torch.no_grad()
def generate_causal(
    model: "GPT",
    input_ids: Tensor,
    attention_mask: Optional[Tensor] = None,
    *,
    max_new_tokens: int = 32,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    eos_id: Optional[int] = None,
    generator: Optional[torch.Generator] = None,
    synced: bool = False,
) -> Tensor:
    """Continue each prompt; returns (B, T + n) = the prompts followed by n <= max_new_tokens
    new tokens, </s> included and pad_id after it.

    Prompts of different lengths are left-padded, with attention_mask (B, T) 0 on the pads.
    Without eos_id, or with synced=True, exactly max_new_tokens tokens are generated;
    otherwise the loop stops once every row has produced eos_id.
    """
    _check_sampling(temperature, top_k, top_p)
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    B, T = input_ids.shape
    if T + max_new_tokens > model.cfg.max_seq_len:
        raise ValueError(
            f"prompt ({T}) + max_new_tokens ({max_new_tokens}) exceeds "
            f"max_seq_len={model.cfg.max_seq_len}"
        )
    cache = KVCache(len(model.blocks))
    mask = attention_mask

    def step(token: Tensor) -> Tensor:
        nonlocal mask
        if mask is not None:
            mask = torch.cat([mask, mask.new_ones(B, 1)], dim=1)  # (B, past + 1)
        return model(token[:, None], mask, cache=cache).logits[:, -1]  # (B, V)

    def pick(logits: Tensor) -> Tensor:
        return choose_next(logits, do_sample, temperature, top_k, top_p, generator)

    with _eval_mode(model):
        logits = model(input_ids, mask, cache=cache).logits[:, -1]  # (B, V)
        new, _, _ = _extend(step, logits, max_new_tokens, pick, eos_id, model.cfg.pad_id, synced)
    return torch.cat([input_ids, new], dim=1)


@torch.no_grad()
def generate_seq2seq(
    model: "Seq2Seq",
    src_ids: Tensor,
    src_mask: Optional[Tensor] = None,
    *,
    max_len: int = 128,
    beam_size: int = 1,
    length_penalty: float = 1.0,
    synced: bool = False,
    max_len_a: float = 0.0,
    max_len_b: int = 0,
) -> Hypotheses:
    """Translate src_ids (B, S): greedy when beam_size is 1, beam search otherwise.

    The encoder runs once; the decoder starts from <s> and emits at most max_len tokens,
    </s> included. With synced=True it runs exactly max_len decoder steps.
    """
    cfg = model.decoder.cfg
    if not 1 <= max_len <= cfg.max_seq_len:
        raise ValueError(
            f"max_len={max_len}: must be in [1, the decoder's max_seq_len={cfg.max_seq_len}]"
        )
    if beam_size < 1 or 2 * beam_size > cfg.vocab_size:
        raise ValueError(f"beam_size={beam_size}: must be >= 1 and at most vocab_size / 2")
    limits = row_limits(src_ids, src_mask, max_len, max_len_a, max_len_b)
    with _eval_mode(model):
        memory = model.encoder(src_ids, src_mask)  # (B, S, C)
        if beam_size == 1:
            return _greedy(model, memory, src_mask, max_len, length_penalty, synced, limits)
        return _beam_search(
            model, memory, src_mask, beam_size, max_len, length_penalty, synced, limits
        )


def row_limits(
    src_ids: Tensor, src_mask: Optional[Tensor], max_len: int, a: float, b: int
) -> Optional[Tensor]:
    """Each source's own limit, min(max_len, floor(a * source length + b)) and at least 1
    (fairseq's max_len_a / max_len_b; the source length counts its </s>); None
    when a and b are 0."""
    if a < 0 or b < 0:
        raise ValueError(f"max_len_a={a}, max_len_b={b}: must be >= 0")
    if a == 0 and b == 0:
        return None
    lengths = (
        src_mask.sum(dim=1)
        if src_mask is not None
        else torch.full((src_ids.shape[0],), src_ids.shape[1])
    )
    return (lengths.double() * a + b).floor().long().clamp(1, max_len).cpu()


def _greedy(
    model: "Seq2Seq",
    memory: Tensor,
    src_mask: Optional[Tensor],
    max_len: int,
    length_penalty: float,
    synced: bool,
    limits: Optional[Tensor] = None,
) -> Hypotheses:
    cfg = model.decoder.cfg
    cache = KVCache(len(model.decoder.blocks))

    def step(token: Tensor) -> Tensor:
        return model.decoder(
            token[:, None], memory=memory, memory_mask=src_mask, cache=cache
        ).logits[:, -1]

    bos = torch.full((memory.shape[0],), cfg.bos_id, dtype=torch.long, device=memory.device)
    tokens, lengths, scores = _extend(
        step, step(bos), max_len, lambda x: x.argmax(-1), cfg.eos_id, cfg.pad_id, synced, limits
    )
    scores = scores / lengths.float() ** length_penalty
    lengths = lengths - (tokens == cfg.eos_id).any(dim=1).long()  # </s> is not returned
    tokens = tokens.masked_fill(tokens == cfg.eos_id, cfg.pad_id)[:, : max(1, int(lengths.max()))]
    return Hypotheses(tokens, lengths, scores)


def _beam_search(
    model: "Seq2Seq",
    memory: Tensor,
    src_mask: Optional[Tensor],
    K: int,
    max_len: int,
    length_penalty: float,
    synced: bool,
    limits: Optional[Tensor] = None,
) -> Hypotheses:
    cfg = model.decoder.cfg
    B, V, device = memory.shape[0], cfg.vocab_size, memory.device
    limit = [max_len] * B if limits is None else limits.tolist()
    memory = memory.repeat_interleave(K, dim=0)  # (B*K, S, C): beams of a source are adjacent rows
    src_mask = None if src_mask is None else src_mask.repeat_interleave(K, dim=0)  # (B*K, S)
    cache = KVCache(len(model.decoder.blocks))
    token = torch.full((B * K,), cfg.bos_id, dtype=torch.long, device=device)
    prefixes = torch.empty(B * K, 0, dtype=torch.long, device=device)  # tokens after <s>
    # All beams start as the same <s>: only the first may extend at step 0.
    scores = torch.full((B, K), float("-inf"), device=device)
    scores[:, 0] = 0.0
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(B)]  # (score, tokens)
    done = torch.zeros(B, dtype=torch.bool)

    for step in range(max_len):
        logits = model.decoder(
            token[:, None], memory=memory, memory_mask=src_mask, cache=cache
        ).logits[:, -1]
        logp = F.log_softmax(logits.float(), dim=-1).view(B, K, V)
        length = step + 1
        # (B, 2K), best first
        top, flat = (scores[:, :, None] + logp).view(B, K * V).topk(2 * K, dim=1)
        beam, tok = flat // V, flat % V
        is_eos = tok == cfg.eos_id
        ended = is_eos[:, :K] & top[:, :K].isfinite() & ~done[:, None].to(device)
        for b, j in ended.nonzero().tolist():
            hypothesis = prefixes[b * K + beam[b, j]].tolist()
            finished[b].append((top[b, j].item() / length**length_penalty, hypothesis))
        # The K best extensions that do not end stay alive (there are at least K of 2K,
        # since each beam has only one </s>); a stable sort keeps them in score order.
        alive = is_eos.int().argsort(dim=1, stable=True)[:, :K]  # (B, K)
        beam, tok, scores = beam.gather(1, alive), tok.gather(1, alive), top.gather(1, alive)
        rows = (torch.arange(B, device=device)[:, None] * K + beam).view(-1)  # (B*K,)
        prefixes = torch.cat([prefixes[rows], tok.view(-1, 1)], dim=1)
        cache.reorder(rows)
        token = tok.view(-1)
        for b in range(B):
            hypotheses = finished[b]
            if not done[b] and length == limit[b] < max_len:
                # Its own limit (max_len_a/b) acts as max_len does for all: the live beams finish.
                _finish_alive(hypotheses, scores[b], prefixes[b * K : (b + 1) * K], length_penalty)
                done[b] = True
                continue
            if done[b] or len(hypotheses) < K:
                continue
            hypotheses.sort(key=lambda h: -h[0])
            del hypotheses[K:]
            # Hugging Face's stopping rule, not fairseq's "K have ended": an early </s>
            # must not end the search while a live beam, normalized at its current length,
            # still scores above the worst kept hypothesis.
            best_alive = scores[b, 0].item() / length**length_penalty
            done[b] = hypotheses[-1][0] >= best_alive
        if not synced and bool(done.all()):
            break

    for b in range(B):
        if not done[b]:
            _finish_alive(finished[b], scores[b], prefixes[b * K : (b + 1) * K], length_penalty)
    best = [max(f, key=lambda h: h[0]) for f in finished]
    lengths = torch.tensor([len(h[1]) for h in best], dtype=torch.long, device=device)
    tokens = torch.full(
        (B, max(1, int(lengths.max()))), cfg.pad_id, dtype=torch.long, device=device
    )
    for b, (_, hypothesis) in enumerate(best):
        tokens[b, : len(hypothesis)] = torch.tensor(hypothesis, dtype=torch.long)
    scores = torch.tensor([h[0] for h in best], device=device)
    return Hypotheses(tokens, lengths, scores)


def _finish_alive(finished: list, scores: Tensor, prefixes: Tensor, length_penalty: float) -> None:
    """Add a source's live beams, scores (K,) and prefixes (K, L), to its finished hypotheses,
    as they stand: at the length limit they end without </s>."""
    for raw, prefix in zip(scores.tolist(), prefixes.tolist()):
        if raw > float("-inf"):
            finished.append((raw / len(prefix) ** length_penalty, prefix))
