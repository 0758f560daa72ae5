"""Stop requests to a training rank: SIGTERM, SIGINT, SIGUSR1 (SLURM's warning), SIGHUP (the
terminal or SSH session that started the job closed; torchrun passes it on to its ranks),
RUN_DIR/STOP (what the batch scripts touch on the warning) and the death of the rank's launcher.

A request is honoured at a step boundary (`launch.train.loop.fit`: the step reached checkpointed,
RUN_DIR/preempted.json for the batch script, one line, exit 0). A rank waiting for data may not
reach one for minutes: a data server that accepts and never answers holds a fetch for its
timeout, its retries and their back-off. So a wait for data is `stoppable`: a request that comes
during it, or came before it, raises StopRequested in the main thread at once, wherever the wait
is (a fetch, a back-off, a lock another download holds, a batch from the DataLoader workers),
and the trainer gives up the step on every rank (`launch.distributed.any_rank`).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from pathlib import Path

from common.terminal import leave_terminal
from launch import launcher

STOP_FILE = "STOP"  # touched by slurm/*.sbatch on SLURM's warning signal
PREEMPTED_FILE = "preempted.json"  # left for the batch script: requeue me
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGHUP)
WATCH_INTERVAL_S = 1.0


class StopRequested(BaseException):
    """A stop request that cut a wait for data short. A BaseException, as KeyboardInterrupt is,
    so that no `except Exception` on its way (a fetch's retries) takes it for a failure."""


_signals: list[str] = []  # the stop signals this rank received, by name
# when the main thread began a stoppable wait (None: not in one)
_waiting_since: float | None = None
# the rank's: a DataLoader worker inherits the handler, and leaves stopping to it
_pid: int | None = None


def install(run_dir: str | Path) -> None:
    """Handle the stop signals, watch RUN_DIR/STOP during long waits for data, and take the
    launcher's death for a stop request. A second SIGINT interrupts at once (KeyboardInterrupt),
    should the stop itself hang."""
    global _pid
    _pid = os.getpid()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    threading.Thread(
        target=_watch_stop_file, args=(Path(run_dir),), name="stop-file", daemon=True
    ).start()
    launcher.stop_with_launcher(signal.SIGUSR1)


def requested() -> bool:
    """Whether this rank received a stop signal (RUN_DIR/STOP is `stop_file`'s)."""
    return bool(_signals)


def stop_file(run_dir: str | Path) -> bool:
    return (Path(run_dir) / STOP_FILE).exists()


@contextlib.contextmanager
def stoppable():
    """Wait for data in here: a stop request that comes meanwhile, or came already, raises
    StopRequested at once instead of waiting for the wait to end."""
    global _waiting_since
    _waiting_since = time.monotonic()
    try:
        if _signals:
            raise StopRequested(_signals[-1])
        yield
    finally:
        _waiting_since = None


def leave_for_requeue(run_dir: str | Path, step: int) -> None:
    """Rank 0, at the end of a stopped job: RUN_DIR/preempted.json (requeue me, from `step`),
    and the STOP file gone, so that the requeued job runs."""
    (Path(run_dir) / STOP_FILE).unlink(missing_ok=True)
    (Path(run_dir) / PREEMPTED_FILE).write_text(json.dumps({"step": step}) + "\n")


def _on_signal(signum, frame) -> None:
    if os.getpid() != _pid:
        return
    name = signal.Signals(signum).name
    if signum == signal.SIGINT and "SIGINT" in _signals:
        raise KeyboardInterrupt
    if signum == signal.SIGHUP:
        leave_terminal()  # gone: a progress line written to it would end the rank unsaved
    _signals.append(name)
    if _waiting_since is not None:
        raise StopRequested(name)


def _watch_stop_file(run_dir: Path) -> None:
    """While the main thread has waited for data over a second, look for RUN_DIR/STOP every
    second, and deliver it as SIGUSR1 to the main thread, whose wait that cuts short. Every rank
    looks, since the one waiting may not be rank 0; between such waits rank 0 alone looks, once a
    step (`launch.train.loop.train_step`), and the ranks agree on it there."""
    while True:
        time.sleep(WATCH_INTERVAL_S)
        since = _waiting_since
        if (
            since is not None
            and time.monotonic() - since >= WATCH_INTERVAL_S
            and not _signals
            and stop_file(run_dir)
        ):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
