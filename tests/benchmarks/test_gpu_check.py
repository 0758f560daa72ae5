"""benchmarks/gpu_check.sh, the offline GPU check (docs/gpu.md), run here for real up to where a
machine without a usable GPU must stop it: its CUDA probe.

The bundles are made in the test: a wheelhouse with no wheels, whose requirements.txt names what
this environment already has, so that the script's `pip install --no-index` has nothing to do.
The script runs with CUDA_VISIBLE_DEVICES="" so that it stops at the probe on any machine (with a
CPU build of torch, a CUDA build and no driver, or a GPU hidden that way)."""

import os
import subprocess
import sys
import venv
from pathlib import Path

from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
REASONS = ("is a CPU-only build", "no NVIDIA driver", "hides every GPU", "driver is too old")


def wheelhouse(bundle: Path, requirements: str) -> Path:
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "requirements.txt").write_text(requirements)
    (wheels / "bundle.txt").write_text(f"python={sys.version_info[0]}.{sys.version_info[1]}\nskipped=\n")
    return bundle


def run_check(tmp_path: Path, bundle: Path, python: str = sys.executable, **env) -> subprocess.CompletedProcess:
    environment = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHON": python, "OUT": str(tmp_path / "out"),
                   "WORK": str(tmp_path / "work"), **env}
    return subprocess.run(["bash", str(SCRIPT), str(bundle)], cwd=tmp_path, env=environment, capture_output=True,
                          text=True, timeout=240)


def summary(tmp_path: Path) -> list[str]:
    return (tmp_path / "out" / "summary.txt").read_text().splitlines()


def test_check_installs_then_stops_at_the_cuda_probe(tmp_path):
    """The stages before the probe pass (torch as it is, the offline install: a no-op here, the
    imports), the probe stops the check with one line saying why and status 3, nothing after it
    runs, and summary.txt, check.log and pip_freeze.txt are written."""
    bundle = wheelhouse(tmp_path / "bundle", "deepspeed>=0.16\nwebdataset\nomegaconf\npolib\nzstandard\npytest\n")
    run = run_check(tmp_path, bundle)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-2000:]
    out = run.stdout
    assert "pip --isolated install -q --no-index --find-links" in out
    assert "installed from the wheelhouse: nothing" in out, out[-3000:]
    for module in ("deepspeed", "webdataset", "omegaconf", "polib", "zstandard", "launch.train"):
        assert f"import {module}: OK" in out, out[-3000:]
    stops = [line for line in out.splitlines() if line.startswith("CUDA probe: STOP: torch cannot use CUDA: ")]
    assert len(stops) == 1 and any(reason in stops[0] for reason in REASONS), out[-2000:]
    lines = summary(tmp_path)
    stages = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert stages == {"torch": "rc=0", "install": "rc=0", "cuda": "rc=3"}, lines
    assert lines[-1].startswith("verdict: STOPPED at the CUDA probe (rc=3), nothing after it ran: torch cannot use CUDA: ")
    log = (tmp_path / "out" / "check.log").read_text()
    assert stops[0] in log and lines[-1] in log
    assert "torch==" in (tmp_path / "out" / "pip_freeze.txt").read_text()
    assert not (tmp_path / "out" / "bench_gpu.json").exists() and not (tmp_path / "work" / "run").exists()


def test_check_stops_without_a_wheelhouse(tmp_path):
    """A bundle that `make gpu-wheelhouse` did not make stops the check (status 2) before the probe."""
    (tmp_path / "bundle").mkdir()
    run = run_check(tmp_path, tmp_path / "bundle")
    assert run.returncode == 2, run.stdout[-3000:]
    assert "requirements.txt is missing: not a wheelhouse made by `make gpu-wheelhouse`" in run.stdout
    lines = summary(tmp_path)
    assert [line.split()[:2] for line in lines[1:-1]] == [["torch", "rc=0"], ["install", "rc=2"]], lines
    assert lines[-1].startswith("verdict: STOPPED: no wheelhouse")


def test_check_stops_on_a_python_without_torch(tmp_path):
    """The node's torch is never installed from the bundle: a Python without one stops the check
    (status 2) with that said, before pip runs."""
    venv.create(tmp_path / "bare", with_pip=False)
    bundle = wheelhouse(tmp_path / "bundle", "polib\n")
    run = run_check(tmp_path, bundle, python=str(tmp_path / "bare" / "bin" / "python"))
    assert run.returncode == 2, run.stdout[-3000:]
    assert "torch: STOP: this Python has no usable torch" in run.stdout
    assert "never installs one" in run.stdout and "pip --isolated install" not in run.stdout
    assert [line.split()[:2] for line in summary(tmp_path)[1:-1]] == [["torch", "rc=2"]]
