"""Runs the pipeline's pure work functions as Ray tasks: the only module that imports Ray.

A local Ray is started by default (`ray.address: ""`, with `num_workers` CPUs); `auto` or
`host:port` joins a running cluster such as the one `slurm/prepare.sbatch` starts. Tasks
are kept 2 x `num_workers` in flight, results are returned in submission order whatever order
they finish in, so the output never depends on scheduling.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sized

from common.configure import UserError
from common.progress import meter
from common.storage import storage_refusal
from pipeline.prepare.config import RayConfig

# the repository (this file is pipeline/prepare/ray_runner.py); not pipeline/, whose module names
# (inspect, format) would hide the standard library's in the workers
PROJECT_ROOT = str(Path(__file__).resolve().parents[2])


@contextlib.contextmanager
def ray_session(cfg: RayConfig) -> Iterator[None]:
    """Connect to (or start) Ray for the duration of a prepare run.

    However the run ends (an error, Ctrl-C, SIGTERM), a local Ray started here is shut down
    and waited for, raylet, GCS and workers included, rather than left to notice later.
    """
    import ray

    if cfg.num_workers < 1:
        raise UserError(f"ray.num_workers: must be at least 1, got {cfg.num_workers}")
    started = not ray.is_initialized()
    before = _descendants() if started else set()
    try:
        if started:
            _init(ray, cfg)
        yield
    finally:
        if started:
            # the raylet, the GCS and the workers the raylet started
            spawned = _descendants() - before
            ray.shutdown(wait_for_processes=True)
            reap(spawned)


# how long the workers of a shut-down local Ray get to exit before they are killed
WORKER_EXIT_S = 15.0


def _descendants() -> set:
    import psutil

    try:
        return set(psutil.Process().children(recursive=True))
    except psutil.Error:
        return set()


def reap(processes) -> None:
    """`ray.shutdown(wait_for_processes=True)` waits for the raylet and GCS, not for the workers
    the raylet started: those notice it gone and exit a moment later, after the run could have
    ended (seen as `ray::IDLE` processes outliving an interrupted prepare). Wait for them too,
    and kill any still there after WORKER_EXIT_S."""
    import psutil

    _, alive = psutil.wait_procs(list(processes), timeout=WORKER_EXIT_S)
    for process in alive:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def _init(ray: Any, cfg: RayConfig) -> None:
    # Workers import this project by path: that works on one machine and on a cluster
    # whose nodes share the file system (as SLURM clusters do) without uploading code.
    env = {
        "PYTHONPATH": os.pathsep.join(
            p for p in (PROJECT_ROOT, os.environ.get("PYTHONPATH", "")) if p
        ),
        "OMP_NUM_THREADS": "1",
        # One core per worker, as OMP_NUM_THREADS: the tokenizers library's batch encode would
        # otherwise start a thread per core in every worker, and the workers fight for the cores.
        "TOKENIZERS_PARALLELISM": "false",
        "RAYON_NUM_THREADS": "1",
    }
    kwargs: dict[str, Any] = dict(
        runtime_env={"env_vars": env},
        include_dashboard=False,
        log_to_driver=True,
        logging_level="WARNING",
    )
    if cfg.address:
        kwargs["address"] = cfg.address
    else:
        # "local" starts a private instance even when another Ray runs on this machine.
        kwargs.update(address="local", num_cpus=cfg.num_workers)
    # ray.init replaces the SIGTERM handler with its own; keep the caller's (pipeline.prepare
    # turns SIGTERM into KeyboardInterrupt, whose unwinding shuts Ray down here).
    main_thread = threading.current_thread() is threading.main_thread()
    sigterm = signal.getsignal(signal.SIGTERM) if main_thread else None
    try:
        ray.init(**kwargs)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise UserError(
            "cannot start or join Ray at "
            f"{cfg.address or 'a local instance'}: {str(err).splitlines()[0]}"
        ) from err
    finally:
        if callable(sigterm):
            signal.signal(signal.SIGTERM, sigterm)


# Set by the driver's SIGINT/SIGTERM handler (`pipeline.prepare`). The handler also raises
# KeyboardInterrupt, but one raised while the main thread waits inside Ray's blocking calls can
# be absorbed there (seen under load: a SIGINT'd prepare ran to the end and exited 0), so the
# task loop checks this flag too.
INTERRUPTED = threading.Event()


def run_tasks(
    fn: Callable[..., Any],
    arguments: Iterable[tuple],
    *,
    num_workers: int,
    desc: str,
    progress: bool = True,
    shared: dict[str, Any] | None = None,
) -> list[Any]:
    """`[fn(*args, **shared) for args in arguments]`, computed as Ray tasks, in order.

    `shared` values (a tokenizer, a config) are put in the object store once rather than
    pickled into every task. `arguments` may be an iterator (chunks of a file decompressed as
    they are needed): it is drawn from only as tasks are submitted, so at most 2 x
    `num_workers` of its items are held at once.

    A task's UserError is raised as the driver's own; a task's OSError of refused storage (a
    full or read-only output: `common.storage.storage_refusal`) as a plain OSError with its
    errno and file, for the caller's `storage_errors` to say in one line; anything else as
    Ray's RayTaskError, with the task's traceback.
    """
    import ray

    remote = ray.remote(num_cpus=1, max_retries=0)(fn)
    shared_refs = {name: ray.put(value) for name, value in (shared or {}).items()}
    total = len(arguments) if isinstance(arguments, Sized) else None
    upcoming = iter(arguments)
    results: list[Any] = []
    pending: dict[Any, int] = {}
    exhausted = False
    with meter(total, desc, "task", enabled=progress) as bar:
        while not exhausted or pending:
            if INTERRUPTED.is_set():
                raise KeyboardInterrupt("interrupted")
            # Twice the workers in flight, so none idles while the driver collects a result.
            while not exhausted and len(pending) < 2 * num_workers:
                args = next(upcoming, None)
                if args is None:
                    exhausted = True
                    break
                pending[remote.remote(*args, **shared_refs)] = len(results)
                results.append(None)
                # a chunk's bytes are the task's now (in the object store), not the driver's
                del args
            if not pending:
                break
            # wakes to see INTERRUPTED
            done, _ = ray.wait(list(pending), num_returns=1, timeout=1.0)
            for ref in done:
                index = pending.pop(ref)
                try:
                    results[index] = ray.get(ref)
                except ray.exceptions.RayTaskError as err:
                    cause = getattr(err, "cause", None)
                    if isinstance(cause, UserError):
                        raise UserError(str(cause.args[0])) from None
                    if storage_refusal(cause):
                        # A full or read-only output (ENOSPC, EROFS, ...): raised here as the
                        # task's plain OSError, errno and file kept, which the driver's
                        # `storage_errors` says in one line, as it says its own.
                        raise OSError(
                            cause.errno, cause.strerror, cause.filename, None, cause.filename2
                        ) from None
                    raise
                bar.update(1)
    return results
