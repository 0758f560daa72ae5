"""Elastic and guarded training with a real DeepSpeed engine under torchrun (CPU, gloo).

Resume on another world size: 2 ranks -> 1 rank with grad_accum doubled -> 2 ranks again, for
ZeRO 0 (whose gradients the trainer reduces on 2 ranks), 1, 2 and 3, against one uninterrupted
2-rank run; every training sample once per epoch.
Guarded steps: a NaN loss on one rank skips the step on both; too many in a row end the job
with a checkpoint of the last good weights.
"""

import json
import shutil
import statistics
from collections import Counter
from pathlib import Path

import pytest
import torch
from trainruns import ELASTIC_CHAIN, losses, metrics, run_train, train

pytestmark = pytest.mark.slow

# The chain's settings and its uninterrupted run (conftest's `uninterrupted_gpt`): trainruns.
LOSS_TOLERANCE = 2e-5  # fp32; the ranks' reductions group the same sums differently


def step_keys(run_dir: Path) -> dict[int, list[str]]:
    """Each step's sample keys, over all the ranks that trained it."""
    out: dict[int, list[str]] = {}
    for path in sorted(run_dir.glob("sample_keys.rank*.jsonl")):
        for row in map(json.loads, path.read_text().splitlines()):
            out[row["step"]] = out.get(row["step"], []) + row["keys"]
    return out


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_resume_on_another_world_size_and_back(tiny_dataset, tmp_path, uninterrupted_gpt, stage):
    run_dir = tmp_path / "run"
    legs = [(2, ["stop_after_steps=4"]), (1, ["grad_accum=2", "stop_after_steps=8"]), (2, [])]
    outputs = []
    for nproc, extra in legs:
        outputs.append(
            run_train(
                tiny_dataset,
                run_dir,
                *ELASTIC_CHAIN,
                f"deepspeed.zero_stage={stage}",
                *extra,
                nproc=nproc,
            )
        )
    assert (
        "written by 2 ranks" in outputs[1].stderr
        and "converting it to a universal checkpoint" in outputs[1].stderr
    )
    assert "written by 1 ranks" in outputs[2].stderr
    # ZeRO-0: the trainer reduces on 2 ranks (launch.train.reduce), DeepSpeed has nothing to
    # reduce on 1
    ours = "gradients all-reduced during the backward"
    assert [ours in output.stderr for output in outputs] == [stage == 0, False, stage == 0]
    # beside the original, which stays; ZeRO-0's has nothing to convert (launch.deepspeed.universal)
    assert (run_dir / "checkpoints" / "step_00000004.universal").is_dir() == (stage > 0)
    assert (run_dir / "checkpoints" / "step_00000004").is_dir()

    expected, got = losses(uninterrupted_gpt), losses(run_dir)
    assert sorted(got) == list(range(1, 15))
    for step in range(1, 15):
        assert got[step] == pytest.approx(expected[step], abs=LOSS_TOLERANCE), (
            step,
            got[step],
            expected[step],
        )

    # Packed blocks give both ranks the same tokens at every step: the logged balance is exact.
    logged = [row for row in metrics(uninterrupted_gpt) if "train/loss" in row]
    assert logged and all(
        row["perf/rank_tokens_max_min"] == row["perf/rank_tokens_max_min_worst"] == 1.0
        for row in logged
    )

    # Every training sample exactly once per epoch, and each step the same samples as uninterrupted.
    keys, reference_keys = step_keys(run_dir), step_keys(uninterrupted_gpt)
    assert {s: sorted(k) for s, k in keys.items()} == {
        s: sorted(k) for s, k in reference_keys.items()
    }
    epoch = [key for step in range(1, 13) for key in keys[step]]
    counts = Counter(epoch)
    assert len(epoch) == 12 * 8 and max(counts.values()) == 1


def test_length_grouped_translation_under_zero0_resumes_exactly(tiny_dataset, tmp_path):
    """The main job's fine-tuning path: length-grouped pairs dealt to the ranks, gradients
    reduced by the trainer (ZeRO-0, fp32). Stopped after step 4 and resumed on 2 ranks: the
    uninterrupted run's losses to the bit; resumed on 1 rank with grad_accum doubled: the same
    samples at every step (a step's bands are fractions of the global batch), the losses within
    the fp32 bound."""
    common = [
        "max_steps=8",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=4",
        "model.dropout=0.0",
        "data.length_grouping=true",
        "deepspeed.zero_stage=0",
        "deepspeed.precision=fp32",
    ]
    straight, stopped, one_rank = (tmp_path / name for name in ("straight", "stopped", "one"))
    run = train("tiny_translation.yaml", tiny_dataset, straight, *common)
    assert "gradients all-reduced during the backward" in run.stderr
    train("tiny_translation.yaml", tiny_dataset, stopped, *common, "stop_after_steps=4")
    shutil.copytree(stopped, one_rank)
    train("tiny_translation.yaml", tiny_dataset, stopped, *common)
    train("tiny_translation.yaml", tiny_dataset, one_rank, *common, "grad_accum=2", nproc=1)
    expected = losses(straight)
    assert sorted(expected) == list(range(1, 9))
    # Logged every step, a window's mean loss is that step's.
    assert all(
        row["train/loss_mean"] == row["train/loss"]
        for row in metrics(straight)
        if "train/loss" in row
    )
    assert losses(stopped) == expected
    got = losses(one_rank)
    for step in range(5, 9):
        assert got[step] == pytest.approx(expected[step], abs=LOSS_TOLERANCE), step


def test_a_global_batch_that_does_not_fit_is_refused_with_the_overrides_that_would(
    tiny_dataset, tmp_path, uninterrupted_gpt
):
    import shutil

    # A copy of the uninterrupted 2-rank run (micro batch 4: global batch 8), resumed on 1 rank.
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_gpt, run_dir)
    # 4 x 1 x 1 = 4, not 8
    refused = run_train(tiny_dataset, run_dir, *ELASTIC_CHAIN, nproc=1, check=False)
    assert refused.returncode == 2
    (line,) = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert "global batch of 8 (4 x 1 x 2 ranks)" in line and "4 x 1 x 1 ranks = 4" in line
    assert "data.micro_batch_size=4 grad_accum=2" in line


def test_a_resume_with_another_model_shape_is_refused_before_loading(
    tiny_dataset, tmp_path, uninterrupted_gpt
):
    import shutil

    # A copy of the uninterrupted 2-rank run (TINY's model.d_model=32), resumed with another model.
    run_dir = tmp_path / "run"
    shutil.copytree(uninterrupted_gpt, run_dir)
    latest = (run_dir / "checkpoints" / "latest").read_text().strip()
    steps = int(latest.removeprefix("step_"))
    common = ["eval_every=0", "checkpoint.every_steps=0", "wandb.mode=disabled"]
    # the same global batch: only the model differs
    for nproc, extra in ((1, ["grad_accum=2"]), (2, [])):
        refused = run_train(
            tiny_dataset,
            run_dir,
            *common,
            f"max_steps={steps + 2}",
            "model.d_model=64",
            *extra,
            nproc=nproc,
            check=False,
        )
        # torchrun reports a failed child as 1
        assert refused.returncode == (2 if nproc == 1 else 1), refused.stderr[-4000:]
        # the same on both ranks
        (line,) = {line for line in refused.stderr.splitlines() if line.startswith("error:")}
        assert line == (
            f"error: checkpoint {run_dir / 'checkpoints' / latest} holds another model than this "
            f"job: model.d_model 32 there, 64 here; resume it as saved with model.d_model=32, or train the "
            f"new model from scratch in a new run_dir"
        ), line
        # Found from the checkpoint's record, before the engine is built: no rank's traceback.
        assert "size mismatch" not in refused.stderr and "[rank" not in refused.stderr, (
            refused.stderr[-4000:]
        )
        assert "DeepSpeedZeroOptimizer" not in refused.stderr
    # What only trains differently may change on a resume.
    resumed = run_train(
        tiny_dataset, run_dir, *common, f"max_steps={steps + 1}", "model.dropout=0.2"
    )
    assert (
        "resumed from" in resumed.stderr
        and json.loads((run_dir / "final.json").read_text())["step"] == steps + 1
    )


def test_the_model_check_names_nested_keys_and_reads_an_older_checkpoints_run_config(tmp_path):
    from dataclasses import replace

    from common.configure import config_to_dict, save_config
    from launch import checkpoint as ckpt
    from launch.config import TrainConfig
    from launch.train.resume import _model_misfit
    from model import ModelConfig, StackConfig

    cfg = TrainConfig(model=ModelConfig(arch="seq2seq", vocab_size=100, d_model=16, n_heads=4))
    root = tmp_path / "run" / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    # before the model was recorded
    (root / "step_00000002" / "client_state.json").write_text(json.dumps({"step": 2}))
    assert ckpt.saved_model_config(root, "step_00000002") is None
    save_config(cfg, tmp_path / "run" / "config.yaml")
    saved = ckpt.saved_model_config(root, "step_00000002")
    assert saved == config_to_dict(cfg.model)
    assert (
        _model_misfit(
            root / "step_00000002", saved, replace(cfg, model=replace(cfg.model, dropout=0.3))
        )
        is None
    )
    changed = replace(
        cfg,
        resume=str(root / "step_00000002"),
        model=replace(
            cfg.model, encoder=StackConfig(n_heads=2), activation="relu", label_smoothing=0.0
        ),
    )
    assert _model_misfit(root / "step_00000002", saved, changed) == (
        f"checkpoint {root / 'step_00000002'} holds another model than this job: model.activation gelu there, relu "
        "here; model.encoder.n_heads null there, 2 here; resume it as saved with model.activation=gelu "
        "model.encoder.n_heads=null, or train the new model from scratch in a new run_dir with resume=none"
    )


def _optimizer_files(checkpoint: Path) -> dict[str, dict]:
    return {
        path.name: torch.load(path, map_location="cpu", weights_only=False)
        for path in sorted(checkpoint.glob("*optim_states.pt"))
    }


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return True  # bookkeeping (counters, flags) may move


def test_a_nan_on_one_rank_skips_the_step_on_both(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    run = run_train(
        tiny_dataset,
        run_dir,
        "max_steps=6",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=10",
        inject="1:3",
    )
    assert (
        "step 3: skipped on every rank (non-finite loss: nan on rank 1); 1 skipped so far"
        in run.stderr
    )
    (row,) = [
        json.loads(line) for line in (run_dir / "skipped_batches.jsonl").read_text().splitlines()
    ]
    assert row["step"] == 3 and row["reason"] == "non-finite loss" and len(row["sample_keys"]) == 8
    # What caused the skip, and apart from it the loss of the batches that were finite (rank 0's).
    assert (
        row["non_finite"] == [{"rank": 1, "loss": "nan", "micro_batches": 1}] and "loss" not in row
    )
    assert 0 < row["finite_loss"] < 10
    checkpoints = run_dir / "checkpoints"
    before, after = (
        _optimizer_files(checkpoints / "step_00000002"),
        _optimizer_files(checkpoints / "step_00000003"),
    )
    # one partition per rank: both ranks' weights and Adam moments unchanged
    assert len(before) == 2
    for name in before:
        assert _same(before[name]["optimizer_state_dict"], after[name]["optimizer_state_dict"]), (
            name
        )
    changed = _optimizer_files(checkpoints / "step_00000004")
    assert not all(
        _same(before[n]["optimizer_state_dict"], changed[n]["optimizer_state_dict"]) for n in before
    )
    rows = metrics(run_dir)
    assert [r["step"] for r in rows if "train/loss" in r] == [1, 2, 3, 4, 5, 6]
    assert [r["guard/skipped_steps"] for r in rows if "guard/skipped_steps" in r] == [1]
    assert json.loads((run_dir / "final.json").read_text())["skipped_steps"] == 1


def test_a_skipped_step_records_the_losses_that_caused_it(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    run = run_train(
        tiny_dataset,
        run_dir,
        "max_steps=6",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=0",
        "grad_accum=2",
        "guard.spike_factor=50",
        "guard.spike_warmup_steps=4",
        "guard.spike_window=4",
        "wandb.mode=disabled",
        nproc=1,
        inject="0:3*inf,0:6*100",
    )
    non_finite, spike = [
        json.loads(line) for line in (run_dir / "skipped_batches.jsonl").read_text().splitlines()
    ]
    assert non_finite["step"] == 3 and non_finite["reason"] == "non-finite loss"
    assert non_finite["non_finite"] == [{"rank": 0, "loss": "inf", "micro_batches": 2}]
    # no batch of the step was finite
    assert non_finite["finite_loss"] is None and "loss" not in non_finite
    assert "step 3: skipped on every rank (non-finite loss: inf on rank 0)" in run.stderr
    # The spike test's limit: the mean of the last 4 applied steps' losses plus 50 of their standard
    # deviations.
    applied = [row["train/loss"] for row in metrics(run_dir) if row["step"] in (1, 2, 4, 5)]
    limit = statistics.mean(applied) + 50 * statistics.stdev(applied)
    assert spike["step"] == 6 and spike["reason"] == "loss spike" and "non_finite" not in spike
    assert spike["limit"] == pytest.approx(limit) and spike["loss"] > 20 * limit
    assert (
        f"step 6: skipped on every rank (loss spike: loss {spike['loss']:.4g} above the limit {limit:.4g})"
        in run.stderr
    )


def test_zero0_on_two_ranks_reduced_by_the_trainer_skips_a_nan_and_a_spike(tiny_dataset, tmp_path):
    """Under ZeRO-0 in fp32 the trainer reduces the gradients (launch.train.reduce) and applies
    the guard's decision to the reduced ones: both ranks drop the update of a step with a NaN
    on one rank and of a step whose loss spikes on the other, as DeepSpeed's reduction did."""
    run_dir = tmp_path / "run"
    run = run_train(
        tiny_dataset,
        run_dir,
        "max_steps=8",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=1",
        "checkpoint.keep_last=10",
        "grad_accum=2",
        "deepspeed.zero_stage=0",
        "guard.spike_factor=50",
        "guard.spike_warmup_steps=4",
        "guard.spike_window=4",
        inject="1:3,0:7*100",
    )
    assert "gradients all-reduced during the backward" in run.stderr
    assert "step 3: skipped on every rank (non-finite loss: nan on rank 1)" in run.stderr
    assert "step 7: skipped on every rank (loss spike: loss" in run.stderr
    reasons = [
        json.loads(line)["reason"]
        for line in (run_dir / "skipped_batches.jsonl").read_text().splitlines()
    ]
    assert reasons == ["non-finite loss", "loss spike"]

    def weights(step: int) -> dict:
        path = run_dir / "checkpoints" / f"step_{step:08d}" / "mp_rank_00_model_states.pt"
        return torch.load(path, map_location="cpu", weights_only=False)["module"]

    for skipped in (3, 7):
        assert _same(weights(skipped - 1), weights(skipped))
        assert not _same(weights(skipped), weights(skipped + 1))
    assert json.loads((run_dir / "final.json").read_text())["skipped_steps"] == 2


def test_too_many_nans_in_a_row_end_the_job_with_a_resumable_checkpoint(tiny_dataset, tmp_path):
    run_dir = tmp_path / "run"
    common = [
        "max_steps=8",
        "log_every=1",
        "eval_every=0",
        "checkpoint.every_steps=2",
        "checkpoint.keep_last=10",
        "guard.max_consecutive_skips=2",
        "deepspeed.zero_stage=0",
    ]
    failed = run_train(tiny_dataset, run_dir, *common, inject="0:3-7", check=False)
    assert failed.returncode != 0  # each rank exits 2; torchrun reports a failed child as 1
    # the same on both ranks
    (line,) = {line for line in failed.stderr.splitlines() if line.startswith("error:")}
    assert "3 steps in a row skipped" in line and "guard.max_consecutive_skips=2" in line
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_00000005"
    good = torch.load(
        checkpoints / "step_00000002" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    last = torch.load(
        checkpoints / "step_00000005" / "mp_rank_00_model_states.pt",
        map_location="cpu",
        weights_only=False,
    )
    # ZeRO-0: whole weights
    assert all(torch.equal(good["module"][k], last["module"][k]) for k in good["module"])
    resumed = run_train(tiny_dataset, run_dir, *common)
    assert "resumed from" in resumed.stderr and "step 5" in resumed.stderr
    assert json.loads((run_dir / "final.json").read_text())["step"] == 8


def test_the_spike_guard_waits_for_its_warmup_then_flags_outliers():
    from launch.train.guard import Guard

    guard = Guard(max_consecutive_skips=5, spike_factor=3.0, spike_warmup_steps=4, spike_window=4)
    for loss in (5.0, 5.2, 4.8):
        assert guard.spike_limit() == float("inf")
        guard.record(loss, skipped=False)
    guard.record(5.0, skipped=False)
    assert guard.spike_limit() == pytest.approx(5.0 + 3.0 * (0.08 / 3) ** 0.5)
    guard.record(50.0, skipped=True)  # a skipped step's loss stays out of the history
    assert (guard.skipped, guard.consecutive, guard.history) == (1, 1, [5.0, 5.2, 4.8, 5.0])
    restored = Guard(5, 3.0, 4, 4)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.state_dict() == guard.state_dict()


def test_unreadable_shards_are_counted_and_too_many_fillers_end_the_job(tiny_dataset, tmp_path):
    import shutil

    data = tmp_path / "data"
    shutil.copytree(tiny_dataset, data)
    manifest = json.loads((data / "manifest.json").read_text())
    shards = manifest["datasets"]["packed"]["splits"]["train"]["shards"]
    for record in shards[:-1]:  # every train shard but one cut short
        path = data / record["path"]
        path.write_bytes(path.read_bytes()[: record["bytes"] // 2])
    # 20 steps of 4 samples span at least two 40-sample shards, so at least ten fillers.
    common = ["max_steps=20", "log_every=2", "eval_every=0", "checkpoint.every_steps=0"]
    ended = run_train(data, tmp_path / "strict", *common, nproc=1, check=False)
    assert ended.returncode == 2
    (line,) = [line for line in ended.stderr.splitlines() if line.startswith("error:")]
    assert "fillers for unreadable data, more than data.max_bad_fraction=0.01" in line
    tolerant = tmp_path / "tolerant"
    run_train(data, tolerant, *common, "data.max_bad_fraction=1", nproc=1)
    final = json.loads((tolerant / "final.json").read_text())
    assert final["data/shards_skipped"] >= 2 and final["data/filler_batches"] >= 10
    rows = [r for r in metrics(tolerant) if "data/filler_batches" in r]
    assert rows and rows[-1]["data/filler_batches"] == final["data/filler_batches"]
