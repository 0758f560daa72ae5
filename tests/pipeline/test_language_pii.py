"""Curation stages: language identification (pipeline.prepare.curate.language) and PII
replacement (pipeline.prepare.curate.pii)."""

import json
import subprocess
import sys

import pytest

from common.configure import UserError
from pipeline.prepare.curate.language import (
    LOW_CONFIDENCE,
    TOO_SHORT,
    WRONG_LANGUAGE,
    LanguageConfig,
    LanguageIdentifier,
    check_language,
    identifier,
)
from pipeline.prepare.curate.pii import EMAIL, IP, PiiConfig, pii_enabled, replace_pii

EN = "The committee will publish its annual report on the state of the river next spring."
DE = "Der Ausschuss wird seinen jährlichen Bericht über den Zustand des Flusses im Frühjahr veröffentlichen."
FR = "Le comité publiera son rapport annuel sur l'état de la rivière au printemps prochain."


def test_language_detects_and_keeps_the_expected_language():
    ident = identifier(LanguageConfig(enabled=True))
    code, confidence = ident.detect(EN)
    assert code == "en" and 0.5 <= confidence <= 1.0
    assert ident.detect(DE)[0] == "de"
    assert ident.judge(EN, "en") == (True, "", "")
    assert ident.judge(DE, "de") == (True, "", "")
    assert ident.judge_batch([EN, FR], "en") == [ident.judge(EN, "en"), ident.judge(FR, "en")]


def test_language_drops_wrong_language_and_low_confidence():
    ident = LanguageIdentifier(LanguageConfig(min_confidence=0.5))
    kept, rule, detail = ident.judge(FR, "en")
    assert (kept, rule) == (False, WRONG_LANGUAGE)
    assert detail.startswith("detected fr ") and detail.endswith(", expected en")
    strict = LanguageIdentifier(LanguageConfig(min_confidence=1.0))
    kept, rule, detail = strict.judge(EN, "en")  # CLD2 gives 0.98-0.99 for a sentence
    assert (kept, rule) == (False, LOW_CONFIDENCE)
    assert detail.startswith("en 0.9") and detail.endswith(" < 1.00")
    kept, rule, _ = ident.judge("12345 67890 12345 67890 12345", "en")
    assert (kept, rule) == (False, LOW_CONFIDENCE)  # no language at all


def test_language_short_text_kept_unjudged():
    ident = identifier(LanguageConfig())
    assert ident.judge("Datei öffnen", "en") == (True, TOO_SHORT, "")
    assert ident.judge("   Open file   ", "de") == (True, TOO_SHORT, "")
    assert LanguageIdentifier(LanguageConfig(min_chars=0)).judge("Save as...", "en")[1] != TOO_SHORT


def test_language_text_cld2_would_refuse():
    ident = identifier(LanguageConfig())
    assert ident.detect(EN + "\x01\x7f\ufffe\ud800")[0] == "en"  # controls, noncharacter, surrogate


def test_language_codes_and_config_checked():
    check_language("en", "data.source_lang")
    check_language("de", "data.target_lang")
    check_language("nb", "data.target_lang")  # Norwegian, as CLD2 reports it: "no"
    with pytest.raises(UserError, match=r"data\.source_lang.*'english'") as err:
        check_language("english", "data.source_lang")
    assert "\n" not in str(err.value) and "en, de" in str(err.value)
    with pytest.raises(UserError, match=r"curate\.language\.min_confidence"):
        LanguageConfig(min_confidence=1.5).check("curate.language")
    with pytest.raises(UserError, match=r"curate\.language\.min_chars"):
        LanguageConfig(min_chars=-1).check("curate.language")
    LanguageConfig().check("curate.language")
    assert identifier(LanguageConfig()) is identifier(LanguageConfig())


def test_language_deterministic_across_processes():
    texts = [EN, DE, FR, "Datei öffnen und speichern, bitte", "Open the file and save it, please"]
    here = [identifier(LanguageConfig()).detect(t) for t in texts]
    code = (
        "import sys, json; from pipeline.prepare.curate.language import identifier, LanguageConfig;"
        "print(json.dumps([identifier(LanguageConfig()).detect(t) for t in json.loads(sys.argv[1])]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(texts)], capture_output=True, text=True, check=True
    ).stdout
    assert [tuple(pair) for pair in json.loads(out)] == here


def test_pii_replaces_and_counts_email_and_public_ip():
    cfg = PiiConfig()
    text = (
        "Write to john.doe+news@mail.example-corp.co.uk or <a-b_c@x.io>. "
        "Our DNS is 8.8.8.8:53, the mirror 151.101.1.69, v6 2606:4700:4700::1111."
    )
    out, counts = replace_pii(text, cfg)
    assert counts == {EMAIL: 2, IP: 3}
    assert out == (
        "Write to email@example.com or <email@example.com>. "
        "Our DNS is 192.0.2.1:53, the mirror 192.0.2.1, v6 2001:db8::1."
    )
    assert replace_pii(out, cfg) == (out, {})  # placeholders are never counted
    assert replace_pii(text, PiiConfig(email=False))[1] == {IP: 3}
    assert replace_pii(text, PiiConfig(ip=False, email_placeholder="<EMAIL>"))[0].startswith(
        "Write to <EMAIL> or <<EMAIL>>."
    )


def test_pii_leaves_non_public_ips_and_versions():
    cfg = PiiConfig()
    keep = (
        "10.0.0.1 172.16.5.4 192.168.1.1 127.0.0.1 169.254.1.1 224.0.0.1 240.0.0.1 0.0.0.0 "
        "255.255.255.255 192.0.2.7 198.51.100.3 203.0.113.9 100.64.0.1 300.1.1.1 1.02.3.4 "
        "1.2.3.4.5 v2.10.3.1 build2.1.1.1 (1.7.4.1-3) Git 1.7.10.5, Standards-Version to 4.6.1.0 "
        "::1 fe80::1 2001:db8::5 dead::beef 12:30:45 std::vector"
    )
    assert replace_pii(keep, cfg) == (keep, {})
    # A bare four-part version that is a valid public address cannot be told from one.
    assert replace_pii("Firefox 2.10.3.1 is out", cfg) == ("Firefox 192.0.2.1 is out", {IP: 1})
    assert replace_pii("at 8.8.8.8.", cfg) == ("at 192.0.2.1.", {IP: 1})


def test_pii_email_edges():
    cfg = PiiConfig()
    keep = (
        "foo@bar, @handle, user@localhost, me@example.com, x@sub.example.org, a@b.test, "
        "x@host.c0m, email@example.com, @@ ."
    )
    assert replace_pii(keep, cfg) == (keep, {})
    assert replace_pii("mailto:First.Last@Uni-Bonn.DE.", cfg) == (
        "mailto:email@example.com.",
        {EMAIL: 1},
    )
    assert replace_pii("see...x.y@z.org", cfg) == ("see...email@example.com", {EMAIL: 1})


def test_pii_without_pii_unchanged_and_modes():
    text = "Nothing personal here: pi is 3.14159, version 2.0, at 12:30."
    out, counts = replace_pii(text, PiiConfig())
    assert out is text and counts == {}
    assert pii_enabled(PiiConfig(), "jsonl") and not pii_enabled(PiiConfig(), "gettext")
    assert pii_enabled(PiiConfig(mode="on"), "gettext")
    assert not pii_enabled(PiiConfig(mode="off"), "text")
    with pytest.raises(UserError, match=r"curate\.pii\.mode.*'maybe'"):
        PiiConfig(mode="maybe").check("curate.pii")
    PiiConfig().check("curate.pii")
