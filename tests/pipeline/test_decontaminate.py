"""Decontamination's normal forms and matches, and the tally's order-free samples, by hand."""

from __future__ import annotations

import random

from pipeline.prepare.curate.decontaminate import EvalKeys, contaminated, normalized
from pipeline.prepare.curate.tally import Tally


def test_a_ui_string_and_its_variants_share_one_normal_form():
    forms = {
        normalized(text)
        for text in (
            "Open %s...",
            "open {0}!",
            "_Open %1$s",
            "&Open %(name)s…",
            "OPEN %-10.3lf",
            "Open %d",
            "Open 42",
        )
    }
    assert forms == {"open"}
    assert normalized("Could not save “%s”: %s") == "could not save"
    assert normalized("100% done") == "done"  # a percent sign before a space is no specifier
    assert normalized("{}") == "" and normalized("%s: %s") == ""


WORDS = "the quick brown fox jumps over the lazy dog while seven wise owls watch from an old oak tree".split()


def test_a_long_text_matches_by_a_shared_13_gram_and_a_short_one_by_its_form():
    evaluation = [" ".join(WORDS), "Save the file as %s"]
    keys = [EvalKeys.from_texts("test", evaluation, 13)]
    shared = "Preface: " + " ".join(WORDS[2:15]).upper() + ", said nobody."  # 13 words in a row
    twelve = " ".join(WORDS[2:14]) + " and more words after that run out"
    found = contaminated([shared, twelve, "save the FILE as {0}!", "save the file"], keys, 13)
    assert found[0] == ("test", " ".join(WORDS[2:15]))
    assert found[1] == ("", "")  # 12 shared words are not 13
    assert found[2] == ("test", "same normalized form")
    assert found[3] == ("", "")


def test_the_first_origin_in_order_is_the_one_counted():
    valid = EvalKeys.from_texts("valid", ["close the window"], 13)
    test = EvalKeys.from_texts("test", ["close the window", "open the door"], 13)
    assert contaminated(["Close the window.", "Open the door!"], [valid, test], 13) == [
        ("valid", "same normalized form"),
        ("test", "same normalized form"),
    ]
    merged = EvalKeys.merged([valid, EvalKeys.from_texts("valid", ["open the door"], 13)])
    assert merged.texts == 2 and len(merged.grams) == 2


def test_a_tallys_sample_is_the_same_whatever_order_texts_are_merged_in():
    texts = [f"dropped text number {i}" for i in range(200)]
    tallies = []
    for seed in (0, 1):
        order = texts[:]
        random.Random(seed).shuffle(order)
        parts = [Tally(k=5) for _ in range(4)]
        for i, text in enumerate(order):
            parts[i % 4].drop("quality.rule", "train", text, "detail")
        total = Tally(k=5)
        for part in parts:
            total.merge(part.to_dict())
        tallies.append(total)
    assert tallies[0].samples("quality.rule") == tallies[1].samples("quality.rule")
    assert len(tallies[0].samples("quality.rule")) == 5
    assert tallies[0].nested() == {"quality": {"rule": {"train": 200}}}
