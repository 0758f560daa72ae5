"""Stop requests to a training rank: every catchable signal that a scheduler, a shell or the
kernel sends before a kill (SIGNALS: SIGTERM, SIGINT, SIGUSR1 (SLURM's warning), SIGHUP (the
terminal or SSH session that started the job closed), SIGQUIT (what torchrun passes on to its
ranks when it gets one), SIGXCPU (the CPU-time limit, RLIMIT_CPU) and SIGXFSZ (the file size
limit, RLIMIT_FSIZE)), RUN_DIR/STOP (what the batch scripts touch on the warning) and the death
of the rank's launcher, which covers whatever kills the launcher itself (`launch.launcher`).

A request is honoured at a step boundary (`launch.train.loop.fit`: the step reached checkpointed,
RUN_DIR/preempted.json for the batch script, one line, exit 0). A rank waiting for data may not
reach one for minutes: a data server that accepts and never answers holds a fetch for its
timeout, its retries and their back-off. So a wait for data is `stoppable`: a request that comes
during it, or came before it, raises StopRequested in the main thread at once, wherever the wait
is (a fetch, a back-off, a lock another download holds, a batch from the DataLoader workers),
and the trainer gives up the step on every rank (`launch.distributed.any_rank`).

Limits. The kernel sends SIGXCPU once a second past the soft CPU-time limit and SIGKILL at the
hard one; `ulimit -t N` sets both to N, and then SIGKILL comes with no SIGXCPU before it. So a
rank whose soft limit is its hard one lowers its own soft limit by a margin
(`leave_room_under_cpu_limit`), and the first SIGXCPU raises it back to the hard limit, so that no
more come while the rank checkpoints (a repeated SIGXCPU is not a second request, as a second
SIGINT is). A write past the file size limit fails with EFBIG and SIGXFSZ: the trainer's own log
lines drop such a write (`log_write`) and stop at the step, checkpointed, but not for a requeue,
which would meet the same limit (`past_file_size_limit`); a checkpoint file past it fails the
save in one line, the previous checkpoint still the latest. A DataLoader worker (which inherits
the handler) passes the SIGXCPU and SIGXFSZ of its own limits on to its rank, and leaves the
other signals, which reach it with its rank's process group, to the rank.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import sys
import threading
import time
from pathlib import Path

from common.terminal import leave_terminal
from launch import launcher

STOP_FILE = "STOP"  # touched by slurm/*.sbatch on SLURM's warning signal
PREEMPTED_FILE = "preempted.json"  # left for the batch script: requeue me
# SIGXFSZ's default in Python is "ignore": a write past the limit then raised EFBIG, and the rank
# died of its next log line, unsaved.
SIGNALS = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGUSR1,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGXCPU,
    signal.SIGXFSZ,
)
# a worker process's own limits: passed on to its rank (the others reach the rank themselves)
LIMIT_SIGNALS = (signal.SIGXCPU, signal.SIGXFSZ)
WATCH_INTERVAL_S = 1.0
# The room a rank leaves itself under a CPU-time limit with no warning (soft = hard): a tenth of
# the limit, at least a minute and at most ten (CPU seconds, all of the rank's threads together:
# the step under way, the stop's agreement and the checkpoint), and never over half the limit.
CPU_MARGIN_MIN_S, CPU_MARGIN_MAX_S, CPU_MARGIN_FRACTION = 60, 600, 0.1


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
    launcher's death for a stop request; under a CPU-time limit with no warning before it, leave
    room for a checkpoint (`leave_room_under_cpu_limit`). A second SIGINT interrupts at once
    (KeyboardInterrupt), should the stop itself hang."""
    global _pid
    _pid = os.getpid()
    for signum in SIGNALS:
        signal.signal(signum, _on_signal)
    lowered = leave_room_under_cpu_limit()
    if lowered and os.environ.get("RANK", "0") == "0":
        soft, hard = lowered
        print(
            f"the CPU-time limit (RLIMIT_CPU, `ulimit -t`) is {hard} s, a SIGKILL with no SIGXCPU "
            f"before it: each rank asks for SIGXCPU at {soft} s instead, to checkpoint and stop "
            f"in the {hard - soft} s left",
            file=sys.stderr,
        )
    threading.Thread(
        target=_watch_stop_file, args=(Path(run_dir),), name="stop-file", daemon=True
    ).start()
    launcher.stop_with_launcher(signal.SIGUSR1)


def requested() -> bool:
    """Whether this rank received a stop signal (RUN_DIR/STOP is `stop_file`'s)."""
    return bool(_signals)


def past_file_size_limit() -> bool:
    """Whether a write of this rank went past the file size limit (SIGXFSZ, or a log write's
    EFBIG): a job that stops on it stops checkpointed, but not for a requeue."""
    return "SIGXFSZ" in _signals


def file_size_limit() -> str:
    """The file size limit, for a message."""
    from common.storage import byte_size

    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    except (ImportError, OSError, ValueError):
        return "unknown"
    return "none set" if soft == resource.RLIM_INFINITY else byte_size(soft)


@contextlib.contextmanager
def log_write():
    """Around a write of the trainer's logs (metrics.jsonl, the progress line): a write past the
    file size limit (EFBIG, which comes with SIGXFSZ) is dropped and taken for a stop request,
    so that the rank goes on to the step's end and its checkpoint instead of dying of its log."""
    try:
        yield
    except OSError as err:
        if err.errno != errno.EFBIG:
            raise
        if "SIGXFSZ" not in _signals:
            _signals.append("SIGXFSZ")


def leave_room_under_cpu_limit() -> tuple[int, int] | None:
    """Under a CPU-time limit whose soft value is its hard one (`ulimit -t N`), which the kernel
    enforces with a SIGKILL and no SIGXCPU before it, lower the soft limit by the margin
    (CPU_MARGIN_*), so that SIGXCPU asks this process to stop with room to checkpoint. A soft
    limit set below the hard one is the user's warning, left as it is. Returns (soft, hard) as
    set, or None where nothing was changed. Processes started later inherit it."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if hard == resource.RLIM_INFINITY or soft != hard:
            return None
        margin = min(
            CPU_MARGIN_MAX_S, max(CPU_MARGIN_MIN_S, int(hard * CPU_MARGIN_FRACTION)), hard // 2
        )
        if margin <= 0:
            return None
        resource.setrlimit(resource.RLIMIT_CPU, (hard - margin, hard))
        return hard - margin, hard
    except (ImportError, OSError, ValueError):  # no such limits here
        return None


def _quiet_cpu_limit() -> None:
    """After the first SIGXCPU: the soft CPU-time limit up to the hard one, so that the kernel
    sends no more SIGXCPU (one a second, each a chance of EINTR in a native thread's system
    call) while the process checkpoints; the hard limit's SIGKILL stays where it was."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
        if soft != hard:
            resource.setrlimit(resource.RLIMIT_CPU, (hard, hard))
    except (ImportError, OSError, ValueError):
        pass


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
    if signum == signal.SIGXCPU:
        _quiet_cpu_limit()
    if os.getpid() != _pid:
        # A process the rank forked (a DataLoader worker): its own limit's signal is the rank's
        # stop request; the others reach the rank with its process group, or were meant for it.
        if signum in LIMIT_SIGNALS and _pid is not None and os.getppid() == _pid:
            os.kill(_pid, signum)
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
    step (`launch.train.step.train_step`), and the ranks agree on it there."""
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
