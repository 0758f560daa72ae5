"""Who am I in the job: rank, world and rendezvous from torchrun, the deepspeed launcher or srun.

torchrun and the deepspeed launcher export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Under `srun` (one process per rank) only SLURM_* variables are
set; they are translated here, with the rendezvous on the first node of the allocation. A
plain `python -m launch.train` is a world of one.

A rendezvous port that is already taken is reported in one line (`init_process_group`), not
as a traceback. A rank also ends with its launcher: `launch.launcher`.
"""

from __future__ import annotations

import datetime
import errno
import logging
import os
import re
import socket
import subprocess
import sys
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
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        )
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
    raise UserError(
        f"the first node of the allocation, {host!r} (SLURM_JOB_NODELIST={nodelist}), does not "
        f"resolve{' and SLURM gives no address for it' if len(candidates) < 2 else ''}: the ranks "
        "could not meet there; set MASTER_ADDR to its address (an IP every node reaches)"
    )


def _slurm_node_addr(host: str) -> str | None:
    """SLURM's NodeAddr for a node, or None where scontrol is missing or does not know it."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "node", host, "--oneliner"],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
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
        per_node = int(env.get("SLURM_NTASKS_PER_NODE", "0").split("(")[0] or 0) or ntasks // int(
            env.get("SLURM_NNODES", "1")
        )
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
    cores = (
        len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    )
    threads = threads_per_rank or max(1, cores // denv.local_world_size)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def init_process_group(denv: DistEnv, timeout_s: int) -> str:
    """Join the job's process group (gloo on CPU, NCCL with CUDA); returns the backend."""
    for key, value in (
        ("RANK", denv.rank),
        ("WORLD_SIZE", denv.world_size),
        ("LOCAL_RANK", denv.local_rank),
        ("MASTER_ADDR", denv.master_addr),
        ("MASTER_PORT", denv.master_port),
    ):
        os.environ[key] = str(value)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        check_gpus_per_node(denv, torch.cuda.device_count())
        torch.cuda.set_device(denv.local_rank)
    if not dist.is_initialized():
        try:
            dist.init_process_group(
                backend,
                rank=denv.rank,
                world_size=denv.world_size,
                timeout=datetime.timedelta(seconds=timeout_s),
            )
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
        raise UserError(
            f"{denv.local_world_size} ranks per node, but this node has {gpus} visible GPU"
            f"{'' if gpus == 1 else 's'}"
            f"{f' (CUDA_VISIBLE_DEVICES={visible})' if visible is not None else ''}: start at most "
            f"{gpus} per node (torchrun/deepspeed --nproc_per_node, srun --ntasks-per-node), or "
            "hide the GPUs (CUDA_VISIBLE_DEVICES=) to train on the CPU"
        )


def rendezvous_problem(denv: DistEnv) -> str | None:
    """Why joining the process group failed, in one line, when the cause is the user's to fix:
    rank 0 hosts the rendezvous store on MASTER_PORT, and another program holds that port.
    Asked after the failure, not before: under torchrun the agent already holds the port for
    the ranks (TORCHELASTIC_USE_AGENT_STORE), so a port in use beforehand is no sign of trouble."""
    hosts_store = (
        denv.rank == 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true"
    )
    if not hosts_store or not port_in_use(denv.master_port):
        return None
    return (
        f"MASTER_PORT={denv.master_port}: port {denv.master_port} on this node is already in use "
        "(another job or rendezvous?), so rank 0 cannot host the rendezvous at "
        f"{denv.master_addr}:{denv.master_port}; set MASTER_PORT (torchrun/deepspeed "
        "--master_port) to a free port"
    )


def port_in_use(port: int) -> bool:
    """Whether a TCP port on this machine cannot be bound (by any address: the
    store listens on all)."""
    with socket.socket() as sock:
        # As the store does: a port held only by connections in TIME_WAIT is free to take.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError as err:
            return err.errno == errno.EADDRINUSE
    return False


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
    GPU under NCCL): nothing here makes the host wait for the device."""
    tensor = scalars_tensor(values)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(tensor)
    return tensor


def scalars_tensor(values: list) -> torch.Tensor:
    """A few scalars as one float64 tensor where collectives run. A value is a Python number or
    a 0-dim tensor on the compute device (a loss). The numbers go over in one host-built tensor
    and one copy (from page-locked memory, asynchronous); building a device tensor per number
    instead costs a blocking copy, a full wait for the queued work, each."""
    device = reduce_device()
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    numbers = [float(value) for value in values if not isinstance(value, torch.Tensor)]
    host = torch.tensor(numbers, dtype=torch.float64)
    if device.type == "cuda":
        host = host.pin_memory().to(device, non_blocking=True)
    on_device = iter(
        [
            value.detach().to(device, torch.float64).reshape(1)
            for value in values
            if isinstance(value, torch.Tensor)
        ]
    )
    from_host = iter(host.split(1))
    return torch.cat(
        [
            next(on_device) if isinstance(value, torch.Tensor) else next(from_host)
            for value in values
        ]
    )


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
