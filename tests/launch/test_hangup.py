"""A hang-up as a terminal gives it (issue #45, item 2): the trainer runs with a pseudo-terminal
as its controlling terminal and its output, as from an SSH session, and the terminal goes away
(its master side closed). The kernel sends SIGHUP, and every write to the terminal fails from
then on (EIO): the run must still stop at the step it reached, checkpointed, rather than die of
its next progress line. The signal to torchrun, to one rank and to launch.main:
test_reliability.py and test_main.py."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import subprocess
import sys
import termios
import threading
from pathlib import Path

import pytest
from clirun import ENV, packed_data, train_command
from processes import alive, kill_all, wait_for
from repo import ROOT
from trainruns import steps_of


def take_as_controlling_terminal() -> None:
    """In the child, after its setsid (start_new_session): stdin, the terminal, becomes its
    controlling terminal, so that closing the terminal hangs the session up."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="finds processes through /proc")
def test_a_closed_terminal_stops_training_with_a_checkpoint(tmp_path):
    data, run_dir = tmp_path / "data", tmp_path / "run"
    packed_data(data, seq_len=32, sizes=(400, 400))
    command = train_command(
        data,
        run_dir,
        "model.max_seq_len=32",
        "max_steps=100000",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "data.log_sample_keys=true",
        "data.num_workers=1",
    )
    master, terminal = pty.openpty()
    shown = bytearray()

    def read_terminal():  # as the terminal does; a full one would block the writer
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:
                return
            if not chunk:
                return
            shown.extend(chunk)

    job = subprocess.Popen(
        [sys.executable, *command],
        cwd=ROOT,
        env=ENV,
        stdin=terminal,
        stdout=terminal,
        stderr=terminal,
        start_new_session=True,
        preexec_fn=take_as_controlling_terminal,
    )
    os.close(terminal)
    reader = threading.Thread(target=read_terminal, daemon=True)
    reader.start()
    try:
        wait_for(lambda: job.poll() is not None or len(steps_of(run_dir, 0)) >= 3, 300, "training")
        assert job.poll() is None, shown.decode(errors="replace")[-3000:]
        os.close(master)  # the terminal goes away: SIGHUP, then EIO on every write to it
        reached = len(steps_of(run_dir, 0))
        assert job.wait(timeout=60) == 0, shown.decode(errors="replace")[-3000:]
        wait_for(lambda: not alive(job.pid), 5, "the job to end")
    finally:
        kill_all([job.pid])
    last = steps_of(run_dir, 0)[-1]
    assert last >= reached
    assert json.loads((run_dir / "preempted.json").read_text()) == {"step": last}
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:08d}"
