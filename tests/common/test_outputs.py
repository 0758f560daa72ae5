"""common.outputs, the one way an output directory is replaced (issue 61): staging and replaced
names unique to the run and marked; a failed swap puts the old output back; what a run killed
outright left is cleared only where it carries our marker, and an output such a run had moved
aside is put back; a symbolic link named as the output stays the user's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
from repo import ROOT

from common.configure import UserError
from common.outputs import (
    MARKER,
    check_inputs_outside,
    check_replaceable,
    clear_leftovers,
    new_staging,
    publish,
    real_output,
)


def test_a_swap_uses_names_of_its_own_and_removes_only_them(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    for name in ("out.old", "out.partial", "out.replaced"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "mine.txt").write_text(name)
    staging = new_staging(out, "test")
    assert staging.name.startswith(f"out.partial-{os.getpid()}-") and (staging / MARKER).is_file()
    assert new_staging(out, "test") != staging  # two runs never share a name
    (staging / "new.txt").write_text("new")
    publish(staging, out, "test")
    assert sorted(p.name for p in out.iterdir()) == ["new.txt"]  # no marker left in the output
    for name in ("out.old", "out.partial", "out.replaced"):
        assert (tmp_path / name / "mine.txt").read_text() == name


KILLED_MID_SWAP = """
import os, sys
from pathlib import Path
import common.outputs as outputs
out = Path(sys.argv[1])
staging = outputs.new_staging(out, "test")
(staging / "new.txt").write_text("new")
real_rename = Path.rename
def rename(self, target):
    if self == staging:  # the old output is aside, the new one not yet in place
        os.kill(os.getpid(), 9)
    return real_rename(self, target)
Path.rename = rename
outputs.publish(staging, out, "test")
"""


def test_what_a_run_killed_mid_swap_left_is_put_back_or_cleared(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("the previous output")
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_MID_SWAP, str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert killed.returncode == -signal.SIGKILL
    assert not out.exists()  # moved aside: out.replaced-*, and the new one in out.partial-*
    (tmp_path / "out.partial-someone-else").mkdir()  # no marker: not ours
    said = []
    removed = clear_leftovers(out, said.append)
    assert (out / "old.txt").read_text() == "the previous output" and not (out / MARKER).exists()
    assert [p.name.rpartition("-")[0].rpartition("-")[0] for p in removed] == ["out.partial"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "out.partial-someone-else"]
    assert said[0].startswith(f"put back {out}") and said[1].startswith("removed ")


def test_what_may_be_replaced(tmp_path):
    def nothing_foreign(directory):
        return []

    def all_foreign(directory):
        return sorted(p.name for p in directory.iterdir())

    out = tmp_path / "out"
    check_replaceable(out, "out", "test", all_foreign, False)  # missing
    out.mkdir()
    check_replaceable(out, "out", "test", all_foreign, False)  # empty
    (out / "a").write_text("a")
    check_replaceable(out, "out", "test", nothing_foreign, True)
    check_replaceable(out, "out", "test", nothing_foreign, None)
    with pytest.raises(UserError, match="pass overwrite=true"):
        check_replaceable(out, "out", "test", nothing_foreign, False)
    with pytest.raises(UserError, match=r"holds what test did not write \(a\)"):
        check_replaceable(out, "out", "test", all_foreign, True)
    (tmp_path / "f").write_text("f")
    with pytest.raises(UserError, match="is a file"):
        check_replaceable(tmp_path / "f", "out", "test", nothing_foreign, True)
    with pytest.raises(UserError, match="an input of this run"):
        check_inputs_outside(tmp_path, "out", [("source.paths", tmp_path / "f")])
    check_inputs_outside(out, "out", [("source.paths", tmp_path / "f")])


def test_a_link_named_as_the_output_stays_the_users(tmp_path):
    target = tmp_path / "scratch" / "data"
    target.mkdir(parents=True)
    link = tmp_path / "data"
    link.symlink_to(target)
    assert real_output(link, "output_dir") == target
    staging = new_staging(real_output(link, "output_dir"), "test")
    assert staging.parent == target.parent
    publish(staging, target, "test")
    assert link.is_symlink() and link.resolve() == target
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    with pytest.raises(UserError, match="does not exist"):
        real_output(tmp_path / "dangling", "output_dir")
