"""What `launch.evaluate` and `launch.translate` share: a translation checkpoint, and token
ids in and out of it.

A checkpoint is an exported model directory (`launch.export`: safetensors and JSON, nothing
unpickled) or a training run (its run directory, `checkpoints/` directory or one `step_*`
checkpoint, verified and consolidated on the fly, weights-only: `launch.deepspeed.safe_load`). A
source is encoded as in training (`pipeline.load.collate`: the source's ids framed as the
tokenizer frames a source, ours `ids </s>`), cut to the model's `max_seq_len` first; sources are
padded into batches and decoded with `Seq2Seq.generate` (beam search, greedy for beam 1);
hypotheses go back to text with the tokenizer the model was trained with.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Sequence, TextIO

import torch

from common.configure import UserError, load_config
from common.hashing import file_sha256
from launch.config import TrainConfig
from launch.export import read_run_checkpoint, target_tokenizer_in
from launch.model_dir import CONFIG, WEIGHTS, load_model_dir, read_model_config
from model import ModelConfig, Seq2Seq, build_model
from pipeline.specials import Specials
from pipeline.tokenizer import load_tokenizer, tokenizer_file_in


@dataclass(frozen=True)
class Checkpoint:
    """What a checkpoint holds, read without loading its weights."""

    path: Path  # as given
    model_cfg: ModelConfig
    tokenizer_path: Path
    tokenizer_sha256: str
    data_dir: str  # the dataset it was trained on, when known ("" otherwise)
    exported: bool  # an exported directory (else a DeepSpeed checkpoint: root / tag)
    root: Path | None = None
    tag: str | None = None
    # the target side's own tokenizer (DIR/target/), None when both sides share tokenizer_path
    target_tokenizer_path: Path | None = None

    @functools.cached_property
    def specials(self) -> Specials:
        """Its (source side's) tokenizer's special ids and frames, read when first asked."""
        return load_tokenizer(self.tokenizer_path).specials

    @property
    def target_path(self) -> Path:
        """The tokenizer of the target side: what hypotheses and references decode with."""
        return self.target_tokenizer_path or self.tokenizer_path

    @property
    def max_source_tokens(self) -> int:
        """Source tokens the encoder takes besides the frame put around every source."""
        before, after = self.specials.source
        return self.model_cfg.max_seq_len - len(before) - len(after)


def _run_data_dir(run_dir: Path) -> str:
    """The dataset of the run an export came from, if that run is still there and readable."""
    config_file = run_dir / "config.yaml"
    if not config_file.is_file():
        return ""
    try:
        return load_config(TrainConfig, config_file).data.data_dir
    except UserError:
        return ""


def inspect_checkpoint(path: str | Path) -> Checkpoint:
    """Config and tokenizer of a translation checkpoint; UserError if it is none, or its
    tokenizer file is not the one it was trained with."""
    path = Path(path)
    if (path / CONFIG).is_file() and (path / WEIGHTS).is_file():
        meta, model_cfg = read_model_config(path)
        tokenizer, recorded = tokenizer_file_in(path), meta.get("tokenizer_sha256")
        target, target_recorded = target_tokenizer_in(path), meta.get("target_tokenizer_sha256")
        source = Path(meta.get("source") or "")
        data_dir = _run_data_dir(source.parent.parent) if meta.get("source") else ""
        root = tag = None
    else:
        if not path.exists():
            raise UserError(f"checkpoint not found: {path}")
        run = read_run_checkpoint(path)
        root, tag = run.root, run.tag
        model_cfg, data_dir = run.config.model, run.config.data.data_dir
        tokenizer, recorded = run.tokenizer, run.client.get("tokenizer_sha256")
        target, target_recorded = run.target_tokenizer, run.client.get("target_tokenizer_sha256")
    if model_cfg.arch != "seq2seq":
        raise UserError(f"{path} holds a {model_cfg.arch} model, not a translation (seq2seq) model")
    if target_recorded and target is None:
        raise UserError(
            f"{path} was trained with a target tokenizer of its own, and its target/ directory "
            "is missing"
        )
    sha = ""
    for file, expected in ((tokenizer, recorded), (target, target_recorded)):
        if file is None:
            continue
        if not file.is_file():
            raise UserError(f"{file} not found")
        actual = file_sha256(file)
        if expected and expected != actual:
            raise UserError(
                f"{file} (sha256 {actual[:12]}) is not the tokenizer the model was trained with "
                f"({expected[:12]})"
            )
        sha = sha or actual
    return Checkpoint(path, model_cfg, tokenizer, sha, data_dir, root is None, root, tag, target)


def load_model(ckpt: Checkpoint) -> Seq2Seq:
    """The checkpoint's Seq2Seq with its weights, in eval mode, on the CPU."""
    if ckpt.exported:
        model, _ = load_model_dir(ckpt.path)
        return model
    from launch.deepspeed.safe_load import consolidated_state_dict

    model = build_model(ckpt.model_cfg)
    missing, unexpected = model.load_state_dict(
        consolidated_state_dict(ckpt.root, ckpt.tag), strict=False
    )
    if missing or unexpected:
        raise UserError(
            f"{ckpt.root / ckpt.tag} does not match its model config: missing {missing[:3]}, "
            f"unexpected {unexpected[:3]}"
        )
    return model.eval()


def source_ids(
    ids: Sequence[int], max_source_tokens: int, specials: Specials
) -> tuple[list[int], bool]:
    """The encoder's input for one source: its ids cut to the model's limit, framed as training
    framed a source; and whether it was cut."""
    ids = [int(i) for i in ids]
    before, after = specials.source
    return [*before, *ids[:max_source_tokens], *after], len(ids) > max_source_tokens


def length_sorted_batches(lengths: Sequence[int], micro_batch_size: int) -> list[list[int]]:
    """Batches of indices, longest sources first (less padding); ties keep their order.
    A function of the lengths alone, so every rank and every world size makes the same batches."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    return [
        order[start : start + micro_batch_size] for start in range(0, len(order), micro_batch_size)
    ]


def pad(
    sources: Sequence[Sequence[int]], device: torch.device, pad_id: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, S) ids padded with `pad_id` and their (B, S) mask, 1 on real tokens (by length: a pad
    id may also be a real token, as GPT-2's <|endoftext|> is)."""
    width = max(len(s) for s in sources)
    ids = torch.full((len(sources), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(sources), width), dtype=torch.long)
    for row, source in enumerate(sources):
        ids[row, : len(source)] = torch.tensor(source, dtype=torch.long)
        mask[row, : len(source)] = 1
    return ids.to(device), mask.to(device)


@torch.no_grad()
def translate_ids(
    model: Seq2Seq,
    sources: Sequence[Sequence[int]],
    *,
    beam: int,
    max_len: int,
    length_penalty: float = 1.0,
    synced: bool = False,
    device: torch.device = torch.device("cpu"),
    max_len_a: float = 0.0,
    max_len_b: int = 0,
) -> list[list[int]]:
    """One batch of encoder inputs (`source_ids`) -> one hypothesis (ids, no </s>) per source.
    synced=True runs exactly max_len decoder steps (ZeRO-3: every rank in every forward)."""
    src_ids, src_mask = pad(sources, device, model.encoder.cfg.pad_id)
    out = model.generate(
        src_ids,
        src_mask,
        max_len=max_len,
        beam_size=beam,
        length_penalty=length_penalty,
        synced=synced,
        max_len_a=max_len_a,
        max_len_b=max_len_b,
    )
    tokens, lengths = out.tokens.cpu(), out.lengths.cpu()
    return [tokens[row, : int(lengths[row])].tolist() for row in range(len(sources))]


def detokenize(tokenizer, ids: Sequence[int]) -> str:
    """Text of a hypothesis or reference, on one line (byte-fallback pieces may
    decode to newlines)."""
    return " ".join(tokenizer.decode([int(i) for i in ids]).splitlines())


@contextlib.contextmanager
def results_only_on_stdout() -> Iterator[TextIO]:
    """The real standard output, for results; whatever else is printed meanwhile goes to stderr
    (DeepSpeed logs to stdout, and its checkpoint consolidation prints there)."""
    real = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        yield real


def check_decoding(model_cfg: ModelConfig, beam: int, max_len: int, micro_batch_size: int) -> int:
    """Validate the decoding keys against the model; returns max_len (0 = the decoder's limit)."""
    limit = model_cfg.max_seq_len
    max_len = max_len or limit
    if not 1 <= max_len <= limit:
        raise UserError(f"max_len={max_len}: must be in [1, the model's max_seq_len={limit}]")
    if beam < 1 or 2 * beam > model_cfg.for_stack("decoder").vocab_size:
        raise UserError(
            f"beam={beam}: must be at least 1 and at most the target vocabulary / 2 "
            f"({model_cfg.for_stack('decoder').vocab_size // 2})"
        )
    if micro_batch_size < 1:
        raise UserError(f"micro_batch_size={micro_batch_size}: must be at least 1")
    return max_len
