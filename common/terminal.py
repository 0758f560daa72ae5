"""After a hang-up (SIGHUP: the terminal or SSH session that started the job closed), a write to
that terminal fails (EIO), and the first progress or stop line would end the process before it
saved anything. `leave_terminal` sends the standard output and error that are a terminal to
/dev/null, so that a job stopping on a hang-up stops as on SIGTERM."""

from __future__ import annotations

import os
import stat


def leave_terminal() -> None:
    """Point stdout and stderr at /dev/null where they are a terminal (a character device: a
    hung-up terminal may no longer answer isatty); a pipe or a file, a log, is left as it is."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        for fd in (1, 2):
            try:
                if stat.S_ISCHR(os.fstat(fd).st_mode):
                    os.dup2(devnull, fd)
            except OSError:
                continue
    finally:
        os.close(devnull)
