"""The heuristic quality rules of `pipeline.prepare.curate.quality`: each rule at its published
threshold and just past it (expected values worked out by hand in the comments), C4's line
removal, the fixed order in which rules name a drop, and `QualityConfig.check`."""

from __future__ import annotations

import pytest

from common.configure import UserError
from pipeline.prepare.curate.quality import judge
from pipeline.prepare.curate.quality_config import RULES, QualityConfig


def only(rule: str, **sets) -> QualityConfig:
    """The stage on with every rule but `rule` disabled; `sets`: {set name: {key: value}}."""
    cfg = QualityConfig(enabled=True, disabled_rules=[r for r in RULES if r != rule])
    for name, values in sets.items():
        for key, value in values.items():
            setattr(getattr(cfg, name), key, value)
    return cfg


def kept(text: str, cfg: QualityConfig, language: str = "en") -> bool:
    return judge(text, cfg, language).text is not None


def dropped_by(text: str, cfg: QualityConfig, language: str = "en") -> str:
    verdict = judge(text, cfg, language)
    assert verdict.text is None, "kept"
    return verdict.rule


def uniq(k: int) -> list[str]:
    """k distinct words of 4 characters each."""
    return [f"w{i:03d}" for i in range(k)]


CLEAN = (
    "The river rises in the hills to the north of the town and runs for about forty miles "
    "before it reaches the sea. In the spring, when the snow melts, it can flood the low "
    "fields along its banks, and the farmers have learned to plant late.\n"
    "\n"
    "A stone bridge, built in the eighteenth century, still carries the main road across the "
    "water. Its five arches were repaired after a storm damaged two of them, and the work was "
    "paid for by the parish with help from a local landowner.\n"
    "\n"
    "Today the valley is known for its orchards. Visitors come in the autumn to buy apples "
    "and pears from the stalls that line the lanes, and many of them stop at the old mill, "
    "which now houses a small museum about the history of the area."
)


# --- a realistic document, the default configuration ---------------------------------------


def test_clean_paragraphs_pass_every_rule_set_unchanged():
    cfg = QualityConfig(enabled=True)
    cfg.check("source")
    verdict = judge(CLEAN, cfg)
    assert (verdict.text, verdict.rule, verdict.detail, verdict.lines_removed) == (
        CLEAN,
        "",
        "",
        {},
    )
    for name in ("gopher_quality", "gopher_repetition", "c4", "fineweb"):
        one = QualityConfig(enabled=True)
        for other in ("gopher_quality", "gopher_repetition", "c4", "fineweb"):
            getattr(one, other).enabled = other == name
        assert judge(CLEAN, one).text == CLEAN, name


def test_defaults_stage_off_sets_on_and_published_thresholds():
    cfg = QualityConfig()
    assert cfg.enabled is False
    assert all(
        getattr(cfg, s).enabled for s in ("gopher_quality", "gopher_repetition", "c4", "fineweb")
    )
    assert cfg.gopher_repetition.max_top_ngram_char_fractions == [0.20, 0.18, 0.16]
    assert cfg.gopher_repetition.max_dup_ngram_char_fractions == [
        0.15,
        0.14,
        0.13,
        0.12,
        0.11,
        0.10,
    ]
    # C4 (Raffel et al. 2020): pages of fewer than 5 sentences, lines of fewer than 3 words
    assert (cfg.c4.min_sentences, cfg.c4.min_words_per_line) == (5, 3)
    assert len(set(RULES)) == len(RULES)
    assert all(r == r.lower() and r.count(".") == 1 and " " not in r for r in RULES)


# --- Gopher quality ------------------------------------------------------------------------


def test_word_count_bounds():
    cfg = only("gopher_quality.word_count")
    assert kept(" ".join(["the", "house"] * 25), cfg)  # 50 words
    assert dropped_by(" ".join(["the", "house"] * 25)[4:], cfg) == "gopher_quality.word_count"
    assert judge("one " * 49, cfg).detail == "49 words < 50"
    assert kept("the " * 100000, cfg)
    assert judge("the " * 100001, cfg).detail == "100001 words > 100000"


def test_mean_word_length_bounds():
    cfg = only("gopher_quality.mean_word_length")
    assert kept(" ".join(["the"] * 50), cfg)  # 150 / 50 = 3.0
    # 49 * 3 + 2 = 149 characters over 50 words: 2.98
    assert judge(" ".join(["the"] * 49 + ["to"]), cfg).detail == "mean word length 2.98 < 3"
    long17 = "a" * 17
    assert kept(" ".join(["the"] * 25 + [long17] * 25), cfg)  # (75 + 425) / 50 = 10.0
    # (75 + 24 * 17 + 18) / 50 = 501 / 50 = 10.02
    text = " ".join(["the"] * 25 + [long17] * 24 + ["a" * 18])
    assert judge(text, cfg).detail == "mean word length 10.02 > 10"


def test_hash_and_ellipsis_per_word():
    words = ["the", "house"] * 25  # 50 words
    cfg = only("gopher_quality.hash_ratio")
    assert kept(" ".join(["#" + w for w in words[:5]] + words[5:]), cfg)  # 5 / 50 = 0.1
    text = " ".join(["#" + w for w in words[:6]] + words[6:])  # 6 / 50 = 0.12
    assert judge(text, cfg).detail == "'#' per word 0.12 > 0.1"
    cfg = only("gopher_quality.ellipsis_ratio")
    # "..." and "…" both count: 4 + 1 = 5 per 50 words
    assert kept(" ".join([w + "..." for w in words[:4]] + ["x…"] + words[5:]), cfg)
    text = " ".join([w + "..." for w in words[:5]] + ["x…"] + words[6:])  # 6 / 50
    assert dropped_by(text, cfg) == "gopher_quality.ellipsis_ratio"


def test_bullet_lines():
    cfg = only("gopher_quality.bullet_lines")
    body = "the house of the garden"
    # 9 of 10 lines start with a bullet (after indentation): 0.9, not more
    lines = ["• " + body] * 4 + ["  - " + body] * 3 + ["* " + body, "‣ " + body, body]
    assert kept("\n".join(lines), cfg)
    lines[-1] = "● " + body  # 10 of 10
    assert judge("\n".join(lines), cfg).detail == "bullet lines 1 > 0.9"
    # blank lines are not lines: 9 bullets and 1 plain line among blank ones stay at 0.9
    assert kept("\n\n".join(lines[:9] + [body]) + "\n\n\n", cfg)


def test_ellipsis_lines():
    cfg = only("gopher_quality.ellipsis_lines")
    line = "the house of the garden is big"
    lines = [line + "..."] * 2 + [line + " …"] + [line + "."] * 7  # 3 of 10
    assert kept("\n".join(lines), cfg)
    lines[3] = line + "...  "  # 4 of 10 (trailing spaces stripped)
    assert judge("\n".join(lines), cfg).detail == "lines ending in an ellipsis 0.4 > 0.3"


def test_alpha_words():
    cfg = only("gopher_quality.alpha_words")
    words = ["the", "house", "é1", "(a)"] * 10 + ["1234"] * 10  # 40 of 50 have a letter: 0.8
    assert kept(" ".join(words), cfg)
    words[0] = "12.5"  # 39 of 50
    assert judge(" ".join(words), cfg).detail == "words with a letter 0.78 < 0.8"


def test_stop_words_count_and_language():
    cfg = only("gopher_quality.stop_words")
    # "The" and "(with," match after lowercasing and stripping punctuation; "theory" does not
    two = " ".join(["house"] * 46 + ["The", "theory", "(with,", "bother"])
    assert kept(two, cfg)
    one = " ".join(["house"] * 47 + ["The", "theory", "bother"])
    assert judge(one, cfg).detail == "1 stop words < 2"
    # the list is English's: a German document is not judged by it ...
    assert kept(one, cfg, language="de")
    # ... unless the config gives German's own list
    cfg.gopher_quality.stop_words = ["der", "und"]
    cfg.gopher_quality.stop_words_languages = ["de"]
    assert dropped_by("Haus und Hof", cfg, language="de") == "gopher_quality.stop_words"
    assert kept("der Hund und", cfg, language="de")


# --- Gopher repetition ---------------------------------------------------------------------


def test_dup_line_fraction():
    cfg = only("gopher_repetition.dup_line_fraction")
    lines = [f"line {i:04d}." for i in range(7)] + ["line 0000."] * 3  # 3 of 10 duplicates
    assert kept("\n".join(lines), cfg)
    lines[6] = "line 0000."  # 4 of 10
    assert judge("\n".join(lines), cfg).detail == "duplicate lines 0.4 > 0.3"


def test_dup_line_chars():
    cfg = only("gopher_repetition.dup_line_chars")
    # ten lines of 10 characters; 2 repeats: 20 / 100 = 0.2
    lines = [f"line {i:04d}." for i in range(8)] + ["line 0001."] * 2
    assert kept("\n".join(lines), cfg)
    lines[7] = "line 0001."  # 30 / 100
    assert judge("\n".join(lines), cfg).detail == "characters in duplicate lines 0.3 > 0.2"


def test_dup_paragraphs():
    cfg = only("gopher_repetition.dup_paragraph_fraction")
    paras = [f"para {i:04d}.\nsecond line." for i in range(7)] + ["para 0000.\nsecond line."] * 3
    assert kept("\n\n".join(paras), cfg)  # 3 of 10
    paras[6] = paras[0]  # 4 of 10; blank lines holding spaces separate paragraphs too
    assert judge("\n \n".join(paras), cfg).detail == "duplicate paragraphs 0.4 > 0.3"
    cfg = only("gopher_repetition.dup_paragraph_chars")
    # paragraphs of 10 + 1 + 9 = 20 characters; 2 repeats of 10: 40 / 200 = 0.2
    paras = [f"para {i:04d}.\nthe line." for i in range(8)] + ["para 0001.\nthe line."] * 2
    assert kept("\n\n\n".join(paras), cfg)
    paras[7] = paras[1]  # 60 / 200
    assert dropped_by("\n\n".join(paras), cfg) == "gopher_repetition.dup_paragraph_chars"


def test_top_bigram_chars():
    cfg = only("gopher_repetition.top_ngram_chars")
    # "xx yy" twice covers 8 of 4 * 2 + 8 * 4 = 40 word characters: 0.2
    words = ["xx", "yy"] + uniq(4) + ["xx", "yy"] + uniq(8)[4:]
    assert kept(" ".join(words), cfg)
    words.pop()  # 8 / 36 = 0.2222
    assert judge(" ".join(words), cfg).detail == "top 2-gram characters 0.2222 > 0.2"


def test_top_ngram_overlapping_occurrences_count_once():
    cfg = only("gopher_repetition.top_ngram_chars")
    # "aa aa" at positions 0 and 1 covers the 3 words "aa aa aa": 6 of 6 + 6 * 4 = 30 = 0.2
    # (counting each occurrence apart would give 8 / 30 and drop it)
    assert kept(" ".join(["aa"] * 3 + uniq(6)), cfg)
    assert dropped_by(" ".join(["aa"] * 3 + uniq(5)), cfg) == "gopher_repetition.top_ngram_chars"


def test_top_ngram_tie_takes_the_one_covering_most():
    cfg = only(
        "gopher_repetition.top_ngram_chars",
        gopher_repetition={"max_top_ngram_char_fractions": [0.15, 0.18, 0.16]},
    )
    # "xx yy" and "q r" both occur twice: 8 and 4 characters of 8 + 4 + 7 * 4 = 40
    words = ["xx", "yy", "q", "r"] + uniq(3) + ["xx", "yy", "w900", "q", "r"] + uniq(6)[3:]
    assert judge(" ".join(words), cfg).detail == "top 2-gram characters 0.2 > 0.15"


def test_top_trigram_chars():
    cfg = only("gopher_repetition.top_ngram_chars")
    # "abc def ghi" twice: 18 of 18 + 20 * 4 + 2 = 100 word characters = 0.18; its bigrams
    # cover 12 / 100 (under 0.2), no 4-gram repeats
    words = ["abc", "def", "ghi"] + uniq(10) + ["abc", "def", "ghi"] + uniq(20)[10:] + ["zz"]
    assert kept(" ".join(words), cfg)
    words.pop()  # 18 / 98 = 0.1837
    assert judge(" ".join(words), cfg).detail == "top 3-gram characters 0.1837 > 0.18"


def test_dup_5gram_chars_count_first_occurrence():
    cfg = only("gopher_repetition.dup_ngram_chars")
    gram = ["abc", "def", "ghi", "jkl", "mno"]  # 15 characters
    # twice: 30 of 30 + 42 * 4 + 2 = 200 word characters = 0.15
    words = gram + uniq(21) + gram + uniq(42)[21:] + ["zz"]
    assert kept(" ".join(words), cfg)
    words.pop()  # 30 / 198 = 0.1515 (only the repeat's 15 characters would keep it)
    assert judge(" ".join(words), cfg).detail == "duplicate 5-gram characters 0.1515 > 0.15"


def test_dup_10gram_chars():
    cfg = only(
        "gopher_repetition.dup_ngram_chars",
        gopher_repetition={"dup_ngram_sizes": [10], "max_dup_ngram_char_fractions": [0.10]},
    )
    gram = [f"g{i:03d}" for i in range(10)]  # 10 words, 40 characters
    # twice: 80 of 80 + 180 * 4 = 800 = 0.1
    words = gram + uniq(90) + gram + uniq(180)[90:]
    assert kept(" ".join(words), cfg)
    words.pop()  # 80 / 796
    assert dropped_by(" ".join(words), cfg) == "gopher_repetition.dup_ngram_chars"


# --- C4 ------------------------------------------------------------------------------------


C4_PAGE = "\n".join(
    [
        "Home | About | Contact",
        "The first line has enough words.",
        "  It ends with a full stop, and so does this one.[1]  ",
        "Too short.",
        "",
        "Please enable JavaScript to see this page.",
        "Read our Privacy Policy before you go on.",
        "This line trails off with an ellipsis...",
        "A word " + "x" * 1001 + " is too long.",
        "She said: “it is all right.”",
        "Is this the last line of the page?",
        "Three words here!",
    ]
)


def test_c4_removes_lines_and_counts_them():
    cfg = QualityConfig(enabled=True)
    for name in ("gopher_quality", "gopher_repetition", "fineweb"):
        getattr(cfg, name).enabled = False
    verdict = judge(C4_PAGE, cfg)
    assert verdict.text == "\n".join(
        [
            "The first line has enough words.",
            "It ends with a full stop, and so does this one.",
            "",
            "She said: “it is all right.”",
            "Is this the last line of the page?",
            "Three words here!",
        ]
    )
    assert verdict.lines_removed == {
        "c4.terminal_punct": 2,
        "c4.min_words": 1,
        "c4.javascript": 1,
        "c4.policy": 1,
        "c4.long_word": 1,
    }
    # each rule switchable: the JavaScript line stays
    cfg.disabled_rules = ["c4.javascript"]
    verdict = judge(C4_PAGE, cfg)
    assert "Please enable JavaScript to see this page." in verdict.text
    assert "c4.javascript" not in verdict.lines_removed


def test_c4_line_bounds():
    cfg = only("c4.min_words")
    text = "One two three.\nOne two.\n"
    assert judge(text, cfg).text == "One two three."
    assert judge(text, cfg).lines_removed == {"c4.min_words": 1}
    cfg = only("c4.long_word")
    text = "A " + "x" * 1000 + " word.\nA " + "x" * 1001 + " word."
    assert judge(text, cfg).text == "A " + "x" * 1000 + " word."


def test_c4_min_sentences():
    cfg = only("c4.min_sentences")
    # 2 + 1 + 2 = 5 sentences ("e.g" inside a word ends none)
    five = "One is here. Two is here.\nThree e.g.here!\nFour (is here.) Five is “here.”"
    assert kept(five, cfg)
    four = "One is here. Two is here.\nThree is here!\nFour is here"  # the last line counts 1
    assert judge(four, cfg).detail == "4 sentences < 5"


def test_c4_page_rules():
    cfg = only("c4.lorem_ipsum")
    assert dropped_by("Some text.\nLorem Ipsum dolor sit amet.", cfg) == "c4.lorem_ipsum"
    cfg = only("c4.curly_bracket")
    assert dropped_by("The set {1, 2} is small.", cfg) == "c4.curly_bracket"
    # as in C4's reference code, a line the line rules removed does not drop the page
    cfg = QualityConfig(enabled=True, disabled_rules=["c4.min_sentences"])
    for name in ("gopher_quality", "gopher_repetition", "fineweb"):
        getattr(cfg, name).enabled = False
    verdict = judge("Kept line is here.\nfunction f() {\nlorem ipsum", cfg)
    assert verdict.text == "Kept line is here."
    assert verdict.lines_removed == {"c4.terminal_punct": 2}


# --- FineWeb -------------------------------------------------------------------------------


LONG = "this line is longer than thirty characters"  # 42 characters, no final punctuation


def test_fineweb_line_punct():
    cfg = only("fineweb.line_punct")
    lines = [LONG + "."] * 3 + [LONG] * 22  # 3 / 25 = 0.12: dropped at the threshold
    assert judge("\n".join(lines), cfg).detail == "lines ending in punctuation 0.12 <= 0.12"
    lines[3] += "!"  # 4 / 25 = 0.16
    assert kept("\n".join(lines), cfg)


def test_fineweb_short_lines():
    cfg = only("fineweb.short_lines")
    lines = ["x" * 30] * 67 + [LONG] * 33  # 67 / 100 short: dropped at the threshold
    assert judge("\n".join(lines), cfg).detail == "short lines 0.67 >= 0.67"
    lines[0] = "x" * 31  # 66 / 100
    assert kept("\n".join(lines), cfg)


def test_fineweb_dup_line_chars():
    cfg = only("fineweb.dup_line_chars")
    lines = [f"line {i:04d}." for i in range(99)] + ["line 0000."]  # 10 / 1000 = 0.01
    assert judge("\n".join(lines), cfg).detail == "characters in duplicate lines 0.01 >= 0.01"
    lines.append("line 0099.")  # 10 / 1010
    assert kept("\n".join(lines), cfg)


def test_fineweb_newline_ratio():
    cfg = only("fineweb.newline_ratio")
    assert kept("a b c\nd e f\ng h i\nj", cfg)  # 3 newlines / 10 words = 0.3
    assert judge("a b c\nd e f\ng h i\n\nj", cfg).detail == "newlines per word 0.4 > 0.3"


def test_fineweb_judges_the_text_c4_kept():
    cfg = QualityConfig(enabled=True, disabled_rules=["c4.min_sentences"])
    cfg.gopher_quality.enabled = cfg.gopher_repetition.enabled = False
    # the same short line 3 times, with no final punctuation: C4 removes them, and FineWeb's
    # duplicate-line rule no longer sees them
    text = "\n".join([CLEAN.replace("\n\n", "\n")] + ["menu item"] * 3)
    verdict = judge(text, cfg)
    assert verdict.text == CLEAN.replace("\n\n", "\n")
    assert verdict.lines_removed == {"c4.terminal_punct": 3}


# --- order and configuration ---------------------------------------------------------------


def test_first_failing_rule_in_fixed_order():
    text = "spam spam spam\nspam spam spam"  # fails rules of every set
    cfg = QualityConfig(enabled=True)
    order = []
    while True:
        verdict = judge(text, cfg)
        if verdict.text is not None:
            break
        order.append(verdict.rule)
        cfg.disabled_rules.append(verdict.rule)
    assert order == [
        "gopher_quality.word_count",  # 6 words
        "gopher_quality.stop_words",  # none
        "c4.min_sentences",  # both lines removed (no final punctuation): 0 sentences
        "fineweb.line_punct",  # C4 kept no line: 0 end in punctuation
        "gopher_repetition.dup_line_fraction",  # on the text as given: 1 of 2 lines
        "gopher_repetition.dup_line_chars",  # 14 of 28 characters
        "gopher_repetition.top_ngram_chars",  # "spam spam" covers every word
        "gopher_repetition.dup_ngram_chars",  # so does "spam spam spam spam spam"
    ]
    assert verdict.text == "" and verdict.lines_removed == {"c4.terminal_punct": 2}


def test_check_refuses_bad_values_naming_the_key():
    def refused(message: str, **sets):
        cfg = QualityConfig(enabled=True)
        for name, values in sets.items():
            for key, value in values.items():
                setattr(getattr(cfg, name), key, value)
        with pytest.raises(UserError) as err:
            cfg.check("sources[0].quality")
        assert str(err.value) == message

    refused(
        "sources[0].quality.gopher_quality.max_mean_word_length: must be > "
        "min_mean_word_length (3.0), got 2.0",
        gopher_quality={"max_mean_word_length": 2.0},
    )
    refused(
        "sources[0].quality.gopher_repetition.max_dup_line_fraction: must be a fraction in "
        "[0, 1], got 1.5",
        gopher_repetition={"max_dup_line_fraction": 1.5},
    )
    refused(
        "sources[0].quality.fineweb.max_short_line_fraction: must be a fraction in [0, 1], "
        "got -0.1",
        fineweb={"max_short_line_fraction": -0.1},
    )
    refused(
        "sources[0].quality.gopher_quality.min_words: must be >= 0, got -1",
        gopher_quality={"min_words": -1},
    )
    refused(
        "sources[0].quality.gopher_quality.max_words: must be >= min_words (50), got 10",
        gopher_quality={"max_words": 10},
    )
    refused(
        "sources[0].quality.c4.min_sentences: must be >= 0, got -5",
        c4={"min_sentences": -5},
    )
    refused(
        "sources[0].quality.gopher_repetition.max_top_ngram_char_fractions: must have one "
        "value per n of top_ngram_sizes (3), got 2",
        gopher_repetition={"max_top_ngram_char_fractions": [0.2, 0.18]},
    )
    refused(
        "sources[0].quality.gopher_repetition.dup_ngram_sizes[0]: must be >= 1, got 0",
        gopher_repetition={"dup_ngram_sizes": [0], "max_dup_ngram_char_fractions": [0.1]},
    )
    refused(
        "sources[0].quality.gopher_quality.stop_words[1]: must not be empty",
        gopher_quality={"stop_words": ["the", ""]},
    )
    with pytest.raises(UserError, match=r"^sources\[0\]\.quality\.disabled_rules: unknown rule "):
        QualityConfig(disabled_rules=["c4.javascrpt"]).check("sources[0].quality")


def test_config_is_an_omegaconf_schema_with_every_field_documented():
    from omegaconf import OmegaConf

    from common.configure import field_comments
    from pipeline.prepare.curate import quality_config

    for schema in (
        QualityConfig,
        quality_config.GopherQualityConfig,
        quality_config.GopherRepetitionConfig,
        quality_config.C4Config,
        quality_config.FineWebConfig,
    ):
        assert all(field_comments(schema).values()), schema
    listed = field_comments(QualityConfig)["disabled_rules"]
    assert [r for r in RULES if r not in listed] == []

    cfg = OmegaConf.merge(
        OmegaConf.structured(QualityConfig),
        {"enabled": True, "disabled_rules": ["c4.terminal_punct"], "c4": {"min_sentences": 3}},
    )
    obj = OmegaConf.to_object(cfg)
    assert isinstance(obj, QualityConfig) and obj.c4.min_sentences == 3
    obj.check("quality")
