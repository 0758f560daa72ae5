"""Hugging Face tokenizers and tiny models in the layouts users bring, and the datasets prepared
with them (conftest's hf_layouts and hf_layout_data fixtures build them once a session)."""

from pathlib import Path

import torch
from corpora import RayHead, prepare_args, run_prepare, synthetic_pairs, write_tsv

# Built here with the `tokenizers` library, in the exact special-token layouts of GPT-2 (byte-level
# BPE, <|endoftext|> the last id, no pad), Llama (<unk> 0, <s> 1, </s> 2, byte fallback pieces
# next, <s> before every text) and BERT (WordPiece: [PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102,
# [MASK] 103, [CLS] text [SEP]), each saved with `save_pretrained` beside a tiny `transformers`
# model of its class: what `tokenizer.path=DIR` and `init.model=DIR` take.
HF_LAYOUTS = ("gpt2", "llama", "bert")
HF_VOCAB = 420  # pieces learned (plus each layout's special and byte pieces)


def layout_texts() -> list[str]:
    return [text for pair in synthetic_pairs(600) for text in pair]


def gpt2_layout_tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=HF_VOCAB, initial_alphabet=alphabet, show_progress=False
    )
    tok.train_from_iterator(texts, trainer)
    tok.add_special_tokens(["<|endoftext|>"])  # the last id, as GPT-2's 50256
    end = "<|endoftext|>"
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=end, eos_token=end, unk_token=end
    )


def llama_layout_tokenizer(texts: list[str]):
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    base = Tokenizer(models.BPE(unk_token="<unk>"))
    base.normalizer = normalizers.Sequence(
        [normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")]
    )
    base.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=HF_VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False
        ),
    )
    spec = json.loads(base.to_str())
    learned = sorted(spec["model"]["vocab"].items(), key=lambda item: item[1])[3:]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({f"<0x{byte:02X}>": 3 + byte for byte in range(256)})  # Llama's byte pieces
    for piece, _ in learned:
        vocab.setdefault(piece, len(vocab))
    spec["model"].update(vocab=vocab, byte_fallback=True, fuse_unk=True)
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


def bert_layout_tokenizer(texts: list[str]):
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.decoder = decoders.WordPiece()
    specials = ["[PAD]", *(f"[unused{i}]" for i in range(99)), "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        texts,
        trainers.WordPieceTrainer(
            vocab_size=HF_VOCAB + len(specials), special_tokens=specials, show_progress=False
        ),
    )
    tok.post_processor = processors.BertProcessing(("[SEP]", 102), ("[CLS]", 101))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="[PAD]",
        unk_token="[UNK]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )


LAYOUT_TOKENIZERS = {
    "gpt2": gpt2_layout_tokenizer,
    "llama": llama_layout_tokenizer,
    "bert": bert_layout_tokenizer,
}


def tiny_hf_model(layout: str, tokenizer):
    """A `transformers` model of the layout's class, tiny, seeded, sized to the tokenizer."""
    import transformers

    torch.manual_seed(0)
    vocab = len(tokenizer)
    if layout == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=vocab, n_embd=32, n_layer=2, n_head=2, n_positions=64,
            bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config)
    if layout == "llama":
        config = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
            bos_token_id=1, eos_token_id=2, tie_word_embeddings=False,
        )  # fmt: skip
        return transformers.LlamaForCausalLM(config)
    config = transformers.BertConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return transformers.BertForMaskedLM(config)


def build_hf_layouts(directory: Path) -> None:
    """DIR/LAYOUT/: the layout's tokenizer and tiny model, saved as `save_pretrained` saves them."""
    texts = layout_texts()
    for layout in HF_LAYOUTS:
        tokenizer = LAYOUT_TOKENIZERS[layout](texts)
        tokenizer.save_pretrained(str(directory / layout))
        tiny_hf_model(layout, tokenizer).save_pretrained(str(directory / layout))


# Each layout's tokenizer (`tokenizer.path=DIR`) prepared on the synthetic corpus, for the tasks
# its model serves (BERT's masks, GPT-2's and Llama's causal blocks; the translation pairs with
# two of them): read, never written, by test_tokenizer_kinds (the ids in the shards) and
# test_hf_layouts (continued pretraining from the layout's model).
BERT2GPT2 = "bert2gpt2"
HF_LAYOUT_TASKS = {
    "gpt2": "[causal_lm,translation]",
    "llama": "[causal_lm]",
    "bert": "[mlm,translation]",
}


def build_hf_layout_data(layouts: dict[str, Path], directory: Path) -> None:
    """DIR/pairs.tsv, the corpus, and DIR/LAYOUT/, it prepared with each layout's tokenizer: three
    prepares joining one Ray cluster (RayHead) instead of starting a Ray each."""
    corpus = write_tsv(directory / "pairs.tsv", synthetic_pairs(600))
    ray = RayHead(num_cpus=2)
    try:
        for layout, tokenizer in layouts.items():
            args = prepare_args(corpus, directory / layout, **{"ray.num_workers": 2})
            args += [f"tokenizer.path={tokenizer}", f"tasks={HF_LAYOUT_TASKS[layout]}"]
            run = run_prepare(args, ray)
            assert run.returncode == 0, run.stderr[-3000:]
        # Rothe et al.'s BERT2GPT2: sources by BERT's WordPiece, targets by GPT-2's BPE.
        args = prepare_args(corpus, directory / BERT2GPT2, **{"ray.num_workers": 2})
        args += [
            f"tokenizer.path={layouts['bert']}",
            f"tokenizer.target_path={layouts['gpt2']}",
            "tasks=[translation]",
        ]
        run = run_prepare(args, ray)
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        ray.stop()
