"""The configuration reference (docs/configuration.md) is generated from the schemas and kept in step with them."""

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import launch.config_reference
from common.configure import config_to_dict, load_config
from launch.config import MainConfig, TrainConfig
from launch.config_reference import BEGIN, DEFAULT_PATH, END, SCHEMAS, block_span, main, reference
from pipeline.prepare.config import PrepareConfig

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "configuration.md"


def leaf_keys(cls: type, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        value = getattr(cls(), f.name)
        if dataclasses.is_dataclass(value):
            keys += leaf_keys(type(value), f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def section(text: str, entry: str) -> str:
    """The part of the reference about one entry point."""
    return text.split(f"### {entry}\n", 1)[1].split("\n### ", 1)[0]


def test_docs_block_is_the_generated_reference():
    assert DEFAULT_PATH == REFERENCE
    text = REFERENCE.read_text(encoding="utf-8")
    start, end = block_span(text)
    assert text[start:end] == reference(), "stale: run python -m launch.config_reference --write"
    assert main(["--check"]) == 0


def test_write_and_check_without_a_path_take_docs_configuration_md(tmp_path, monkeypatch):
    # The same file the repository's default names, moved aside so that the test writes a copy.
    copy = tmp_path / "configuration.md"
    copy.write_text(f"intro\n{BEGIN}\nold rows\n{END}\n", encoding="utf-8")
    monkeypatch.setattr(launch.config_reference, "DEFAULT_PATH", copy)
    assert main(["--check"]) == 1
    assert main(["--write"]) == 0
    assert copy.read_text(encoding="utf-8") == f"intro\n{BEGIN}\n{reference()}{END}\n"
    assert main(["--check"]) == 0


@pytest.mark.parametrize(
    "entry, schema",
    [(entry, schema) for entry, schema, _ in SCHEMAS],
    ids=[entry for entry, *_ in SCHEMAS],
)
def test_every_leaf_key_is_in_the_reference(entry, schema):
    part = section(reference(), entry)
    missing = [key for key in leaf_keys(schema) if f"| `{key}` |" not in part]
    assert not missing
    assert part.count("\n| `") == len(leaf_keys(schema))


def test_check_fails_on_a_removed_row_and_passes_on_a_copy(tmp_path):
    text = REFERENCE.read_text(encoding="utf-8")
    intact = tmp_path / "intact.md"
    intact.write_text(text, encoding="utf-8")
    assert main(["--check", str(intact)]) == 0

    row = next(
        line
        for line in text.splitlines(keepends=True)
        if line.startswith("| `deepspeed.zero_stage` |")
    )
    stale = tmp_path / "stale.md"
    stale.write_text(text.replace(row, "", 1), encoding="utf-8")
    run = subprocess.run(
        [sys.executable, "-m", "launch.config_reference", "--check", str(stale)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert run.stderr.count("\n") == 1 and "deepspeed.zero_stage" in run.stderr


def test_write_replaces_only_the_block(tmp_path):
    before, after = "# Title\n\nkept as is\r\n\n", "\ntrailing text, no newline"
    path = tmp_path / "reference.md"
    path.write_bytes(f"{before}{BEGIN}\nold rows\n{END}{after}".encode())
    assert main(["--check", str(path)]) == 1
    assert main(["--write", str(path)]) == 0
    assert path.read_bytes() == f"{before}{BEGIN}\n{reference()}{END}{after}".encode()
    assert main(["--check", str(path)]) == 0


def test_a_file_without_markers_or_no_file_is_a_bad_input(tmp_path, capsys):
    """Exit 2 (the user's input: FILE), not 1 (a stale reference)."""
    path = tmp_path / "reference.md"
    path.write_text("# no reference here\n")
    for mode in ("--check", "--write"):
        assert main([mode, str(path)]) == 2
        assert "config-reference:begin" in capsys.readouterr().err
    assert path.read_text() == "# no reference here\n"
    assert main(["--check", str(tmp_path / "nowhere.md")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'nowhere.md'}: ")


def _schema(path: Path) -> tuple[str, type]:
    if path.name.startswith("prepare_"):
        return "pipeline.prepare", PrepareConfig
    if path.name.startswith(("main", "transfer")):  # main.yaml, transfer.yaml, transfer_gpu.yaml
        return "launch.main", MainConfig
    return "launch.train", TrainConfig


def _yaml_keys(node, prefix: str = "") -> list[str]:
    if not isinstance(node, dict):
        return [prefix.rstrip(".")]
    return [key for name, value in node.items() for key in _yaml_keys(value, f"{prefix}{name}.")]


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads_and_its_keys_are_documented(path):
    entry, schema = _schema(path)
    given = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    # Loading keeps every value the file gives, as the file gives it: none dropped, renamed,
    # or turned into another value on the way (a quoted "1024" for an int key becomes 1024).
    loaded = config_to_dict(load_config(schema, path))
    assert _holds(loaded, given), [
        key for key in _yaml_keys(given) if not _holds(_at(loaded, key), _at(given, key))
    ]
    part = section(reference(), entry)
    keys = _yaml_keys(given)
    assert keys and all(_documented(key, part) for key in keys), [
        key for key in keys if not _documented(key, part)
    ]


def _documented(key: str, part: str) -> bool:
    """A key's own row, or, for an entry of a mapping field (`data.mixture.NAME`), the field's."""
    parts = key.split(".")
    return f"| `{key}` |" in part or any(
        f"| `{'.'.join(parts[:n])}` | Dict[" in part for n in range(1, len(parts))
    )


def _at(node, key: str):
    for name in key.split("."):
        node = node.get(name) if isinstance(node, dict) else None
    return node


def _holds(loaded, given) -> bool:
    """Whether the loaded config (a plain dict) has every value of the YAML's `given` (a subset)."""
    if isinstance(given, dict):
        return isinstance(loaded, dict) and all(
            k in loaded and _holds(loaded[k], v) for k, v in given.items()
        )
    if isinstance(given, list):
        return (
            isinstance(loaded, list)
            and len(loaded) == len(given)
            and all(map(_holds, loaded, given))
        )
    if isinstance(given, str) and "${" in given:  # an interpolation: resolved when loaded
        return isinstance(loaded, str) and "${" not in loaded and loaded != given
    return (
        type(loaded) is type(given)
        and loaded == given
        or (isinstance(loaded, float) and type(given) is int and loaded == given)
    )
