"""Saving a checkpoint across ranks (issue #28, item 10): each rank hashes the files it wrote,
and integrity.json is what a serial hash of the directory would be. Real processes and real
files: a 2-rank run of launch.train under torchrun (CPU, gloo).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import pytest  # noqa: E402

from launch import checkpoint as ckpt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- helpers


def train(data: Path, run_dir: Path, *overrides: str, script: Path | None = None, env: dict | None = None,
          timeout: int = 600) -> subprocess.CompletedProcess:
    """2 ranks of launch.train (or of `script`, which runs it) under torchrun; not checked."""
    from test_train import TINY

    entry = [str(script)] if script else ["-m", "launch.train"]
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *entry,
               str(ROOT / "configs" / "tiny_gpt.yaml"), f"data.data_dir={data}", f"run_dir={run_dir}", *TINY,
               "wandb.mode=disabled", "eval_every=0", "log_every=1", "dist_timeout_s=60", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------------- hashing shared by the ranks


def test_each_rank_hashes_the_files_it_wrote_and_the_rest_is_balanced_by_size():
    sizes = {f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt": 1000 + rank for rank in range(4)}
    sizes |= {"mp_rank_00_model_states.pt": 900, "client_state.json": 10}
    assert ckpt.hashing_shares(sizes, 4) == [
        ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt"],  # the least loaded, 1000
        ["client_state.json", "zero_pp_rank_1_mp_rank_00_optim_states.pt"],  # then 1001
        ["zero_pp_rank_2_mp_rank_00_optim_states.pt"], ["zero_pp_rank_3_mp_rank_00_optim_states.pt"]]
    # On fewer ranks (a resume elsewhere) the files of ranks that are not there are balanced with the rest.
    shares = ckpt.hashing_shares(sizes, 2)
    assert sorted(name for share in shares for name in share) == sorted(sizes)
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in shares[1] and abs(
        sum(sizes[n] for n in shares[0]) - sum(sizes[n] for n in shares[1])) < 1000
    assert ckpt.hashing_shares(sizes, 1) == [sorted(sizes)]


@pytest.mark.slow
def test_two_ranks_each_hash_their_own_files_and_integrity_json_is_the_serial_hash(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    saved = train(tiny_dataset, run_dir, "max_steps=1", "deepspeed.zero_stage=3")
    assert saved.returncode == 0, saved.stderr[-4000:]
    tag_dir = ckpt.checkpoint_root(run_dir) / ckpt.tag_for(1)
    record = json.loads((tag_dir / ckpt.INTEGRITY).read_text())["files"]
    serial = tmp_path / "serial"
    shutil.copytree(tag_dir, serial)
    (serial / ckpt.INTEGRITY).unlink()
    ckpt.write_integrity(serial)  # one process hashing every file
    expected = json.loads((serial / ckpt.INTEGRITY).read_text())["files"]
    assert {name: (e["size"], e["sha256"]) for name, e in record.items()} == \
           {name: (e["size"], e["sha256"]) for name, e in expected.items()}
    # ZeRO-3: each rank writes an optimizer partition and a model-states file, named by its rank.
    for rank in (0, 1):
        own = [name for name in record if name.startswith(f"zero_pp_rank_{rank}_")]
        assert len(own) == 2 and all(record[name]["hashed_by"] == rank for name in own), record
    # The shares are those a resume on 2 ranks verifies: one rule, `hashing_shares`, for both.
    shares = ckpt.hashing_shares({name: entry["size"] for name, entry in record.items()}, 2)
    assert {name: entry["hashed_by"] for name, entry in record.items()} == \
           {name: rank for rank, share in enumerate(shares) for name in share}
    assert [ckpt.files_for_rank(tag_dir, rank, 2) for rank in (0, 1)] == shares
