"""Continued pretraining of the models users already have, with their own tokenizers: a Hugging Face
GPT-2, Llama and BERT directory (tokenizer and tiny model, `conftest.hf_layouts`) gives a dataset
(`tokenizer.path=DIR`) and the starting weights (`init.model=DIR`). The first step's loss is the
loss `transformers` computes for that model on the same batch; the export back to Hugging Face
carries the same tokenizer files (AutoTokenizer gives the same ids) and the trained model's logits;
lm-eval's own command scores the causal ones; a model of another tokenizer is refused in one line."""

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from continuing import export_here, first_batch, lm_eval_metrics, train_from  # noqa: E402

pytestmark = pytest.mark.slow

TASK = {"gpt2": "causal_lm", "llama": "causal_lm", "bert": "mlm"}
CONFIG = {"causal_lm": "tiny_gpt.yaml", "mlm": "tiny_bert.yaml"}


@pytest.fixture(scope="module")
def continued(hf_layouts, hf_layout_data, tmp_path_factory) -> dict[str, Path]:
    """{layout: the run dir of 3 steps of continued pretraining from the layout's model}, on the
    dataset of its tokenizer (conftest's hf_layout_data, whose shards test_tokenizer_kinds checks
    against the library's own ids; GPT-2's and BERT's hold translation pairs too, unread here)."""
    top = tmp_path_factory.mktemp("continued")
    runs = {}
    for layout, directory in hf_layouts.items():
        runs[layout] = top / layout
        run = train_from(
            directory, CONFIG[TASK[layout]], hf_layout_data[layout], runs[layout], "max_steps=3"
        )
        assert run.returncode == 0, run.stderr[-4000:]
    return runs


@pytest.fixture(scope="module")
def exported(continued, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{layout: {format: the continued run exported in it}}, `ours` and `hf`: made once for the
    tests that read them (the export's own checks and lm_eval's)."""
    top = tmp_path_factory.mktemp("exported")
    out = {}
    for layout, run_dir in continued.items():
        out[layout] = {fmt: top / layout / fmt for fmt in ("ours", "hf")}
        for fmt, directory in out[layout].items():
            code, stderr = export_here(f"checkpoint={run_dir}", f"out={directory}", f"format={fmt}")
            assert code == 0, stderr[-3000:]
    return out


def first_loss(run_dir: Path) -> float:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return next(row["train/loss"] for row in rows if row.get("step") == 1)


@pytest.mark.parametrize("layout", list(TASK))
def test_step0_loss_is_transformers_loss_of_that_model(layout, hf_layouts, continued):
    task = TASK[layout]
    inputs = first_batch(continued[layout], task)
    if task == "causal_lm":
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_layouts[layout]).eval()
        labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    else:
        model = transformers.AutoModelForMaskedLM.from_pretrained(hf_layouts[layout]).eval()
        labels = inputs["labels"]
    with torch.no_grad():
        expected = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels
        ).loss.item()
    assert first_loss(continued[layout]) == pytest.approx(expected, abs=1e-4)


@pytest.mark.parametrize("layout", list(TASK))
def test_the_export_carries_the_tokenizer_and_the_trained_model(layout, hf_layouts, exported):
    """format=hf: the same tokenizer files (AutoTokenizer's ids as before training), and the
    trained model's logits through AutoModel (those of our own format's export of the run)."""
    out = exported[layout]["hf"]
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (hf_layouts[layout] / name).read_bytes()
    texts = ["the red cat opens a new door 12", "die grüne Katze schließt 7", "漢字 ☃ tab\there"]
    before = transformers.AutoTokenizer.from_pretrained(hf_layouts[layout])
    after = transformers.AutoTokenizer.from_pretrained(out)
    assert after(texts)["input_ids"] == before(texts)["input_ids"]

    from launch.model_dir import load_model_dir

    ours, _ = load_model_dir(exported[layout]["ours"])
    auto = (
        transformers.AutoModelForCausalLM
        if TASK[layout] == "causal_lm"
        else transformers.AutoModelForMaskedLM
    )
    theirs = auto.from_pretrained(out).eval()
    for text in texts[:2]:  # one at a time: GPT-2's and Llama's tokenizers have no pad token
        ids = after(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            expected = ours(ids, torch.ones_like(ids)).logits
            got = theirs(input_ids=ids).logits
        assert (got - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("layout", ["gpt2", "llama"])
def test_lm_eval_scores_the_continued_model(layout, exported, hf_layout_data, tmp_path):
    pytest.importorskip("lm_eval")
    export = exported[layout]["ours"]
    metrics = lm_eval_metrics(export, hf_layout_data[layout], tmp_path / "scores.json")
    assert metrics["lm_eval/cloze/perplexity"] > 1 and 0 <= metrics["lm_eval/choice/acc"] <= 1


def test_a_model_of_another_tokenizer_is_refused_in_one_line(hf_layouts, hf_layout_data, tmp_path):
    run = train_from(
        hf_layouts["llama"], "tiny_gpt.yaml", hf_layout_data["gpt2"], tmp_path / "run",
        "max_steps=1",
    )  # fmt: skip
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    # GPT-2's and Llama's vocabularies differ in size: that is found first, before any weight loads
    assert errors[0].startswith(f"error: init.model: {hf_layouts['llama']} has a vocabulary of")
    assert "prepared with another tokenizer than the model's" in errors[0]
    assert not (tmp_path / "run").exists()
