"""Exports of a real run, and runs started from them (issue #27 §1 and §2).

A tiny GPT is pretrained on the tiny dataset (launch.train, one process) and exported by the
command in both formats. The exports carry one provenance record; the Hugging Face one computes
our logits with `transformers` and its tokenizer gives the dataset's ids on the dataset's own
texts. `init.model=DIR` then starts causal_lm runs at step 0: from our export, the first step's
loss is the exported model's loss on that batch (pretraining resumes where the export left it);
from the Hugging Face directory, it is `transformers`' own loss of that model on the same batch.
A directory trained with another tokenizer, an override that contradicts the directory's model
config, and a directory of the wrong architecture are refused in one line."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

import trainruns  # noqa: E402
from repo import ROOT  # noqa: E402

pytestmark = pytest.mark.slow

# trainruns' TINY, shorter (later settings win)
TINY = [
    *trainruns.TINY,
    "model.max_seq_len=32",
    "schedule.warmup_steps=2",
    "eval_every=0",
    "checkpoint.every_steps=0",
    "log_every=1",
]
PRETRAIN_STEPS = 20


def train(
    data: Path, run_dir: Path, *overrides: str, config: str = "tiny_gpt.yaml", ok: bool = True
):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
    command = [
        sys.executable,
        "-m",
        "launch.train",
        str(ROOT / "configs" / config),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        *overrides,
    ]
    run = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert (run.returncode == 0) == ok, run.stderr[-4000:]
    return run


def export(checkpoint: Path, out: Path, *args: str) -> None:
    run = subprocess.run(
        [sys.executable, "-m", "launch.export", f"checkpoint={checkpoint}", f"out={out}", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-4000:]


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


def one_line_error(run: subprocess.CompletedProcess) -> str:
    lines = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(lines) == 1 and "Traceback" not in run.stderr, run.stderr[
        -3000:
    ]
    return lines[0]


@pytest.fixture(scope="module")
def pretrained(tiny_dataset, tmp_path_factory):
    """(run dir, our export, the Hugging Face export) of a GPT pretrained for PRETRAIN_STEPS steps."""
    top = tmp_path_factory.mktemp("pretrained")
    run_dir = top / "run"
    train(tiny_dataset, run_dir, *TINY, f"max_steps={PRETRAIN_STEPS}")
    export(run_dir, top / "ours")
    export(run_dir, top / "hf", "format=hf")
    return run_dir, top / "ours", top / "hf"


def first_batch(run_dir: Path, task_name: str = "causal_lm") -> dict:
    """The model inputs of the first training batch a run of `run_dir`'s config reads (one rank)."""
    from common.configure import load_config
    from launch.config import TrainConfig
    from launch.tasks import TASKS
    from pipeline.load.loader import ShardLoader
    from pipeline.load.plan import LoaderPlan

    cfg = load_config(TrainConfig, run_dir / "config.yaml")
    loader = ShardLoader(
        LoaderPlan.from_config(
            cfg.data, task_name, "train", rank=0, world_size=1, grad_accum=cfg.grad_accum
        )
    )
    return TASKS[task_name].model_inputs(next(iter(loader)))


def test_both_exports_carry_one_provenance_record(pretrained, tiny_dataset):
    from common.hashing import file_sha256

    run_dir, ours, hf = pretrained
    record = json.loads((ours / "provenance.json").read_text())
    assert json.loads((hf / "provenance.json").read_text()) == record
    client = json.loads(
        (run_dir / "checkpoints" / "latest")
        .parent.joinpath(
            (run_dir / "checkpoints" / "latest").read_text().strip(), "client_state.json"
        )
        .read_text()
    )
    assert record["step"] == PRETRAIN_STEPS and record["tokens_seen"] == client["tokens_seen"] > 0
    assert record["tokenizer_sha256"] == file_sha256(tiny_dataset / "tokenizer.model")
    assert record["dataset"]["manifest_sha256"] == file_sha256(tiny_dataset / "manifest.json")
    assert len(record["dataset"]["train_shards_sha256"]) == 64
    assert record["mixture"] == {"weights": {}, "samples_per_epoch": None}  # one source, unmixed
    assert record["config"]["task"] == "causal_lm" and record["config"]["model"]["d_model"] == 32
    assert record["config"]["max_steps"] == PRETRAIN_STEPS


def test_hugging_face_export_of_a_run_gives_our_logits_and_ids(pretrained, tiny_dataset):
    from launch.model_dir import load_model_dir
    from pipeline.tokenizer import load_tokenizer

    run_dir, ours_dir, hf_dir = pretrained
    ours, _ = load_model_dir(ours_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    inputs = first_batch(run_dir)
    with torch.no_grad():
        expected = ours(inputs["input_ids"], inputs["attention_mask"]).logits
        theirs = hf(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert (theirs - expected).abs().max().item() < 1e-4
    # The dataset's own texts, as its tokenizer decodes them, tokenize back to the same ids.
    sp = load_tokenizer(tiny_dataset / "tokenizer.model")
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    texts = [
        text for row in inputs["input_ids"].tolist() for text in sp.decode(row).split("  ") if text
    ]
    assert texts and hf_tokenizer(texts)["input_ids"] == [sp.encode(text) for text in texts]


def test_continued_pretraining_from_our_export_resumes_the_loss(pretrained, tiny_dataset, tmp_path):
    from launch.model_dir import load_model_dir

    run_dir, ours_dir, _ = pretrained
    resumed = tmp_path / "continued"
    train(
        tiny_dataset, resumed, *TINY, "max_steps=3", f"init.model={ours_dir}", "model.dropout=0.0"
    )
    got = losses(resumed)
    assert sorted(got) == [1, 2, 3]  # a new run: step 0, its own schedule
    model, _ = load_model_dir(ours_dir)
    with torch.no_grad():
        expected = model(**first_batch(resumed)).loss.item()
    assert got[1] == pytest.approx(expected, abs=1e-5)
    before = losses(run_dir)
    assert got[1] < 0.8 * before[1]  # where pretraining left it, not where it began
    config = (resumed / "config.yaml").read_text()
    assert "d_model: 32" in config and f"model: {ours_dir}" in config


def test_step0_loss_from_a_hugging_face_directory_equals_transformers(
    pretrained, tiny_dataset, tmp_path
):
    """The HF export without our tokenizer.model: the tokenizer is checked by its ids on a sample."""
    _, _, hf_dir = pretrained
    plain = tmp_path / "plain_hf"
    shutil.copytree(hf_dir, plain)
    (plain / "tokenizer.model").unlink()
    (plain / "provenance.json").unlink()
    started = tmp_path / "from_hf"
    train(tiny_dataset, started, *TINY, "max_steps=1", f"init.model={plain}", "model.dropout=0.0")
    hf = transformers.AutoModelForCausalLM.from_pretrained(plain).eval()
    inputs = first_batch(started)
    # transformers shifts them itself
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    with torch.no_grad():
        expected = hf(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels
        ).loss.item()
    assert losses(started)[1] == pytest.approx(expected, abs=1e-5)


def test_another_tokenizer_is_refused_naming_both(pretrained, tiny_dataset, tmp_path):
    _, ours_dir, hf_dir = pretrained
    # A Hugging Face directory whose tokenizer maps two pieces to each other's ids.
    swapped = tmp_path / "swapped"
    shutil.copytree(hf_dir, swapped)
    (swapped / "tokenizer.model").unlink()
    spec = json.loads((swapped / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    # not a control or byte piece
    normal = [i for i, (piece, score) in enumerate(vocab) if score > -1e8][:2]
    vocab[normal[0]], vocab[normal[1]] = vocab[normal[1]], vocab[normal[0]]
    (swapped / "tokenizer.json").write_text(json.dumps(spec))
    line = one_line_error(
        train(tiny_dataset, tmp_path / "a", *TINY, "max_steps=1", f"init.model={swapped}", ok=False)
    )
    assert "gives other ids" in line and str(swapped) in line and str(tiny_dataset) in line
    # Our export with another tokenizer's sha256 recorded.
    other = tmp_path / "other"
    shutil.copytree(ours_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["tokenizer_sha256"] = "0" * 64
    (other / "config.json").write_text(json.dumps(config))
    line = one_line_error(
        train(tiny_dataset, tmp_path / "b", *TINY, "max_steps=1", f"init.model={other}", ok=False)
    )
    assert "0" * 64 in line and str(other) in line and "tokenizer.model" in line


def test_contradicting_override_and_wrong_architecture_are_refused(
    pretrained, tiny_dataset, tmp_path
):
    _, ours_dir, hf_dir = pretrained
    line = one_line_error(
        train(
            tiny_dataset,
            tmp_path / "a",
            *TINY,
            "max_steps=1",
            f"init.model={hf_dir}",
            "model.d_model=48",
            ok=False,
        )
    )
    assert "model.d_model=32" in line and "model.d_model=48" in line and str(hf_dir) in line
    line = one_line_error(
        train(
            tiny_dataset,
            tmp_path / "b",
            *TINY,
            "max_steps=1",
            f"init.model={ours_dir}",
            config="tiny_bert.yaml",
            ok=False,
        )
    )
    assert "holds a gpt model" in line and "task mlm trains bert" in line
