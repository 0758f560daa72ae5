"""The loader's persistent DataLoader workers: started once and told each epoch's starting point
through a shared cursor, ended with their loader or their rank and never by a job's signals."""

from __future__ import annotations

import atexit
import functools
import os
import signal
import threading
import time

import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.load.epoch import rank_epoch


def start_workers(spec: dict, cursor: torch.Tensor, num_workers: int, seed: int):
    """(DataLoader, its closing flag): `num_workers` persistent workers iterating the batches of
    `spec` (`pipeline.load.epoch.rank_epoch`) from the (epoch, first batch) in `cursor` each
    time they restart. A private generator: creating a DataLoader iterator draws a seed from the
    one it is given, and drawing from torch's global generator would shift the trainer's dropout
    stream, so a resumed run would no longer repeat an uninterrupted one."""
    closing = torch.zeros(1, dtype=torch.int64).share_memory_()
    _OPEN_WORKER_FLAGS.append(closing)
    workers = DataLoader(
        CursorBatches(spec, cursor),
        batch_size=None,
        num_workers=num_workers,
        collate_fn=_as_is,
        persistent_workers=True,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=functools.partial(_worker_lifetime, closing),
    )
    return workers, closing


def stop_workers(workers: DataLoader | None, closing: torch.Tensor | None) -> None:
    """Stop the workers. One that is blocked in a remote fetch ends itself a moment later
    (`_worker_lifetime`)."""
    if closing is not None:
        closing[0] = 1
    iterator = getattr(workers, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()


class CursorBatches(IterableDataset):
    """What the persistent workers iterate: the batches of the epoch and first batch that the
    shared `cursor` holds when they (re)start."""

    def __init__(self, spec: dict, cursor: torch.Tensor):
        self.spec, self.cursor = spec, cursor

    def __iter__(self):
        epoch, first = (int(value) for value in self.cursor.tolist())
        return iter(rank_epoch(self.spec, epoch, first))


WORKER_EXIT_S = 1.0  # how long a closed loader's worker may take to end by itself


_OPEN_WORKER_FLAGS: list[torch.Tensor] = []  # every loader's `closing` flag, raised at exit


@atexit.register
def _close_workers_at_exit() -> None:
    """A process that ends with a loader still open (never closed, its iterator still referenced)
    raises every loader's flag, so that the workers end by themselves (`_worker_lifetime`).
    multiprocessing's own exit handler, which runs after this one (registered earlier), joins
    them; SIGTERM, which it would send first, they ignore, so without this the join waited for
    ever (a test process that never exited)."""
    for flag in _OPEN_WORKER_FLAGS:
        flag[0] = 1


def _worker_lifetime(closing: torch.Tensor, worker_id: int) -> None:
    """A DataLoader worker (its worker_init_fn) lives as long as its loader and its rank, no longer:
    * it ignores SIGTERM, SIGHUP and SIGQUIT, which reach every process of a job (torchrun sends
      them to each rank's process group, SLURM SIGTERM to every process of a step): dead of one
      mid-batch, a worker takes its rank down ("DataLoader worker is killed by signal") before
      the rank, which takes them for a stop request, could checkpoint (SIGXCPU and SIGXFSZ, which
      its own limits send it alone, the stop handler it inherits passes on to the rank);
    * a thread ends it WORKER_EXIT_S after its loader is closed, or at once when its rank is gone,
      if it has not ended by itself. Asked to stop, a worker ends between two batches, but one
      blocked in a remote fetch or a retry's back-off (minutes, at the default timeouts) would
      keep its rank, and a stop request, waiting. What it leaves in the shard cache is what a
      killed download leaves, which the next fetch clears (`pipeline.remote`). Exit status 0:
      the DataLoader takes any other for a worker that failed."""
    for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(signum, signal.SIG_IGN)
    rank = os.getppid()

    def leave():
        while not int(closing[0]) and os.getppid() == rank:
            time.sleep(0.1)
        if os.getppid() == rank:
            time.sleep(WORKER_EXIT_S)
        os._exit(0)

    threading.Thread(target=leave, name="worker-lifetime", daemon=True).start()


def _as_is(item):
    return item
