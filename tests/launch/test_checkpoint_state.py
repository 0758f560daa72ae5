"""The checkpoint's record (`launch.checkpoint.state.CheckpointState`) through the trainer's real
save and restore: on 2 ranks with a DeepSpeed engine under ZeRO-2 and ZeRO-3, `Checkpointer`
saves it and `launch.checkpoint.restore.load_state` reads it back into a fresh engine, every field
equal (the random streams of both ranks included), the weights and optimizer moments back, the
checkpoint intact and client_state.json the record's listing (tests/launch/checkpoint_state_worker.py).
And the record's own rules: a checkpoint of an older trainer reads with defaults, one of a newer
record version is refused in one line."""

import json
import os
import subprocess
from pathlib import Path

import pytest

from common.configure import UserError
from launch.checkpoint.state import VERSION, CheckpointState
from launch.main.plan import torchrun

ROOT = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).resolve().parent / "checkpoint_state_worker.py"


@pytest.mark.parametrize("stage", [2, 3])
def test_the_real_save_and_restore_give_back_every_field_on_two_ranks(tmp_path, stage):
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.run(
        [*torchrun(2), str(WORKER), str(tmp_path / "run"), str(out), str(stage)],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        assert len(report["fields"]) == 16 and report["differing"] == [], (rank, report)
        assert report["engine_back"] and report["listing_is_the_states"] and report["intact"]
        assert report["last_saved"] == 1
    assert [report["hook_saw"] for report in reports] == [[1], []]  # the tracker's, on rank 0


def test_an_older_record_reads_with_defaults_and_a_newer_one_is_refused():
    older = {
        "step": 3,
        "tokens_seen": 96,
        "loader": {"version": 3},
        "rng": [{}],
        "config": {"model": {}},
        "tokenizer_sha256": "ab",
    }
    state = CheckpointState.from_client_state(older)
    assert (state.version, state.world_size, state.wandb_run_id, state.guard) == (
        VERSION,
        0,
        None,
        {},
    )
    assert "version" not in older and state.client_state()["version"] == VERSION
    with pytest.raises(UserError, match=f"record version {VERSION + 1}; this one reads up to"):
        CheckpointState.from_client_state({**older, "version": VERSION + 1}, where="runs/x/step_3")
