"""Who am I in the job: rank, world and rendezvous from torchrun, the deepspeed launcher or srun.

torchrun and the deepspeed launcher export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Under `srun` (one process per rank) only SLURM_* variables are
set; they are translated here, with the rendezvous on the first node of the allocation. A
plain `python -m launch.train` is a world of one.

A rank also ends with its launcher (`die_with_parent`, `stop_with_launcher`): torchrun starts
each rank in a session of its own, so a `kill -9` of torchrun (a user, or a scheduler without
cgroups) would leave the ranks training to the end and writing checkpoints, unseen. And a
rendezvous port that is already taken is reported in one line (`init_process_group`), not as a
traceback.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import errno
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from common.configure import UserError, run_main


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _first_slurm_host() -> str:
    """The address of the allocation's first node, where rank 0 hosts the rendezvous (the
    srun-per-rank path). SLURM's NodeAddr for it if it has one (what slurmd itself is reached
    at; emulated nodes of a one-machine cluster have 127.0.0.1 there), else its name. Either
    must resolve: falling back to this machine would leave every other node waiting in the
    rendezvous until its timeout."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True)
        host = out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        host = nodelist.split(",")[0]
    candidates = [addr for addr in (_slurm_node_addr(host), host) if addr]
    for addr in candidates:
        try:
            socket.getaddrinfo(addr, None)
            return addr
        except OSError:
            continue
    raise UserError(f"the first node of the allocation, {host!r} (SLURM_JOB_NODELIST={nodelist}), does not resolve"
                    f"{' and SLURM gives no address for it' if len(candidates) < 2 else ''}: the ranks could not meet "
                    "there; set MASTER_ADDR to its address (an IP every node reaches)")


def _slurm_node_addr(host: str) -> str | None:
    """SLURM's NodeAddr for a node, or None where scontrol is missing or does not know it."""
    try:
        out = subprocess.run(["scontrol", "show", "node", host, "--oneliner"], capture_output=True, text=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"\bNodeAddr=(\S+)", out)
    return match.group(1) if match and match.group(1) != "(null)" else None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def read_env() -> DistEnv:
    env = os.environ
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(env.get("MASTER_PORT", 29500)),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        ntasks = int(env["SLURM_NTASKS"])
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or ntasks // int(env.get("SLURM_NNODES", "1"))
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return DistEnv(
            rank=int(env["SLURM_PROCID"]),
            world_size=ntasks,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            local_world_size=max(per_node, 1),
            master_addr=env.get("MASTER_ADDR") or _first_slurm_host(),
            # Derived from the job id so that every rank agrees without talking first.
            master_port=int(env.get("MASTER_PORT") or 20000 + job_id % 20000),
        )
    return DistEnv(0, 1, 0, 1, "127.0.0.1", int(env.get("MASTER_PORT") or _free_port()))


def set_threads(threads_per_rank: int, denv: DistEnv) -> int:
    """One rank per core share: oversubscribed ranks on a CPU are many times slower."""
    # The CPUs this process may run on (SLURM and taskset restrict them), not the machine's.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    threads = threads_per_rank or max(1, cores // denv.local_world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def init_process_group(denv: DistEnv, timeout_s: int) -> str:
    """Join the job's process group (gloo on CPU, NCCL with CUDA); returns the backend."""
    for key, value in (("RANK", denv.rank), ("WORLD_SIZE", denv.world_size), ("LOCAL_RANK", denv.local_rank),
                       ("MASTER_ADDR", denv.master_addr), ("MASTER_PORT", denv.master_port)):
        os.environ[key] = str(value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        check_gpus_per_node(denv, torch.cuda.device_count())
        torch.cuda.set_device(denv.local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group(backend, rank=denv.rank, world_size=denv.world_size,
                                    timeout=datetime.timedelta(seconds=timeout_s))
        except dist.DistNetworkError as err:
            problem = rendezvous_problem(denv)
            if problem is None:
                raise
            raise UserError(problem) from err
        if backend == "nccl" and denv.world_size > 1:
            global _host_group
            _host_group = dist.new_group(backend="gloo")  # see any_rank
    return backend


def check_gpus_per_node(denv: DistEnv, gpus: int) -> None:
    """Refuse, on every rank alike, a node with more ranks than visible GPUs (rank k takes GPU
    k of its node; the ranks beyond the last GPU would die with "invalid device ordinal")."""
    if denv.local_world_size > gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        raise UserError(f"{denv.local_world_size} ranks per node, but this node has {gpus} visible GPU"
                        f"{'' if gpus == 1 else 's'}{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}: "
                        f"start at most {gpus} per node (torchrun/deepspeed --nproc_per_node, srun --ntasks-per-node), "
                        "or hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU")


def rendezvous_problem(denv: DistEnv) -> str | None:
    """Why joining the process group failed, in one line, when the cause is the user's to fix:
    rank 0 hosts the rendezvous store on MASTER_PORT, and another program holds that port.
    Asked after the failure, not before: under torchrun the agent already holds the port for
    the ranks (TORCHELASTIC_USE_AGENT_STORE), so a port in use beforehand is no sign of trouble."""
    hosts_store = denv.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    if not hosts_store or not port_in_use(denv.master_port):
        return None
    return (f"MASTER_PORT={denv.master_port}: port {denv.master_port} on this node is already in use (another job "
            f"or rendezvous?), so rank 0 cannot host the rendezvous at {denv.master_addr}:{denv.master_port}; "
            "set MASTER_PORT (torchrun/deepspeed --master_port) to a free port")


def port_in_use(port: int) -> bool:
    """Whether a TCP port on this machine cannot be bound (by any address: the store listens on all)."""
    with socket.socket() as sock:
        # As the store does: a port held only by connections in TIME_WAIT is free to take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


# ----------------------------------------------------------------------------- dying with the launcher

# Linux's prctl(2) option: the signal this process gets when the thread that forked it exits.
PR_SET_PDEATHSIG = 1
WATCH_INTERVAL_S = 1.0
LAUNCHER_GONE_GRACE_S = 30.0  # as long as torchrun gives its ranks between SIGTERM and SIGKILL
_armed = False
_pdeathsig = False  # whether the kernel signals this rank when its launcher dies
_stop_on_death: tuple[int, float] | None = None  # (signal, grace) once `stop_with_launcher` is called


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
        _die(f"the {kind} launcher that started this rank is gone (the parent is now pid {parent}, "
             f"{os.path.basename(_program(parent).split(' ')[0]) or 'unknown'})")
    _pdeathsig = kind in ("torchrun", "deepspeed") and _set_pdeathsig(signal.SIGKILL)
    if _pdeathsig and os.getppid() != parent:
        _die(f"the {kind} launcher (pid {parent}) died as this rank started")  # between the read and prctl
    runner = _deepspeed_runner(parent) if kind == "deepspeed" else None
    threading.Thread(target=_watch, args=(kind, parent, runner, interval_s), name="die-with-parent",
                     daemon=True).start()
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
    SIGQUIT into an exception and passes SIGTERM on to its ranks, which stop, but SIGUSR1 (what
    `scancel --signal=USR1` without `B:` sends, or a `kill -USR1` of the launcher) ends it at once;
    a wrapper that passed signals on would serve only the jobs started through it. The ranks see
    their launcher die whatever killed it, so a `kill -9` of the launcher also ends them with a
    checkpoint, within the grace, rather than without one."""
    global _stop_on_death
    _stop_on_death = (int(signum), grace_s)
    if _pdeathsig:
        _set_pdeathsig(signum)


def _watch(kind: str, parent: int, runner: int | None, interval_s: float) -> None:
    while True:
        time.sleep(interval_s)
        if os.getppid() != parent:
            return _launcher_gone(f"the {kind} launcher (pid {parent}) died")
        # DeepSpeed's launch.py outlives a killed runner (it is reparented), so ask who its parent is now.
        if runner is not None and _parent_of(parent) not in (runner, None):
            return _launcher_gone(f"the deepspeed runner (pid {runner}) died")


def _launcher_gone(reason: str) -> None:
    """Die, or, after `stop_with_launcher`, ask the main thread to stop and die if it has not ended in time."""
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
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'.
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


# ----------------------------------------------------------------------------- ending a rank

def run_rank(main) -> None:
    """A rank's entry point: `run_main(main)`, then end the process with `os._exit`, skipping
    the interpreter's teardown.

    Why: gloo's worker threads (and other native threads of torch and DeepSpeed) can still be
    releasing tensors when Python finalizes. A native thread that needs the GIL then is ended
    by `pthread_exit`, whose forced unwinding through C++ code calls std::terminate: a run that
    finished and saved everything exits with SIGABRT ("terminate called without an active
    exception", seen under load in CI). By the time `main` returns, everything a rank writes
    is written and closed (checkpoints, metrics, the W&B run finished, the process group
    destroyed), so the teardown has nothing left to do but race. An exception other than
    SystemExit (a bug) takes the normal path, traceback included."""
    try:
        run_main(main)
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:  # SystemExit("message"): Python prints it and exits 1
            print(stop.code, file=sys.stderr)
            code = 1
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a pipe to a launcher that is gone
            pass
    os._exit(code)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def all_gather_object(obj) -> list:
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def reduce_device() -> torch.device:
    """Where collectives run: the rank's GPU under NCCL, else the host (gloo, or no group)."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum_tensor(values: list) -> torch.Tensor:
    """Sum a few scalars over ranks, in float64, leaving the sums where the collective ran (the
    GPU under NCCL): nothing here makes the host wait for the device. A value is a Python number
    or a 0-dim tensor on the compute device (a loss). The numbers go over in one host-built
    tensor and one copy (from page-locked memory, asynchronous); building a device tensor per
    number instead costs a blocking copy, a full wait for the queued work, each."""
    device = reduce_device()
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    numbers = [float(value) for value in values if not isinstance(value, torch.Tensor)]
    host = torch.tensor(numbers, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    on_device = iter([value.detach().to(device, torch.float64).reshape(1) for value in values
                      if isinstance(value, torch.Tensor)])
    from_host = iter(host.split(1))
    tensor = torch.cat([next(on_device) if isinstance(value, torch.Tensor) else next(from_host) for value in values])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def all_reduce_sum(values: list) -> list[float]:
    """`all_reduce_sum_tensor`, read back on the host in one copy: a step that reduces its
    figures this way waits for the device once, not once per value."""
    return all_reduce_sum_tensor(values).cpu().tolist()


_host_group = None  # under NCCL, the gloo group of every rank that `any_rank` sums over


def any_rank(flag: bool) -> bool:
    """Whether `flag` is true on any rank, known to the host at once: summed on the CPU, by gloo
    (under NCCL a gloo group of the same ranks, made with the process group), so the answer waits
    for no work queued on a device. For a decision the ranks must share before the first
    collective of a step: whether any of them was stopped while it waited for its batches."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    votes = torch.tensor([float(flag)])
    dist.all_reduce(votes, group=_host_group)
    return bool(votes.item())


def destroy() -> None:
    global _host_group
    if dist.is_initialized():
        dist.destroy_process_group()
    _host_group = None
