"""Who am I in the job: rank, world and rendezvous from torchrun, the deepspeed launcher or srun.

torchrun and the deepspeed launcher export RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT. Under `srun` (one process per rank) only SLURM_* variables are
set; they are translated here, with the rendezvous on the first node of the allocation. A
plain `python -m launch.train` is a world of one.
"""

from __future__ import annotations

import datetime
import os
import socket
import subprocess
from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST", "")
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True)
        host = out.stdout.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        host = nodelist.split(",")[0]
    # A node's name need not resolve (emulated nodes of a test cluster): use what does.
    try:
        socket.gethostbyname(host)
        return host
    except OSError:
        return "127.0.0.1"


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
        torch.cuda.set_device(denv.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=denv.rank, world_size=denv.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return backend


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


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum a few scalars over ranks (float64 on CPU: gloo is everywhere)."""
    tensor = torch.tensor(values, dtype=torch.float64)
    if dist.is_initialized():
        if dist.get_backend() == "nccl":
            tensor = tensor.cuda()
        dist.all_reduce(tensor)
    return tensor.cpu().tolist()


def destroy() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
