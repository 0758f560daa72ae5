"""Progress of a long loop on stderr, for a person at a terminal or reading a SLURM log.

On a terminal, a tqdm bar with its rate and ETA. Elsewhere (a log file, SLURM's output: no
TTY), where a bar's carriage returns would pile up into one unreadable line, a plain line of
the same figures (tqdm's `format_meter`) at most every PROGRESS_EVERY_S seconds, and one at
the end if any was printed: a loop shorter than that says nothing. Only the main rank shows
any (`enabled`). Every entry point's loop goes through `meter`; the training loop's log line
and the main job's stage lines take their ETA from `remaining` and `interval` here.
"""

from __future__ import annotations

import os
import re
import sys
import time
from typing import TextIO

from tqdm import tqdm

from common.configure import UserError

EVERY_ENV = "PROGRESS_EVERY_S"
DEFAULT_EVERY_S = 30.0
_PLAIN = (
    "{desc}: {n_fmt}/{total_fmt} {unit} ({percentage:.0f}%), elapsed {elapsed}, "
    "ETA {remaining}, {rate_fmt}"
)
_PLAIN_NO_TOTAL = "{desc}: {n_fmt} {unit}, elapsed {elapsed}, {rate_fmt}"
_PROGRESS_LINE = re.compile(r"\bETA (\?|>=|\d)")


def every_s() -> float:
    """Seconds between plain progress lines: $PROGRESS_EVERY_S, else 30 (0: at every update)."""
    given = os.environ.get(EVERY_ENV, "")
    if not given:
        return DEFAULT_EVERY_S
    try:
        value = float(given)
    except ValueError:
        value = -1.0
    if not value >= 0:  # also refuses nan
        raise UserError(f"{EVERY_ENV}={given}: seconds between progress lines, a number >= 0")
    return value


class Meter:
    """`update(n)` as work is done, `close()` at the end (or use it as a context manager)."""

    def __init__(
        self,
        total: int | None,
        desc: str,
        unit: str,
        *,
        enabled: bool = True,
        stream: TextIO | None = None,
    ):
        self.total, self.desc, self.unit = total, desc, unit
        self.stream = stream or sys.stderr
        self.n = self._said_n = 0
        self.bar = None
        self.plain = False
        self.every = every_s()  # read on every rank: a bad value fails them all alike
        if not enabled:
            return
        if self.stream.isatty():
            # A terminal that reports no size (a bare pseudo-terminal: 0 x 0) would get no bar from
            # tqdm.
            columns, rows = _size(self.stream)
            self.bar = tqdm(
                total=total,
                desc=desc,
                unit=unit,
                file=self.stream,
                dynamic_ncols=columns > 0,
                ncols=None if columns else 80,
                nrows=None if rows else 24,
            )
        else:
            self.plain = True
            self.started = self._said_at = time.monotonic()

    def update(self, n: int = 1) -> None:
        self.n += n
        if self.bar is not None:
            self.bar.update(n)
        elif self.plain and time.monotonic() - self._said_at >= self.every:
            self._say()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        elif self.plain and self._said_n and self.n != self._said_n:
            self._say()
        self.plain = False

    def _say(self) -> None:
        now = time.monotonic()
        line = tqdm.format_meter(
            self.n,
            self.total,
            now - self.started,
            prefix=self.desc,
            unit=self.unit,
            bar_format=_PLAIN if self.total else _PLAIN_NO_TOTAL,
        )
        self.stream.write(" ".join(line.split()) + "\n")  # one write: ranks' lines do not splice
        self.stream.flush()
        self._said_at, self._said_n = now, self.n

    def __enter__(self) -> "Meter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _size(stream: TextIO) -> tuple[int, int]:
    """(columns, rows) of the terminal `stream` writes to; 0 where it reports none."""
    try:
        return tuple(os.get_terminal_size(stream.fileno()))
    except (AttributeError, OSError, ValueError):
        return 0, 0


def meter(
    total: int | None,
    desc: str,
    unit: str = "it",
    *,
    enabled: bool = True,
    stream: TextIO | None = None,
) -> Meter:
    """A progress meter over `total` units (None: unknown) on `stream` (stderr): a tqdm bar on a
    terminal, plain lines otherwise, nothing when not `enabled` (a rank other than the main one)."""
    return Meter(total, desc, unit, enabled=enabled, stream=stream)


def remaining(done: float, total: float, elapsed: float) -> float | None:
    """Seconds left at the mean rate so far; None before anything is done."""
    return elapsed / done * max(total - done, 0) if done > 0 else None


def interval(seconds: float | None) -> str:
    """`[H:]MM:SS`, as tqdm writes its times; `?` for an unknown one."""
    return "?" if seconds is None else tqdm.format_interval(max(seconds, 0))


def is_progress_line(line: str) -> bool:
    """Whether a log line is a progress line: this module's plain line, or training's log line."""
    return bool(_PROGRESS_LINE.search(line))
