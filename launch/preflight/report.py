"""What a dry run reports: its problems and warnings (`Report`), the world, what it learnt of the
dataset (`DataInfo`, or `PlannedData` for one not prepared yet), and the text it prints."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from launch.preconditions import TargetSide
from launch.resolve import Problem
from model import ModelConfig
from pipeline.specials import Specials

SHOWN_SHARDS = 3  # shard names quoted per problem line; the count says how many in all


@dataclass
class Report:
    """What a dry run found: labelled facts (in reading order), numbers for machines,
    problems, warnings."""

    facts: dict[str, str] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    warnings: list[Problem] = field(default_factory=list)
    # the model as resolved (vocabulary from the data); None if it cannot be
    model_config: ModelConfig | None = None

    def problem(self, key: str, message: str) -> None:
        self.problems.append(Problem(key, message))

    def warn(self, key: str, message: str) -> None:
        self.warnings.append(Problem(key, message))

    def problem_line(self, line: str) -> None:
        """A message that already starts with its key
        (`launch.resolve.config_problems`, UserErrors)."""
        self.problems.append(Problem.from_line(line))


@dataclass
class DataInfo:
    """What the dataset tells about the run; None where it could not be read."""

    vocab_size: int | None = None
    tokenizer_sha256: str | None = None
    specials: Specials | None = None  # its tokenizer's special ids (None: not known yet)
    target: TargetSide | None = None  # a translation target's own tokenizer
    # split -> samples of the task's shard set
    samples: dict[str, int] = field(default_factory=dict)
    # split -> tokens stored (translation: source + target)
    tokens: dict[str, int] = field(default_factory=dict)
    # the longest input the model will be given (for the token figures)
    block_length: int | None = None


@dataclass(frozen=True)
class PlannedData:
    """A dataset that a prepare config will make (the main job's dry run, before its prepare stage):
    what it fixes in advance. Sample counts are unknown until the shards exist."""

    source: str  # the prepare config, for the messages
    vocab_size: int  # tokenizer.vocab_size
    tasks: tuple[str, ...]
    seq_len: int  # packed blocks
    max_tokens: int  # translation pairs: the most tokens a side


def render(report: Report, config: str) -> str:
    """Aligned `label: value` lines, then the problems and warnings, each naming its key,
    then the verdict."""
    width = max(len(label) for label in report.facts) + 2 if report.facts else 0
    lines = [f"dry run of {config}: nothing started, nothing written"]
    lines += [f"  {label + ':':<{width}} {value}" for label, value in report.facts.items()]
    for title, items in (("problems", report.problems), ("warnings", report.warnings)):
        if items:
            lines.append(f"{title} ({len(items)}):")
            lines += [f"  {item}" for item in items]
    if report.problems:
        count = len(report.problems)
        lines.append(f"verdict: {count} problem{'s' * (count > 1)}: this run would fail (exit 2)")
    else:
        lines.append("verdict: ready: nothing found that would stop this run (exit 0)")
    return "\n".join(lines)
