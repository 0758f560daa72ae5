"""A refusal as the commands give it: exit status 2 and one `error:` line naming the problem, no
traceback (common.configure.run_main), checked on run_cli's (status, stderr lines) or on a
CompletedProcess. Free of conftest, so that a test file run as a script can import it."""

from __future__ import annotations

import subprocess


def assert_one_error_line(code: int, lines: list[str], *fragments: str) -> str:
    """run_cli's answer is exit status 2, one `error:` line with each fragment and no traceback;
    that line."""
    errors = [line for line in lines if line.startswith("error:")]
    assert code == 2 and len(errors) == 1, "\n".join(lines[-40:])
    assert not any("Traceback" in line for line in lines), "\n".join(lines[-40:])
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def assert_one_line_error(result: subprocess.CompletedProcess, *fragments: str) -> str:
    """The same of a CompletedProcess (as test_checkpoint_integrity's run_export returns): exit
    status 2, one `error: ` line with each fragment in its stderr and no traceback; that line."""
    assert result.returncode == 2, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]
