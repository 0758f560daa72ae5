"""benchmarks/bench_train.py's Llama pair on the CPU: the path the GPU check runs (one process,
ours against transformers' LlamaForCausalLM from the same weights and batches), small enough to
run here. Both sides train the same model, so after the same steps their losses agree."""

import json
import subprocess
import sys

from repo import ROOT


def test_llama_pair_trains_ours_and_transformers_alike(tiny_dataset, tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_train.py"),
            "--archs",
            "llama",
            "--quick",
            "--nproc",
            "1",
            "--zero-stage",
            "1",
            "--micro-batch",
            "4",
            "--data",
            str(tiny_dataset),
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=400,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    (r,) = json.loads(out.read_text())
    assert (r["hf_class"], r["zero_stage"], r["micro_batch"]) == ("LlamaForCausalLM", 1, 4)
    # 4 optimizer steps in the warm-up round and 4 in the timed one, fp32: the same losses
    assert abs(r["last_loss"]["ours"] - r["last_loss"]["hf"]) < 1e-4, r["last_loss"]
    # each side's off-CPU share of its timed steps, one per rank
    assert all(len(v) == 1 and 0.0 <= v[0] < 1.0 for v in r["off_cpu"].values()), r["off_cpu"]
    assert "off the CPU, per rank" in run.stdout
    assert "LLAMA vs LlamaForCausalLM | tiny" in run.stdout and "**" in run.stdout
