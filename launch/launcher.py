"""A rank ends with its launcher (`die_with_parent`, `stop_with_launcher`).

torchrun starts each rank in a session of its own, so a `kill -9` of torchrun (a user, or a
scheduler without cgroups) would leave the ranks training to the end and writing checkpoints,
unseen. A rank here watches the launcher that started it (torchrun, the deepspeed runner, srun)
and, once the trainer has a stop handler, takes the launcher's death for a stop request.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import re
import signal
import sys
import threading
import time

# Linux's prctl(2) option: the signal this process gets when the thread that forked it exits.
PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0
LAUNCHER_GONE_GRACE_S = 30.0  # as long as torchrun gives its ranks between SIGTERM and SIGKILL
_armed = False
_pdeathsig = False  # whether the kernel signals this rank when its launcher dies
# (signal, grace) once `stop_with_launcher` is called
_stop_on_death: tuple[int, float] | None = None


def launcher_kind(env=None) -> str:
    """Who started this process, from what each launcher exports to its ranks: 'torchrun' (the
    elastic agent), 'deepspeed' (the per-node `deepspeed.launcher.launch`), 'srun' (we are
    the task slurmstepd started) or 'plain'."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" in env:
        return "torchrun"
    if "CROSS_RANK" in env and "LOCAL_SIZE" in env:
        return "deepspeed"
    # SLURM_TASK_PID is the task's own pid: a process the task started in turn is not srun's.
    if "SLURM_STEP_ID" in env and env.get("SLURM_TASK_PID") == str(os.getpid()):
        return "srun"
    return "plain"


def die_with_parent(interval_s: float = WATCH_INTERVAL_S) -> str | None:
    """End this process (SIGKILL, nothing written) when the launcher that started it dies; after
    `stop_with_launcher`, ask it to stop with a checkpoint instead.

    Call it first thing in a rank. Two mechanisms:
    * a watchdog thread compares `os.getppid()` with the parent recorded here every
      `interval_s` (a dead parent's children are handed to init or a subreaper). It covers
      every launcher and any platform with a parent pid, and also watches the `deepspeed`
      runner above DeepSpeed's per-node launcher, which is what a user kills;
    * under torchrun and the deepspeed launcher, also Linux's PR_SET_PDEATHSIG (the kernel
      kills us at once, even while the interpreter is stuck in native code). It fires when
      the parent *thread* that forked us exits, so only launchers known to start their ranks
      from their main thread get it: torchrun's agent (`SubprocessHandler`, from `_start_workers`
      on its main thread) and DeepSpeed's `launch.py` (its main loop). slurmstepd is
      multi-threaded and plain parents are anyone's program: the watchdog alone serves those.

    A launcher that died while we were starting up (importing torch takes seconds) has handed
    us to init or a subreaper already: under a known launcher a parent that is not that kind of
    program means exactly that, and we exit at once. A plain run started detached (`nohup`, which
    leaves SIGHUP ignored, or `setsid`) was meant to outlive its shell: it is left alone.
    Returns the launcher kind watched, or None when left alone. Calling it again does nothing."""
    global _armed, _pdeathsig
    if _armed:
        return None
    kind = launcher_kind()
    if kind == "plain" and _started_detached():
        return None
    parent = os.getppid()
    if kind != "plain" and not _runs_launcher(parent, kind):
        _die(
            f"the {kind} launcher that started this rank is gone (the parent is now pid {parent}, "
            f"{os.path.basename(_program(parent).split(' ')[0]) or 'unknown'})"
        )
    _pdeathsig = kind in ("torchrun", "deepspeed") and _set_pdeathsig(signal.SIGKILL)
    if _pdeathsig and os.getppid() != parent:
        # between the read and prctl
        _die(f"the {kind} launcher (pid {parent}) died as this rank started")
    runner = _deepspeed_runner(parent) if kind == "deepspeed" else None
    threading.Thread(
        target=_watch, args=(kind, parent, runner, interval_s), name="die-with-parent", daemon=True
    ).start()
    _armed = True
    return kind


def stop_with_launcher(signum: int, grace_s: float = LAUNCHER_GONE_GRACE_S) -> None:
    """From now on the launcher's death asks this rank to stop instead of killing it: `signum`,
    which the caller handles as a stop request (checkpoint the step reached, exit), is delivered
    to its main thread (the parent-death signal becomes `signum`; the watchdog sends it too), and
    the rank is killed `grace_s` later if it has not ended by then (a collective waiting for a
    rank that is gone). Call it once the handler is installed; a launcher that dies before dies
    with its ranks as `die_with_parent` says.

    Why the ranks, not the launcher: a signal that torchrun or the deepspeed runner does not handle
    kills it outright, and their code is not ours. torchrun turns SIGTERM, SIGINT, SIGHUP and
    SIGQUIT (TORCHELASTIC_SIGNALS_TO_HANDLE) into an exception and passes the same signal on to
    each rank's process group, which the ranks take for a stop request (`launch.stop`), then kills
    them 30 s later; but SIGUSR1 (what `scancel --signal=USR1` without `B:` sends, or a
    `kill -USR1` of the launcher) and SIGXCPU (its own CPU-time limit) end it at once (SIGXFSZ
    Python ignores); a wrapper that passed signals on would serve only the jobs started through
    it. The ranks see their launcher die whatever killed it, so a `kill -9` of the launcher also
    ends them with a checkpoint, within the grace, rather than without one."""
    global _stop_on_death
    _stop_on_death = (int(signum), grace_s)
    if _pdeathsig:
        _set_pdeathsig(signum)


def _watch(kind: str, parent: int, runner: int | None, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent:
            return _launcher_gone(f"the {kind} launcher (pid {parent}) died")
        # DeepSpeed's launch.py outlives a killed runner (it is reparented), so ask who its parent
        # is now.
        if runner is not None and _parent_of(parent) not in (runner, None):
            return _launcher_gone(f"the deepspeed runner (pid {runner}) died")


def _launcher_gone(reason: str) -> None:
    """Die, or, after `stop_with_launcher`, ask the main thread to stop and die if it has
    not ended in time."""
    if _stop_on_death is None:
        _die(reason)
    signum, grace_s = _stop_on_death
    _tell(f"{reason}; stopping with a checkpoint (killed if still running in {grace_s:.0f} s)")
    signal.pthread_kill(threading.main_thread().ident, signum)
    time.sleep(grace_s)
    _die(f"{reason}, and this rank did not stop within {grace_s:.0f} s")


def _started_detached() -> bool:
    hangup = getattr(signal, "SIGHUP", None)
    nohup = hangup is not None and signal.getsignal(hangup) == signal.SIG_IGN
    setsid = hasattr(os, "getsid") and os.getsid(0) == os.getpid()
    return nohup or setsid


def _set_pdeathsig(sig: int) -> bool:
    """Ask the kernel for `sig` when our parent dies (Linux only); whether it was set."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):  # no libc to load: the watchdog still serves
        return False


def _runs_launcher(pid: int, kind: str) -> bool:
    """Whether process `pid` could be a launcher of this kind; True when it cannot be told."""
    if kind == "srun":
        name = _read_proc(pid, "comm")
        return name is None or name.strip() == "slurmstepd"
    # torchrun's agent and DeepSpeed's launch.py are Python programs, whatever their script is
    # called: the interpreter is the executable, or the command's first word where that is hidden.
    try:
        program = os.readlink(f"/proc/{pid}/exe")
    except OSError:
        program = _program(pid).split(" ")[0]
    return not program or re.match(r"(python|pypy)", os.path.basename(program)) is not None


def _deepspeed_runner(launcher: int) -> int | None:
    """The `deepspeed` runner above DeepSpeed's per-node launch.py, if that is who started it
    (a multi-node run starts launch.py through pdsh or ssh instead: nothing more to watch)."""
    runner = _parent_of(launcher)
    command = _program(runner) if runner else ""
    if runner and "deepspeed" in command and "deepspeed.launcher.launch" not in command:
        return runner
    return None


def _parent_of(pid: int) -> int | None:
    stat = _read_proc(pid, "stat")
    if stat is None:
        return None
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last
    # ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def _program(pid: int) -> str:
    return (_read_proc(pid, "cmdline") or "").replace("\0", " ").strip()


def _read_proc(pid: int, name: str) -> str | None:
    try:
        with open(f"/proc/{pid}/{name}", "rb") as fh:
            return fh.read().decode(errors="replace")
    except OSError:
        return None


def _die(reason: str) -> None:
    """SIGKILL ourselves, as PR_SET_PDEATHSIG would: no checkpoint, no W&B summary, no cleanup."""
    _tell(f"{reason}; exiting")
    if hasattr(signal, "SIGKILL"):
        os.kill(os.getpid(), signal.SIGKILL)
    os._exit(1)


def _tell(message: str) -> None:
    try:
        print(f"rank pid {os.getpid()}: {message}", file=sys.stderr, flush=True)
    except (OSError, ValueError):  # stderr may be a pipe to the launcher that died
        pass
