"""Translation from two vocabularies, Rothe et al. 2020's BERT2GPT2: a dataset whose sources are
encoded by a BERT WordPiece and targets by a GPT-2 BPE (`tokenizer.target_path`, conftest's
bert2gpt2_data), a Seq2Seq warm-started from a Hugging Face BERT (encoder) and GPT-2 (decoder)
directory and trained on two ranks, evaluated with BLEU, translated, exported in both formats. The
Hugging Face export is read back by `transformers` alone: the export's own tokenizer encodes the
sources, `generate` decodes, the tokenizer in export/target detokenizes, and the hypotheses are
launch.evaluate's. A stack whose weights were trained with the other side's tokenizer is refused."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

transformers = pytest.importorskip("transformers")

from repo import ROOT  # noqa: E402

from common.hashing import file_sha256  # noqa: E402
from launch.main.plan import torchrun  # noqa: E402
from pipeline.format import read_manifest, tokenizer_record  # noqa: E402

pytestmark = pytest.mark.slow

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
# The stacks of conftest's tiny Hugging Face BERT (post-LN, eps 1e-12, MLP 64) and GPT-2 (pre-LN,
# gelu_new, MLP 128), both 2 layers of width 32 with 2 heads and 64 positions.
MODEL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.max_seq_len=64",
    "model.encoder.layer_norm_eps=1e-12",
    "model.decoder.d_ff=128",
    "model.dropout=0.0",
]
TRAIN = [
    "data.micro_batch_size=8",
    "data.num_workers=0",
    "optim.lr=3e-3",
    "schedule.warmup_steps=10",
    "max_steps=150",
    "eval_every=75",
    "eval_batches=2",
    "log_every=25",
    "checkpoint.every_steps=0",
    "deepspeed.zero_stage=1",
    "threads_per_rank=1",
]
DECODE = ["split=test", "beam=4", "micro_batch_size=16"]


def python_m(module: str, *args: str, two_ranks: bool = False, **kwargs):
    launcher = [*torchrun(2), "-m", module] if two_ranks else [sys.executable, "-m", module]
    return subprocess.run(
        [*launcher, *args], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=900, **kwargs
    )


def train_args(data: Path, run_dir: Path, encoder: Path, decoder: Path) -> list[str]:
    return [
        str(ROOT / "configs" / "tiny_translation.yaml"),
        f"data.data_dir={data}",
        f"run_dir={run_dir}",
        f"init.encoder={encoder}",
        f"init.decoder={decoder}",
        *MODEL,
        *TRAIN,
    ]


@pytest.fixture(scope="module")
def bert2gpt2(hf_layouts, bert2gpt2_data, tmp_path_factory) -> dict[str, Path]:
    """The run (2 ranks, ZeRO-1, warm-started from the layouts' BERT and GPT-2), its evaluation on
    the test split, and its exports in our format and Hugging Face's."""
    top = tmp_path_factory.mktemp("bert2gpt2")
    paths = {name: top / name for name in ("run", "eval", "ours", "hf")}
    run = python_m(
        "launch.train",
        *train_args(bert2gpt2_data, paths["run"], hf_layouts["bert"], hf_layouts["gpt2"]),
        two_ranks=True,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    paths["train_log"] = top / "train.log"
    paths["train_log"].write_text(run.stderr)
    evaluated = python_m(
        "launch.evaluate", f"checkpoint={paths['run']}", *DECODE, f"out={paths['eval']}"
    )
    assert evaluated.returncode == 0, evaluated.stderr[-4000:]
    for fmt in ("ours", "hf"):
        exported = python_m(
            "launch.export", f"checkpoint={paths['run']}", f"out={paths[fmt]}", f"format={fmt}"
        )
        assert exported.returncode == 0, exported.stderr[-4000:]
    return paths


def test_each_side_holds_its_own_tokenizers_ids(hf_layouts, bert2gpt2_data, hf_layout_corpus):
    """Every source in the shards is a corpus sentence as BERT's tokenizer encodes it, every target
    one as GPT-2's does (each library's own encoding); the manifest names both tokenizers."""
    from pipeline.load.shards import decode_sample
    from pipeline.validate import validate

    bert = transformers.AutoTokenizer.from_pretrained(hf_layouts["bert"])
    gpt2 = transformers.AutoTokenizer.from_pretrained(hf_layouts["gpt2"])
    pairs = [line.split("\t") for line in hf_layout_corpus.read_text().splitlines()]
    sources = {
        tuple(ids) for ids in bert([s for s, _ in pairs], add_special_tokens=False)["input_ids"]
    }
    targets = {
        tuple(ids) for ids in gpt2([t for _, t in pairs], add_special_tokens=False)["input_ids"]
    }
    manifest = read_manifest(bert2gpt2_data)
    assert tokenizer_record(manifest, "source")["vocab_size"] == len(bert)
    assert tokenizer_record(manifest, "target")["vocab_size"] == len(gpt2)
    assert (bert2gpt2_data / "target" / "tokenizer.json").read_bytes() == (
        hf_layouts["gpt2"] / "tokenizer.json"
    ).read_bytes()
    import tarfile

    seen = 0
    for split in manifest["datasets"]["translation"]["splits"].values():
        for shard in split["shards"]:
            with tarfile.open(bert2gpt2_data / shard["path"]) as tar:
                members: dict[str, dict] = {}
                for member in tar:
                    key, _, suffix = member.name.partition(".")
                    members.setdefault(key, {})[suffix.removesuffix(".npy")] = tar.extractfile(
                        member
                    ).read()
            for raw in members.values():
                src, tgt = decode_sample(raw, ("src_ids", "tgt_ids"), 10**6)
                assert tuple(src.tolist()) in sources and tuple(tgt.tolist()) in targets
                seen += 1
    assert seen == len(pairs)
    assert validate(bert2gpt2_data) == []


def test_warm_started_bert2gpt2_trains_evaluates_translates(bert2gpt2, hf_layouts):
    log = bert2gpt2["train_log"].read_text()
    # every tensor of both stacks copied; only the decoder's cross-attention is new
    report = (bert2gpt2["run"] / "warm_start.txt").read_text().splitlines()
    new = [line.split()[1] for line in report[1:] if line.startswith("new")]
    assert new and all(".cross_attn" in key for key in new), new
    losses = [json.loads(line) for line in (bert2gpt2["run"] / "metrics.jsonl").open()]
    train = [row["train/loss"] for row in losses if "train/loss" in row]
    assert train[-1] < 0.6 * train[0], log[-2000:]
    # the target tokenizer's identity travels with the checkpoint and the export
    sha = file_sha256(hf_layouts["gpt2"] / "tokenizer.json")
    (client_file,) = (bert2gpt2["run"] / "checkpoints").glob("step_*/client_state.json")
    assert json.loads(client_file.read_text())["target_tokenizer_sha256"] == sha
    exported = json.loads((bert2gpt2["ours"] / "config.json").read_text())
    assert exported["target_tokenizer_sha256"] == sha
    config = exported["model"]
    assert config["encoder"]["vocab_size"] == len(
        transformers.AutoTokenizer.from_pretrained(hf_layouts["bert"])
    )
    assert config["decoder"]["vocab_size"] == len(
        transformers.AutoTokenizer.from_pretrained(hf_layouts["gpt2"])
    )
    scores = json.loads((bert2gpt2["eval"] / "scores.json").read_text())
    print(f"\nBERT2GPT2 test split: {scores['bleu_detail']} | chrF {scores['chrf']:.2f}")
    assert scores["bleu"] > 20, scores
    # references are the targets as GPT-2's tokenizer decodes them: German words, cased as given
    refs = (bert2gpt2["eval"] / "references.txt").read_text().splitlines()
    assert refs and all(ref.split()[0] in ("der", "die", "das") for ref in refs), refs[:3]

    # launch.translate, from the run and from our export, gives the evaluation's hypotheses
    sources = (bert2gpt2["eval"] / "sources.txt").read_text()
    hypotheses = (bert2gpt2["eval"] / "hypotheses.txt").read_text()
    for checkpoint in (bert2gpt2["run"], bert2gpt2["ours"]):
        out = python_m("launch.translate", f"checkpoint={checkpoint}", "beam=4", input=sources)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout == hypotheses
    again = python_m(
        "launch.evaluate", f"checkpoint={bert2gpt2['ours']}", *DECODE, f"out={bert2gpt2['eval']}2"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert (
        json.loads((Path(f"{bert2gpt2['eval']}2") / "scores.json").read_text())["bleu"]
        == (scores["bleu"])
    )


def test_hf_export_round_trip_through_transformers_alone(bert2gpt2):
    """The export as a user reads it: EncoderDecoderModel and AutoTokenizer from the directory,
    the sources encoded the standard way, beam 4 with launch.evaluate's per-source length limit
    (min(max_len, 1.5 x source tokens + 10)), the target tokenizer in export/target decoding."""
    import math

    import sacrebleu
    import torch

    hf = bert2gpt2["hf"]
    model = transformers.EncoderDecoderModel.from_pretrained(hf).eval()
    source_tokenizer = transformers.AutoTokenizer.from_pretrained(hf)
    target_tokenizer = transformers.AutoTokenizer.from_pretrained(hf / "target")
    sources = (bert2gpt2["eval"] / "sources.txt").read_text().splitlines()
    ours = (bert2gpt2["eval"] / "hypotheses.txt").read_text().splitlines()
    refs = (bert2gpt2["eval"] / "references.txt").read_text().splitlines()
    max_len = model.config.decoder.max_position_embeddings
    theirs = []
    with torch.no_grad():
        for text in sources:
            ids = source_tokenizer(text, return_tensors="pt")
            limit = max(1, min(max_len, math.floor(1.5 * ids["input_ids"].shape[1] + 10)))
            out = model.generate(
                **ids, num_beams=4, max_new_tokens=limit, length_penalty=1.0, do_sample=False
            )
            text_out = target_tokenizer.decode(out[0], skip_special_tokens=True)
            theirs.append(" ".join(text_out.splitlines()))
    same = sum(a == b for a, b in zip(theirs, ours))
    bleu_theirs = sacrebleu.corpus_bleu(theirs, [refs]).score
    bleu_ours = sacrebleu.corpus_bleu(ours, [refs]).score
    print(f"\nHF round trip: {same}/{len(ours)} equal, BLEU {bleu_theirs:.2f} vs {bleu_ours:.2f}")
    assert same >= 0.95 * len(ours) and abs(bleu_theirs - bleu_ours) <= 0.3


@pytest.mark.parametrize("side", ["encoder", "decoder"])
def test_stack_of_the_other_sides_tokenizer_is_refused(side, hf_layouts, bert2gpt2_data, tmp_path):
    """A GPT-2 (whose tokenizer is the targets') as the encoder, or a BERT as the decoder: one
    line naming the key and the side, exit 2, no run directory."""
    run_dir = tmp_path / "run"
    swapped = {"encoder": hf_layouts["gpt2"], "decoder": hf_layouts["bert"]}
    encoder = swapped["encoder"] if side == "encoder" else hf_layouts["bert"]
    decoder = swapped["decoder"] if side == "decoder" else hf_layouts["gpt2"]
    run = python_m(
        "launch.train",
        *train_args(bert2gpt2_data, run_dir, encoder, decoder),
        "max_steps=1",
    )
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    text_side = "source" if side == "encoder" else "target"
    assert len(errors) == 1 and f"init.{side}" in errors[0], run.stderr[-3000:]
    assert f"the dataset's {text_side} tokenizer" in errors[0], errors
    assert not run_dir.exists()


def test_bert2bert_with_one_tokenizer_fills_both_stacks(hf_layouts, hf_layout_data, tmp_path):
    """BERT2BERT: one tokenizer for both sides (the BERT layout's dataset) and a BERT in each
    stack, the decoder a post-LN stack of BERT's shape; both stacks' weights are the BERT's."""
    run_dir = tmp_path / "run"
    bert = hf_layouts["bert"]
    args = train_args(hf_layout_data["bert"], run_dir, bert, bert)
    args = [a for a in args if not a.startswith(("model.decoder.", "model.encoder.", "max_steps"))]
    run = python_m(
        "launch.train",
        *args,
        "model.layer_norm_eps=1e-12",
        "model.decoder.norm_position=post",
        "model.decoder.activation=gelu",
        "max_steps=2",
        "eval_every=0",
        "deepspeed.zero_stage=0",
    )
    assert run.returncode == 0, run.stderr[-3000:]
    report = (run_dir / "warm_start.txt").read_text().splitlines()
    copied = {line.split()[1]: line.split()[-1] for line in report if line.startswith("copied")}
    assert copied["encoder.embed.tok.weight"] == "encoder:embed.tok.weight"
    assert copied["decoder.embed.tok.weight"] == "decoder:embed.tok.weight"
    assert copied["decoder.blocks.1.mlp.fc.weight"] == "decoder:blocks.1.mlp.fc.weight"
    assert not (run_dir / "target").exists()  # one tokenizer: none of its own for the targets


@pytest.mark.parametrize(
    "given, expected",
    [
        (["tokenizer.target_path={gpt2}"], "needs the source side's given too"),
        (
            ["tokenizer.path={bert}", "tokenizer.target_path={gpt2}", "tasks=[mlm]"],
            "only translation has a target side",
        ),
        (
            ["tokenizer.path={bert}", "tokenizer.target_path={bad}", "tasks=[translation]"],
            "is not a Hugging Face tokenizer",
        ),
    ],
    ids=["no source tokenizer", "no translation", "not a tokenizer"],
)
def test_bad_target_tokenizer_is_one_line(given, expected, hf_layouts, hf_layout_corpus, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"version": "1.0", "model": 3}')
    out = tmp_path / "data"
    args = [arg.format(gpt2=hf_layouts["gpt2"], bert=hf_layouts["bert"], bad=bad) for arg in given]
    run = python_m(
        "pipeline.prepare",
        str(ROOT / "configs" / "prepare_gettext_en_de.yaml"),
        f"output_dir={out}",
        "source.format=tsv",
        f"source.paths=[{hf_layout_corpus}]",
        "progress=false",
        *args,
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert run.returncode == 2 and len(errors) == 1, run.stderr[-2000:]
    assert "tokenizer.target_path" in errors[0] and expected in errors[0], errors
    assert not out.exists() and not list(out.parent.glob(f"{out.name}.partial*"))


def test_a_replaced_target_tokenizer_is_refused(bert2gpt2, hf_layouts, tmp_path):
    """The run's target/tokenizer.json swapped for another: export and translate refuse it in one
    line, exit 2, and write nothing."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(bert2gpt2["run"], run)
    shutil.copyfile(hf_layouts["bert"] / "tokenizer.json", run / "target" / "tokenizer.json")
    out = tmp_path / "export"
    for result in (
        python_m("launch.export", f"checkpoint={run}", f"out={out}"),
        python_m("launch.translate", f"checkpoint={run}", input="the red cat\n"),
    ):
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.returncode == 2 and len(errors) == 1, result.stderr[-2000:]
        assert "target/tokenizer.json" in errors[0] and "trained with" in errors[0], errors
        assert result.stdout == "" or not result.stdout.strip()
    assert not out.exists()
