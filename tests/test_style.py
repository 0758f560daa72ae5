"""One style for the whole tree: `ruff format` and `ruff check` (lint and import order), with the
settings in pyproject.toml, leave nothing to change."""

import subprocess
import sys

from repo import ROOT


def ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True
    )


def test_the_tree_is_formatted():
    result = ruff("format", "--check", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_tree_passes_the_linter():
    result = ruff("check", "--no-cache", ".")
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_checks_can_fail(tmp_path):
    """A badly formatted file with an unused import and unsorted imports fails both."""
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nimport os\nx=1\n")
    settings = ["--config", str(ROOT / "pyproject.toml")]
    assert ruff("format", *settings, "--check", str(bad)).returncode == 1
    assert ruff("check", *settings, "--no-cache", str(bad)).returncode == 1
