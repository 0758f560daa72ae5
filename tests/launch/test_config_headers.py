"""The parameter counts that training configs state in their header comments are the code's.

A header may name a model's size only as `N parameters at V pieces` (exact) or `N.N M parameters
at V pieces` (rounded as written): the count depends on the vocabulary, which `vocab_size: 0`
takes from the data, so a figure without one cannot be checked, and one that is checked cannot
drift from the model the config builds.
"""

import re
from pathlib import Path

import pytest
import torch

from common.configure import load_config
from launch.config import TrainConfig
from model import build_model

ROOT = Path(__file__).resolve().parents[2]
TRAINING_CONFIGS = sorted(
    path
    for path in (ROOT / "configs").glob("*.yaml")
    if re.search(r"^model:", path.read_text(encoding="utf-8"), re.MULTILINE)
)
# Any figure a header gives for a model's size, and the one form that can be checked.
MENTION = re.compile(r"\d(?:[\d,.]*\d)?\s?M?[\s-]+parameters?\b")
CLAIM = re.compile(
    r"(?P<count>\d[\d,]*(?:\.(?P<decimals>\d+))?)(?P<millions>\s?M)?\s+parameters\s+at\s+"
    r"(?P<vocab>\d[\d,]*)\s+pieces"
)


def header(path: Path) -> str:
    """The comment lines before the first key, joined into one text."""
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("#").strip())
    return " ".join(lines)


def parameters(path: Path, vocab: int) -> int:
    cfg = load_config(TrainConfig, path, [f"model.vocab_size={vocab}"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    return sum(p.numel() for p in model.parameters())  # a shared tensor is counted once


def claim_problems(path: Path) -> list[str]:
    text = header(path)
    problems = [
        f"{path.name}: {mention.group(0)!r} does not say at how many pieces; write "
        "'N parameters at V pieces' (or 'N.N M parameters at V pieces')"
        for mention in MENTION.finditer(text)
        if not CLAIM.match(text, mention.start())
    ]
    for claim in CLAIM.finditer(text):
        vocab = int(claim["vocab"].replace(",", ""))
        actual = parameters(path, vocab)
        count = claim["count"].replace(",", "")
        if claim["millions"]:
            decimals = len(claim["decimals"] or "")
            said, real = float(count), round(actual / 1e6, decimals)
            ok = said == real
        else:
            said, real = int(count), actual
            ok = said == real
        if not ok:
            problems.append(
                f"{path.name}: says {claim.group(0)!r}, but the model has {actual:,} parameters "
                f"at {vocab:,} pieces"
            )
    return problems


@pytest.mark.parametrize("path", TRAINING_CONFIGS, ids=lambda p: p.name)
def test_header_parameter_counts_are_the_models(path):
    assert not claim_problems(path)


def test_the_gpu_configs_state_their_size():
    stated = {path.name for path in TRAINING_CONFIGS if CLAIM.search(header(path))}
    assert {
        "gpt2_small.yaml",
        "bert_base.yaml",
        "llama_gpu_small.yaml",
        "translation_gpu.yaml",
        "transformer_base.yaml",
    } <= stated


def test_a_wrong_or_uncheckable_count_is_caught(tmp_path):
    config = (ROOT / "configs" / "tiny_gpt.yaml").read_text(encoding="utf-8")
    right = parameters(ROOT / "configs" / "tiny_gpt.yaml", 1000)
    cases = {
        f"# {right:,} parameters at 1,000 pieces.\n": 0,
        f"# {right / 1e6:.2f} M parameters at 1000 pieces.\n": 0,
        f"# {right + 1:,} parameters at 1,000 pieces.\n": 1,
        "# 124M parameters with a 50k vocabulary.\n": 1,
        "# a 92 M-parameter model.\n": 1,
    }
    for text, expected in cases.items():
        path = tmp_path / "config.yaml"
        path.write_text(text + config, encoding="utf-8")
        assert len(claim_problems(path)) == expected, text
