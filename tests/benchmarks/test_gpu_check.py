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

from repo import ROOT

SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
REASONS = ("is a CPU-only build", "no NVIDIA driver", "hides every GPU", "driver is too old")


def wheelhouse(bundle: Path, requirements: str) -> Path:
    wheels = bundle / "wheels"
    wheels.mkdir(parents=True)
    (wheels / "requirements.txt").write_text(requirements)
    (wheels / "bundle.txt").write_text(
        f"python={sys.version_info[0]}.{sys.version_info[1]}\nskipped=\n"
    )
    return bundle


def run_check(
    tmp_path: Path, bundle: Path, python: str = sys.executable, **env
) -> subprocess.CompletedProcess:
    environment = {
        **os.environ,
        "CUDA_VISIBLE_DEVICES": "",
        "PYTHON": python,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), str(bundle)],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=240,
    )


def summary(tmp_path: Path) -> list[str]:
    return (tmp_path / "out" / "summary.txt").read_text().splitlines()


def test_check_installs_then_stops_at_the_cuda_probe(tmp_path):
    """The stages before the probe pass (torch as it is, the offline install: a no-op here, the
    imports), the probe stops the check with one line saying why and status 3, nothing after it
    runs, and summary.txt, check.log and pip_freeze.txt are written."""
    bundle = wheelhouse(
        tmp_path / "bundle",
        "deepspeed>=0.16\nwebdataset\nomegaconf\npolib\ntransformers\ntokenizers\npytest\n",
    )
    run = run_check(tmp_path, bundle)
    assert run.returncode == 3, run.stdout[-3000:] + run.stderr[-2000:]
    out = run.stdout
    assert "pip --isolated install -q --no-index --find-links" in out
    assert "installed from the wheelhouse: nothing" in out, out[-3000:]
    for module in ("deepspeed", "webdataset", "omegaconf", "polib", "transformers", "launch.train"):
        assert f"import {module}: OK" in out, out[-3000:]
    stops = [
        line
        for line in out.splitlines()
        if line.startswith("CUDA probe: STOP: torch cannot use CUDA: ")
    ]
    assert len(stops) == 1 and any(reason in stops[0] for reason in REASONS), out[-2000:]
    lines = summary(tmp_path)
    stages = {line.split()[0]: line.split()[1] for line in lines[1:-1]}
    assert stages == {"torch": "rc=0", "install": "rc=0", "cuda": "rc=3"}, lines
    assert lines[-1].startswith(
        "verdict: STOPPED at the CUDA probe (rc=3), nothing after it ran: torch cannot use CUDA: "
    )
    log = (tmp_path / "out" / "check.log").read_text()
    assert stops[0] in log and lines[-1] in log
    assert "torch==" in (tmp_path / "out" / "pip_freeze.txt").read_text()
    assert (
        not (tmp_path / "out" / "bench_gpu.json").exists()
        and not (tmp_path / "work" / "run").exists()
    )


def test_check_stops_without_a_wheelhouse(tmp_path):
    """A bundle that `make gpu-wheelhouse` did not make stops the check (status 2) before the probe."""
    (tmp_path / "bundle").mkdir()
    run = run_check(tmp_path, tmp_path / "bundle")
    assert run.returncode == 2, run.stdout[-3000:]
    assert (
        "requirements.txt is missing: not a wheelhouse made by `make gpu-wheelhouse`" in run.stdout
    )
    lines = summary(tmp_path)
    assert [line.split()[:2] for line in lines[1:-1]] == [["torch", "rc=0"], ["install", "rc=2"]], (
        lines
    )
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


def test_train_against_bench_reports_the_ratio_and_the_busy_clocks(tmp_path):
    """The check's train-vs-bench stage on files like a GPU run's: the median of the steady
    windows against the bench row of the same vocabulary and stage, passing within 10% and failing
    outside it, with the SM clock and power of the busy nvidia-smi samples (a sustained run is
    clocked lower than the bench's seconds-long burst)."""
    import json

    out = tmp_path / "out"
    out.mkdir()
    (out / "nvidia_smi.csv").write_text(
        "timestamp, utilization.gpu [%], memory.used [MiB], power.draw [W], temperature.gpu, clocks.current.sm [MHz]\n"
        "2026/11/27 03:26:47.758, 0 %, 0 MiB, 72.35 W, 41, 345 MHz\n"
        "2026/11/27 03:28:42.782, 96 %, 23401 MiB, 446.51 W, 56, 1725 MHz\n"
        "2026/11/27 03:28:47.783, 91 %, 23401 MiB, 632.59 W, 60, 1770 MHz\n"
        "2026/11/27 03:28:52.784, 9 %, 23401 MiB, 599.49 W, 57, 1965 MHz\n"
        "2026/11/27 03:28:57.785, 89 %, 23401 MiB, 623.12 W, 65, 1875 MHz\n"
    )
    bench = tmp_path / "bench_gpu.json"
    bench.write_text(
        json.dumps(
            [
                {
                    "vocab_size": 8000,
                    "zero_stage": 1,
                    "tokens_per_s": 600_000.0,
                    "mfu": 0.4,
                    "mfu_llmc": 0.37,
                }
            ]
        )
    )
    env = {
        **os.environ,
        "GPU_CHECK_ROOT": str(ROOT),
        "GPU_CHECK_OUT": str(out),
        "GPU_CHECK_WORK": str(tmp_path),
    }
    for rate, code, verdict in (
        (560_000.0, 0, "ratio 0.933, within 10%"),
        (500_000.0, 1, "ratio 0.833, NOT within 10%"),
    ):
        metrics = tmp_path / f"metrics_{code}.jsonl"
        metrics.write_text(
            "".join(
                json.dumps(
                    {
                        "step": 10 * i,
                        "perf/tokens_per_s": 100_000.0 if i < 3 else rate,
                        "perf/mfu": 0.3,
                        "perf/mfu_llmc": 0.28,
                        "train/loss": 9.0 - i,
                    }
                )
                + "\n"
                for i in range(1, 9)
            )
        )
        run = subprocess.run(
            [
                sys.executable,
                str(ROOT / "benchmarks" / "gpu_check.py"),
                "compare",
                str(metrics),
                str(bench),
                "8000",
                "1",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == code, run.stdout + run.stderr
        assert (
            f"V=8,000 ZeRO-1: train {rate:,.0f} tokens/s" in run.stdout and verdict in run.stdout
        ), run.stdout
        assert "SM clock median 1770 MHz (min 1725, max 1875), power median 623 W" in run.stdout, (
            run.stdout
        )


def test_llama_1b_dry_run_and_figures_stage(tiny_dataset, tmp_path):
    """configs/llama_gpu_1b.yaml's dry run (what the check runs before training it) gives its
    parameter count and a memory estimate per GPU, and the check's train-1b stage puts a run's
    steady throughput and peak memory against that estimate."""
    import json

    dry = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.train",
            str(ROOT / "configs" / "llama_gpu_1b.yaml"),
            f"data.data_dir={tiny_dataset}",
            f"run_dir={tmp_path / 'run'}",
            "--dry-run",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr[-2000:]
    report = json.loads(dry.stdout)
    figures = report["figures"]
    vocab = json.loads((tiny_dataset / "manifest.json").read_text())["tokenizer"]["vocab_size"]
    assert report["facts"]["parameters"] == f"{973_146_112 + 2048 * vocab:,}"
    assert figures["memory_bytes_per_gpu"] == (
        figures["model_state_bytes_per_gpu"] + figures["activation_bytes_per_gpu"]
    )
    assert figures["model_state_bytes_per_gpu"] > 16 * (973_146_112 + 2048 * vocab) > 0
    (tmp_path / "dry.json").write_text(dry.stdout)

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text(
        "".join(
            json.dumps(
                {
                    "step": 5 * i,
                    "perf/tokens_per_s": 1_000.0 if i < 3 else 52_000.0 + i,
                    "perf/mfu": 0.41,
                    "perf/mfu_llmc": 0.43,
                    "train/loss": 11.0 - i,
                    "memory/gpu_max_allocated_mb": 0.5 * figures["memory_bytes_per_gpu"] / 2**20,
                }
            )
            + "\n"
            for i in range(1, 8)
        )
    )
    env = {
        **os.environ,
        "GPU_CHECK_ROOT": str(ROOT),
        "GPU_CHECK_OUT": str(tmp_path),
        "GPU_CHECK_WORK": str(tmp_path),
    }
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "train-1b",
            str(metrics),
            str(tmp_path / "dry.json"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    # windows 3..7 are steady: 52,003 .. 52,007, median 52,005
    assert "median of 5 windows): 52,005 tokens/s, MFU 41.0% (ours), 43.0% (llm.c)" in run.stdout
    assert "measured / estimated 0.50" in run.stdout, run.stdout
    missing = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "train-1b", str(metrics), "x"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert missing.returncode == 1 and "no dry-run estimate in x" in missing.stdout
