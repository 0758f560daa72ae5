"""`python -m launch.translate [CONFIG.yaml] checkpoint=DIR [key=value ...]`:
translate text, line by line.

The keys are `launch.config.TranslateConfig`'s (`--help` lists them). Reads UTF-8 source
sentences from standard input (or `input`), undecodable bytes replaced, and writes one
translation per line to standard output, in input order, flushed after every batch of
`micro_batch_size` lines (a pipe sees output before its input ends). A line that encodes to no
tokens (an empty or blank line) gives an empty line. A line longer than the model's limit is
cut to it, with a warning on standard error naming the line. DIR is an exported model
directory (`launch.export`) or a training run; the tokenizer is the one beside its weights (a
target side's own, under target/, decodes the translations).
Encoding, batching and decoding are `launch.decoding`'s, the same as `launch.evaluate`'s.
"""

from __future__ import annotations

import io
import itertools
import sys
from typing import BinaryIO, Iterable, TextIO

from common.configure import UserError, parse_cli, run_main
from common.progress import meter
from launch.config import TranslateConfig
from pipeline.tokenizer import load_tokenizer

USAGE = """usage: python -m launch.translate [CONFIG.yaml] checkpoint=DIR [input=FILE] \
[key.sub=value ...]

Translate UTF-8 text, one sentence per line, from standard input (or input=FILE) to standard \
output."""


def translate_lines(
    cfg: TranslateConfig, lines: Iterable[str], out: TextIO, err: TextIO, total: int | None = None
) -> dict:
    """Translate `lines` (without their newlines) to `out`; returns counts. With their number
    `total` (an input file's), progress is shown on `err`."""
    # with the model code, once the command line is read: --help and its errors answer at once
    import torch

    from launch.decoding import (
        check_decoding,
        detokenize,
        inspect_checkpoint,
        load_model,
        source_ids,
        translate_ids,
    )

    ckpt = inspect_checkpoint(cfg.checkpoint)
    max_len = check_decoding(ckpt.model_cfg, cfg.beam, cfg.max_len, cfg.micro_batch_size)
    tokenizer, target = load_tokenizer(ckpt.tokenizer_path), load_tokenizer(ckpt.target_path)
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    model = load_model(ckpt).to(device)
    counts = {"lines": 0, "empty": 0, "truncated": 0}
    lines = iter(lines)
    with meter(total, "translate", "line", enabled=total is not None, stream=err) as shown:
        while chunk := list(itertools.islice(lines, cfg.micro_batch_size)):
            encoded = [tokenizer.encode(line) for line in chunk]
            sources = []
            for offset, ids in enumerate(encoded):
                if ids:
                    src, cut = source_ids(ids, ckpt.max_source_tokens, ckpt.specials)
                    sources.append(src)
                    if cut:
                        counts["truncated"] += 1
                        print(
                            f"warning: line {counts['lines'] + offset + 1}: {len(ids)} "
                            "tokens, truncated to the model's limit of "
                            f"{ckpt.max_source_tokens} (+ the source frame)",
                            file=err,
                            flush=True,
                        )
            outputs = iter(
                translate_ids(
                    model,
                    sources,
                    beam=cfg.beam,
                    max_len=max_len,
                    length_penalty=cfg.length_penalty,
                    device=device,
                    max_len_a=cfg.max_len_a,
                    max_len_b=cfg.max_len_b,
                )
                if sources
                else []
            )
            out.write(
                "".join(
                    (detokenize(target, next(outputs)) if ids else "") + "\n" for ids in encoded
                )
            )
            out.flush()
            counts["lines"] += len(chunk)
            counts["empty"] += len(chunk) - len(sources)
            shown.update(len(chunk))
    return counts


def _read_lines(stream: BinaryIO) -> Iterable[str]:
    """Lines split at \\n only (a stray \\r or other separator inside a line does not make two),
    without their \\n or \\r\\n; bytes that are not UTF-8 replaced by U+FFFD."""
    for raw in stream:
        raw = raw[:-1] if raw.endswith(b"\n") else raw
        raw = raw[:-1] if raw.endswith(b"\r") else raw
        yield raw.decode("utf-8", errors="replace")


def _count_lines(stream: BinaryIO) -> int | None:
    """The number of lines `_read_lines` will give (a last line without \\n counts), the stream
    rewound; None for one that cannot be read twice (a named pipe)."""
    if not stream.seekable():
        return None
    count, last = 0, b"\n"
    while block := stream.read(1 << 20):
        count += block.count(b"\n")
        last = block[-1:]
    stream.seek(0)
    return count + (last != b"\n")


def main(argv: list[str] | None = None) -> int:
    cfg = parse_cli(
        TranslateConfig, sys.argv[1:] if argv is None else argv, usage=USAGE, config_optional=True
    )
    import torch

    from launch.decoding import results_only_on_stdout

    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    total = None  # standard input: no progress (its length is unknown; it may be a terminal)
    if cfg.input == "-":
        source = sys.stdin.buffer
    else:
        try:
            source = open(cfg.input, "rb")
            total = _count_lines(source)
        except OSError as err:
            raise UserError(f"input: {err}") from err
    with source, results_only_on_stdout() as stdout:
        out = io.TextIOWrapper(stdout.buffer, encoding="utf-8", newline="\n", write_through=True)
        try:
            counts = translate_lines(cfg, _read_lines(source), out, sys.stderr, total)
        finally:
            out.detach()  # sys.stdout keeps its buffer
    print(
        f"translated {counts['lines'] - counts['empty']} lines ({counts['empty']} empty, "
        f"{counts['truncated']} truncated)",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    run_main(main)
