"""The trainer's AdamW (`launch.optim.build_optimizer`): torch's fused kernel, the same updates
as torch's default AdamW, and still fused after loading a state saved by another implementation."""

import pytest
import torch

from launch.config import OptimConfig
from launch.optim import AdamW, build_optimizer, keep_implementation, parameter_groups
from model import ModelConfig, build_model

CFG = OptimConfig(lr=1e-2, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8)
# float32 parameters after 8 steps, fused against torch's default: measured 1.2e-7 (1 ulp) on a
# (300 x 70) matrix after 20 steps; a wrong weight decay or bias correction moves them by > 1e-4.
TOLERANCE = 1e-6


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return build_model(ModelConfig(arch="gpt", vocab_size=50, d_model=16, n_layers=2, n_heads=2, max_seq_len=8, dropout=0.0))


def _default(model: torch.nn.Module) -> torch.optim.AdamW:
    """torch's AdamW as it comes (on a CPU: the loop over tensors), over the same groups."""
    return torch.optim.AdamW(parameter_groups(model, CFG.weight_decay), lr=CFG.lr, betas=(CFG.beta1, CFG.beta2), eps=CFG.eps)


def _steps(pairs, n: int, seed: int) -> None:
    """n steps of each (model, optimizer) pair with the same random gradients."""
    generator = torch.Generator().manual_seed(seed)
    for _ in range(n):
        grads = [torch.randn(p.shape, generator=generator) for p in pairs[0][0].parameters()]
        for model, optimizer in pairs:
            for param, grad in zip(model.parameters(), grads):
                param.grad = grad.clone()
            optimizer.step()


def _assert_same(a: torch.nn.Module, b: torch.nn.Module, tolerance: float = TOLERANCE) -> None:
    for (name, x), y in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(x.detach(), y.detach(), atol=tolerance, rtol=0, msg=name)


@pytest.mark.parametrize("skip_non_finite", [False, True])
def test_the_fused_adamw_takes_torchs_default_steps(skip_non_finite):
    ours, reference = _model(), _model()
    optimizer = build_optimizer(ours, CFG, skip_non_finite=skip_non_finite)
    assert type(optimizer) is (AdamW if skip_non_finite else torch.optim.AdamW)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    _steps([(ours, optimizer), (reference, _default(reference))], 8, seed=1)
    _assert_same(ours, reference)
    moved = max((p - q).abs().max().item() for p, q in zip(ours.parameters(), _model().parameters()))
    assert moved > 1e-2  # it stepped


def test_a_non_finite_gradient_is_still_a_dropped_step():
    model = _model()
    optimizer = build_optimizer(model, CFG, skip_non_finite=True)
    before = [p.detach().clone() for p in model.parameters()]
    for i, param in enumerate(model.parameters()):
        param.grad = torch.full_like(param, float("inf") if i == 3 else 1.0)
    optimizer.step()
    assert optimizer.overflow and not optimizer.state
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))


def test_loading_a_state_saved_by_the_default_adamw_keeps_the_fused_kernel():
    """A checkpoint written before (torch's default kernel, `fused: None` in its groups) resumes
    fused, from the same moments and step count, and continues as the default one does."""
    saved_model, reference = _model(), _model()
    saved_optimizer, reference_optimizer = _default(saved_model), _default(reference)
    _steps([(saved_model, saved_optimizer), (reference, reference_optimizer)], 3, seed=1)
    state = saved_optimizer.state_dict()
    assert state["param_groups"][0]["fused"] is None

    resumed = _model()
    resumed.load_state_dict(saved_model.state_dict())
    optimizer = build_optimizer(resumed, CFG)
    optimizer.load_state_dict(state)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]
    steps = [optimizer.state[p]["step"] for p in resumed.parameters()]
    assert all(s.dtype == torch.float32 and s.item() == 3 for s in steps)
    _steps([(resumed, optimizer), (reference, reference_optimizer)], 5, seed=2)
    _assert_same(resumed, reference)


def test_a_direct_write_of_groups_and_steps_is_repaired():
    """What DeepSpeed's universal load does (`base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir`):
    it writes the saved group keys and each partition's step straight into the optimizer;
    `launch.engine.Engine.load` calls `keep_implementation` after it."""
    model = _model()
    optimizer = build_optimizer(model, CFG)
    _steps([(model, optimizer)], 2, seed=1)
    for group in optimizer.param_groups:
        group.update(fused=None, foreach=None)
        for param in group["params"]:
            optimizer.state[param]["step"] = 2  # a plain number: the fused kernel refuses it
    keep_implementation(optimizer)
    assert [g["fused"] for g in optimizer.param_groups] == [True, True]
    assert all(s["step"].dtype == torch.float32 and s["step"].item() == 2 for s in optimizer.state.values())
    _steps([(model, optimizer)], 1, seed=2)  # the fused kernel runs
    assert all(s["step"].item() == 3 for s in optimizer.state.values())


def test_an_optimizer_built_elsewhere_is_left_as_it_is():
    optimizer = _default(_model())
    keep_implementation(optimizer)
    assert [g["fused"] for g in optimizer.param_groups] == [None, None]
