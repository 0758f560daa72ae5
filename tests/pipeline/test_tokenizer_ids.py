"""A tokenizer's vocabulary is its id range, the highest id + 1, not its count of tokens (issue 61
#4). A Hugging Face tokenizer whose ids have gaps (its special tokens mid-vocabulary, then a hole
of HOLE ids) prepares with that range in the manifest, validates, and trains; a model with fewer
embedding rows than the range is refused in one line, the same line at the dry run and at the
start of training; a manifest that recorded the count (an earlier prepare's) is refused in one
line by validate, the dry run and the trainer, before any batch is read."""

import json
import shutil
import subprocess
import tarfile
from pathlib import Path

import numpy as np
import pytest
from corpora import prepare_args, run_prepare, synthetic_pairs, write_tsv
from errorlines import assert_one_line_error
from hflayouts import layout_texts
from trainruns import run_module, train_one_process

from pipeline.format import decode_array, read_manifest
from pipeline.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

HOLE = 100  # ids no token has, above the special tokens
SPECIALS = ("<|endoftext|>", "<|pad|>")


def save_gapped_tokenizer(directory: Path) -> tuple[int, int]:
    """A byte-level BPE (GPT-2's design, trained with the `tokenizers` library on the synthetic
    corpus) renumbered so that its ids have a gap: the first half of the learned pieces, then the
    special tokens (added tokens, mid-vocabulary), then HOLE ids no token has, then the rest; saved
    by `PreTrainedTokenizerFast.save_pretrained`. Returns (its count of tokens, its highest id)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE())
    base.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    base.decoder = decoders.ByteLevel()
    base.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    base.train_from_iterator(layout_texts(), trainer)
    spec = json.loads(base.to_str())
    learned = [piece for piece, _ in sorted(spec["model"]["vocab"].items(), key=lambda i: i[1])]
    half = len(learned) // 2
    vocab = {piece: index for index, piece in enumerate(learned[:half])}
    for token in SPECIALS:
        vocab[token] = len(vocab)
    for piece in learned[half:]:
        vocab[piece] = len(vocab) + HOLE
    spec["model"]["vocab"] = vocab
    spec["added_tokens"] = [
        {
            "id": vocab[token],
            "content": token,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for token in SPECIALS
    ]
    tokenizer = Tokenizer.from_str(json.dumps(spec))
    end, pad = SPECIALS
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=end, eos_token=end, unk_token=end, pad_token=pad
    ).save_pretrained(str(directory))
    return tokenizer.get_vocab_size(with_added_tokens=True), max(vocab.values())


@pytest.fixture(scope="module")
def gapped(tmp_path_factory) -> tuple[Path, int, int]:
    """(the tokenizer directory, its count of tokens, its highest id)."""
    directory = tmp_path_factory.mktemp("gapped") / "tokenizer"
    count, highest = save_gapped_tokenizer(directory)
    return directory, count, highest


@pytest.fixture(scope="module")
def gapped_data(gapped, tmp_path_factory) -> Path:
    """The synthetic corpus prepared for causal_lm with the gapped tokenizer (`tokenizer.path`)."""
    top = tmp_path_factory.mktemp("gapped-data")
    corpus = write_tsv(top / "pairs.tsv", synthetic_pairs(600))
    args = prepare_args(corpus, top / "data", **{"ray.num_workers": 2})
    run = run_prepare([*args, f"tokenizer.path={gapped[0]}", "tasks=[causal_lm]"], timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return top / "data"


def dry_run_problems(run: subprocess.CompletedProcess) -> list[str]:
    """The problem lines of a dry run's report (exit 2), each `key: message`."""
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("problems ("))
    return [line.strip() for line in lines[start + 1 :] if line.startswith("  ")]


def test_the_vocabulary_is_the_id_range_not_the_count(gapped):
    directory, count, highest = gapped
    assert highest + 1 == count + HOLE  # the tokenizers library counts the tokens
    tokenizer = load_tokenizer(directory)
    assert tokenizer.vocab_size == highest + 1
    assert tokenizer.info()["vocab_size"] == highest + 1
    vocabulary = tokenizer.vocabulary()
    assert len(vocabulary) == count and max(vocabulary.values()) == highest
    # ids above the count are the tokenizer's own ids: a text encodes to some of them
    ids = sum(tokenizer.encode_batch(layout_texts()[:200]), [])
    assert max(ids) >= count and max(ids) < tokenizer.vocab_size
    end, pad = (vocabulary[token] for token in SPECIALS)
    assert (tokenizer.specials.eos, tokenizer.specials.pad) == (end, pad)
    # every entry's text, the gap skipped (no id without a token is decoded)
    texts = tokenizer.vocabulary_texts()
    assert len(texts) <= count - len(SPECIALS) and all(texts)


@pytest.mark.slow
def test_prepare_records_the_id_range_and_validate_passes(gapped, gapped_data):
    _, count, highest = gapped
    manifest = read_manifest(gapped_data)
    assert manifest["tokenizer"]["vocab_size"] == highest + 1
    top = 0
    for entry in manifest["datasets"]["packed"]["splits"]["train"]["shards"]:
        with tarfile.open(gapped_data / entry["path"]) as tar:
            for member in tar:
                if member.name.endswith(".input_ids.npy"):
                    ids = decode_array(tar.extractfile(member).read())
                    top = max(top, int(np.max(ids)))
    assert count <= top <= highest  # the shards hold ids at or above the count
    run = run_module("pipeline.validate", f"data_dir={gapped_data}")
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip().endswith("0 problem(s)")


@pytest.mark.slow
def test_a_model_smaller_than_the_id_range_is_refused_in_one_line(gapped, gapped_data, tmp_path):
    """The dry run and the trainer say the same line (`launch.preconditions.with_data_tokenizer`,
    one rule for both); model.vocab_size=0 takes the range, and the run trains."""
    _, count, highest = gapped
    small = f"model.vocab_size={count}"
    ready = train_one_process(gapped_data, tmp_path / "run", "--dry-run")
    assert ready.returncode == 0, ready.stdout + ready.stderr
    assert f"vocabulary {highest + 1}" in ready.stdout
    problems = dry_run_problems(
        train_one_process(gapped_data, tmp_path / "run", small, "--dry-run")
    )
    expected = (
        f"model.vocab_size: {count} but the tokenizer of {gapped_data} has a vocabulary of "
        f"{highest + 1} (ids 0 to {highest})"
    )
    assert len(problems) == 1 and problems[0].startswith(expected), problems
    line = assert_one_line_error(
        train_one_process(gapped_data, tmp_path / "run", small, "max_steps=2")
    ).removeprefix("error: ")
    assert line.startswith(expected.replace("model.vocab_size: ", "model.vocab_size=")), line
    assert not (tmp_path / "run").exists()
    trained = train_one_process(gapped_data, tmp_path / "run", "max_steps=2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2]


@pytest.mark.slow
def test_a_manifest_that_counted_the_tokens_is_refused_in_one_line(gapped, gapped_data, tmp_path):
    """A dataset as a prepare that counted the tokens wrote it (the same shards, the manifest's
    vocab_size the count): one line at validate, the dry run and the trainer, not a loader that
    finds no readable batch."""
    _, count, highest = gapped
    data = tmp_path / "counted"
    shutil.copytree(gapped_data, data)
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["vocab_size"] = count
    (data / "manifest.json").write_text(json.dumps(manifest, indent=1))
    expected = (
        f"{data}: the manifest records a vocabulary of {count}, but its tokenizer's ids run to "
        f"{highest} (a vocabulary of {highest + 1}"
    )
    run = run_module("pipeline.validate", f"data_dir={data}")
    assert run.returncode == 1 and run.stdout.startswith(f"FAIL {expected}"), run.stdout
    problems = dry_run_problems(train_one_process(data, tmp_path / "run", "--dry-run"))
    refused = assert_one_line_error(train_one_process(data, tmp_path / "run"))
    assert problems[0] == "data.data_dir: " + refused.removeprefix("error: ")
    assert problems[0].startswith(f"data.data_dir: {expected}")
    assert not (tmp_path / "run").exists()
