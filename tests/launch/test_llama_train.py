"""A Llama-shaped GPT through the training paths (issue #31): rotary positions, RMSNorm, SwiGLU,
one key/value head for two query heads, no biases, an untied LM head.

One chain on CPU under torchrun, as tests/launch/test_elastic.py and tests/launch/test_compile.py run the
default GPT: 2 ranks under ZeRO-3 with `compile: true` and activation checkpointing, stopped at
step 4; resumed eagerly on 1 rank (the ZeRO-3 checkpoint converted to a universal one, 2 micro
batches accumulated instead of 2 ranks) to step 8. Every loss equals an uninterrupted eager
2-rank ZeRO-3 run's (fp32, dropout 0: compiled kernels and the ranks' reductions differ by
rounding only). The final checkpoint exports (`launch.export`), loads strictly into a plain
model and converts to LlamaForCausalLM with the same logits.
"""

import subprocess
import sys

import pytest
import torch
from repo import ROOT
from trainruns import losses, run_train

pytestmark = pytest.mark.slow

LLAMA = [
    "model.positions=rope",
    "model.norm=rmsnorm",
    "model.activation=swiglu",
    "model.n_kv_heads=1",
    "model.bias=false",
    "model.tie_embeddings=false",
]
COMMON = [
    *LLAMA,
    "max_steps=8",
    "log_every=1",
    "eval_every=0",
    "checkpoint.every_steps=4",
    "model.dropout=0.0",
    "deepspeed.zero_stage=3",
]
LOSS_TOLERANCE = 2e-5  # fp32: compiled against eager, and 2 ranks against 1, differ by rounding


def test_llama_gpt_compiled_under_zero3_resumes_on_one_rank_and_exports(tiny_dataset, tmp_path):
    reference = tmp_path / "reference"
    run_train(tiny_dataset, reference, *COMMON)
    run_dir = tmp_path / "run"
    first = run_train(
        tiny_dataset,
        run_dir,
        *COMMON,
        "compile=true",
        "model.activation_checkpointing=true",
        "stop_after_steps=4",
    )
    second = run_train(tiny_dataset, run_dir, *COMMON, "grad_accum=2", nproc=1)
    assert "recompile_limit" not in first.stderr
    assert (
        "written by 2 ranks" in second.stderr
        and "converting it to a universal checkpoint" in second.stderr
    )

    expected, got = losses(reference), losses(run_dir)
    print("\nstep  eager ZeRO-3, 2 ranks  compiled (1-4), then 1 rank eager (5-8)")
    for step in range(1, 9):
        print(f"{step:4d}  {expected[step]:.8f}          {got[step]:.8f}")
    assert sorted(got) == list(range(1, 9))
    assert [got[s] for s in range(1, 9)] == pytest.approx(
        [expected[s] for s in range(1, 9)], abs=LOSS_TOLERANCE, rel=0
    )
    assert got[8] < got[1]

    out = tmp_path / "export"
    run = subprocess.run(
        [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={out}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    from launch.model_dir import load_model_dir
    from model.hf_decoders import gpt_to_hf_decoder

    model, meta = load_model_dir(out)  # strictly: every key of the Llama shape, nothing else
    assert meta["step"] == 8 and model.cfg.positions == "rope" and model.cfg.n_kv_heads == 1
    assert (
        "lm_head.weight" in model.state_dict()
        and model.lm_head.weight is not model.embed.tok.weight
    )
    llama = gpt_to_hf_decoder(model).eval()
    x = torch.randint(5, model.cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(llama(x).logits, model(x).logits, rtol=1e-5, atol=1e-5)
