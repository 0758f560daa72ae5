"""common.cgroup: the memory a process's cgroup can still give, version 1 and 2 layouts, and a
real group made here when this machine lets a test make one."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from repo import ROOT

from common.cgroup import memory_left

MIB = 1 << 20


def write(folder: Path, **files):
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_version_2_takes_the_least_over_the_group_and_its_parents(tmp_path):
    root = tmp_path / "fs"
    write(root, cgroup_controllers="cpu memory\n")
    write(root / "job_7", memory_max=f"{1000 * MIB}\n", memory_current=f"{300 * MIB}\n")
    write(
        root / "job_7" / "step_0",
        memory_max="max\n",
        memory_current=f"{200 * MIB}\n",
        memory_stat=f"anon 1\ninactive_file {50 * MIB}\n",
    )
    proc = tmp_path / "cgroup"
    proc.write_text("0::/job_7/step_0\n")
    assert memory_left(proc, root) == 700 * MIB  # the job's: 1000 - 300
    write(root / "job_7" / "step_0", memory_max=f"{400 * MIB}\n")
    assert memory_left(proc, root) == 250 * MIB  # the step's: 400 - (200 - 50 cached)


def test_version_1_and_no_limit(tmp_path):
    root = tmp_path / "fs"
    write(root / "memory", memory_limit_in_bytes="9223372036854771712\n")
    write(
        root / "memory" / "slurm" / "uid_0" / "job_3",
        memory_limit_in_bytes=f"{512 * MIB}\n",
        memory_usage_in_bytes=f"{112 * MIB}\n",
        memory_stat=f"cache 5\ntotal_inactive_file {12 * MIB}\n",
    )
    write(root / "memory" / "slurm", memory_limit_in_bytes="9223372036854771712\n")
    proc = tmp_path / "cgroup"
    proc.write_text("4:memory:/slurm/uid_0/job_3\n2:cpu,cpuacct:/slurm\n0::/\n")
    assert memory_left(proc, root) == 412 * MIB
    proc.write_text("4:memory:/slurm\n0::/\n")
    assert memory_left(proc, root) is None  # no limit anywhere
    proc.write_text("4:memory:/gone/elsewhere\n")  # a namespace's path: the root is read
    assert memory_left(proc, root) is None


def _v1_memory_mount() -> Path | None:
    mount = Path("/sys/fs/cgroup/memory")
    if not (mount / "memory.limit_in_bytes").is_file() or not os.access(mount, os.W_OK):
        return None
    return mount


@pytest.mark.skipif(_v1_memory_mount() is None, reason="no writable cgroup v1 memory hierarchy")
def test_a_real_cgroup_limit_is_what_prepare_sees_as_available():
    group = _v1_memory_mount() / f"prepare-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "memory.limit_in_bytes").write_text(str(300 * MIB))
        code = (
            "import os, sys; open(sys.argv[1], 'w').write(str(os.getpid())); "
            "from pipeline.prepare.memory import available_bytes; print(available_bytes())"
        )
        # the child joins the group before it imports the project, then asks
        out = subprocess.run(
            [sys.executable, "-c", code, str(group / "cgroup.procs")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        available = int(out.stdout.strip())
        assert 150 * MIB < available <= 300 * MIB
    finally:
        group.rmdir()
