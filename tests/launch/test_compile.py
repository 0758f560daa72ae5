"""`compile: true`: the transformer blocks compiled with inductor for training (`launch.train.setup.compile_model`).

The first slow test trains a tiny GPT on 2 ranks (torchrun, CPU) compiled under ZeRO-3 with
activation checkpointing, stopped at step 4, and resumes that checkpoint eagerly under ZeRO-3 to
step 14; it compares with the session's eager ZeRO-2 run of the same settings (conftest's
`uninterrupted_gpt`, trainruns.UNINTERRUPTED_GPT). In fp32, with dropout 0, ZeRO-2 and ZeRO-3 give the
same losses on the same ranks, and inductor's fused kernels differ from eager ones by rounding
only: every loss agrees to 1e-5 (they do to about 1e-6). The second trains a tiny BERT under
ZeRO-1, eagerly and compiled. Inductor's first compile on a CPU takes tens of seconds: one compiling job per test, the tiniest
models (about 90 s for the file with an empty inductor cache on 2 cores).
"""

import subprocess
import sys

import pytest
import torch
from repo import ROOT
from trainruns import UNINTERRUPTED_GPT, metrics, train

LOSS_TOLERANCE = 1e-5  # fp32: compiled and eager losses differ by rounding (about 1e-6 here)


def test_compile_is_a_top_level_switch_off_by_default(tmp_path):
    from common.configure import load_config
    from launch.config import TrainConfig

    assert TrainConfig().compile is False
    assert (
        load_config(TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", ["compile=true"]).compile
        is True
    )


def _tiny_gpt():
    from model import ModelConfig, build_model

    return build_model(
        ModelConfig(
            arch="gpt", vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_ff=32, max_seq_len=16
        )
    )


def test_compiling_keeps_the_model_and_its_state_dict_keys():
    from launch.train.setup import compile_model
    from model.blocks import Block

    model = _tiny_gpt()
    before = list(model.state_dict())
    compile_model(model)  # lazy: nothing is compiled until a forward
    assert type(model).__name__ == "GPT" and list(model.state_dict()) == before
    assert not any("_orig_mod" in key for key in model.state_dict())
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    assert len(blocks) == 2 and all(m._z3_leaf for m in blocks)  # DeepSpeed's ZeRO-3 leaf flag
    with torch.compiler.set_stance("force_eager"):  # the forward still runs, uncompiled
        model(torch.zeros(1, 4, dtype=torch.long))


@pytest.mark.parametrize(
    "task, stage, cuda, expected",
    [
        ("causal_lm", 2, False, "model"),
        ("mlm", 0, False, "model"),
        ("mlm", 1, False, "model"),
        ("causal_lm", 3, False, "blocks"),
        ("translation", 1, False, "blocks"),
        ("causal_lm", 2, True, "blocks"),
    ],
)
def test_compile_scope_auto_is_the_whole_model_where_shapes_are_fixed_and_parameters_whole(
    task, stage, cuda, expected
):
    from common.configure import load_config
    from launch.config import TrainConfig, compile_scope_for

    cfg = load_config(
        TrainConfig,
        ROOT / "configs" / "tiny_gpt.yaml",
        [f"task={task}", f"deepspeed.zero_stage={stage}"],
    )
    assert cfg.compile_scope == "auto" and compile_scope_for(cfg, cuda) == expected
    for scope in ("model", "blocks"):
        cfg = load_config(
            TrainConfig,
            ROOT / "configs" / "tiny_gpt.yaml",
            [f"task={task}", f"compile_scope={scope}"],
        )
        assert compile_scope_for(cfg, cuda) == scope


def test_compile_scope_problems_are_named():
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.resolve import config_problems

    cfg = load_config(TrainConfig, ROOT / "configs" / "tiny_gpt.yaml", ["compile_scope=graph"])
    assert config_problems(cfg) == ["compile_scope: 'graph' is not one of auto, model, blocks"]
    cfg = load_config(
        TrainConfig,
        ROOT / "configs" / "tiny_gpt.yaml",
        ["compile_scope=model", "deepspeed.zero_stage=3"],
    )
    assert [p.split(" (")[0] for p in config_problems(cfg)] == [
        "compile_scope: model needs deepspeed.zero_stage 0-2"
    ]


@pytest.mark.parametrize("arch", ["gpt", "bert"])
def test_the_whole_model_compiles_to_one_graph_with_its_loss_and_matches_eager(arch):
    """compile_scope=model: embeddings, blocks and the loss (GPT's chunked linear cross-entropy
    with its autograd function, BERT's head on the masked rows) in one graph without breaks; the
    state dict keeps its keys; loss and gradients are eager's (fp32). BERT's count of masked rows
    changes from batch to batch: `Task.to_device` marks it dynamic, so three counts share one graph."""
    from torch._dynamo.utils import counters

    from launch.tasks import Task
    from launch.train.setup import compile_model
    from model import ModelConfig, build_model
    from model.loss import IGNORE_INDEX

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(
        arch=arch,
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        d_ff=64,
        max_seq_len=16,
        dropout=0.0,
    )
    torch.manual_seed(0)
    eager, compiled = build_model(cfg), build_model(cfg)
    compiled.load_state_dict(eager.state_dict())
    keys = list(compiled.state_dict())
    compile_model(compiled, "model")
    assert list(compiled.state_dict()) == keys
    generator = torch.Generator().manual_seed(1)
    for masked in (3, 5, 7):
        x = torch.randint(5, 64, (2, 12), generator=generator)
        if arch == "gpt":
            labels = torch.cat([x[:, 1:], torch.full((2, 1), IGNORE_INDEX)], 1)
        else:
            labels = torch.full_like(x, IGNORE_INDEX)
            labels.view(-1)[torch.randperm(24, generator=generator)[:masked]] = 7
        for model in (eager, compiled):
            model.zero_grad(set_to_none=True)
        # BERT's masked rows found on the host and moved as the trainer moves its inputs
        # (launch.tasks)
        inputs = {"input_ids": x, "labels": labels}
        if arch == "bert":
            inputs["scored_index"] = (labels.view(-1) != IGNORE_INDEX).nonzero().squeeze(1)
        inputs = Task.to_device(inputs, torch.device("cpu"))
        losses = [model(**inputs).loss for model in (eager, compiled)]
        for loss in losses:
            loss.backward()
        torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=LOSS_TOLERANCE)
        for (name, a), b in zip(eager.named_parameters(), compiled.parameters(), strict=True):
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert not counters["graph_break"]
    assert counters["stats"]["unique_graphs"] == 1


def test_compile_without_a_cpp_compiler_is_one_line(monkeypatch):
    from common.configure import UserError
    from launch.train.setup import compile_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("CXX", "no-such-c++-compiler")
    with pytest.raises(UserError) as err:
        compile_model(_tiny_gpt())
    assert str(err.value).startswith("compile: ") and "no-such-c++-compiler" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.slow
def test_compiled_zero3_training_matches_eager_and_its_checkpoint_resumes_and_exports_eagerly(
    tiny_dataset, tmp_path, uninterrupted_gpt
):
    # UNINTERRUPTED_GPT: 14 steps, a checkpoint and an evaluation every 4, ZeRO-2
    eager = uninterrupted_gpt
    compiled = tmp_path / "compiled"
    train(
        "tiny_gpt.yaml",
        tiny_dataset,
        compiled,
        *UNINTERRUPTED_GPT,
        "deepspeed.zero_stage=3",
        "compile=true",
        "model.activation_checkpointing=true",
        "stop_after_steps=4",
    )
    resumed = train(
        "tiny_gpt.yaml", tiny_dataset, compiled, *UNINTERRUPTED_GPT, "deepspeed.zero_stage=3"
    )
    assert "resumed from" in resumed.stderr

    def by_step(run_dir, key):
        return {row["step"]: row[key] for row in metrics(run_dir) if key in row}

    expected, got = by_step(eager, "train/loss"), by_step(compiled, "train/loss")
    print("\nstep  eager ZeRO-2  compiled ZeRO-3 (1-4), then resumed eagerly (5-14)")
    for step in range(1, 15):
        print(f"{step:4d}  {expected[step]:.8f}  {got[step]:.8f}")
    assert sorted(got) == list(range(1, 15))
    assert [got[s] for s in range(1, 15)] == pytest.approx(
        [expected[s] for s in range(1, 15)], abs=LOSS_TOLERANCE, rel=0
    )
    # Evaluation runs eagerly in a compiled run too.
    assert by_step(compiled, "eval/loss")[4] == pytest.approx(
        by_step(eager, "eval/loss")[4], abs=LOSS_TOLERANCE
    )

    # The compiled run's checkpoint exports with the eager run's keys and (nearly) its weights.
    from safetensors.torch import load_file

    from launch.model_dir import WEIGHTS, load_model_dir

    exported = {}
    for name, run_dir in (("eager", eager), ("compiled", compiled)):
        out = tmp_path / f"export-{name}"
        run = subprocess.run(
            [
                sys.executable,
                "-m",
                "launch.export",
                f"checkpoint={run_dir / 'checkpoints' / 'step_00000004'}",
                f"out={out}",
            ],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert run.returncode == 0, run.stderr[-3000:]
        exported[name] = load_file(out / WEIGHTS)
        load_model_dir(out)  # loads strictly into a plain model
    assert sorted(exported["compiled"]) == sorted(exported["eager"])
    assert not any("_orig_mod" in key for key in exported["compiled"])
    for key, weight in exported["eager"].items():
        torch.testing.assert_close(
            exported["compiled"][key], weight, atol=LOSS_TOLERANCE, rtol=0, msg=key
        )


@pytest.mark.slow
def test_compiled_bert_under_zero1_matches_eager(tiny_dataset, tmp_path):
    common = [
        "max_steps=4",
        "log_every=1",
        "eval_every=4",
        "checkpoint.every_steps=0",
        "deepspeed.zero_stage=1",
    ]
    eager, compiled = tmp_path / "eager", tmp_path / "compiled"
    train("tiny_bert.yaml", tiny_dataset, eager, *common)
    run = train("tiny_bert.yaml", tiny_dataset, compiled, *common, "compile=true")
    assert "recompile_limit" not in run.stderr  # one graph for both blocks, none for the hooks
    for key in ("train/loss", "eval/loss", "eval/accuracy"):
        expected = [row[key] for row in metrics(eager) if key in row]
        assert [row[key] for row in metrics(compiled) if key in row] == pytest.approx(
            expected, abs=LOSS_TOLERANCE, rel=0
        )


@pytest.mark.slow
def test_compiled_llama_shaped_blocks_are_one_graph_and_match_eager():
    """Rotary (cos, sin) reach each compiled block as arguments; grouped heads go to SDPA as
    they are; RMSNorm and the gated MLP fuse. Both blocks share one graph, without breaks, and
    the loss and gradients are eager's (fp32)."""
    from torch._dynamo.utils import counters

    from launch.train.setup import compile_model
    from model import ModelConfig, build_model

    torch._dynamo.reset()
    counters.clear()
    cfg = ModelConfig(
        arch="gpt",
        vocab_size=64,
        d_model=32,
        n_layers=2,
        n_heads=2,
        n_kv_heads=1,
        d_ff=64,
        max_seq_len=16,
        dropout=0.0,
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
    )
    torch.manual_seed(0)
    eager, compiled = build_model(cfg), build_model(cfg)
    compiled.load_state_dict(eager.state_dict())
    compile_model(compiled)
    x = torch.randint(5, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = [model(x, labels=x).loss for model in (eager, compiled)]
    for loss in losses:
        loss.backward()
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(losses[1], losses[0], rtol=0, atol=LOSS_TOLERANCE)
    for a, b in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6)
