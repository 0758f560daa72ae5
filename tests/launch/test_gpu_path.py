"""The GPU path's defects, proven on the CPU where the behaviour can be reproduced there
(issue: GPU path). The checks that need CUDA are in tests/benchmarks/test_gpu.py, marked `gpu`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from batches import UNEVEN, assert_same_batches
from repo import ROOT
from trainruns import TINY, metrics, train

from common.configure import UserError
from launch.distributed import DistEnv, check_gpus_per_node
from launch.tasks import TASKS
from model import ModelConfig, build_model
from model.loss import IGNORE_INDEX
from pipeline.load.loader import ShardLoader
from pipeline.load.plan import LoaderPlan
from tests.shardtools import make_dataset

TINY_SYNC = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=32",
    "data.micro_batch_size=4",
    "threads_per_rank=1",
]


@pytest.mark.slow
def test_sinusoidal_positions_train_under_bf16(tiny_dataset, tmp_path):
    """DeepSpeed casts parameters to bf16, not buffers: the fp32 sinusoid table met bf16
    activations in the first LayerNorm ("expected scalar type") before the fix."""
    run_dir = tmp_path / "run"
    train(
        "tiny_gpt.yaml",
        tiny_dataset,
        run_dir,
        "model.positions=sinusoidal",
        "deepspeed.precision=bf16",
        "max_steps=5",
        "log_every=1",
        "eval_every=5",
        nproc=1,
    )
    losses = [row["train/loss"] for row in metrics(run_dir) if "train/loss" in row]
    assert len(losses) == 5 and all(0 < loss < 20 for loss in losses)


def test_more_ranks_per_node_than_gpus_is_refused_in_one_line():
    denv = DistEnv(
        rank=1, world_size=4, local_rank=1, local_world_size=2, master_addr="x", master_port=1
    )
    with pytest.raises(UserError) as err:
        check_gpus_per_node(denv, 1)
    message = str(err.value)
    assert "2 ranks per node" in message and "1 visible GPU" in message and "\n" not in message
    check_gpus_per_node(denv, 2)  # as many ranks as GPUs: fine


def test_an_unresolvable_first_node_is_an_error_not_localhost(monkeypatch):
    """On the srun-per-rank path rank 0 hosts the rendezvous on the allocation's first node;
    a name that does not resolve used to become 127.0.0.1, where the other nodes waited forever."""
    from launch import distributed

    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_NNODES", "2")
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "no-such-node-7f3a.invalid")
    with pytest.raises(UserError) as err:
        distributed.read_env()
    assert "no-such-node-7f3a.invalid" in str(err.value) and "MASTER_ADDR" in str(err.value)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "localhost")
    assert distributed.read_env().master_addr in ("localhost", "127.0.0.1", "::1")


def test_padding_free_masks_are_dropped_on_the_host_and_change_nothing():
    """The attention mask of a packed block has no padding: the trainer drops it before the copy
    to the device (checked on the host, no device sync), and the model's output is the same."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="gpt", vocab_size=50, d_model=16, n_layers=2, n_heads=2, max_seq_len=12)
    model = build_model(cfg).eval()
    ids = torch.randint(6, 50, (3, 12))
    full = TASKS["causal_lm"].model_inputs(
        {"input_ids": ids, "attention_mask": torch.ones(3, 12, dtype=torch.long)}
    )
    moved = TASKS["causal_lm"].to_device(full, torch.device("cpu"))
    assert "attention_mask" not in moved and set(moved) == {"input_ids", "labels"}
    padded_mask = torch.ones(3, 12, dtype=torch.long)
    padded_mask[0, 9:] = 0
    padded = TASKS["causal_lm"].model_inputs({"input_ids": ids, "attention_mask": padded_mask})
    assert "attention_mask" in TASKS["causal_lm"].to_device(padded, torch.device("cpu"))
    with torch.no_grad():
        assert torch.allclose(model(**moved).loss, model(**full).loss, atol=1e-6)


def test_bert_scores_host_found_positions_as_its_own_selection():
    """BERT's head runs on the scored positions; the task finds their indices on the host
    (a boolean selection on the device waits for the count): the same loss and logits."""
    torch.manual_seed(0)
    cfg = ModelConfig(arch="bert", vocab_size=40, d_model=16, n_layers=1, n_heads=2, max_seq_len=10)
    model = build_model(cfg).eval()
    ids = torch.randint(6, 40, (2, 10))
    masked = torch.zeros(2, 10, dtype=torch.bool)
    masked[0, [1, 4]] = masked[1, [0, 7, 9]] = True
    batch = {
        "input_ids": ids,
        "attention_mask": torch.ones(2, 10, dtype=torch.long),
        "original_ids": ids,
        "masked_positions": masked,
    }
    inputs = TASKS["mlm"].model_inputs(batch)
    assert inputs["scored_index"].tolist() == [1, 4, 10, 17, 19]
    with torch.no_grad():
        given = model(**inputs)
        own = model(**{k: v for k, v in inputs.items() if k != "scored_index"})
        reference = model(input_ids=ids)
    assert torch.equal(given.scored_logits, own.scored_logits)
    assert torch.allclose(given.scored_logits, reference.logits[masked], atol=1e-5)
    labels = inputs["labels"][inputs["labels"] != IGNORE_INDEX]
    assert torch.allclose(
        given.loss, torch.nn.functional.cross_entropy(reference.logits[masked], labels), atol=1e-5
    )


def _worker_pids(loader: ShardLoader) -> list[int]:
    return sorted(worker.pid for worker in loader._workers._iterator._workers)


def test_persistent_workers_keep_the_order_across_epochs_and_abandoned_passes(tmp_path):
    """Workers start once: a new epoch, or a new pass after one left midway (an evaluation
    stopped at eval_batches), restarts them at a position, and the batches are those of a
    loader without workers."""
    make_dataset(tmp_path, packed=UNEVEN)
    kw = dict(micro_batch_size=4, grad_accum=1, seed=3)
    workers = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", num_workers=2, **kw))
    plain = ShardLoader(LoaderPlan(str(tmp_path), "causal_lm", "train", num_workers=0, **kw))
    try:
        assert_same_batches(list(workers), list(plain))  # epoch 0
        pids = _worker_pids(workers)
        for index, _ in enumerate(workers):  # epoch 1, left after 3 batches
            if index == 2:
                break
        assert _worker_pids(workers) == pids
        state = workers.state_dict()
        assert state["epoch"] == 1 and state["samples_consumed"] == 12
        workers.load_state_dict({**state, "epoch": 0, "samples_consumed": 0})
        plain.load_state_dict({**plain.state_dict(), "epoch": 0, "samples_consumed": 0})
        assert_same_batches(list(workers), list(plain))  # epoch 0 again, as an evaluation pass does
        workers.load_state_dict({**workers.state_dict(), "epoch": 1, "samples_consumed": 8})
        plain.load_state_dict({**plain.state_dict(), "epoch": 1, "samples_consumed": 8})
        assert_same_batches(list(workers), list(plain))  # a resume mid-epoch
        assert _worker_pids(workers) == pids
    finally:
        workers.close()
    assert workers._workers is None


def test_pinned_batches_are_asked_for_only_with_cuda():
    """pin_memory is what the trainer passes on CUDA; pinning needs a CUDA device, so the CPU
    check is that the trainer asks for it exactly then (the pinned copy is a `gpu` test)."""
    source = (ROOT / "launch" / "train" / "setup.py").read_text()
    # one ShardLoader call in `open_data`, made for the train split and the valid one
    assert source.count("pin_memory=torch.cuda.is_available()") == 1
    assert 'for split in ("train", "valid"):' in source


MFU_DRIVER = """
import sys, time
import launch.checkpoint.save as checkpoint_save
import launch.train.cli as cli
import launch.train.loop as train

real = train.evaluate
def slow_evaluate(run):
    time.sleep(0.5)  # an evaluation (or a checkpoint) that takes long between two logged steps
    return real(run)
train.evaluate = slow_evaluate
real_save = checkpoint_save.save_checkpoint  # what the loop's Checkpointer calls
def slow_save(*args):
    time.sleep(0.5)
    return real_save(*args)
checkpoint_save.save_checkpoint = slow_save
sys.exit(cli.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_throughput_times_training_steps_only(tiny_dataset, tmp_path):
    """Evaluation and checkpoints between two logged steps used to count as training time,
    lowering tokens/s and MFU. With both made 0.5 s slower (2 s more in each window of 2
    logged steps: 2 evaluations, 2 checkpoints), a window of 2 tiny steps still reports the
    time of those steps, far below the 2 s added. MFU is logged by both counts
    (ours and llm.c's, `model.flops`)."""
    driver = tmp_path / "driver.py"
    driver.write_text(MFU_DRIVER)
    run_dir = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    command = [
        sys.executable,
        str(driver),
        str(ROOT / "configs" / "tiny_gpt.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *TINY,
        "max_steps=6",
        "log_every=2",
        "eval_every=1",
        "eval_batches=1",
        "checkpoint.every_steps=1",
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row for row in rows if "perf/tokens_per_s" in row]
    assert [row["step"] for row in logged] == [2, 4, 6]
    final = json.loads((run_dir / "final.json").read_text())
    tokens_per_step = final["tokens_seen"] / 6
    for row in logged[1:]:  # windows 3-4 and 5-6 each had 2 evaluations and 2 checkpoints in them
        window_seconds = 2 * tokens_per_step / row["perf/tokens_per_s"]
        assert window_seconds < 1.0, (row, window_seconds)  # counted, they would make it over 2 s
        assert (
            0 < row["perf/mfu_llmc"] < 1
            and 0 < row["perf/mfu"] < 1
            and row["perf/mfu_llmc"] != row["perf/mfu"]
        )


# ----------------------------------------------------------------------------- tf32


def test_the_peak_of_an_fp32_run_is_tf32s_when_tf32_is_in_use():
    from launch.metrics import table_peak

    assert table_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=True) == 495e12
    assert table_peak("NVIDIA H100 80GB HBM3", "fp32", tf32=False) == 67e12
    assert table_peak("NVIDIA H100 PCIe", "fp32", tf32=True) == 378e12  # not the SXM figure
    assert (
        table_peak("NVIDIA A100-SXM4-80GB", "bf16", tf32=True) == 312e12
    )  # 16-bit peaks whatever tf32 says
    assert (
        table_peak("NVIDIA A10G", "fp32", tf32=True) == 0.0
    )  # none in the table: measured instead
    assert table_peak("Tesla V100-SXM2-32GB", "fp32", tf32=False) == 15.7e12
    assert table_peak("Some Future GPU", "bf16") == 0.0


TF32_GETTERS = {  # every reader of the cuBLAS float32 setting, legacy and new
    "torch.backends.cuda.matmul.allow_tf32": lambda: torch.backends.cuda.matmul.allow_tf32,
    "torch.backends.cuda.matmul.fp32_precision": lambda: torch.backends.cuda.matmul.fp32_precision,
    "torch.get_float32_matmul_precision()": torch.get_float32_matmul_precision,
    # what dynamo's graph region tracker reads
    "torch._C._get_cublas_allow_tf32()": torch._C._get_cublas_allow_tf32,
}


@pytest.mark.parametrize("tf32", [True, False])
def test_after_the_tf32_setting_every_reader_answers_and_compile_runs(tf32):
    """torch 2.13 raises "mix of the legacy and new APIs" when a legacy getter reads a setting
    made through the new API (`fp32_precision`), and torch.compile reads the legacy one: the
    setting as the trainer makes it must leave every getter answering, and a compiled model
    running. The CUDA flag is set on a CPU too (it governs cuBLAS only): this is the trainer's path."""
    from launch.metrics import set_fp32_matmul
    from launch.train.setup import compile_model

    before = torch.backends.cuda.matmul.allow_tf32
    try:
        set_fp32_matmul(tf32)
        answers = {name: get() for name, get in TF32_GETTERS.items()}  # raises on a mixed-API state
        assert answers["torch.backends.cuda.matmul.allow_tf32"] is tf32
        assert answers["torch.backends.cuda.matmul.fp32_precision"] == ("tf32" if tf32 else "ieee")
        assert answers["torch._C._get_cublas_allow_tf32()"] is tf32
        model = build_model(
            ModelConfig(
                arch="gpt",
                vocab_size=64,
                d_model=16,
                n_layers=1,
                n_heads=2,
                d_ff=32,
                max_seq_len=8,
                dropout=0.0,
            )
        )
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
        eager = model(ids).logits
        compile_model(model)
        torch._dynamo.reset()
        compiled = model(ids).logits  # dynamo and inductor read the setting while compiling
        torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's behaviour")
def test_tf32_changes_nothing_on_a_cpu():
    """`tf32` is CUDA's: on a CPU `set_fp32_matmul` reports no TF32, the CPU's own float32
    setting (mkldnn) is untouched, and a CPU float32 GEMM stays bit-identical."""
    from launch.metrics import set_fp32_matmul

    a, b = torch.randn(256, 300, generator=torch.Generator().manual_seed(0)), torch.randn(300, 200)
    before = (torch.backends.mkldnn.matmul.fp32_precision, torch.backends.cuda.matmul.allow_tf32)
    product = a @ b
    try:
        assert set_fp32_matmul(True) is False
        assert torch.backends.mkldnn.matmul.fp32_precision == before[0]
        assert torch.equal(a @ b, product)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before[1]


# ----------------------------------------------------------------------------- host-device syncs


def test_a_training_step_reads_the_device_once_after_its_last_backward(tiny_dataset, tmp_path):
    """What the host reads of device values in a training step (tests/sync_worker.py, on the
    CPU: every `.item()`, `.cpu()`, `.tolist()`, `float()`... of a tensor, with its call site),
    2 ranks' worth of work on one (grad_accum 2): the step's figures once, through `HostCopy`,
    after the forwards; nothing before the first forward (a wait there would stall the device
    between steps); the gradient norm left unread between log lines. Counts of the host batch
    (`launch.tasks.host_value`, which refuses a device tensor) wait for nothing."""
    from sync_worker import watch_syncs

    found = watch_syncs(tiny_dataset, tmp_path / "run", *TINY_SYNC, "grad_accum=2")
    assert found["device"] == "cpu" and found["grad_accum"] == 2
    for step in range(found["steps"]):
        ours = [
            e
            for e in found["events"]
            if e["step"] == step and e["ours"] and e["function"] != "host_value"
        ]
        assert [e["function"] for e in ours] == ["values"], (
            ours
        )  # HostCopy.values: the step's figures
        assert not ours[0]["before_forward"]
        assert any(e["function"] == "host_value" for e in found["events"] if e["step"] == step)


def test_host_value_refuses_what_would_wait_for_the_device():
    from launch.tasks import host_value

    assert host_value(torch.tensor([1, 0, 1]).sum()) == 2
    with pytest.raises(ValueError, match="wait for the device"):
        host_value(torch.ones((), device="meta"))


def test_the_step_figures_go_over_in_one_tensor_and_come_back_as_numbers():
    """`all_reduce_sum_tensor` keeps the order of mixed numbers and device tensors (one host-built
    tensor for the numbers), sums in float64, and `all_reduce_sum` reads them back once."""
    from launch.distributed import all_reduce_sum, all_reduce_sum_tensor

    values = [torch.tensor(1.5), 2, torch.tensor(3.25, dtype=torch.bfloat16), 4.0, True]
    summed = all_reduce_sum_tensor(values)
    assert summed.dtype == torch.float64 and summed.shape == (5,)
    assert all_reduce_sum(values) == [1.5, 2.0, 3.25, 4.0, 1.0]
    assert all_reduce_sum([]) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's behaviour")
def test_gpu_tests_fail_instead_of_skipping_where_a_gpu_is_required():
    """`pytest -m gpu` on a machine whose torch cannot use CUDA: without REQUIRE_GPU every gpu test
    skips and pytest passes; with REQUIRE_GPU=1 (benchmarks/gpu_check.sh) it stops with the reason."""
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-p",
        "no:cacheprovider",
        "tests/model/test_loss.py",
    ]
    skipped = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "REQUIRE_GPU": "0"},
    )
    assert skipped.returncode == 0 and "skipped" in skipped.stdout, skipped.stdout[-2000:]
    required = subprocess.run(
        command,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "REQUIRE_GPU": "1"},
    )
    assert required.returncode != 0, required.stdout[-2000:]
    assert (
        "REQUIRE_GPU=1 but CUDA is not usable: this torch is a CPU build"
        in required.stdout + required.stderr
    )
