"""BLEU of a translation model exported to Hugging Face's format, decoded by `transformers` itself; prints figures.

    python benchmarks/hf_translation_bleu.py EXPORT_DIR DATA_DIR [--split test] [--beam 4]
                                             [--limit N] [--compare EVAL_DIR_OR_JSON]

The round trip of `launch.export format=hf` for the translation model through `transformers`
alone, as a user would run it: `EncoderDecoderModel` and `AutoTokenizer` loaded from EXPORT_DIR
(and from EXPORT_DIR/target, the target side's own tokenizer, when the model has one);
each source of the split as text (as `launch.evaluate` detokenizes it) encoded by the exported
tokenizer the standard way (`tokenizer(texts)`, truncated at the encoder's positions), decoded
by `model.generate` with `--beam` beams, length penalty 1.0 and the per-source length limit
`launch.evaluate` uses by default (min(max_len, floor(1.5 x source tokens + 10))), the
hypotheses decoded with the exported tokenizer, and scored by `launch.evaluate.score` (the same
sacrebleu call) against the references as `launch.evaluate` detokenizes them. Sources of one
length share a limit, so they are decoded in batches without padding. It also counts the
sources whose encoding differs from the ids training gave the model (`launch.decoding.source_ids`).

`--compare` takes `launch.evaluate`'s output (its directory or scores JSON) and prints the
difference; the interop issue asks for BLEU within 0.3 of it.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MAX_LEN_A, MAX_LEN_B = 1.5, 10  # launch.evaluate's defaults (EvaluateConfig.max_len_a / max_len_b)
BATCH = 32


def read_compare(path: Path) -> dict:
    if path.is_dir():
        found = sorted(path.glob("scores*.json"))
        if not found:
            raise SystemExit(f"error: --compare {path}: no scores JSON in it")
        path = found[0]
    return json.loads(path.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "export", type=Path, help="a translation model exported with launch.export format=hf"
    )
    parser.add_argument("data", type=Path, help="the prepared dataset it was trained on")
    parser.add_argument("--split", default="test")
    parser.add_argument("--beam", type=int, default=4)
    parser.add_argument("--limit", type=int, default=0, help="first N pairs only (default: all)")
    parser.add_argument(
        "--compare", type=Path, help="launch.evaluate's output directory or scores JSON"
    )
    args = parser.parse_args(argv)

    import torch
    from transformers import AutoTokenizer, EncoderDecoderModel

    from launch.decoding import detokenize, source_ids
    from launch.evaluate import read_pairs, score
    from pipeline.format import dataset_tokenizer, read_manifest

    torch.set_grad_enabled(False)
    model = EncoderDecoderModel.from_pretrained(args.export).eval()
    tokenizer = AutoTokenizer.from_pretrained(args.export)
    # a target side's own tokenizer (BERT2GPT2) decodes what generate returns
    has_target = (args.export / "target").is_dir()
    target_tokenizer = (
        AutoTokenizer.from_pretrained(args.export / "target") if has_target else tokenizer
    )
    manifest = read_manifest(args.data)
    ours = dataset_tokenizer(args.data, manifest)
    ours_target = dataset_tokenizer(args.data, manifest, side="target")
    specials = ours.specials
    # room for the source frame (ours </s>, BERT's [CLS] and [SEP]), as the trainer cuts them
    before, after = specials.source
    max_source = model.config.encoder.max_position_embeddings - len(before) - len(after)
    # the decoder's positions, its start token first
    max_len = model.config.decoder.max_position_embeddings - 1
    pairs = read_pairs(args.data, args.split, args.limit)
    texts = [detokenize(ours, src) for src, _ in pairs]
    # the exported tokenizer's own encoding, frame included, cut at the encoder's positions
    sources = tokenizer(
        texts, truncation=True, max_length=model.config.encoder.max_position_embeddings
    )["input_ids"]
    trained = [source_ids(src, max_source, specials)[0] for src, _ in pairs]
    differ = sum(a != b for a, b in zip(sources, trained))

    by_length: dict[int, list[int]] = {}
    for index, src in enumerate(sources):
        by_length.setdefault(len(src), []).append(index)
    hypotheses: dict[int, list[int]] = {}
    start = time.perf_counter()
    for length, indices in sorted(by_length.items(), reverse=True):
        limit = max(1, min(max_len, math.floor(MAX_LEN_A * length + MAX_LEN_B)))
        for at in range(0, len(indices), BATCH):
            batch = indices[at : at + BATCH]
            out = model.generate(
                torch.tensor([sources[i] for i in batch]),
                num_beams=args.beam,
                length_penalty=1.0,
                max_new_tokens=limit,
                do_sample=False,
                early_stopping=False,
            )
            for i, row in zip(batch, out.tolist()):
                hypotheses[i] = row[1:]  # the decoder's start token first
    seconds = time.perf_counter() - start

    hyp_text = [
        " ".join(target_tokenizer.decode(hypotheses[i], skip_special_tokens=True).splitlines())
        for i in range(len(pairs))
    ]
    ref_text = [detokenize(ours_target, tgt) for _, tgt in pairs]
    result = score(hyp_text, ref_text)
    print(
        f"{args.export} on {args.data} {args.split}: {len(pairs)} pairs, transformers generate, beam {args.beam}, "
        f"{seconds:.0f} s"
    )
    print(f"BLEU {result['bleu']:.2f}, chrF {result['chrf']:.2f}  ({result['signature_bleu']})")
    print(
        f"sources encoded by the exported tokenizer as in training: {len(pairs) - differ} of "
        f"{len(pairs)}"
    )
    if args.compare:
        ours_hyp = (
            args.compare / "hypotheses.txt"
            if args.compare.is_dir()
            else args.compare.parent / "hypotheses.txt"
        )
        if ours_hyp.is_file():
            lines = ours_hyp.read_text(encoding="utf-8").splitlines()[: len(hyp_text)]
            same = sum(a == b for a, b in zip(hyp_text, lines))
            print(f"hypotheses identical to launch.evaluate's: {same} of {len(hyp_text)}")
        theirs = read_compare(args.compare)
        if args.limit:
            print(f"(--limit {args.limit}: launch.evaluate's BLEU below is of the whole split)")
        diff = result["bleu"] - theirs["bleu"]
        print(
            f"launch.evaluate: BLEU {theirs['bleu']:.2f}, chrF {theirs['chrf']:.2f}; difference {diff:+.2f} BLEU "
            f"({'within' if abs(diff) <= 0.3 else 'NOT within'} 0.3)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
