"""benchmarks/profile_step.py and profile_translation_step.py run both sides and sort the profiled time by
what it was spent on."""

import re
import subprocess
import sys

from repo import ROOT


def test_profile_step_times_both_sides_and_groups_the_profile():
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/profile_step.py",
            "--arch",
            "gpt",
            "--shape",
            "tiny",
            "--precision",
            "fp32",
            "--steps",
            "1",
            "--rounds",
            "1",
            "--variants",
            "ours,hf",
            "--profile",
            "ours,hf",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    for variant in ("ours", "hf"):
        assert re.search(
            rf"^gpt tiny fp32 {variant} +\d+\.\d ms per micro batch", run.stdout, re.M
        ), run.stdout
    rows = {
        line.split(" | ")[0].strip("| "): line
        for line in run.stdout.splitlines()
        if line.startswith("| ")
    }
    # Both compute the logits of all 8 x 128 positions over the 8,000 pieces: time in that row on
    # both sides.
    vocab = [
        float(x)
        for x in rows["GEMM: vocabulary (logits and their gradients)"].strip("| ").split(" | ")[1:]
    ]
    assert len(vocab) == 2 and min(vocab) > 0
    assert "total" in rows and "GEMM: blocks" in rows


def test_profile_translation_step_runs_ours_and_marian_on_the_loaders_batches(tiny_dataset):
    run = subprocess.run(
        [
            sys.executable,
            "benchmarks/profile_translation_step.py",
            "--data",
            str(tiny_dataset),
            "--config",
            "configs/tiny_translation.yaml",
            "--batches",
            "2",
            "--rounds",
            "1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert re.search(r"^2 micro batches of \d+ pairs: \d+ real tokens", run.stdout, re.M), (
        run.stdout
    )
    for side in ("ours", "Marian"):
        assert re.search(rf"^{side} +\d+\.\d ms per micro batch", run.stdout, re.M), run.stdout
    vocab = next(line for line in run.stdout.splitlines() if line.startswith("| GEMM: vocabulary"))
    # both project onto the vocabulary
    assert min(float(x) for x in vocab.strip("| ").split(" | ")[1:]) > 0
    total = next(line for line in run.stdout.splitlines() if line.startswith("| total"))
    shown = [
        line
        for line in run.stdout.splitlines()
        if line.startswith("| ") and not line.startswith(("| ms", "| total"))
    ]
    # The rows add up to the total (each printed to 0.05 ms): nothing profiled is dropped from the
    # table.
    for column in (0, 1):
        parts = sum(float(line.strip("| ").split(" | ")[1 + column]) for line in shown)
        assert abs(parts - float(total.strip("| ").split(" | ")[1 + column])) <= 0.05 * (
            len(shown) + 1
        ), (parts, total)
