"""`make main` hands the main job the caller's W&B mode, offline when the caller sets none.

The target's own recipe runs, with `PY` pointed at a stand-in interpreter that records the
environment and arguments it was started with, instead of the main job; set-up is marked done
(`-o`), so nothing is installed.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="no make")


def what_main_runs(tmp_path: Path, env_mode: str | None) -> dict:
    record = tmp_path / "record.json"
    stand_in = tmp_path / "python"
    stand_in.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'WANDB_MODE': os.environ.get('WANDB_MODE')}}, "
        f"open({str(record)!r}, 'w'))\n"
    )
    stand_in.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("WANDB_MODE", "MAKEFLAGS")}
    if env_mode is not None:
        env["WANDB_MODE"] = env_mode
    subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "main", f"PY={stand_in}"],
        cwd=ROOT,
        env=env,
        check=True,
        capture_output=True,
        timeout=60,
    )
    return json.loads(record.read_text())


@pytest.mark.parametrize("mode", ["online", "disabled"])
def test_make_main_passes_the_callers_wandb_mode(tmp_path, mode):
    ran = what_main_runs(tmp_path, mode)
    assert ran == {"argv": ["-m", "launch.main", "configs/main.yaml"], "WANDB_MODE": mode}


def test_make_main_is_offline_when_the_caller_sets_nothing(tmp_path):
    assert what_main_runs(tmp_path, None)["WANDB_MODE"] == "offline"
