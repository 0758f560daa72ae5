"""The project's SentencePiece tokenizer: reserved ids, round trip, reproducible sample."""

import random

import pytest
from corpora import synthetic_pairs

from common.configure import UserError
from pipeline.prepare.config import TokenizerConfig
from pipeline.prepare.train_tokenizer import BottomKSample, train_tokenizer
from pipeline.specials import SENTENCEPIECE_SPECIALS
from pipeline.tokenizer import SentencePieceTokenizer, _in_thread_binding


@pytest.fixture(scope="module")
def trained():
    texts = [t for pair in synthetic_pairs(400) for t in pair]
    cfg = TokenizerConfig(vocab_size=400, lang_tags=["<2de>", "<2en>"], num_threads=1)
    model = train_tokenizer(texts, cfg)
    return model, SentencePieceTokenizer(model, lang_tags=["<2de>", "<2en>"])


def test_reserved_ids_and_language_tags(trained):
    model, sp = trained
    assert [sp.token(i) for i in range(len(SENTENCEPIECE_SPECIALS))] == list(SENTENCEPIECE_SPECIALS)
    info = sp.info()
    assert info["lang_tags"] == {"<2de>": 6, "<2en>": 7}
    assert info["special_ids"] == [0, 1, 2, 3, 4, 5, 6, 7]
    assert (info["kind"], info["file"], info["files"]) == (
        "sentencepiece",
        "tokenizer.model",
        ["tokenizer.model"],
    )
    assert info["specials"]["frames"] == {
        "document": [[], [3]],
        "source": [[], [3]],
        "target": [[2], [3]],
    }
    # Control symbols never come out of encoding ordinary text, even if it spells them.
    assert 4 not in sp.encode("the <mask> cat")


def test_round_trip_including_unseen_characters(trained):
    _, sp = trained
    for text in ["the red cat opens a new door 42", "die grüne Katze schließt", "ünïcødé ☃ 漢字"]:
        assert sp.decode(sp.encode(text)) == text  # byte fallback: nothing becomes <unk>
        assert 1 not in sp.encode(text)


def test_training_is_deterministic(trained):
    model, _ = trained
    texts = [t for pair in synthetic_pairs(400) for t in pair]
    assert (
        train_tokenizer(
            texts, TokenizerConfig(vocab_size=400, lang_tags=["<2de>", "<2en>"], num_threads=1)
        )
        == model
    )


def test_bottom_k_sample_is_order_independent_and_capped():
    items = [(random.Random(i).getrandbits(64), f"text {i}") for i in range(1000)]
    a, b = BottomKSample(50), BottomKSample(50)
    a.merge(items)
    shuffled = items[:] + items[:100]  # duplicates count once
    random.Random(1).shuffle(shuffled)
    for chunk in range(0, len(shuffled), 77):  # merged piecewise, as from several workers
        part = BottomKSample(50)
        part.merge(shuffled[chunk : chunk + 77])
        b.merge(part.items())
    assert a.items() == b.items() and len(a.items()) == 50
    assert a.items() == sorted(items)[:50]


def test_foreign_model_and_bad_type_are_refused():
    with pytest.raises(UserError, match="not a SentencePiece model"):
        SentencePieceTokenizer(b"garbage")
    with pytest.raises(UserError, match="model_type"):
        train_tokenizer(["a"], TokenizerConfig(model_type="wordpiece"))


def test_prepare_encoder_equals_the_public_batch_call(trained):
    """prepare's in-thread per-text encoding gives the public batch call's ids exactly, and a
    processor without the one-text binding falls back to that call."""
    _, tokenizer = trained
    sp = tokenizer.processor
    rng = random.Random(0)
    texts = [t for pair in synthetic_pairs(300) for t in pair]
    texts += [
        "",
        " ",
        "  leading and  double  spaces ",
        "tab\there",
        "ünïcødé ☃ 漢字",
        "<2de> <mask> </s>",
        "x" * 3000,
    ]
    texts += [
        "".join(rng.choice("abc äöü漢 \t,.") for _ in range(rng.randint(0, 40))) for _ in range(200)
    ]
    expected = sp.encode(texts, num_threads=1)
    # this sentencepiece has it: the fast path is the one tested
    assert _in_thread_binding(sp) is not None
    assert tokenizer.encode_batch(texts) == expected

    class Wrapped:  # the public API only, as a sentencepiece without the binding would offer
        def encode(self, batch, num_threads):
            return sp.encode(batch, num_threads=num_threads)

    wrapped = Wrapped()
    assert _in_thread_binding(wrapped) is None
    tokenizer._encode_one = _in_thread_binding(wrapped)
    assert tokenizer.encode_batch(texts) == expected
