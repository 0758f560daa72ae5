"""A dataset's tokenizer of either kind: a Hugging Face tokenizer given by `tokenizer.path` (GPT-2,
Llama and BERT layouts, `conftest.hf_layouts`) or trained by the `tokenizers` library, its special
ids and frames read from it and recorded in the manifest, and the shards holding exactly the ids
the library itself gives each text; bad tokenizers refused in one line; no module outside the
SentencePiece code relying on the fixed ids."""

import ast
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from corpora import RayHead, prepare_args, synthetic_pairs
from hflayouts import HF_LAYOUT_TASKS
from repo import ROOT

from pipeline.format import dataset_specials, decode_array, read_manifest
from pipeline.tokenizer import load_tokenizer

transformers = pytest.importorskip("transformers")

TASKS = HF_LAYOUT_TASKS  # what conftest's hf_layout_data prepared each layout's tokenizer for


@pytest.fixture(scope="module")
def corpus(hf_layout_corpus) -> Path:
    return hf_layout_corpus


def prepare(corpus: Path, out: Path, ray: RayHead | None, *overrides: str):
    args = prepare_args(corpus, out, **{"ray.num_workers": 2})
    command = [
        sys.executable,
        "-m",
        "pipeline.prepare",
        str(ROOT / "configs/prepare_gettext_en_de.yaml"),
        *args,
        *([f"ray.address={ray.address}"] if ray else []),
        *overrides,
    ]
    env = ray.env if ray else None
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)


def one_line_error(run: subprocess.CompletedProcess) -> str:
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    return errors[0]


def samples(data: Path, dataset: str, split: str = "train") -> list[dict[str, np.ndarray]]:
    """Every sample of a split, member name -> array, in manifest and tar order."""
    manifest = read_manifest(data)
    found = []
    for entry in manifest["datasets"][dataset]["splits"][split]["shards"]:
        members: dict[str, dict[str, np.ndarray]] = {}
        with tarfile.open(data / entry["path"]) as tar:
            for member in tar:
                key, field = member.name.split(".", 1)
                members.setdefault(key, {})[field.removesuffix(".npy")] = decode_array(
                    tar.extractfile(member).read()
                )
        found.extend(members.values())
    return found


def test_special_tokens_and_frames_of_each_layout(hf_layouts):
    gpt2, llama, bert = (load_tokenizer(hf_layouts[name]).specials for name in TASKS)
    end = load_tokenizer(hf_layouts["gpt2"]).vocab_size - 1  # <|endoftext|>: the last id
    assert (gpt2.pad, gpt2.bos, gpt2.eos, gpt2.mask, gpt2.pad_id) == (None, end, end, None, end)
    assert (gpt2.document, gpt2.source, gpt2.target) == (((), (end,)),) * 2 + (((end,), (end,)),)
    assert (llama.unk, llama.bos, llama.eos, llama.pad, llama.pad_id) == (0, 1, 2, None, 2)
    assert llama.document == ((1,), (2,)) and llama.target == ((1,), (2,))
    assert (bert.pad, bert.unk, bert.bos, bert.eos, bert.mask, bert.sep) == (
        0,
        100,
        101,
        102,
        103,
        102,
    )
    assert bert.document == ((101,), (102,)) and {0, *range(100, 104)} <= set(bert.ids)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(TASKS))
def test_prepare_writes_the_librarys_own_ids_framed_as_recorded(layout, hf_layouts, hf_layout_data):
    """Every whole document of the packed blocks is `AutoTokenizer`'s encoding of a corpus text in
    the tokenizer's own frame (its post-processor's, with eos after where that adds none); every
    pair is the two sides' plain encodings; the manifest records the kind, the files and the ids.
    The dataset is conftest's hf_layout_data: the corpus prepared with `tokenizer.path` set to the
    layout's directory and `tasks` to TASKS[layout], with test_hf_layouts' training reading it."""
    out = hf_layout_data[layout]
    manifest = read_manifest(out)
    tokenizer = manifest["tokenizer"]
    assert tokenizer["kind"] == "hf" and tokenizer["file"] == "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == (
        hf_layouts[layout] / "tokenizer.json"
    ).read_bytes()
    assert sorted(tokenizer["files"]) == ["tokenizer.json", "tokenizer_config.json"]
    specials = dataset_specials(manifest)
    assert specials == load_tokenizer(hf_layouts[layout]).specials
    hf = transformers.AutoTokenizer.from_pretrained(out)  # the dataset directory itself loads
    texts = sorted({text for pair in synthetic_pairs(600) for text in pair})
    plain = dict(zip(texts, hf(texts, add_special_tokens=False)["input_ids"]))
    framed = hf(texts)["input_ids"]
    before, after = specials.document
    expected = set()
    for text, ids in zip(texts, framed):
        # the library's own frame, and eos after where it puts nothing there
        assert ids[: len(before)] == list(before)
        expected.add(tuple(ids if ids[-1] == after[-1] else ids + [after[-1]]))
    if "packed" in manifest["datasets"]:
        documents = 0
        for sample in samples(out, "packed"):
            ids, starts = sample["input_ids"].tolist(), sample["doc_starts"].tolist()
            for start, end in zip(starts[1:], starts[2:]):  # whole documents: between two starts
                assert tuple(ids[start:end]) in expected, (layout, hf.decode(ids[start:end]))
                documents += 1
        assert documents > 50
    if "translation" in manifest["datasets"]:
        encodings = {tuple(ids) for ids in plain.values()}
        pairs = samples(out, "translation")
        assert pairs and all(
            tuple(s["src_ids"].tolist()) in encodings and tuple(s["tgt_ids"].tolist()) in encodings
            for s in pairs
        )


@pytest.mark.slow
def test_hf_kind_is_the_same_bytes_for_one_and_two_workers(
    hf_layouts, hf_layout_data, corpus, ray_head, tmp_path
):
    """Two workers: hf_layout_data's GPT-2 dataset (prepare_args' 2 workers, the same corpus
    file and overrides); one worker prepared here."""
    outs = {1: tmp_path / "w1", 2: hf_layout_data["gpt2"]}
    run = prepare(
        corpus,
        outs[1],
        ray_head,
        f"tokenizer.path={hf_layouts['gpt2']}",
        f"tasks={TASKS['gpt2']}",
        "ray.num_workers=1",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    tars = sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*.tar"))
    assert tars == sorted(p.relative_to(outs[2]) for p in outs[2].rglob("*.tar"))
    assert all((outs[1] / p).read_bytes() == (outs[2] / p).read_bytes() for p in tars)


@pytest.mark.slow
def test_a_byte_level_bpe_trained_by_the_tokenizers_library(corpus, ray_head, tmp_path):
    """tokenizer.kind=hf trains GPT-2's design; the dataset directory loads with AutoTokenizer and
    gives the shards' ids."""
    out = tmp_path / "data"
    run = prepare(corpus, out, ray_head, "tokenizer.kind=hf", "tokenizer.model_type=bpe")
    assert run.returncode == 0, run.stderr[-3000:]
    manifest = read_manifest(out)
    assert manifest["tokenizer"]["kind"] == "hf" and manifest["tokenizer"]["trained"]
    specials = dataset_specials(manifest)
    assert None not in (specials.pad, specials.bos, specials.eos, specials.mask)
    hf = transformers.AutoTokenizer.from_pretrained(out)
    assert (hf.pad_token_id, hf.eos_token_id, hf.mask_token_id) == (
        specials.pad,
        specials.eos,
        specials.mask,
    )
    pair = samples(out, "translation")[0]
    text = hf.decode(pair["src_ids"].tolist())
    assert hf(text, add_special_tokens=False)["input_ids"] == pair["src_ids"].tolist()


def test_bad_tokenizers_are_refused_in_one_line_and_nothing_is_written(
    hf_layouts, corpus, tmp_path
):
    not_one = tmp_path / "tokenizer.json"
    not_one.write_text(json.dumps({"these": "are not the droids"}))
    cases = [
        ([f"tokenizer.path={not_one}"], "is not a Hugging Face tokenizer"),
        ([f"tokenizer.path={tmp_path / 'missing.model'}"], "tokenizer not found"),
        ([f"tokenizer.path={hf_layouts['gpt2']}", "tasks=[mlm]"], "mlm replaces tokens by a mask"),
        (["tokenizer.kind=hf", "tokenizer.model_type=unigram"], "byte-level bpe"),
    ]
    for overrides, message in cases:
        out = tmp_path / "out"
        line = one_line_error(prepare(corpus, out, None, *overrides))
        assert message in line, line
        assert not out.exists() and not list(tmp_path.glob("out.partial*"))


# The names of the SentencePiece layout's fixed ids, and the modules that own that layout: the
# tokenizer's own code and its special tokens, its training and its conversion to a Hugging Face
# fast tokenizer.
FIXED_ID_NAMES = {"SENTENCEPIECE_SPECIALS", "sentencepiece_specials"}
FIXED_ID_OWNERS = {
    "pipeline/tokenizer.py",
    "pipeline/specials.py",
    "pipeline/prepare/train_tokenizer.py",
    "launch/hf_tokenizer.py",
}


def fixed_id_users(root: Path) -> list[str]:
    """Modules outside FIXED_ID_OWNERS that name the fixed layout, or spell an id constant."""
    found = []
    for package in ("common", "pipeline", "model", "launch", "benchmarks"):
        for path in sorted((root / package).rglob("*.py")):
            name = str(path.relative_to(root))
            if name in FIXED_ID_OWNERS:
                continue
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                used = (
                    node.id
                    if isinstance(node, ast.Name)
                    else node.attr
                    if isinstance(node, ast.Attribute)
                    else node.name
                    if isinstance(node, ast.alias)
                    else None
                )
                if used in FIXED_ID_NAMES or (used or "").endswith(
                    ("PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "MASK_ID", "SEP_ID")
                ):
                    found.append(f"{name}:{node.lineno if hasattr(node, 'lineno') else ''} {used}")
    return found


def test_no_module_outside_the_sentencepiece_code_uses_the_fixed_ids(tmp_path):
    assert fixed_id_users(ROOT) == []
    (tmp_path / "launch").mkdir()
    (tmp_path / "launch" / "x.py").write_text(
        "from pipeline.tokenizer import sentencepiece_specials\nEOS_ID = 3\n"
    )
    assert [line.split(" ")[1] for line in fixed_id_users(tmp_path)] == [
        "sentencepiece_specials",
        "EOS_ID",
    ]
