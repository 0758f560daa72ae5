"""How much a translation model's predictions lean on its source; prints figures, asserts nothing.

    python benchmarks/source_use.py RUN_OR_EXPORT [...] [--data data/gettext-en-de] [--split valid]

For each checkpoint (a training run or an exported directory, as `launch.evaluate` takes them):
the teacher-forced loss per target token, without label smoothing, over the split's pairs, once
with each pair's own source and once with the sources rolled by one inside each batch of 32
(every target then reads another pair's source). The difference is what the source is worth to
the model in nats per token; a decoder that ignores its encoder shows none. Used for issue #31
(docs/results.md, "Why the modern translation trails").
"""

from __future__ import annotations

import argparse

import torch

from launch.decoding import inspect_checkpoint, length_sorted_batches, load_model, pad, source_ids
from launch.evaluate import read_pairs
from model.loss import IGNORE_INDEX


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--data", default="data/gettext-en-de")
    parser.add_argument("--split", default="valid")
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = read_pairs(args.data, args.split)
    for path in args.checkpoints:
        own, rolled, tokens = source_losses(path, pairs, args.batch)
        print(
            f"{path}: own source {own:.3f}, rolled sources {rolled:.3f}, "
            f"the source is worth {rolled - own:.3f} nats/token ({tokens:,} target tokens, {args.split})"
        )


@torch.no_grad()
def source_losses(path: str, pairs: list, batch_size: int) -> tuple[float, float, int]:
    """Mean loss with own and with rolled sources, and the number of target tokens scored."""
    ckpt = inspect_checkpoint(path)
    model = load_model(ckpt)
    model.cfg.label_smoothing = 0.0  # the plain cross-entropy, whatever the model trained with
    cpu = torch.device("cpu")
    sources = [source_ids(src, ckpt.max_source_tokens, ckpt.specials)[0] for src, _ in pairs]
    (start,), (end,) = ckpt.specials.target
    # <s> + target as the decoder's input, target + </s> as its labels, within max_seq_len.
    targets = [[int(t) for t in tgt][: model.cfg.max_seq_len - 1] for _, tgt in pairs]
    sums, tokens = [0.0, 0.0], 0
    for batch in length_sorted_batches([len(s) for s in sources], batch_size):
        src, src_mask = pad([sources[i] for i in batch], cpu, model.cfg.pad_id)
        dec_in, dec_mask = pad([[start, *targets[i]] for i in batch], cpu, model.cfg.pad_id)
        labels = torch.full_like(dec_in, IGNORE_INDEX)
        for row, i in enumerate(batch):
            labels[row, : len(targets[i]) + 1] = torch.tensor([*targets[i], end])
        n = int((labels != IGNORE_INDEX).sum())
        tokens += n
        for k, shift in enumerate((0, 1)):
            out = model(src.roll(shift, 0), src_mask.roll(shift, 0), dec_in, dec_mask, labels)
            sums[k] += float(out.loss) * n
    return sums[0] / tokens, sums[1] / tokens, tokens


if __name__ == "__main__":
    main()
