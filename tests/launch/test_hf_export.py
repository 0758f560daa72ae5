"""Hugging Face export (`launch.export format=hf`) and import (`model.hf_dir.load_hf_dir`): tiny models
made in the test are written as an export writes them, loaded by `transformers`' Auto classes
with the tokenizer beside them, and give our logits; GPT and the translation model generate
greedily the same tokens as ours; read back, they are our models again. A model no Hugging Face
class computes is refused in one line naming the option, by the command, before anything is written."""

import dataclasses
import json
import subprocess
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from corpora import synthetic_pairs  # noqa: E402
from repo import ROOT  # noqa: E402

from common.configure import save_config  # noqa: E402
from common.hashing import file_sha256  # noqa: E402
from launch.config import TrainConfig  # noqa: E402
from launch.model_dir import PROVENANCE, save_hf_dir  # noqa: E402
from model import ModelConfig, StackConfig, build_model  # noqa: E402
from model.hf_dir import hf_config_for, load_hf_dir  # noqa: E402
from pipeline.prepare.config import TokenizerConfig  # noqa: E402
from pipeline.prepare.train_tokenizer import train_tokenizer  # noqa: E402
from pipeline.specials import sentencepiece_specials  # noqa: E402
from pipeline.tokenizer import SENTENCEPIECE_FILE, load_tokenizer  # noqa: E402

ATOL = 1e-5
TINY = dict(d_model=32, n_layers=2, n_heads=4, d_ff=64, max_seq_len=32, dropout=0.0)
CONFIGS = {
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
    "bert": dict(arch="bert", norm_position="post"),
    "translation": dict(
        arch="seq2seq",
        n_decoder_layers=3,
        encoder=StackConfig(norm_position="post", activation="gelu"),
        decoder=StackConfig(norm_position="pre", activation="gelu_tanh"),
    ),
}
AUTO = {
    "gpt2": "AutoModelForCausalLM",
    "llama": "AutoModelForCausalLM",
    "bert": "AutoModelForMaskedLM",
    "translation": "AutoModelForSeq2SeqLM",
}
HF_CLASS = {
    "gpt2": "GPT2LMHeadModel",
    "llama": "LlamaForCausalLM",
    "bert": "BertForMaskedLM",
    "translation": "EncoderDecoderModel",
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    """A SentencePiece model of ours (reserved ids 0-5, byte fallback), trained on the tiny corpus's texts."""
    path = tmp_path_factory.mktemp("tokenizer") / SENTENCEPIECE_FILE
    texts = [text for pair in synthetic_pairs(400) for text in pair]
    path.write_bytes(train_tokenizer(texts, TokenizerConfig(vocab_size=400)))
    return path


def made(kind: str, vocab_size: int, scale: float = 0.05) -> torch.nn.Module:
    """A tiny model of `kind`, every weight moved off its init (so no map hides behind a 1 or a 0)."""
    cfg = ModelConfig(vocab_size=vocab_size, **TINY, **CONFIGS[kind])
    torch.manual_seed(0)
    model = build_model(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model.eval()


def export(kind: str, tokenizer, out, scale: float = 0.05):
    model = made(kind, load_tokenizer(tokenizer).vocab_size, scale)
    save_hf_dir(out, model.state_dict(), model.cfg, tokenizer, {"step": 7, "task": kind})
    return model


def logits(model, kind: str, ids, mask, decoder_ids=None):
    with torch.no_grad():
        if kind == "translation":
            return model(ids, mask, decoder_ids).logits
        return model(ids, mask).logits


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_export_loads_with_auto_classes_and_gives_our_logits(kind, tokenizer, tmp_path):
    out = tmp_path / "hf"
    ours = export(kind, tokenizer, out)
    names = {path.name for path in out.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        SENTENCEPIECE_FILE,
        PROVENANCE,
    } <= names
    assert ("generation_config.json" in names) == (kind != "bert")
    assert json.loads((out / PROVENANCE).read_text()) == {"step": 7, "task": kind}
    assert not list(tmp_path.glob("hf.partial*"))

    hf = getattr(transformers, AUTO[kind]).from_pretrained(out).eval()
    assert type(hf).__name__ == HF_CLASS[kind]
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tokenizer.model_max_length == ours.cfg.max_seq_len
    texts = ["the red cat opens a new door 12", "die alte Katze"]
    batch = hf_tokenizer(texts, padding=True, return_tensors="pt")
    sp = load_tokenizer(tokenizer)
    expected_ids = [sp.encode(t) for t in texts]
    assert [
        row[: len(ids)] for row, ids in zip(batch["input_ids"].tolist(), expected_ids)
    ] == expected_ids
    # By default the exported tokenizer frames a text as training framed the model's inputs:
    # a translation source and a BERT document end with </s>; a GPT prompt gets nothing.
    layout = sentencepiece_specials()
    before, after = {"translation": layout.source, "bert": layout.document}.get(kind, ((), ()))
    assert hf_tokenizer(texts)["input_ids"] == [[*before, *ids, *after] for ids in expected_ids]
    ids, mask = batch["input_ids"], batch["attention_mask"]  # right-padded: our positions are HF's
    decoder_ids = torch.tensor(
        [([2] + sp.encode(t) + [0] * 8)[:8] for t in ("die rote Katze", "das Haus 12")]
    )
    with torch.no_grad():
        if kind == "translation":
            theirs = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids).logits
        else:
            theirs = hf(input_ids=ids, attention_mask=mask).logits
    expected = logits(ours, kind, ids, mask, decoder_ids)
    real = mask.bool() if kind != "translation" else torch.ones(decoder_ids.shape, dtype=torch.bool)
    assert (theirs - expected)[real].abs().max().item() < ATOL

    back = load_hf_dir(out)  # the same directory read into our model
    assert type(back) is type(ours)
    if kind == "translation":
        for stack in ("encoder", "decoder"):
            assert back.cfg.for_stack(stack) == ours.cfg.for_stack(stack)
    else:  # a Llama directory read back names its family, which ours left to its options
        assert back.cfg == dataclasses.replace(ours.cfg, family=back.cfg.family)
        assert back.cfg.family == ("llama" if kind == "llama" else "")
    assert (logits(back, kind, ids, mask, decoder_ids) - expected)[real].abs().max().item() < ATOL


def test_gpt_greedy_generate_equals_ours_token_for_token(tokenizer, tmp_path):
    ours = export("gpt2", tokenizer, tmp_path / "hf", scale=0.5)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = hf_tokenizer(["the green window"], return_tensors="pt")
    theirs = hf.generate(**prompt, max_new_tokens=20, do_sample=False)
    mine = ours.generate(prompt["input_ids"], max_new_tokens=20, eos_id=ours.cfg.eos_id)
    assert theirs.tolist() == mine[:, : theirs.shape[1]].tolist()
    # the weights are far enough from init to say something
    assert len(set(theirs[0, 3:].tolist())) > 3
    decoded = load_tokenizer(tokenizer).decode(mine[0].tolist())
    assert hf_tokenizer.decode(theirs[0], skip_special_tokens=True) == decoded


def test_translation_greedy_generate_equals_ours_token_for_token(tokenizer, tmp_path):
    ours = export("translation", tokenizer, tmp_path / "hf", scale=0.5)
    hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "hf").eval()
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    src = hf_tokenizer(["the red cat opens a door", "a list"], padding=True, return_tensors="pt")
    theirs = hf.generate(**src, max_new_tokens=24, do_sample=False, num_beams=1)
    mine = ours.generate(src["input_ids"], src["attention_mask"], max_len=24)
    assert theirs[:, 0].tolist() == [ours.cfg.bos_id] * 2  # decoding starts from our <s>
    for row, (tokens, length) in enumerate(zip(mine.tokens.tolist(), mine.lengths.tolist())):
        generated = theirs[row, 1:].tolist()
        ended = generated.index(ours.cfg.eos_id) if ours.cfg.eos_id in generated else len(generated)
        assert generated[:ended] == tokens[:length]
    assert len(set(mine.tokens[0].tolist())) > 3


def test_plain_hugging_face_directories_are_read(tmp_path):
    """GPT-2 and BERT directories as `transformers` saves them (OpenAI's ids, token types, a
    pooler) read into ours with the same logits; a BERT saved without its MLM head is refused."""
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=70, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    ).eval()
    gpt2.save_pretrained(tmp_path / "gpt2")
    bert = transformers.BertForMaskedLM(
        transformers.BertConfig(
            vocab_size=70,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=16,
        )
    ).eval()
    with torch.no_grad():
        bert.bert.embeddings.token_type_embeddings.weight.normal_()
    bert.save_pretrained(tmp_path / "bert")
    ids = torch.randint(0, 70, (2, 9), generator=torch.Generator().manual_seed(0))
    ids_fit = dict(bos_id=2, eos_id=3)  # OpenAI's 50256 lies outside a 70-piece vocabulary
    for hf, directory, overrides in ((gpt2, "gpt2", ids_fit), (bert, "bert", {})):
        ours = load_hf_dir(str(tmp_path / directory), **overrides)
        with torch.no_grad():
            assert (ours(ids).logits - hf(ids).logits).abs().max().item() < ATOL
    bert.bert.save_pretrained(tmp_path / "bare")  # BertModel: no MLM head
    with pytest.raises(ValueError, match="lacks .* weights of BertForMaskedLM .*cls.predictions"):
        load_hf_dir(str(tmp_path / "bare"))


@pytest.mark.parametrize(
    "kind, change, named",
    [
        ("gpt2", dict(positions="sinusoidal"), "positions"),
        ("gpt2", dict(n_kv_heads=2), "n_kv_heads=2"),
        ("llama", dict(norm="layernorm"), "norm"),
        ("bert", dict(norm_position="pre"), "norm_position"),
        ("translation", dict(encoder=StackConfig(norm_position="pre")), "encoder: .*norm_position"),
        ("translation", dict(share_embeddings=True), "share_embeddings"),
        (
            "translation",
            dict(decoder=StackConfig(norm_position="pre", positions="rope")),
            "decoder: .*positions",
        ),
    ],
)
def test_unrepresentable_options_are_named(kind, change, named):
    cfg = ModelConfig(vocab_size=64, **TINY, **{**CONFIGS[kind], **change})
    with pytest.raises(ValueError, match=named):
        hf_config_for(cfg)


def test_export_command_refuses_an_unrepresentable_model_in_one_line(tokenizer, tmp_path):
    """Before reading the weights: a run directory whose config no Hugging Face class computes."""
    run_dir = tmp_path / "run"
    cfg = TrainConfig(
        model=ModelConfig(vocab_size=64, **{**TINY, "positions": "sinusoidal"}),
        run_dir=str(run_dir),
    )
    (run_dir / "checkpoints" / "step_00000001").mkdir(parents=True)
    (run_dir / "checkpoints" / "latest").write_text("step_00000001\n")
    save_config(cfg, run_dir / "config.yaml")
    (run_dir / SENTENCEPIECE_FILE).write_bytes(tokenizer.read_bytes())
    assert file_sha256(run_dir / SENTENCEPIECE_FILE) == file_sha256(tokenizer)
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "launch.export", f"checkpoint={run_dir}", f"out={out}", "format=hf"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 2, run.stderr[-3000:]
    assert run.stderr.count("\n") == 1 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.startswith("error: format=hf: ") and "positions='learned'" in run.stderr
    assert "sinusoidal" in run.stderr
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("fmt", ["ours", "hf"])
def test_init_model_reads_a_translation_export(fmt, tokenizer, tmp_path):
    """`init.model` for translation: the model config comes from the directory (YAML's replaced,
    training-only fields kept), the weights load strictly, a contradicting override is refused."""
    from common.configure import UserError
    from launch import init_model
    from launch.config import InitConfig
    from launch.model_dir import save_model_dir

    out = tmp_path / fmt
    ours = made("translation", load_tokenizer(tokenizer).vocab_size)
    if fmt == "hf":
        save_hf_dir(out, ours.state_dict(), ours.cfg, tokenizer, {})
    else:
        save_model_dir(out, ours.state_dict(), ours.cfg, tokenizer, {"task": "translation"})
    # As the command line would leave it: YAML values (d_model 64), then the overrides given to
    # resolve.
    job = TrainConfig(
        task="translation",
        model=ModelConfig(
            arch="seq2seq",
            d_model=64,
            label_smoothing=0.2,
            encoder=StackConfig(norm_position="post"),
        ),
        init=InitConfig(model=str(out)),
    )
    cfg = init_model.with_directory_model(
        job, ["model.label_smoothing=0.2", "model.encoder.norm_position=post"]
    )
    # the special ids are the dataset's tokenizer's, as the trainer sets them at start
    from launch.preconditions import with_data_tokenizer

    data_tokenizer = load_tokenizer(tokenizer)
    model_cfg, _ = with_data_tokenizer(
        cfg.model, data_tokenizer.vocab_size, data_tokenizer.specials, ""
    )
    cfg = dataclasses.replace(cfg, model=model_cfg)
    assert cfg.model.d_model == 32 and cfg.model.label_smoothing == 0.2
    for stack in ("encoder", "decoder"):
        assert cfg.model.for_stack(stack) == dataclasses.replace(
            ours.cfg.for_stack(stack), label_smoothing=0.2, dropout=job.model.dropout
        )
    started = init_model.load(cfg, tokenizer)
    src = torch.randint(6, 60, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(started.eval()(src, None, src).logits, ours(src, None, src).logits)
    contradiction = r"has model.decoder.norm_position=pre; the override model.decoder.norm_position=post contradicts"
    with pytest.raises(UserError, match=contradiction):
        init_model.with_directory_model(
            dataclasses.replace(
                job, model=dataclasses.replace(job.model, decoder=StackConfig(norm_position="post"))
            ),
            ["model.decoder.norm_position=post"],
        )
    with pytest.raises(UserError, match="give one or the other"):
        init_model.with_directory_model(
            dataclasses.replace(job, init=InitConfig(model=str(out), encoder=str(out))), []
        )
