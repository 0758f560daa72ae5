"""ZeRO-Offload of the optimizer (deepspeed.offload_optimizer, with offload_params under ZeRO-3):
DeepSpeed's CPU Adam in AdamW mode over our parameter groups (`launch.engine.cpu_adam`), torch's
AdamW only if its op cannot be built; 2 ranks under torchrun on CPU train and resume exactly.

DeepSpeed builds the CPU Adam op with the host's C++ compiler at its first use, about 100 s on
2 cores, and caches it (TORCH_EXTENSIONS_DIR, ~/.cache/torch_extensions): the first test here
pays for that once per machine."""

import pytest
import torch

from test_train import metrics, train

RESUME_TOLERANCE = 1e-5  # absolute, on each logged loss; measured: 0, or 1 float32 ulp (4.8e-7) at one step


def _groups(params: list[torch.Tensor]) -> list[dict]:
    return [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]


def test_the_fallback_is_torch_adamw_over_the_same_groups_with_one_warning_line(monkeypatch, capsys):
    from deepspeed.ops.adam import cpu_adam as deepspeed_cpu_adam

    from launch.engine import cpu_adam

    def no_compiler(self, *args, **kwargs):
        raise RuntimeError("simulated: no C++ compiler\nmore detail")

    monkeypatch.setattr(deepspeed_cpu_adam.CPUAdamBuilder, "load", no_compiler)
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)] + [torch.nn.Parameter(torch.randn(4))]
    optimizer = cpu_adam(_groups(params), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer) is torch.optim.AdamW
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert [len(g["params"]) for g in optimizer.param_groups] == [2, 2]
    assert optimizer.defaults["betas"] == (0.9, 0.95) and optimizer.defaults["lr"] == 1e-3
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("warning: DeepSpeed's CPU Adam op is unavailable") and "no C++ compiler" in line


@pytest.mark.slow
def test_cpu_adam_takes_torch_adamws_steps_group_by_group():
    """AdamW mode: decoupled weight decay, each group's own; the same updates as torch's AdamW."""
    from launch.engine import cpu_adam

    torch.manual_seed(0)
    start = [torch.randn(8, 8), torch.randn(8), torch.randn(8, 8), torch.randn(8)]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    reference = [torch.nn.Parameter(t.clone()) for t in start]
    optimizer = cpu_adam(_groups(ours), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert type(optimizer).__name__ == "DeepSpeedCPUAdam"
    torch_adamw = torch.optim.AdamW(_groups(reference), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    for _ in range(5):
        grads = [torch.randn_like(t) for t in start]
        for params, opt in ((ours, optimizer), (reference, torch_adamw)):
            for param, grad in zip(params, grads):
                param.grad = grad.clone()
            opt.step()
    for mine, theirs in zip(ours, reference):
        torch.testing.assert_close(mine.detach(), theirs.detach(), atol=1e-6, rtol=0)
    assert not torch.equal(ours[0], start[0])


@pytest.mark.slow
@pytest.mark.parametrize("offload", [
    ["deepspeed.zero_stage=2", "deepspeed.offload_optimizer=true"],
    ["deepspeed.zero_stage=3", "deepspeed.offload_optimizer=true", "deepspeed.offload_params=true"],
], ids=["zero2-offload_optimizer", "zero3-offload_optimizer-offload_params"])
def test_offload_trains_with_cpu_adam_and_resumes_exactly(tiny_dataset, tmp_path, offload):
    common = ["max_steps=10", "log_every=1", "eval_every=0", "checkpoint.every_steps=5", *offload]
    straight = tmp_path / "straight"
    runs = [train("tiny_gpt.yaml", tiny_dataset, straight, *common)]
    stopped = tmp_path / "stopped"
    runs.append(train("tiny_gpt.yaml", tiny_dataset, stopped, *common, "stop_after_steps=5"))
    runs.append(train("tiny_gpt.yaml", tiny_dataset, stopped, *common))
    assert "resumed from" in runs[-1].stderr
    for run in runs:  # the optimizer DeepSpeed steps, as the trainer reports it
        assert "optimizer: DeepSpeedCPUAdam in DeepSpeed's DeepSpeedZeroOptimizer" in run.stderr
        assert "states offloaded to CPU" in run.stderr and "warning: DeepSpeed's CPU Adam" not in run.stderr
    expected = {r["step"]: r["train/loss"] for r in metrics(straight) if "train/loss" in r}
    got = {r["step"]: r["train/loss"] for r in metrics(stopped) if "train/loss" in r}
    print("\nstep  uninterrupted  stopped+resumed")
    for step in range(1, 11):
        print(f"{step:4d}  {expected[step]:.8f}     {got[step]:.8f}")
    losses = [expected[step] for step in range(1, 11)]
    assert losses[-1] < 0.9 * losses[0], losses  # it trains
    assert [got[s] for s in range(6, 11)] == pytest.approx(losses[5:], abs=RESUME_TOLERANCE, rel=0)
