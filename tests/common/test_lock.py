"""`common.lock.dir_lock`: real processes contending for one directory, stale takeover after `kill -9`."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from repo import ROOT

from common.configure import UserError
from common.lock import LOCK_FILE, dir_lock

# Takes the lock, says so, holds it for HOLD seconds; a UserError becomes `error: ...` and exit 2.
HOLDER = """
import sys, time
from common.configure import run_main
from common.lock import dir_lock

def main():
    with dir_lock(sys.argv[1], what="test"):
        print("held", flush=True)
        time.sleep(float(sys.argv[2]))
    return 0

run_main(main)
"""


def start_holder(directory, hold_s):
    return subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(directory), str(hold_s)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_until_held(process):
    assert process.stdout.readline().strip() == "held", process.stderr.read()


def test_second_process_fails_at_once_and_a_killed_holder_is_taken_over(tmp_path):
    first = start_holder(tmp_path, 120)
    try:
        wait_until_held(first)
        started = time.monotonic()
        second = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path), "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert second.returncode == 2 and second.stdout == ""
        # At once: no waiting for the holder (which sleeps for two minutes).
        assert time.monotonic() - started < 30
        message = second.stderr.strip()
        assert "\n" not in message and message.startswith("error: ")
        assert (
            str(tmp_path) in message
            and f"test pid {first.pid} on host {socket.gethostname()} since " in message
        )
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The kernel dropped the dead holder's flock; its lock file is still there, naming it.
    assert str(first.pid) in (tmp_path / LOCK_FILE).read_text()
    third = subprocess.run(
        [sys.executable, "-c", HOLDER, str(tmp_path), "0"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert third.returncode == 0 and third.stdout == "held\n", third.stderr
    assert (
        f"taking over the stale lock of pid {first.pid} on host {socket.gethostname()}"
        in third.stderr
    )
    # A clean release leaves no lock file behind, so the next holder has nothing to take over.
    assert not (tmp_path / LOCK_FILE).exists()


def test_in_process_contract(tmp_path):
    with dir_lock(tmp_path / "run", what="train") as lock:
        assert lock.locked and lock.took_over is None and lock.holder.pid == os.getpid()
        assert lock.lock_file == tmp_path / "run" / LOCK_FILE and lock.lock_file.is_file()
        # Locks belong to open files, not processes: the same process cannot take it twice.
        with pytest.raises(UserError, match=f"is locked by train pid {os.getpid()}"):
            with dir_lock(tmp_path / "run", what="train"):
                pass
    assert not (tmp_path / "run" / LOCK_FILE).exists()
    # A lock file outside the directory (prepare locks OUTPUT.lock, beside the output it replaces).
    beside = tmp_path / "data.lock"
    with dir_lock(tmp_path / "data", what="prepare", lock_file=beside) as lock:
        assert beside.is_file() and not (tmp_path / "data").exists()
    # A file of that name that names no holder is someone else's (issue 61): refused, untouched.
    beside.write_text("my notes on the data\n")
    with pytest.raises(UserError, match="is not a lock file of ours"):
        with dir_lock(tmp_path / "data", lock_file=beside):
            pass
    assert beside.read_text() == "my notes on the data\n"
    # An empty one (a holder killed between creating and writing it) is taken over.
    beside.write_text("")
    with dir_lock(tmp_path / "data", lock_file=beside) as lock:
        assert lock.took_over is None
    assert not beside.exists()


# Takes the lock, forks a child that outlives it (as a DataLoader worker may), and holds.
FORKING_HOLDER = """
import os, sys, time
from common.lock import dir_lock

with dir_lock(sys.argv[1], what="test"):
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    print("held", child, flush=True)
    time.sleep(60)
"""


def test_the_lock_dies_with_its_holder_not_with_its_forked_children(tmp_path):
    holder = subprocess.Popen(
        [sys.executable, "-c", FORKING_HOLDER, str(tmp_path / "run")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    word, child = holder.stdout.readline().split()
    assert word == "held"
    try:
        holder.kill()
        holder.wait()
        os.kill(int(child), 0)  # the child lives on
        taker = subprocess.run(
            [sys.executable, "-c", HOLDER, str(tmp_path / "run"), "0"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert taker.returncode == 0, taker.stderr
        assert f"taking over the stale lock of pid {holder.pid}" in taker.stderr
    finally:
        os.kill(int(child), signal.SIGKILL)
