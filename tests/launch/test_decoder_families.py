"""Continued pretraining from the decoder families users start from, as a new user would: a
Hugging Face directory per family (a tiny random Qwen2ForCausalLM, Qwen3ForCausalLM,
MistralForCausalLM, Olmo2ForCausalLM and the mixtures of experts OlmoeForCausalLM,
Qwen3MoeForCausalLM and MixtralForCausalLM saved by transformers beside a tokenizer made with the
`tokenizers` library: the byte-level BPE of conftest's GPT-2 layout for Qwen and OLMo, which use
that kind, the Llama layout for Mistral and Mixtral) starts `launch.train` on a dataset prepared with that
tokenizer. The first step's loss is transformers' on the same batch; after 20 steps the HF export,
read by transformers alone, gives our logits and our greedy continuations of 20 prompts. Mistral's
window (8) is shorter than the blocks (32) and than prompt plus continuation: without it
transformers' own loss on that batch is another. A rope scaling we do
not compute and a bias layout we do not know are refused in one line before anything is written."""

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from continuing import export_here, first_batch, lm_eval_metrics, train_from  # noqa: E402

pytestmark = pytest.mark.slow

# family -> (transformers' class prefix, the conftest layout whose tokenizer and dataset it takes,
# what its tiny config sets apart)
FAMILIES = {
    "qwen2": ("Qwen2", "gpt2", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3", "gpt2", dict(head_dim=16)),
    "mistral": ("Mistral", "llama", dict(sliding_window=8)),
    "olmo2": ("Olmo2", "gpt2", {}),
    # mixtures of experts: 4 experts, top 2 (model.moe)
    "olmoe": ("Olmoe", "gpt2", dict(num_experts=4, num_experts_per_tok=2)),
    "qwen3_moe": (
        "Qwen3Moe",
        "gpt2",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            head_dim=16,
            norm_topk_prob=True,
        ),  # fmt: skip
    ),
    "mixtral": ("Mixtral", "llama", dict(num_local_experts=4, num_experts_per_tok=2)),
}
STEPS = 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_family(directory: Path, family: str, layout_dir: Path, **overrides) -> Path:
    """A tiny random model of the family sized to the layout's tokenizer, saved with it."""
    prefix, _, shape = FAMILIES[family]
    tokenizer = transformers.AutoTokenizer.from_pretrained(layout_dir)
    end = tokenizer.eos_token_id
    config = dict(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=end, tie_word_embeddings=False,
    )  # fmt: skip
    config.update(shape, **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, f"{prefix}ForCausalLM")(
        getattr(transformers, f"{prefix}Config")(**config)
    )
    with torch.no_grad():  # norms away from 1, so a misplaced one shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(str(directory))
    for name in TOKENIZER_FILES:
        shutil.copy(layout_dir / name, directory / name)
    return directory


@pytest.fixture(scope="module")
def family_dirs(hf_layouts, tmp_path_factory) -> dict[str, Path]:
    top = tmp_path_factory.mktemp("families")
    return {
        family: save_family(top / family, family, hf_layouts[layout])
        for family, (_, layout, _) in FAMILIES.items()
    }


@pytest.fixture(scope="module")
def continued(family_dirs, hf_layout_data, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """{family: {"run": 20 steps from its directory, "ours"/"hf": that run exported}}."""
    top = tmp_path_factory.mktemp("continued-families")
    out = {}
    for family, directory in family_dirs.items():
        run_dir = top / family / "run"
        run = train_from(
            directory,
            "tiny_gpt.yaml",
            hf_layout_data[FAMILIES[family][1]],
            run_dir,
            f"max_steps={STEPS}",
        )
        assert run.returncode == 0, run.stderr[-4000:]
        out[family] = {"run": run_dir}
        for fmt in ("ours", "hf"):
            out[family][fmt] = top / family / fmt
            code, stderr = export_here(
                f"checkpoint={run_dir}", f"out={out[family][fmt]}", f"format={fmt}"
            )
            assert code == 0, stderr[-3000:]
    return out


def losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["train/loss"] for row in rows if "train/loss" in row}


@pytest.mark.parametrize("family", FAMILIES)
def test_step0_loss_is_transformers_loss_and_the_run_learns(family, family_dirs, continued):
    run_dir = continued[family]["run"]
    inputs = first_batch(run_dir, "causal_lm")
    model = transformers.AutoModelForCausalLM.from_pretrained(family_dirs[family]).eval()
    labels = inputs["input_ids"].masked_fill(inputs["attention_mask"] == 0, -100)
    with torch.no_grad():
        expected = model(
            input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"], labels=labels
        ).loss.item()
    if family == "mistral":  # the window shapes that loss: transformers' without it is another
        unwindowed = transformers.AutoModelForCausalLM.from_pretrained(
            family_dirs[family], sliding_window=None
        ).eval()
        with torch.no_grad():
            other = unwindowed(
                input_ids=inputs["input_ids"],
                attention_mask=inputs["attention_mask"],
                labels=labels,
            ).loss.item()
    got = losses(run_dir)
    if family == "mistral":  # ours is the windowed loss, 10x closer to it than to the other
        assert abs(got[1] - other) > 10 * max(abs(got[1] - expected), 1e-6)
    print(
        f"\n{family}: step 1 ours {got[1]:.6f}, transformers {expected:.6f}; step {STEPS} {got[STEPS]:.4f}"
    )
    assert got[1] == pytest.approx(expected, abs=1e-4)
    assert sorted(got) == list(range(1, STEPS + 1)) and got[STEPS] < got[1]


PROMPTS = [
    "the red cat opens a new door",
    "die grüne Katze schließt",
    "a small dog sees the",
    "twelve birds fly over",
    "the old man reads",
    "ein kleiner Hund",
    "we walk to the",
    "she writes a long",
    "the house on the hill",
    "my friend gives me",
    "in the morning the",
    "zwei Kinder spielen",
    "the blue car stops at",
    "he buys three",
    "under the bridge a",
    "the teacher asks",
    "after the rain",
    "das rote Haus",
    "they open the window and",
    "one more time the",
]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_hf_export_gives_our_logits_and_greedy_continuations(family, continued):
    """transformers alone on the export (AutoTokenizer, AutoModelForCausalLM, `generate`)
    against our own export of the same run, loaded by us."""
    from launch.model_dir import load_model_dir

    out = continued[family]["hf"]
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(theirs).__name__ == f"{FAMILIES[family][0]}ForCausalLM"
    ours, _ = load_model_dir(continued[family]["ours"])
    ours.eval()
    assert ours.cfg.family == family
    worst, lengths = 0.0, []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            worst = max(worst, (theirs(input_ids=ids).logits - ours(ids).logits).abs().max().item())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = theirs.generate(ids, max_new_tokens=20, do_sample=False)
        mine = ours.generate(ids, max_new_tokens=20, eos_id=ours.cfg.eos_id)
        assert got.tolist() == mine.tolist(), prompt
        lengths.append(got.shape[1])
    print(
        f"\n{family}: largest logit difference {worst:.2e}; sequences of {min(lengths)}-{max(lengths)} tokens"
    )
    assert worst < 1e-4
    if family == "mistral":  # the window (8) slides within the continuations
        assert max(lengths) > 8 + 8


def test_the_dry_run_names_the_family_it_read(family_dirs, hf_layout_data, tmp_path):
    run = train_from(
        family_dirs["qwen3"], "tiny_gpt.yaml", hf_layout_data["gpt2"], tmp_path / "run", "--dry-run"
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert "a Qwen3 model (Qwen3ForCausalLM); its tokenizer gives the dataset's ids" in run.stdout
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        (
            "qwen2",
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}),
            "Qwen2Config rope_type='yarn' is not supported (plain rotary positions only)",
        ),
        (
            "qwen3",
            dict(attention_bias=True),
            "Qwen3Config.attention_bias=True is not supported",
        ),
        (  # dense MLPs at listed layers: a router layout ours (every n-th layer) cannot hold
            "qwen3_moe",
            dict(mlp_only_layers=[0]),
            "Qwen3MoeConfig.mlp_only_layers=[0] is not supported",
        ),
    ],
)
def test_what_we_do_not_compute_is_refused_in_one_line(
    family, overrides, message, hf_layouts, hf_layout_data, tmp_path
):
    layout = FAMILIES[family][1]
    directory = save_family(tmp_path / family, family, hf_layouts[layout], **overrides)
    run = train_from(
        directory, "tiny_gpt.yaml", hf_layout_data[layout], tmp_path / "run", "max_steps=1"
    )
    errors = [line for line in run.stderr.splitlines() if line.startswith("error: ")]
    assert run.returncode == 2 and len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    assert message in errors[0] and str(directory) in errors[0]
    assert not (tmp_path / "run").exists()


def test_lm_eval_scores_a_family_export_through_transformers(continued, hf_layout_data, tmp_path):
    """lm-eval's own HFLM over the OLMo 2 export (format=hf): a family lm-eval loads by itself."""
    pytest.importorskip("lm_eval")
    metrics = lm_eval_metrics(
        continued["olmo2"]["hf"], hf_layout_data["gpt2"], tmp_path / "scores.json"
    )
    assert metrics["lm_eval/cloze/perplexity"] > 1 and 0 <= metrics["lm_eval/choice/acc"] <= 1
