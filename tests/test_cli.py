"""One command-line grammar for every entry point (`common.configure.parse_cli`).

`python -m ENTRY [CONFIG.yaml] [key.sub=value ...]`: `--help` prints the usage and the schema's
keys and exits 0 everywhere; no arguments where some are needed prints the usage and exits 2;
a missing required key or an unknown one is one `error:` line and exit 2.
"""

import functools
import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import List

import pytest
from omegaconf import MISSING
from repo import ROOT

from common.configure import (
    UserError,
    field_comments,
    help_text,
    leaf_rows,
    parse_cli,
    strip_launcher_args,
)
from launch.config import (
    AverageConfig,
    EvaluateConfig,
    ExportConfig,
    MainConfig,
    ReportConfig,
    TrainConfig,
    TranslateConfig,
)
from launch.lm_eval.config import LmEvalConfig
from pipeline.prepare.config import PrepareConfig
from pipeline.validate import ValidateConfig

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
# Every `python -m` entry point of the project, with the schema its command line fills.
ENTRY_POINTS = {
    "pipeline.prepare": PrepareConfig,
    "pipeline.validate": ValidateConfig,
    "launch.train": TrainConfig,
    "launch.export": ExportConfig,
    "launch.average": AverageConfig,
    "launch.evaluate": EvaluateConfig,
    "launch.translate": TranslateConfig,
    "launch.lm_eval": LmEvalConfig,
    "launch.report": ReportConfig,
    "launch.main": MainConfig,
    "launch.config_reference": None,  # writes docs/configuration.md; its own two flags
}


def python_m(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=300,
    )


@functools.lru_cache(maxsize=None)
def help_of(module: str) -> subprocess.CompletedProcess:
    """`python -m MODULE --help`, run once for the tests that read it."""
    return python_m(module, "--help")


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_help_prints_the_usage_and_every_key_and_exits_0(module):
    run = help_of(module)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.startswith(f"usage: python -m {module}"), run.stdout[:500]
    schema = ENTRY_POINTS[module]
    if schema is None:
        assert "--write [FILE]" in run.stdout and "docs/configuration.md" in run.stdout
        return
    for key, _, _, _ in leaf_rows(schema):
        assert f"  {key}=" in run.stdout, key


@pytest.mark.parametrize(
    "module",
    [
        m
        for m in ENTRY_POINTS
        if m not in ("launch.train", "pipeline.prepare", "launch.config_reference")
    ],
)
def test_no_arguments_prints_the_usage_and_exits_2(module, capsys):
    # launch.train and pipeline.prepare call the same parse_cli (test_required_config_file below).
    entry = importlib.import_module(module)
    if hasattr(entry, "__path__"):  # a room (launch.main): what `python -m` runs is its __main__
        entry = importlib.import_module(f"{module}.__main__")
    with pytest.raises(SystemExit) as exit_:
        entry.main([])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.startswith(f"usage: python -m {module}")


@pytest.mark.parametrize("module", ["launch.evaluate", "launch.translate"])
@pytest.mark.parametrize(
    "args, expected",
    [
        (["beam=2"], "error: checkpoint: required, not given"),
        (
            ["checkpoint=runs/x", "batch_size=4"],
            "error: command line 'batch_size=4': batch_size: unknown key",
        ),
        (
            ["checkpoint=runs/x", "--beam", "4"],
            "error: override '--beam' is not of the form key.sub=value",
        ),
    ],
)
def test_missing_or_unknown_key_is_one_line_and_exit_2(module, args, expected):
    run = python_m(module, *args)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and run.stderr.startswith(expected), run.stderr
    assert run.stdout == ""


@pytest.mark.parametrize(
    "module, args",
    [
        ("launch.train", [str(ROOT / "configs" / "tiny_gpt.yaml"), "max_steps={tag}"]),
        (
            "pipeline.prepare",
            [str(ROOT / "configs" / "prepare_gettext_en_de.yaml"), "seq_len={tag}"],
        ),
        ("launch.main", [str(ROOT / "configs" / "main.yaml"), "nproc={tag}"]),
        ("launch.evaluate", ["checkpoint=runs/x", "beam={tag}"]),
    ],
    ids=["train", "prepare", "main", "evaluate"],
)
@pytest.mark.parametrize(
    "tag",
    ["!!python/name:os.system", "!!python/object/apply:os.system [echo]"],
    ids=["name", "object-apply"],
)
def test_a_yaml_object_tag_in_an_override_is_one_line_and_exit_2(module, args, tag):
    """As in a YAML file: refused by the YAML loader, reported in one line naming the key and the value."""
    argv = [arg.format(tag=tag) for arg in args]
    key = argv[-1].partition("=")[0]
    run = python_m(module, *argv)
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1, run.stderr[-3000:]
    assert run.stderr.startswith(
        f"error: command line {argv[-1]!r}: {key}: value {tag!r} is not valid YAML: "
        "could not determine a constructor for the tag"
    ), run.stderr


# ----------------------------------------------------------------------------- parse_cli itself


@dataclass
class Tool:
    checkpoint: str = MISSING  # where the weights are
    # how many
    # at once
    beam: int = 4
    runs: List[str] = field(default_factory=list)  # run directories


def test_optional_config_file_is_the_first_yaml_argument(tmp_path):
    path = tmp_path / "tool.yml"
    path.write_text("checkpoint: from_yaml\nbeam: 2\n")
    assert parse_cli(Tool, [str(path), "beam=3"], usage="u", config_optional=True) == Tool(
        "from_yaml", 3
    )
    assert parse_cli(Tool, ["checkpoint=c", "runs=[a,b]"], usage="u", config_optional=True) == Tool(
        "c", 4, ["a", "b"]
    )
    # A value that ends in .yaml is an override, not the file.
    assert (
        parse_cli(Tool, ["checkpoint=c.yaml"], usage="u", config_optional=True).checkpoint
        == "c.yaml"
    )
    with pytest.raises(UserError, match=r"^checkpoint: required, not given \(checkpoint=\.\.\.\)$"):
        parse_cli(Tool, ["beam=1"], usage="u", config_optional=True)


def test_required_config_file(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(PrepareConfig, [], usage="usage: prepare CONFIG.yaml")
    assert exit_.value.code == 2 and capsys.readouterr().err.startswith(
        "usage: prepare CONFIG.yaml"
    )
    with pytest.raises(UserError, match="the first argument is the CONFIG.yaml file"):
        parse_cli(PrepareConfig, ["seq_len=64"], usage="u")
    path = tmp_path / "p.yaml"
    path.write_text("seq_len: 64\n")
    assert parse_cli(PrepareConfig, [str(path), "shard.buckets=5"], usage="u").shard.buckets == 5


@pytest.mark.parametrize("flag", ["-h", "--help"])
def test_help_anywhere_lists_keys_defaults_and_field_comments(flag, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_cli(
            Tool,
            ["beam=2", flag],
            usage="usage: tool [CONFIG.yaml] checkpoint=DIR",
            config_optional=True,
        )
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out == help_text(Tool, "usage: tool [CONFIG.yaml] checkpoint=DIR") + "\n"
    assert out.startswith("usage: tool [CONFIG.yaml] checkpoint=DIR\n")
    assert "??? = required" in out
    lines = out.splitlines()
    assert any(
        line.startswith("  checkpoint=???") and line.endswith("where the weights are [str]")
        for line in lines
    )
    assert any(
        line.startswith("  beam=4") and line.endswith("how many at once [int]") for line in lines
    )
    assert any(line.startswith("  runs=[]") and "run directories" in line for line in lines)


def test_one_reader_of_field_comments():
    assert field_comments(Tool) == {
        "checkpoint": "where the weights are",
        "beam": "how many at once",
        "runs": "run directories",
    }
    for schema in (
        EvaluateConfig,
        TranslateConfig,
        ExportConfig,
        ReportConfig,
        ValidateConfig,
        MainConfig,
    ):
        assert all(field_comments(schema).values()), schema  # every field documented


def test_launcher_arguments_are_dropped():
    assert strip_launcher_args(["--local_rank=1", "checkpoint=x"]) == ["checkpoint=x"]
    assert strip_launcher_args(["checkpoint=x", "--local_rank", "1", "beam=2"]) == [
        "checkpoint=x",
        "beam=2",
    ]
    from launch.evaluate import main

    # The deepspeed launcher's --local_rank=N reaches evaluate's checks, not the grammar's.
    with pytest.raises(UserError, match="checkpoint not found"):
        main(["--local_rank=0", "checkpoint=/nonexistent/run"])


# ----------------------------------------------------------------------------- one exit-code
# convention

# 2: the user's input (a config, a key, a path given), one line naming it, nothing started or
# written; 1: a run that failed (a stage of the main job, tests/launch/test_main.py; a dataset that
# does
# not validate, tests/pipeline/test_prepare.py; a stale reference,
# tests/launch/test_config_reference.py).
BAD_INPUT = {
    "pipeline.prepare": (
        [
            str(ROOT / "configs" / "prepare_gettext_en_de.yaml"),
            "source.paths=[{tmp}/nowhere.mo]",
            "output_dir={tmp}/out",
        ],
        "source.paths: file not found",
    ),
    "pipeline.validate": (["data_dir={tmp}/nowhere"], "data_dir: not a directory"),
    "pipeline.prepare.make_parquet": (
        ["{tmp}/out", "--max-rows", "0"],
        "--max-rows: must be at least 1",
    ),
    "launch.train": (
        [
            str(ROOT / "configs" / "tiny_gpt.yaml"),
            "data.data_dir={tmp}/nowhere",
            "run_dir={tmp}/out",
        ],
        "no manifest.json in",
    ),
    "launch.preflight": (
        ["--world-size", "none", str(ROOT / "configs" / "tiny_gpt.yaml")],
        "--world-size: expects",
    ),
    "launch.export": (["checkpoint={tmp}/nowhere", "out={tmp}/out"], "no complete checkpoint at"),
    "launch.average": (["checkpoint={tmp}/nowhere", "out={tmp}/out"], "no complete checkpoint at"),
    "launch.evaluate": (["checkpoint={tmp}/nowhere", "out={tmp}/out"], "checkpoint not found"),
    "launch.translate": (["checkpoint={tmp}/nowhere"], "checkpoint not found"),
    "launch.lm_eval": (
        ["checkpoint={tmp}/nowhere"],
        "{tmp}/nowhere is not an exported model directory",
    ),
    "launch.report": (["out={tmp}/out", "runs=[{tmp}/nowhere]"], "no metrics.jsonl in"),
    "launch.main": (
        [str(ROOT / "configs" / "main.yaml"), "starts=[bert/t5]", "out_dir={tmp}/out"],
        "starts: 'bert/t5'",
    ),
    "launch.config_reference": (["--check", "{tmp}/nowhere.md"], "{tmp}/nowhere.md: "),
}


def test_every_entry_point_has_a_bad_input_case():
    assert set(BAD_INPUT) == set(ENTRY_POINTS) | {
        "pipeline.prepare.make_parquet",
        "launch.preflight",
    }


@pytest.mark.parametrize("module", BAD_INPUT)
def test_a_bad_input_is_one_error_line_and_exit_2_and_writes_no_file(module, tmp_path):
    argv, text = BAD_INPUT[module]
    run = python_m(module, *(arg.format(tmp=tmp_path) for arg in argv))
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if "error: " in line]
    assert len(errors) == 1 and f"error: {text.format(tmp=tmp_path)}" in errors[0], run.stderr[
        -3000:
    ]
    assert "Traceback" not in run.stderr
    # No file, and no directory either (launch.train makes and locks run_dir before it reads the
    # data, and removes it again on a bad input).
    assert list(tmp_path.rglob("*")) == []


@pytest.mark.parametrize(
    "module, config", [("launch.train", "tiny_gpt.yaml"), ("launch.main", "main.yaml")]
)
def test_dry_run_is_in_the_help(module, config):
    """--dry-run is a flag beside the key=value grammar, so --help says so in the usage."""
    run = help_of(module)
    assert run.returncode == 0 and "--dry-run" in run.stdout.split("Keys (")[0], run.stdout[:1500]
    run = python_m(module, str(ROOT / "configs" / config), "--dry-run", "--help")
    assert run.returncode == 0 and run.stdout.startswith("usage: "), run.stderr[-3000:]


# Entry points whose --help and command-line errors answer before torch is imported (~2 s of a
# core): the schemas (`launch.config`, `model.config`) import no torch. The training, export and
# evaluation commands import it with the code they run at once.
WITHOUT_TORCH = [
    "pipeline.prepare",
    "pipeline.validate",
    "launch.main",
    "launch.lm_eval",
    "launch.report",
    "launch.config_reference",
    "launch.translate",
]
HELP_WITHOUT_TORCH = """
import contextlib, io, runpy, sys
import launch.config, model.config, pipeline.prepare.config
assert "torch" not in sys.modules, "the schemas import torch"
for module in sys.argv[1:]:
    sys.argv = [module, "--help"]
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    assert "torch" not in sys.modules, f"python -m {module} --help imports torch"
print("ok")
"""


def test_help_and_schemas_import_no_torch():
    run = subprocess.run(
        [sys.executable, "-c", HELP_WITHOUT_TORCH, *WITHOUT_TORCH],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-3000:]
