"""Translation after training: BLEU/chrF evaluation (`launch.evaluate`), the translate command
(`launch.translate`), evaluation under 2 ranks and ZeRO-3, and a tokenizer mismatch refused.

One tiny Seq2Seq is fine-tuned once for the module (about 30 s on 2 cores) on the tiny
dataset's word-for-word EN->DE pairs, and evaluated once on the train split it has memorised;
the other tests reuse both.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from corpora import synthetic_pairs
from repo import ROOT

from common.hashing import file_sha256
from launch.decoding import length_sorted_batches, source_ids
from launch.evaluate import rank_batches, read_pairs, score
from launch.main.plan import torchrun
from pipeline.format import read_manifest
from pipeline.specials import sentencepiece_specials

SP = sentencepiece_specials()  # the project's SentencePiece layout

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
# A 2+2-layer d_model 64 model: 300 steps of 16 pairs (about 10 epochs of the 500 train pairs)
# bring the loss to the label-smoothing floor (about 0.9 nats with smoothing 0.1 over ~325 pieces).
FINETUNE = [
    "model.d_model=64",
    "model.n_heads=4",
    "model.d_ff=128",
    "model.max_seq_len=64",
    "model.dropout=0.0",
    "data.micro_batch_size=16",
    "data.num_workers=0",
    "optim.lr=3e-3",
    "schedule.warmup_steps=20",
    "max_steps=300",
    "eval_every=0",
    "eval_batches=0",
    "log_every=50",
    "checkpoint.every_steps=0",
    "wandb.mode=disabled",
    "threads_per_rank=1",
]
# 500 train pairs in 11 batches of 48: under 2 ranks one rank has a batch fewer, so the
# dummy batch that keeps it in step under ZeRO-3 is exercised.
DECODE = ["split=train", "beam=4", "max_len=40", "micro_batch_size=48"]
# Above which a tiny model has learnt to translate the data it was trained on. A model that
# learnt only the word frequencies scores under 10 (common words match, 4-grams do not); the
# memorised word-for-word pairs score about 85, short only of some of the sentence-final
# numbers (i % 97, a rarely seen piece each).
BLEU_THRESHOLD, CHRF_THRESHOLD = 50.0, 70.0


def run(*args: str, stdin: bytes | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        list(args), cwd=ROOT, env=ENV, input=stdin, capture_output=True, timeout=timeout
    )


def python_m(module: str, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", module, *args, **kwargs)


def lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


# ----------------------------------------------------------------------------- fast


def test_pairs_in_manifest_order_and_batches_independent_of_world_size(tiny_dataset):
    manifest = read_manifest(tiny_dataset)
    shards = manifest["datasets"]["translation"]["splits"]["valid"]["shards"]
    pairs = read_pairs(tiny_dataset, "valid")
    assert len(pairs) == sum(s["samples"] for s in shards)
    assert [len(p) for p in read_pairs(tiny_dataset, "valid", limit=5)] == [2] * 5
    assert all(
        np.array_equal(a[0], b[0])
        for a, b in zip(read_pairs(tiny_dataset, "valid", limit=5), pairs)
    )

    lengths = [len(source_ids(src, 63, SP)[0]) for src, _ in pairs]
    batches = length_sorted_batches(lengths, 8)
    assert sorted(i for batch in batches for i in batch) == list(range(len(pairs)))
    # longest first
    assert all(lengths[a[-1]] >= lengths[b[0]] for a, b in zip(batches, batches[1:]))
    for world in (1, 2, 3):
        dealt = [rank_batches(batches, rank, world) for rank in range(world)]
        # the same batches, each once
        assert sorted(map(tuple, sum(dealt, []))) == sorted(map(tuple, batches))
        assert max(map(len, dealt)) - min(map(len, dealt)) <= 1

    assert source_ids(range(10, 20), 4, SP) == ([10, 11, 12, 13, SP.eos], True)
    assert source_ids([7], 4, SP) == ([7, SP.eos], False)


def test_scores_and_signatures():
    hyps, refs = (
        ["die rote Katze sieht eine Tür", ""],
        ["die rote Katze sieht eine Tür", "die Liste"],
    )
    result = score(hyps, refs)
    assert 0 < result["bleu"] < 100 and 0 < result["chrf"] < 100
    assert "version:2.6" in result["signature_bleu"] and "tok:13a" in result["signature_bleu"]
    assert "nc:6" in result["signature_chrf"]
    assert score(refs, refs)["bleu"] == pytest.approx(100.0)


def _export_random_model(out: Path, tokenizer: Path) -> None:
    """A random tiny Seq2Seq exported with `tokenizer` (no training needed to be refused)."""
    from launch.model_dir import save_model_dir
    from model import ModelConfig, build_model

    sp_vocab = _vocab_size(tokenizer)
    cfg = ModelConfig(
        arch="seq2seq",
        vocab_size=sp_vocab,
        d_model=16,
        n_layers=1,
        n_heads=2,
        d_ff=32,
        max_seq_len=32,
    )
    save_model_dir(
        out, build_model(cfg).state_dict(), cfg, tokenizer, {"task": "translation", "step": 0}
    )


def _vocab_size(tokenizer: Path) -> int:
    from pipeline.tokenizer import load_tokenizer

    return load_tokenizer(tokenizer).vocab_size


def test_tokenizer_mismatch_is_refused_before_any_compute(tiny_dataset, tmp_path):
    from pipeline.prepare.config import TokenizerConfig
    from pipeline.prepare.train_tokenizer import train_tokenizer

    # Another tokenizer, trained on the same kind of text with a different vocabulary size.
    texts = [text for pair in synthetic_pairs(300, seed=1) for text in pair]
    other = tmp_path / "other.model"
    other.write_bytes(train_tokenizer(texts, TokenizerConfig(vocab_size=360, sample_texts=1000)))
    assert file_sha256(other) != read_manifest(tiny_dataset)["tokenizer"]["sha256"]
    exported = tmp_path / "export"
    _export_random_model(exported, other)

    result = python_m(
        "launch.evaluate", f"checkpoint={exported}", f"data_dir={tiny_dataset}", "split=valid"
    )
    stderr = result.stderr.decode()
    assert result.returncode == 2, stderr[-3000:]
    assert stderr.count("\n") == 1 and stderr.startswith("error: tokenizer mismatch"), stderr
    assert not (exported / "eval-valid").exists()

    # The translate command refuses a tokenizer file that is not the one the weights were trained
    # with.
    (exported / "tokenizer.model").write_bytes((tiny_dataset / "tokenizer.model").read_bytes())
    result = python_m("launch.translate", f"checkpoint={exported}", stdin=b"the red cat\n")
    assert result.returncode == 2 and result.stderr.decode().startswith("error: "), (
        result.stderr.decode()[-3000:]
    )
    assert "not the tokenizer the model was trained with" in result.stderr.decode()


# ----------------------------------------------------------------------------- with a fine-tuned
# model


@pytest.fixture(scope="module")
def finetuned(tiny_dataset, tmp_path_factory) -> dict:
    """A tiny Seq2Seq trained on the tiny dataset (one process, ZeRO-2), its run and its export."""
    root = tmp_path_factory.mktemp("finetuned")
    run_dir, exported = root / "run", root / "export"
    train = python_m(
        "launch.train",
        str(ROOT / "configs" / "tiny_translation.yaml"),
        f"data.data_dir={tiny_dataset}",
        f"run_dir={run_dir}",
        *FINETUNE,
    )
    assert train.returncode == 0, train.stderr.decode()[-4000:]
    export = python_m("launch.export", f"checkpoint={run_dir}", f"out={exported}")
    assert export.returncode == 0, export.stderr.decode()[-4000:]
    return {"run": run_dir, "export": exported, "data": tiny_dataset}


@pytest.fixture(scope="module")
def train_eval(finetuned) -> Path:
    """One rank, no DeepSpeed engine: the run directory evaluated directly (consolidated on the fly)
    on the train split, the dataset taken from the run's config."""
    out = finetuned["run"] / "eval-train-1rank"
    result = python_m("launch.evaluate", f"checkpoint={finetuned['run']}", *DECODE, f"out={out}")
    assert result.returncode == 0, result.stderr.decode()[-4000:]
    (out / "stdout.txt").write_bytes(result.stdout)
    return out


@pytest.mark.slow
def test_finetuned_model_translates_its_training_data(train_eval, finetuned):
    scores = json.loads((train_eval / "scores.json").read_text())
    print(f"\ntrain split: {scores['bleu_detail']} | chrF {scores['chrf']:.2f}")
    assert scores["bleu"] > BLEU_THRESHOLD and scores["chrf"] > CHRF_THRESHOLD, scores
    n = len(read_pairs(finetuned["data"], "train"))
    assert (
        scores["n"] == n
        and scores["beam"] == 4
        and scores["split"] == "train"
        and scores["world_size"] == 1
    )
    assert scores["checkpoint"] == str(finetuned["run"].resolve())
    for name in ("hypotheses.txt", "references.txt", "sources.txt"):
        assert len(lines(train_eval / name)) == n, name
    assert lines(train_eval / "references.txt")[:3] == [
        de for _, de in _pairs_of(finetuned["data"], "train", 3)
    ]
    printed = (train_eval / "stdout.txt").read_text().splitlines()  # DeepSpeed's logs go to stderr
    assert printed == [
        f"{scores['bleu_detail']} | {scores['signature_bleu']}",
        f"{scores['chrf_detail']} | {scores['signature_chrf']}",
    ]
    assert printed[0].startswith(f"BLEU = {scores['bleu']:.2f} ")


def _pairs_of(data_dir: Path, split: str, n: int) -> list[tuple[str, str]]:
    from pipeline.tokenizer import load_tokenizer

    sp = load_tokenizer(data_dir / "tokenizer.model")
    return [
        (sp.decode(src.tolist()), sp.decode(tgt.tolist()))
        for src, tgt in read_pairs(data_dir, split, n)
    ]


@pytest.mark.slow
def test_translate_round_trip_matches_evaluation(train_eval, finetuned):
    sources, hypotheses = (
        lines(train_eval / "sources.txt")[:20],
        lines(train_eval / "hypotheses.txt")[:20],
    )
    long_line = " ".join(["the red cat sees a small window"] * 30)  # far over max_seq_len=64 tokens
    given = [s.encode() for s in sources]
    given[3:3] = [b""]  # line 4: empty
    given[8:8] = [long_line.encode()]  # line 9: too long
    given[12:12] = [b"  "]  # line 13: blank, no tokens
    given[15:15] = [b"the old \xff\xfe file"]  # line 16: not UTF-8
    result = python_m(
        "launch.translate",
        f"checkpoint={finetuned['export']}",
        "beam=4",
        "max_len=40",
        "micro_batch_size=8",
        stdin=b"\n".join(given) + b"\n",
    )
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-4000:]
    out = result.stdout.decode("utf-8").split("\n")
    assert out[-1] == "" and len(out) - 1 == len(given)
    out = out[:-1]
    assert out[3] == "" and out[12] == ""
    assert out[8] and out[15]
    warnings = [line for line in stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "line 9:" in warnings[0] and "truncated" in warnings[0], stderr
    assert "translated 22 lines (2 empty, 1 truncated)" in stderr
    assert [o for i, o in enumerate(out) if i not in (3, 8, 12, 15)] == hypotheses

    # input=FILE reads the same; greedy decoding (beam=1) works too.
    source_file = finetuned["run"] / "sources-5.txt"
    source_file.write_text("\n".join(sources[:5]) + "\n", encoding="utf-8")
    greedy = python_m(
        "launch.translate", f"checkpoint={finetuned['export']}", f"input={source_file}", "beam=1"
    )
    assert greedy.returncode == 0, greedy.stderr.decode()[-4000:]
    assert len(greedy.stdout.decode().split("\n")) == 6


@pytest.mark.slow
def test_two_ranks_zero3_equal_one_rank(train_eval, finetuned, tmp_path):
    # Below DeepSpeed's default persistence threshold (1e5 elements) every tensor of this tiny
    # model would stay whole on every rank; 0 makes ZeRO-3 partition them all.
    ds_config = tmp_path / "ds.json"
    ds_config.write_text(
        json.dumps({"zero_optimization": {"stage3_param_persistence_threshold": 0}})
    )
    out = tmp_path / "eval-2ranks"
    command = [
        *torchrun(2),
        "-m",
        "launch.evaluate",
        f"checkpoint={finetuned['export']}",
        f"data_dir={finetuned['data']}",
        *DECODE,
        "deepspeed.zero_stage=3",
        f"deepspeed.config_file={ds_config}",
        "threads_per_rank=1",
        f"out={out}",
    ]
    result = run(*command)
    stderr = result.stderr.decode()
    assert result.returncode == 0, stderr[-4000:]
    assert "world 2, ZeRO-3" in stderr
    partitioned = next(line for line in stderr.splitlines() if line.startswith("ZeRO-3:"))
    split, total = (int(x) for x in partitioned.split()[1:4:2])
    assert split == total > 0, partitioned

    assert (out / "hypotheses.txt").read_bytes() == (train_eval / "hypotheses.txt").read_bytes()
    assert (out / "references.txt").read_bytes() == (train_eval / "references.txt").read_bytes()
    one, two = (json.loads((d / "scores.json").read_text()) for d in (train_eval, out))
    for key in ("bleu", "chrf", "signature_bleu", "signature_chrf", "n"):
        assert one[key] == two[key], key
    assert two["world_size"] == 2 and two["zero_stage"] == 3
