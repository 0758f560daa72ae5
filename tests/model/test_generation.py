"""Generation: cached decoding equals recomputation, batching and left padding change
nothing, beam size 1 equals greedy, beam scores match the model's own log-probabilities,
sampling is reproducible, and synced loops always run their full number of steps."""

import contextlib
import copy

import pytest
import torch

from model import ModelConfig, StackConfig, build_model
from model.generation import _beam_search, choose_next, row_limits

V = 40
PAD, BOS, EOS = 0, 2, 3


def tiny(arch: str, **overrides) -> ModelConfig:
    base = dict(
        arch=arch,
        vocab_size=V,
        d_model=32,
        n_layers=2,
        n_heads=4,
        d_ff=64,
        max_seq_len=32,
        dropout=0.1,
    )
    return ModelConfig(**{**base, **overrides})


def ids(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(5, V, shape, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_model(tiny("gpt"))


@pytest.fixture(scope="module", params=["pre", "post"])
def seq2seq(request):
    torch.manual_seed(0)
    # A mixed model, as warm starting makes it: post-LN BERT-like encoder, chosen decoder.
    cfg = tiny(
        "seq2seq",
        encoder=StackConfig(norm_position="post"),
        decoder=StackConfig(norm_position=request.param),
    )
    return build_model(cfg)


def ending_early(model, scale: float = 0.03):
    """A copy of `model` that grows likelier to emit </s> with each decoder position, so that
    hypotheses end at different lengths before max_len (an untrained model rarely ends)."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        eos = model.decoder.embed.tok.weight[EOS]
        positions = torch.arange(model.decoder.cfg.max_seq_len, dtype=torch.float32)[:, None]
        model.decoder.embed.pos.weight += scale * positions * eos / eos.norm()
    return model


@contextlib.contextmanager
def counting(module: torch.nn.Module):
    """Count the module's forward calls while the block runs."""
    calls = []
    handle = module.register_forward_hook(lambda *_: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


@contextlib.contextmanager
def eos_bonus(lm_head: torch.nn.Module, rows=slice(None), bonus: float = 100.0):
    """Add `bonus` to the </s> logit of batch rows `rows` while the block runs."""

    def hook(_module, _inputs, logits):
        logits = logits.clone()
        logits[rows, :, EOS] += bonus
        return logits

    handle = lm_head.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


# --- GPT ------------------------------------------------------------------------------------


def test_gpt_cached_greedy_equals_recomputation(gpt):
    prompt = ids(2, 5)
    out = gpt.generate(prompt, max_new_tokens=8)
    gpt.eval()
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, gpt(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_generate_restores_training_mode(gpt):
    gpt.train()
    gpt.generate(ids(1, 3), max_new_tokens=2)
    assert gpt.training


def test_gpt_left_padded_batch_equals_each_prompt_alone(gpt):
    short, long = ids(1, 3, seed=1), ids(1, 6, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    out = gpt.generate(batch, mask, max_new_tokens=6)
    assert torch.equal(out[0, 6:], gpt.generate(short, max_new_tokens=6)[0, 3:])
    assert torch.equal(out[1], gpt.generate(long, max_new_tokens=6)[0])


def test_gpt_sampling_is_reproducible_and_seeded(gpt):
    prompt = ids(3, 4)

    def sample(seed, **kw):
        return gpt.generate(
            prompt,
            max_new_tokens=10,
            do_sample=True,
            generator=torch.Generator().manual_seed(seed),
            **kw,
        )

    assert torch.equal(sample(1), sample(1))
    assert not torch.equal(sample(1), sample(2))
    assert torch.equal(
        sample(1, temperature=0.7, top_k=5, top_p=0.9),
        sample(1, temperature=0.7, top_k=5, top_p=0.9),
    )


def test_gpt_top_k_1_and_tiny_top_p_equal_greedy(gpt):
    prompt = ids(3, 4)
    greedy = gpt.generate(prompt, max_new_tokens=8)
    for kw in (dict(top_k=1), dict(top_p=1e-6), dict(top_k=1, temperature=5.0)):
        sampled = gpt.generate(
            prompt,
            max_new_tokens=8,
            do_sample=True,
            generator=torch.Generator().manual_seed(0),
            **kw,
        )
        assert torch.equal(sampled, greedy), kw


def test_choose_next_filters_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    gen = torch.Generator().manual_seed(0)
    draws = {choose_next(logits, True, top_k=2, generator=gen).item() for _ in range(200)}
    assert draws == {0, 1}
    draws = {choose_next(logits, True, top_p=0.85, generator=gen).item() for _ in range(300)}
    assert draws == {0, 1, 2}  # 0.5 + 0.3 < 0.85, so the third token is still needed


def test_gpt_stops_at_eos_and_pads_finished_rows(gpt):
    prompt = ids(2, 4)
    with eos_bonus(gpt.lm_head, rows=[0]):
        out = gpt.generate(prompt, max_new_tokens=5, eos_id=EOS)
    assert out[0, 4].item() == EOS and (out[0, 5:] == PAD).all()
    assert (out[1, 4:] != PAD).all()


@pytest.mark.parametrize("synced, expected_forwards", [(False, 1), (True, 6)])
def test_gpt_synced_runs_every_step(gpt, synced, expected_forwards):
    with counting(gpt.lm_head) as calls, eos_bonus(gpt.lm_head):
        out = gpt.generate(ids(2, 4), max_new_tokens=6, eos_id=EOS, synced=synced)
    assert len(calls) == expected_forwards  # prefill + one forward per further step
    assert (out[:, 4] == EOS).all() and (out[:, 5:] == PAD).all()


def test_gpt_generate_refuses_too_long(gpt):
    with pytest.raises(ValueError, match="max_seq_len"):
        gpt.generate(ids(1, 30), max_new_tokens=5)


# --- Seq2Seq --------------------------------------------------------------------------------


def test_seq2seq_cached_greedy_equals_recomputation(seq2seq):
    src = ids(2, 6)
    hyp = seq2seq.generate(src, max_len=7)
    seq2seq.eval()
    tgt = torch.full((2, 1), BOS)
    with torch.no_grad():
        for _ in range(7):
            tgt = torch.cat(
                [tgt, seq2seq(src, None, tgt).logits[:, -1].argmax(-1, keepdim=True)], 1
            )
    assert not (tgt[:, 1:] == EOS).any()  # an untrained model: no early stop to account for
    assert torch.equal(hyp.tokens, tgt[:, 1:]) and hyp.lengths.tolist() == [7, 7]


@pytest.mark.parametrize("scale", [0.0, 0.05])  # without and with hypotheses ending early
def test_beam_search_with_one_beam_equals_greedy(seq2seq, scale):
    model = ending_early(seq2seq, scale)
    src = ids(3, 6)
    greedy = model.generate(src, max_len=8)  # beam_size=1 takes the greedy path
    model.eval()
    with torch.no_grad():
        beam = _beam_search(model, model.encoder(src), None, 1, 8, 1.0, False)
    assert torch.equal(beam.tokens, greedy.tokens) and torch.equal(beam.lengths, greedy.lengths)
    assert (greedy.lengths < 8).all() == (scale > 0)
    torch.testing.assert_close(beam.scores, greedy.scores)


def _teacher_forced_score(
    model, src, src_mask, tokens, ended: bool, length_penalty: float
) -> float:
    model.eval()
    with torch.no_grad():
        inputs = torch.tensor([[BOS] + tokens])
        targets = torch.tensor([tokens + ([EOS] if ended else [])])
        logp = model(src, src_mask, inputs[:, : targets.shape[1]]).logits.log_softmax(-1)
        total = logp.gather(2, targets[..., None]).sum().item()
    return total / targets.shape[1] ** length_penalty


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_beam_search_scores_match_the_model(seq2seq, length_penalty):
    src = ids(2, 6, seed=5)
    src_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    for model, ends in ((seq2seq, False), (ending_early(seq2seq, 0.1), True)):
        hyp = model.generate(src, src_mask, max_len=8, beam_size=3, length_penalty=length_penalty)
        assert not ends or (hyp.lengths < 8).any()  # an eager </s> is taken where it scores best
        for b in range(2):
            tokens = hyp.tokens[b, : hyp.lengths[b]].tolist()
            ended = len(tokens) < 8
            expected = _teacher_forced_score(
                model, src[b : b + 1], src_mask[b : b + 1], tokens, ended, length_penalty
            )
            assert hyp.scores[b].item() == pytest.approx(expected, abs=1e-4)


def test_beam_search_beats_or_ties_greedy_without_length_penalty(seq2seq):
    src = ids(4, 6, seed=7)
    greedy = seq2seq.generate(src, max_len=5, length_penalty=0.0)
    beam = seq2seq.generate(src, max_len=5, beam_size=4, length_penalty=0.0)
    assert (beam.scores >= greedy.scores - 1e-5).all()


@pytest.mark.parametrize("scale", [0.0, 0.03])
def test_seq2seq_batched_padded_sources_equal_each_alone(seq2seq, scale):
    seq2seq = ending_early(seq2seq, scale)
    a, b = ids(1, 4, seed=1), ids(1, 7, seed=2)
    src = torch.cat([torch.cat([a, torch.full((1, 3), PAD)], 1), b])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 0], [1] * 7])
    for beam_size in (1, 3):
        batched = seq2seq.generate(src, mask, max_len=8, beam_size=beam_size)
        for row, single in enumerate((a, b)):
            alone = seq2seq.generate(single, max_len=8, beam_size=beam_size)
            n = alone.lengths[0]
            assert batched.lengths[row] == n
            assert torch.equal(batched.tokens[row, :n], alone.tokens[0, :n])
            assert batched.scores[row].item() == pytest.approx(alone.scores[0].item(), abs=1e-5)


# Unsynced, greedy stops after the first step; beam search once 3 hypotheses have ended:
# one at step 0 (all beams are still the same <s>), then one per beam at step 1.
@pytest.mark.parametrize(
    "beam_size, synced, expected_steps", [(1, False, 1), (3, False, 2), (1, True, 5), (3, True, 5)]
)
def test_seq2seq_stops_at_eos_unless_synced(seq2seq, beam_size, synced, expected_steps):
    lm_head = seq2seq.decoder.lm_head
    with counting(lm_head) as calls, counting(seq2seq.encoder) as encoder_calls, eos_bonus(lm_head):
        hyp = seq2seq.generate(ids(2, 5), max_len=5, beam_size=beam_size, synced=synced)
    assert len(calls) == expected_steps and len(encoder_calls) == 1
    assert hyp.lengths.tolist() == [0, 0] and (hyp.tokens == PAD).all()


def test_seq2seq_generate_checks_arguments(seq2seq):
    with pytest.raises(ValueError, match="max_len"):
        seq2seq.generate(ids(1, 4), max_len=33)
    with pytest.raises(ValueError, match="beam_size"):
        seq2seq.generate(ids(1, 4), max_len=5, beam_size=0)


def test_row_limits_follow_fairseqs_formula():
    src = ids(3, 8)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3, [1, 1] + [0] * 6])
    assert row_limits(src, mask, 30, 0.0, 0) is None  # off: max_len for every row
    assert row_limits(src, mask, 30, 1.5, 2).tolist() == [14, 9, 5]  # floor(1.5 x length + 2)
    assert row_limits(src, mask, 10, 2.0, 3).tolist() == [10, 10, 7]  # never above max_len
    assert row_limits(src, None, 30, 0.0, 4).tolist() == [4, 4, 4]  # no mask: every row is S long
    with pytest.raises(ValueError, match="max_len_a"):
        row_limits(src, mask, 30, -1.0, 0)


# both: some rows cut, some ended
@pytest.mark.parametrize("beam_size, scale", [(1, 0.02), (3, 0.05)])
def test_a_rows_own_limit_equals_max_len_for_it_alone(seq2seq, beam_size, scale):
    """max_len_a/b: each row of a batch decodes as it would alone with max_len = its own limit,
    for rows that end before it (ending_early) and rows it cuts."""
    model = ending_early(seq2seq, scale)
    lengths = [3, 6, 8]
    src = torch.full((3, 8), PAD)
    mask = torch.zeros(3, 8, dtype=torch.long)
    for row, n in enumerate(lengths):
        src[row, :n], mask[row, :n] = ids(n, seed=row), 1
    batched = model.generate(src, mask, max_len=20, beam_size=beam_size, max_len_a=1.0, max_len_b=1)
    for row, n in enumerate(lengths):
        alone = model.generate(src[row : row + 1, :n], max_len=n + 1, beam_size=beam_size)
        k = int(alone.lengths[0])
        assert int(batched.lengths[row]) == k <= n + 1
        assert torch.equal(batched.tokens[row, :k], alone.tokens[0, :k])
        assert batched.scores[row].item() == pytest.approx(alone.scores[0].item(), abs=1e-5)
    cut = [int(batched.lengths[row]) == n + 1 for row, n in enumerate(lengths)]
    assert any(cut) and not all(cut)


# --- the Llama shape: rotary positions, grouped key/value heads in the cache ----------------

LLAMA = dict(
    positions="rope",
    norm="rmsnorm",
    activation="swiglu",
    n_kv_heads=2,
    bias=False,
    tie_embeddings=False,
)


@pytest.fixture(scope="module")
def llama_gpt():
    torch.manual_seed(0)
    return build_model(tiny("gpt", **LLAMA))


@pytest.fixture(scope="module")
def rotary_seq2seq():
    torch.manual_seed(0)
    return build_model(tiny("seq2seq", **LLAMA))


def test_llama_gpt_cached_greedy_equals_recomputation(llama_gpt):
    """Each step rotates its new query and key at position past + i; the cache holds rotated
    keys of the 2 key/value heads."""
    prompt = ids(2, 5)
    out = llama_gpt.generate(prompt, max_new_tokens=8)
    llama_gpt.eval()
    seq = prompt
    with torch.no_grad():
        for _ in range(8):
            seq = torch.cat([seq, llama_gpt(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_llama_gpt_left_padded_batch_equals_each_prompt_alone(llama_gpt):
    """Rotary positions, like learned ones, count from a row's first real token."""
    short, long = ids(1, 3, seed=1), ids(1, 6, seed=2)
    batch = torch.cat([torch.cat([torch.full((1, 3), PAD), short], 1), long])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    out = llama_gpt.generate(batch, mask, max_new_tokens=6)
    assert torch.equal(out[0, 6:], llama_gpt.generate(short, max_new_tokens=6)[0, 3:])
    assert torch.equal(out[1], llama_gpt.generate(long, max_new_tokens=6)[0])


def test_rotary_seq2seq_cached_greedy_equals_recomputation(rotary_seq2seq):
    src = ids(2, 6)
    hyp = rotary_seq2seq.generate(src, max_len=7)
    rotary_seq2seq.eval()
    tgt = torch.full((2, 1), BOS)
    with torch.no_grad():
        for _ in range(7):
            tgt = torch.cat(
                [tgt, rotary_seq2seq(src, None, tgt).logits[:, -1].argmax(-1, keepdim=True)], 1
            )
    for row in range(2):
        expected = tgt[row, 1:].tolist()
        # </s> is not returned
        expected = expected[: expected.index(EOS)] if EOS in expected else expected
        assert hyp.tokens[row, : hyp.lengths[row]].tolist() == expected


def test_rotary_seq2seq_beam_scores_match_the_model_and_padding_changes_nothing(rotary_seq2seq):
    """Beam search reorders the grouped-head cache; its scores are the model's own
    log-probabilities, and a padded source in a batch decodes as it does alone."""
    src = ids(2, 6, seed=5)
    src_mask = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]])
    hyp = rotary_seq2seq.generate(src, src_mask, max_len=8, beam_size=3)
    for b in range(2):
        tokens = hyp.tokens[b, : hyp.lengths[b]].tolist()
        expected = _teacher_forced_score(
            rotary_seq2seq, src[b : b + 1], src_mask[b : b + 1], tokens, len(tokens) < 8, 1.0
        )
        assert hyp.scores[b].item() == pytest.approx(expected, abs=1e-4)
    alone = rotary_seq2seq.generate(src[1:, :4], max_len=8, beam_size=3)
    n = int(alone.lengths[0])
    assert int(hyp.lengths[1]) == n and torch.equal(hyp.tokens[1, :n], alone.tokens[0, :n])
