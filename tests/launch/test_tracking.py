"""W&B settings (`launch.tracking`): the config's key, else W&B's environment variable, else the
default; the start line that says where the run is; and the main job's one group."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from repo import ROOT
from trainruns import TINY

from common.configure import UserError
from launch.config import MainConfig
from launch.main.plan import wandb_group
from launch.tracking import WandbConfig, wandb_settings

WANDB_VARIABLES = ("WANDB_MODE", "WANDB_PROJECT", "WANDB_ENTITY", "WANDB_RUN_GROUP")


@pytest.mark.parametrize(
    "key, variable, default",
    [
        ("mode", "WANDB_MODE", "offline"),
        ("project", "WANDB_PROJECT", "pretrain-pipeline"),
        ("entity", "WANDB_ENTITY", ""),
        ("group", "WANDB_RUN_GROUP", ""),
    ],
)
def test_the_config_key_wins_over_the_environment_which_wins_over_the_default(
    key, variable, default
):
    given = {
        "mode": ("disabled", "online"),
        "project": ("mine", "theirs"),
        "entity": ("lab", "other-lab"),
        "group": ("sweep-1", "sweep-2"),
    }[key]
    assert wandb_settings(WandbConfig(), {})[key] == (default, "default")
    assert wandb_settings(WandbConfig(), {variable: given[1]})[key] == (given[1], variable)
    assert wandb_settings(WandbConfig(**{key: given[0]}), {variable: given[1]})[key] == (
        given[0],
        f"wandb.{key}",
    )
    assert wandb_settings(WandbConfig(**{key: given[0]}), {})[key] == (given[0], f"wandb.{key}")


def test_the_shipped_configs_leave_the_wandb_settings_to_the_environment():
    from common.configure import load_config
    from launch.config import TrainConfig

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        if "wandb" in path.read_text():
            raise AssertionError(
                f"{path.name} sets wandb.*: WANDB_MODE=online sbatch ... would be ignored"
            )
    assert load_config(TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", []).wandb.mode == ""


def test_w_and_b_s_own_mode_names_are_taken_and_others_refused():
    assert wandb_settings(WandbConfig(), {"WANDB_MODE": "dryrun"})["mode"] == (
        "offline",
        "WANDB_MODE",
    )
    assert wandb_settings(WandbConfig(), {"WANDB_MODE": "run"})["mode"] == ("online", "WANDB_MODE")
    with pytest.raises(
        UserError, match=r"^WANDB_MODE=ofline: W&B's mode is one of online, offline or disabled$"
    ):
        wandb_settings(WandbConfig(), {"WANDB_MODE": "ofline"})
    with pytest.raises(UserError, match=r"^wandb.mode=onlin: "):
        wandb_settings(WandbConfig(mode="onlin"), {"WANDB_MODE": "offline"})


def train_with_env(
    data: Path, run_dir: Path, env: dict, *overrides: str
) -> subprocess.CompletedProcess:
    environment = {k: v for k, v in os.environ.items() if k not in WANDB_VARIABLES}
    environment.update({"OMP_NUM_THREADS": "1", **env})
    command = [
        sys.executable,
        "-m",
        "launch.train",
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *[o for o in TINY if not o.startswith("wandb.")],
        "max_steps=2",
        "eval_every=0",
        "checkpoint.every_steps=0",
        *overrides,
    ]
    return subprocess.run(
        command, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=600
    )


def w_and_b_lines(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if line.startswith("W&B: ")]


@pytest.mark.slow
def test_the_environment_decides_for_a_shipped_config_and_the_start_line_says_where(
    tiny_dataset, tmp_path
):
    """A shipped config (wandb.mode unset): WANDB_MODE=disabled writes no W&B files and says so;
    WANDB_MODE=offline writes the run under RUN_DIR/wandb/, in the group WANDB_RUN_GROUP names,
    and its start line names the directory and the `wandb sync` command; a config key wins over
    WANDB_MODE; a mode W&B does not know stops the job in one line, with status 2."""
    disabled = train_with_env(tiny_dataset, tmp_path / "disabled", {"WANDB_MODE": "disabled"})
    assert disabled.returncode == 0, disabled.stderr[-3000:]
    assert w_and_b_lines(disabled) == ["W&B: disabled (WANDB_MODE)"]
    assert not (tmp_path / "disabled" / "wandb").exists()

    offline = train_with_env(
        tiny_dataset, tmp_path / "offline", {"WANDB_MODE": "offline", "WANDB_RUN_GROUP": "g1"}
    )
    assert offline.returncode == 0, offline.stderr[-3000:]
    (line,) = w_and_b_lines(offline)
    (run,) = (tmp_path / "offline" / "wandb").glob("offline-run-*")
    assert line == (
        f"W&B: offline run in {run} (project pretrain-pipeline, group g1; mode from WANDB_MODE); "
        f"upload it with: wandb sync {run}"
    ), line
    assert any(run.glob("*.wandb"))

    key_wins = train_with_env(
        tiny_dataset, tmp_path / "key", {"WANDB_MODE": "offline"}, "wandb.mode=disabled"
    )
    assert key_wins.returncode == 0 and w_and_b_lines(key_wins) == ["W&B: disabled (wandb.mode)"]
    assert not (tmp_path / "key" / "wandb").exists()

    refused = train_with_env(tiny_dataset, tmp_path / "bad", {"WANDB_MODE": "onlne"})
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert (
        refused.stderr.strip()
        .splitlines()[-1]
        .endswith("WANDB_MODE=onlne: W&B's mode is one of online, offline or disabled")
    ), refused.stderr[-2000:]
    assert "Traceback" not in refused.stderr


def test_a_main_job_keeps_one_group_for_its_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    out = tmp_path / "main"
    out.mkdir()
    first = wandb_group(MainConfig(out_dir=str(out)), out)
    # a re-run: the same
    assert first.startswith("main-") and wandb_group(MainConfig(out_dir=str(out)), out) == first
    assert wandb_group(MainConfig(out_dir=str(out), wandb_group="mine"), out) == "mine"
    monkeypatch.setenv("WANDB_RUN_GROUP", "from-env")
    assert wandb_group(MainConfig(out_dir=str(out)), out) == "from-env"
