"""Scoring with lm-evaluation-harness (`launch.lm_eval`): a tiny GPT made in the test, exported as
ours and as Hugging Face's, gives through our `OurLM` and through lm-eval's own `HFLM` the same
log-likelihoods, greedy flags, rolling log-likelihoods and generations on the same requests (the
round trip proves both); the command writes both tasks' metrics with nothing downloaded; a bad
task name is one line, exit 2; `lm_eval.every` logs the metrics at those steps of a training run."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("lm_eval")

from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402
from lm_eval.models.huggingface import HFLM  # noqa: E402
from repo import ROOT  # noqa: E402

from common.configure import UserError  # noqa: E402
from launch.lm_eval.command import load_lm  # noqa: E402
from launch.lm_eval.ours import OurLM  # noqa: E402
from launch.lm_eval.tasks import build_docs, held_out_texts  # noqa: E402
from launch.model_dir import save_hf_dir, save_model_dir  # noqa: E402
from model import ModelConfig, build_model  # noqa: E402
from pipeline.format import read_manifest  # noqa: E402
from pipeline.tokenizer import (
    SENTENCEPIECE_FILE,  # noqa: E402
    load_tokenizer,  # noqa: E402
)

OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
TINY = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32, dropout=0.0)
ARCHS = {
    "gpt2": dict(arch="gpt", activation="gelu_tanh"),
    "llama": dict(
        arch="gpt",
        positions="rope",
        norm="rmsnorm",
        activation="swiglu",
        bias=False,
        n_kv_heads=2,
        tie_embeddings=False,
    ),
}
ATOL = 1e-4


def export_both(kind: str, data, out, scale: float = 0.5):
    """A tiny GPT of `kind` on the dataset's vocabulary, every weight moved off its init (but
    the byte pieces' output rows),
    exported as ours (out/ours) and as Hugging Face's (out/hf), both naming `data` as their dataset."""
    cfg = ModelConfig(
        vocab_size=int(read_manifest(data)["tokenizer"]["vocab_size"]), **TINY, **ARCHS[kind]
    )
    torch.manual_seed(0)
    model = build_model(cfg)
    sp = load_tokenizer(data / SENTENCEPIECE_FILE).processor
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
        # Byte pieces score 0, below the best text piece: greedy output is text, which both
        # tokenizers decode alike (they differ on invalid UTF-8 byte runs).
        model.lm_head.weight[[i for i in range(sp.get_piece_size()) if sp.is_byte(i)]] = 0.0
    provenance = {"task": "causal_lm", "step": 7, "dataset": {"data_dir": str(data)}}
    save_model_dir(
        out / "ours",
        model.state_dict(),
        cfg,
        data / SENTENCEPIECE_FILE,
        {"task": "causal_lm", "step": 7},
        provenance,
    )
    save_hf_dir(out / "hf", model.state_dict(), cfg, data / SENTENCEPIECE_FILE, provenance)
    return out / "ours", out / "hf"


def requests(lm, texts: list[str]) -> list[Instance]:
    """The tasks' own requests (cloze and choice over the split), an empty context, one too long
    for the model's positions (cut on the left), and continuations the model itself generated
    greedily (so some greedy flags are true)."""
    docs = build_docs(texts, seed=1)
    pairs = [(doc["context"], doc["target"]) for doc in docs["cloze"][:12]]
    pairs += [
        (doc["context"], " " + choice) for doc in docs["choice"][:4] for choice in doc["choices"]
    ]
    short = min(texts, key=len)
    pairs += [("", short), (" ".join(texts[:4]), " " + short)]
    contexts = [doc["context"] for doc in docs["cloze"][12:18]]
    generated = lm.generate_until(
        [
            Instance("generate_until", {}, (c, {"until": ["\n"], "max_gen_toks": 4}), 0)
            for c in contexts
        ]
    )
    # An ending that only changes the context's last piece leaves no token to score (lm-eval
    # asserts).
    pairs += [
        (context, ending)
        for context, ending in zip(contexts, generated)
        if lm._encode_pair(context, ending)[1]
    ]
    return [Instance("loglikelihood", {}, pair, index) for index, pair in enumerate(pairs)]


@pytest.mark.parametrize("kind", list(ARCHS))
def test_our_lm_and_hflm_over_the_hf_export_agree(kind, tiny_dataset, tmp_path):
    ours_dir, hf_dir = export_both(kind, tiny_dataset, tmp_path)
    # Through lm-eval's registry, as `lm_eval --model pretrain-pipeline --model_args pretrained=DIR`
    # makes it.
    ours = get_model("pretrain-pipeline").create_from_arg_string(
        f"pretrained={ours_dir},batch_size=5", {"device": "cpu"}
    )
    assert type(ours) is OurLM and ours.batch_size_per_rank == 5
    # HFLM, its logits cache off (see load_lm)
    hf = load_lm(hf_dir, "hf", batch_size=3, device="cpu")
    assert type(hf) is HFLM
    assert hf.max_length == ours.max_length == TINY["max_seq_len"]
    texts = held_out_texts(tiny_dataset, "valid")
    asked = requests(ours, texts)
    # the cut path
    assert any(len(ours.tok_encode(r.args[0] + r.args[1])) > TINY["max_seq_len"] + 1 for r in asked)
    mine, theirs = ours.loglikelihood(asked), hf.loglikelihood(asked)
    assert max(abs(a[0] - b[0]) for a, b in zip(mine, theirs)) < ATOL
    assert [a[1] for a in mine] == [b[1] for b in theirs]
    assert any(greedy for _, greedy in mine) and not all(greedy for _, greedy in mine)
    assert all(score < 0 for score, _ in mine)

    rolling = [
        Instance("loglikelihood_rolling", {}, (" ".join(texts[i : i + 5]),), i) for i in range(3)
    ]
    mine_rolling, theirs_rolling = (
        ours.loglikelihood_rolling(rolling),
        hf.loglikelihood_rolling(rolling),
    )
    assert len(ours.tok_encode(rolling[0].args[0])) > TINY["max_seq_len"]  # more than one window
    assert max(abs(a - b) for a, b in zip(mine_rolling, theirs_rolling)) < ATOL

    prompts = [
        Instance(
            "generate_until", {}, (text.rsplit(" ", 3)[0], {"until": ["Tür"], "max_gen_toks": 6}), i
        )
        for i, text in enumerate(texts[:6])
    ]
    generated = ours.generate_until(prompts)
    assert generated == hf.generate_until(prompts)
    assert sum(bool(text.strip()) for text in generated) >= 3


def test_tasks_are_built_from_the_held_out_documents(tiny_dataset, tiny_corpus):
    """The split's documents come back as the corpus's own lines, each once; cloze targets are their
    last words; each choice doc holds its real ending at `label` among 3 other endings of the split,
    the same for the same seed; a continuation that does not fit leaves its document out."""
    lines = {
        side
        for line in tiny_corpus.read_text(encoding="utf-8").splitlines()
        for side in line.split("\t")
    }
    texts = held_out_texts(tiny_dataset, "valid")
    assert len(texts) > 40 and set(texts) <= lines
    assert held_out_texts(tiny_dataset, "test") != texts
    docs = build_docs(texts, seed=3)
    assert [d["context"] + d["target"] for d in docs["cloze"]] == texts
    endings = set()
    for doc, text in zip(docs["choice"], texts):
        assert doc["context"] + " " + doc["choices"][doc["label"]] == text
        assert len(set(doc["choices"])) == 4
        endings.add(doc["choices"][doc["label"]])
    assert {choice for doc in docs["choice"] for choice in doc["choices"]} <= endings
    assert (
        build_docs(texts, seed=3) == docs and build_docs(texts, seed=4)["choice"] != docs["choice"]
    )
    short = build_docs(texts, seed=3, fits=lambda continuation: len(continuation.split()) <= 4)
    assert 0 < len(short["choice"]) < len(docs["choice"]) and short["cloze"] == docs["cloze"]
    assert all(len(doc["choices"][doc["label"]].split()) <= 4 for doc in short["choice"])


def run_lm_eval(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "launch.lm_eval", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_command_scores_both_tasks_with_nothing_downloaded(tiny_dataset, tmp_path):
    """Ours in a fresh process with the Hugging Face libraries offline; the HF export in this
    one, through HFLM: the same docs, the same metrics."""
    ours_dir, hf_dir = export_both("gpt2", tiny_dataset, tmp_path)
    run = run_lm_eval(
        f"checkpoint={ours_dir}",
        "limit=30",
        f"out={tmp_path / 'scores' / 'ours.json'}",
        "wandb.mode=offline",
        env=OFFLINE,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    record = json.loads((tmp_path / "scores" / "ours.json").read_text())
    assert (
        record["format"] == "ours"
        and record["step"] == 7
        and record["data_dir"] == str(tiny_dataset)
    )
    metrics = record["metrics"]
    assert set(metrics) == {
        "lm_eval/cloze/acc",
        "lm_eval/cloze/perplexity",
        "lm_eval/choice/acc",
        "lm_eval/choice/acc_norm",
    }
    assert (
        record["n-samples"]["cloze"]["effective"]
        == record["n-samples"]["choice"]["effective"]
        == 30
    )
    assert metrics["lm_eval/cloze/perplexity"] > 1 and 0 <= metrics["lm_eval/choice/acc"] <= 1
    assert "cloze" in run.stdout and "acc_norm" in run.stdout  # lm-eval's table
    # the offline W&B run beside the JSON, logged at the export's step
    from trainruns import wandb_records

    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in wandb_records(tmp_path / "scores")
        if r.WhichOneof("record_type") == "history"
    ]
    assert [(h["_step"], {k: h[k] for k in metrics}) for h in history] == [(7, metrics)]

    from launch.lm_eval.command import lm_eval_scores
    from launch.lm_eval.config import LmEvalConfig
    from launch.tracking import WandbConfig

    out = tmp_path / "hf.json"
    theirs = lm_eval_scores(
        LmEvalConfig(
            checkpoint=str(hf_dir),
            limit=30,
            out=str(out),
            device="cpu",
            wandb=WandbConfig(mode="disabled"),
        )
    )
    assert theirs["format"] == "hf" and json.loads(out.read_text())["metrics"] == theirs["metrics"]
    assert theirs["metrics"].keys() == metrics.keys()
    for key, value in metrics.items():
        assert theirs["metrics"][key] == pytest.approx(value, rel=1e-4), key


def test_bad_input_is_one_line_exit_2(tiny_dataset, tmp_path):
    from launch.lm_eval.command import lm_eval_scores
    from launch.lm_eval.config import LmEvalConfig

    ours_dir, hf_dir = export_both("gpt2", tiny_dataset, tmp_path)
    run = run_lm_eval(f"checkpoint={ours_dir}", "tasks=[cloze,lambada]")
    assert run.returncode == 2, run.stderr
    assert run.stderr == "error: tasks: 'lambada' is not one of cloze, choice\n"
    for directory, given, message in [
        (ours_dir, "hf", "is in our format (format=ours)"),
        (hf_dir, "ours", "is a Hugging Face one (format=hf)"),
        (tmp_path, "auto", "is not an exported model directory"),
    ]:
        with pytest.raises(UserError, match=re.escape(message)):
            lm_eval_scores(LmEvalConfig(checkpoint=str(directory), format=given))
    assert not list(tmp_path.rglob("lm_eval-*.json"))


def test_training_logs_lm_eval_metrics_every_n_steps(tiny_dataset, tmp_path):
    from trainruns import metrics, train

    run_dir = tmp_path / "run"
    train(
        "tiny_gpt.yaml",
        tiny_dataset,
        run_dir,
        "max_steps=4",
        "log_every=1",
        "eval_every=0",
        "lm_eval.every=2",
        "lm_eval.limit=8",
        "checkpoint.every_steps=0",
        nproc=1,
    )
    rows = metrics(run_dir)
    scored = [row["step"] for row in rows if "lm_eval/cloze/acc" in row]
    assert scored == [2, 4]
    last = next(row for row in rows if row["step"] == 4)
    logged = {key: value for key, value in last.items() if key.startswith("lm_eval/")}
    assert set(logged) == {
        "lm_eval/cloze/acc",
        "lm_eval/cloze/perplexity",
        "lm_eval/choice/acc",
        "lm_eval/choice/acc_norm",
    }

    # The figures are the command's on the step's export.
    from launch.export import export
    from launch.lm_eval.command import lm_eval_scores
    from launch.lm_eval.config import LmEvalConfig
    from launch.tracking import WandbConfig

    export(run_dir, tmp_path / "export")
    scored = lm_eval_scores(
        LmEvalConfig(
            checkpoint=str(tmp_path / "export"),
            limit=8,
            device="cpu",
            wandb=WandbConfig(mode="disabled"),
        )
    )
    assert scored["step"] == 4 and scored["metrics"] == pytest.approx(logged, rel=1e-4)
