"""A tokenizer is known by the ids it gives, not by its file's bytes (issue 61 #8). A dataset
prepared with a Hugging Face tokenizer directory (conftest's hf_layout_data, GPT-2's layout), then
`init.model=` a tiny GPT-2 saved by `save_pretrained` with that tokenizer as transformers saves it
again after a padded, truncated call (its tokenizer.json rewritten, no id changed): the dry run
says ready and two steps train. Preparing with the model's directory instead gives the same
shards, byte for byte. A tokenizer that differs in one id, or in one special id, is still refused
in one line that says what differs."""

import json
import subprocess
from pathlib import Path

import pytest
from corpora import prepare_args, run_prepare
from errorlines import assert_one_line_error
from hflayouts import HF_LAYOUT_TASKS, tiny_hf_model
from trainruns import train_one_process

from common.hashing import file_sha256
from pipeline.format import read_manifest
from pipeline.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")


def save_model_with_resaved_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    """A tiny GPT2LMHeadModel and the tokenizer of `tokenizer_dir` in `out`, both by
    `save_pretrained`, the tokenizer after a call that padded and truncated (as a user's
    batches do): transformers writes those settings into the tokenizer.json it saves, and a pad
    token into its tokenizer_config.json."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.pad_token = tokenizer.eos_token
    tokenizer(
        ["the red cat opens a door", "a window"],
        padding="max_length",
        truncation=True,
        max_length=8,
    )
    tiny_hf_model("gpt2", tokenizer).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))


@pytest.fixture(scope="module")
def resaved(hf_layouts, tmp_path_factory) -> Path:
    """The model directory, its tokenizer GPT-2's layout's (hf_layouts["gpt2"]) saved again."""
    out = tmp_path_factory.mktemp("resaved") / "model"
    save_model_with_resaved_tokenizer(hf_layouts["gpt2"], out)
    return out


def with_vocabulary(source: Path, out: Path, edit) -> Path:
    """A copy of the model directory `source` whose tokenizer.json's vocabulary `edit` changed."""
    out.mkdir()
    for path in source.iterdir():
        (out / path.name).write_bytes(path.read_bytes())
    spec = json.loads((out / "tokenizer.json").read_text())
    edit(spec["model"]["vocab"])
    (out / "tokenizer.json").write_text(json.dumps(spec))
    return out


def swap_two_ids(vocab: dict[str, int]) -> None:
    by_id = {index: piece for piece, index in vocab.items()}
    vocab[by_id[300]], vocab[by_id[301]] = 301, 300


def train(data: Path, run_dir: Path, *overrides: str) -> subprocess.CompletedProcess:
    """The model's shape is init.model's."""
    return train_one_process(data, run_dir, "model.dropout=0.0", *overrides, shape=False)


def test_a_tokenizer_saved_again_is_the_same_by_its_ids(hf_layouts, resaved, tmp_path):
    from pipeline.tokenizer_identity import difference  # here: the end-to-end tests run without it

    original = hf_layouts["gpt2"] / "tokenizer.json"
    assert file_sha256(resaved / "tokenizer.json") != file_sha256(original)
    spec = json.loads((resaved / "tokenizer.json").read_text())
    assert spec["truncation"]["max_length"] == 8 and spec["padding"] is not None
    ours, theirs = load_tokenizer(hf_layouts["gpt2"]), load_tokenizer(resaved)
    assert difference(ours, theirs) is None
    # read as a text's whole ids, unpadded, whatever truncation and padding it was saved with
    text = "the old window closes and the small cat sees a new house 12"
    assert theirs.encode(text) == ours.encode(text) and len(ours.encode(text)) > 8
    # one id swapped: the first id that differs, and what each side has there
    swapped = load_tokenizer(with_vocabulary(resaved, tmp_path / "swapped", swap_two_ids))
    by_id = {index: piece for piece, index in ours.vocabulary().items()}
    assert difference(ours, swapped) == (f"id 300 is {by_id[300]!r} here, {by_id[301]!r} there")
    # one special id: the eos token named as another token
    renamed = tmp_path / "renamed"
    with_vocabulary(resaved, renamed, lambda vocab: None)
    config = json.loads((renamed / "tokenizer_config.json").read_text())
    config["eos_token"] = by_id[7]
    (renamed / "tokenizer_config.json").write_text(json.dumps(config))
    end = ours.specials.eos
    assert (
        difference(ours, load_tokenizer(renamed)) == f"the eos token is id {end} here, id 7 there"
    )


@pytest.mark.slow
def test_init_model_from_a_directory_whose_tokenizer_was_saved_again(
    hf_layouts, hf_layout_data, hf_layout_corpus, resaved, tmp_path
):
    data = hf_layout_data["gpt2"]
    assert read_manifest(data)["tokenizer"]["sha256"] == file_sha256(
        hf_layouts["gpt2"] / "tokenizer.json"
    )
    trained = train(data, tmp_path / "run", f"init.model={resaved}", "max_steps=2")
    assert trained.returncode == 0, trained.stderr[-3000:]
    rows = [
        json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows if "train/loss" in row] == [1, 2]
    # the dataset's own tokenizer travels with the run
    run_tokenizer = (tmp_path / "run" / "tokenizer.json").read_bytes()
    assert run_tokenizer == (data / "tokenizer.json").read_bytes()
    # the dry run says so too, before anything starts
    ready = train(data, tmp_path / "again", f"init.model={resaved}", "--dry-run")
    assert ready.returncode == 0, ready.stdout + ready.stderr
    fact = f"{resaved}: its tokenizer gives the dataset's ids"
    assert any(
        line.split() and line.split()[0] == "init.model:" and line.endswith(fact)
        for line in ready.stdout.splitlines()
    ), ready.stdout
    # The model's directory as tokenizer.path: the same shards (the same ids, unpadded, whole).
    out = tmp_path / "from-model"
    args = prepare_args(hf_layout_corpus, out, **{"ray.num_workers": 2})
    run = run_prepare([*args, f"tokenizer.path={resaved}", f"tasks={HF_LAYOUT_TASKS['gpt2']}"])
    assert run.returncode == 0, run.stderr[-3000:]
    tars = sorted(path.relative_to(data) for path in data.rglob("*.tar"))
    assert tars and tars == sorted(path.relative_to(out) for path in out.rglob("*.tar"))
    assert all((data / tar).read_bytes() == (out / tar).read_bytes() for tar in tars)


@pytest.mark.slow
def test_a_tokenizer_that_differs_in_one_id_is_refused_in_one_line(
    hf_layout_data, resaved, tmp_path
):
    data = hf_layout_data["gpt2"]
    swapped = with_vocabulary(resaved, tmp_path / "swapped", swap_two_ids)
    vocab = json.loads((data / "tokenizer.json").read_text())["model"]["vocab"]
    by_id = {index: piece for piece, index in vocab.items()}
    expected = (
        f"init.model: the tokenizer of {swapped} gives other ids than the dataset's tokenizer "
        f"{data / 'tokenizer.json'} (sha256 {file_sha256(data / 'tokenizer.json')[:12]}): id 300 "
        f"is {by_id[300]!r} in the dataset's, {by_id[301]!r} in the directory's"
    )
    dry = train(data, tmp_path / "run", f"init.model={swapped}", "--dry-run")
    assert dry.returncode == 2 and "Traceback" not in dry.stderr, dry.stdout + dry.stderr
    assert f"  {expected}" in dry.stdout.splitlines(), dry.stdout
    line = assert_one_line_error(
        train(data, tmp_path / "run", f"init.model={swapped}", "max_steps=2")
    ).removeprefix("error: ")
    assert line == expected
    assert not (tmp_path / "run").exists()
