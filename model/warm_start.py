"""Warm-starting a Seq2Seq from pretrained GPT and BERT weights.

The design and its reasons: docs/design.md#modelwarm_startpy.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Set

import torch
from torch import Tensor, nn

from model.bert import BERT
from model.config import STACKS, ModelConfig, StackConfig
from model.gpt import GPT
from model.seq2seq import Seq2Seq

SOURCE_CLASSES = {"gpt": GPT, "bert": BERT}
# Fields a source must share with the stack it fills; max_seq_len may differ (resized).
ARCHITECTURE_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "activation", "norm",
    "norm_position", "positions", "rope_theta", "layer_norm_eps", "bias", "pad_id", "bos_id",
    "eos_id", "mask_id", "head_dim", "qkv_bias", "qk_norm", "sliding_window", "moe",
)  # fmt: skip
# A stack's vocabulary: its size and special ids, the stack's own when the sides' tokenizers differ.
VOCABULARY_FIELDS = ("vocab_size", "pad_id", "bos_id", "eos_id", "mask_id")
# ... and the decoder source also whether its output layer is its token embedding: the decoder has
# an LM head, the encoder none (a source's head is dropped there).
DECODER_FIELDS = ("tie_embeddings",)
RESIZABLE = "embed.pos.weight"
TOKEN_EMBEDDING = "embed.tok.weight"


class WarmStartError(ValueError):
    """Pretrained weights that do not fit the Seq2Seq; the message is one line."""


@dataclass
class Pretrained:
    """One side's source: a GPT or BERT state dict, its config, and its tokenizer's sha256."""

    state_dict: Mapping[str, Tensor]
    config: ModelConfig
    tokenizer_sha256: str


@dataclass
class TensorOrigin:
    status: str  # copied | resized | new
    source: str = ""  # "{side}:{key of the source state dict}"
    note: str = ""


@dataclass
class WarmStartReport:
    tensors: Dict[str, TensorOrigin] = field(default_factory=dict)  # every key of the Seq2Seq
    dropped: List[str] = field(default_factory=list)  # "{side}:{key}" of unused source tensors
    shared: str = ""  # share_embeddings: where the one token matrix came from, and why

    def keys(self, status: str) -> List[str]:
        return [key for key, origin in self.tensors.items() if origin.status == status]

    def summary(self) -> str:
        counts = Counter(origin.status for origin in self.tensors.values())
        parts = [f"{status} {counts[status]}" for status in ("copied", "resized", "new")]
        return ", ".join(parts + [f"dropped {len(self.dropped)}"])

    def __str__(self) -> str:
        lines = [self.summary()] + ([f"shared   {self.shared}"] if self.shared else [])
        for key, origin in self.tensors.items():
            detail = " ".join(part for part in (origin.source, origin.note) if part)
            lines.append(f"{origin.status:8} {key}" + (f" <- {detail}" if detail else ""))
        lines += [f"dropped  {key}" for key in self.dropped]
        return "\n".join(lines)


def architecture_fields(side: str) -> tuple[str, ...]:
    """The config fields a source must share with the Seq2Seq stack `side` it fills."""
    return ARCHITECTURE_FIELDS + (DECODER_FIELDS if side == "decoder" else ())


def seq2seq_config(
    encoder_config: Optional[ModelConfig] = None,
    decoder_config: Optional[ModelConfig] = None,
    **overrides,
) -> ModelConfig:
    """The Seq2Seq config whose encoder and decoder stacks match the given source configs.

    Shared fields (dropout, init, ids, ...) come from the encoder source, else the decoder
    source, else the defaults; tie_embeddings from the decoder source, whose LM head it
    describes; max_seq_len is the larger of the sources'; `overrides`
    (any ModelConfig field, e.g. max_seq_len, dropout, label_smoothing) are applied last.
    """
    encoder, decoder = encoder_config, decoder_config
    sources = [c for c in (encoder, decoder) if c is not None]
    # Sources with two vocabularies (BERT2GPT2) give each stack its own, unless one is shared.
    own_vocab = len({tuple(getattr(c, n) for n in VOCABULARY_FIELDS) for c in sources}) > 1
    checked = ("d_model", "bias") + (
        VOCABULARY_FIELDS if overrides.get("share_embeddings") or not own_vocab else ()
    )
    for name in checked:
        values = {getattr(c, name) for c in sources}
        if len(values) > 1:
            why = (
                " (share_embeddings=True needs one vocabulary)"
                if name == "vocab_size" and overrides.get("share_embeddings")
                else ""
            )
            raise WarmStartError(
                f"encoder and decoder sources differ in {name}: {sorted(values)}{why}"
            )
    base = sources[0] if sources else ModelConfig()

    def stack(c: Optional[ModelConfig]) -> StackConfig:
        if c is None:
            return StackConfig()
        vocabulary = {name: getattr(c, name) for name in VOCABULARY_FIELDS} if own_vocab else {}
        return StackConfig(
            **vocabulary,
            n_heads=c.n_heads,
            n_kv_heads=c.n_kv_heads,
            d_ff=c.d_ff,
            activation=c.activation,
            norm=c.norm,
            norm_position=c.norm_position,
            positions=c.positions,
            rope_theta=c.rope_theta,
            layer_norm_eps=c.layer_norm_eps,
        )

    cfg = dataclasses.replace(
        base,
        arch="seq2seq",
        n_layers=(encoder or base).n_layers,
        n_decoder_layers=(decoder or base).n_layers,
        max_seq_len=max(c.max_seq_len for c in sources) if sources else base.max_seq_len,
        tie_embeddings=(decoder or base).tie_embeddings,
        family="",  # a translation model is of no decoder family
        encoder=stack(encoder),
        decoder=stack(decoder),
    )
    return dataclasses.replace(cfg, **overrides).validate()


def warm_start(
    cfg: ModelConfig,
    tokenizer_sha256: str | Mapping[str, str],
    encoder: Optional[Pretrained] = None,
    decoder: Optional[Pretrained] = None,
) -> tuple[Seq2Seq, WarmStartReport]:
    """A new Seq2Seq for `cfg`, its stacks filled from `encoder` and `decoder` sources; each
    source must have been trained with its side's tokenizer (`tokenizer_sha256`: one for both
    sides, or {"encoder": the source side's, "decoder": the target side's})."""
    if isinstance(tokenizer_sha256, str):
        tokenizer_sha256 = {side: tokenizer_sha256 for side in STACKS}
    if cfg.arch != "seq2seq":
        raise WarmStartError(f"warm_start builds a seq2seq model, got arch={cfg.arch!r}")
    cfg.validate()  # the one check of this path's config (build_model's, for a random start)
    model = Seq2Seq(cfg)
    report = WarmStartReport()
    origins: Dict[str, TensorOrigin] = {}
    target = model.state_dict(keep_vars=True)
    target_aliases = _tied_aliases(model)
    # share_embeddings: the side whose token matrix becomes the shared one
    # (docs/design.md#modelwarm_startpy).
    shared_side = (
        ("decoder" if decoder is not None else "encoder" if encoder is not None else None)
        if cfg.share_embeddings
        else None
    )
    with torch.no_grad():
        for side, source in zip(STACKS, (encoder, decoder)):
            if source is not None:
                _check_config(side, source, cfg.for_stack(side), tokenizer_sha256[side])
                skip = {TOKEN_EMBEDDING} if shared_side not in (None, side) else set()
                _load_side(side, source, target, target_aliases, origins, report, skip)
    if shared_side:
        report.shared = _shared_origin(
            cfg, shared_side, (encoder, decoder)[STACKS.index(shared_side)]
        )
        origin = TensorOrigin("copied", f"{shared_side}:{TOKEN_EMBEDDING}")
        for key in ("encoder", "decoder"):
            origins[f"{key}.{TOKEN_EMBEDDING}"] = origin
    for key in target:
        owner = target_aliases.get(key)
        origin = origins.get(key) or origins.get(owner) or TensorOrigin("new")
        report.tensors[key] = (
            dataclasses.replace(origin, note=f"tied to {owner}") if owner else origin
        )
    return model, report


def _shared_origin(cfg: ModelConfig, side: str, source: Pretrained) -> str:
    """The report's line on the shared matrix: its source, why, and how its scale changed."""
    why = (
        "the decoder source trained it as its output layer, and the Seq2Seq's "
        "output projection is this matrix"
        if side == "decoder"
        else "there is no decoder source; the encoder source's is the one pretrained matrix"
    )
    line = (
        "share_embeddings: source, target and output embeddings <- "
        f"{side}:{TOKEN_EMBEDDING} ({why})"
    )
    if source.config.positions != "sinusoidal":
        line += (
            f"; lookups are now scaled by sqrt(d_model) = {math.sqrt(cfg.d_model):g}, where the "
            f"source ({source.config.positions} positions) used 1"
        )
    if side == "decoder":
        line += f"; encoder:{TOKEN_EMBEDDING}, if given, is dropped"
    return line


def _check_config(side: str, source: Pretrained, stack: ModelConfig, tokenizer_sha256: str) -> None:
    if source.tokenizer_sha256 != tokenizer_sha256:
        text_side = "source" if side == "encoder" else "target"
        raise WarmStartError(
            f"{side} source tokenizer sha256 {source.tokenizer_sha256[:12]}... differs from the "
            f"Seq2Seq's {text_side} side's {tokenizer_sha256[:12]}...: embeddings would not mean "
            "the same tokens"
        )
    src = source.config
    if src.arch not in SOURCE_CLASSES:
        raise WarmStartError(
            f"{side} source has arch={src.arch!r}; expected one of {sorted(SOURCE_CLASSES)}"
        )
    if src.vocab_size != stack.vocab_size:
        why = " (share_embeddings=True needs one vocabulary)" if stack.share_embeddings else ""
        raise WarmStartError(
            f"vocabulary mismatch: {side} source vocab_size={src.vocab_size}, Seq2Seq "
            f"vocab_size={stack.vocab_size}{why}"
        )
    for name in architecture_fields(side):
        if getattr(src, name) != getattr(stack, name):
            raise WarmStartError(
                f"{side} source has {name}={getattr(src, name)!r} but the Seq2Seq {side} has "
                f"{getattr(stack, name)!r} (derive the config with seq2seq_config)"
            )


def _load_side(
    side: str,
    source: Pretrained,
    target: Mapping[str, Tensor],
    target_aliases: Mapping[str, str],
    origins: Dict[str, TensorOrigin],
    report: WarmStartReport,
    skip: Set[str] = frozenset(),
) -> None:
    """Copy one source into `{side}.*`; source keys in `skip` are dropped (and reported so)."""
    # The source model's own keys, from a copy built on the meta device (no memory).
    with torch.device("meta"):
        reference = SOURCE_CLASSES[source.config.arch](source.config)
    expected = reference.state_dict()
    source_aliases = _tied_aliases(reference)
    state = source.state_dict
    unknown = sorted(set(state) - set(expected))
    if unknown:
        raise WarmStartError(
            f"{side} source has {len(unknown)} unknown keys, e.g. {unknown[0]!r}: not a "
            f"{source.config.arch} state dict"
        )
    prefix = f"{side}."
    for key in expected:
        name = prefix + key
        if key in source_aliases:
            # A tied duplicate of another source tensor: checked, never loaded by itself.
            if key in state:
                owner = source_aliases[key]
                if owner in state and not torch.equal(state[key], state[owner]):
                    raise WarmStartError(
                        f"{side} source {key} should be tied to {owner} but differs from it"
                    )
                if name in target:
                    origins[name] = TensorOrigin("copied", f"{side}:{key}")
                else:
                    report.dropped.append(f"{side}:{key}")
            continue
        if name not in target or key in skip:
            if key in state:
                report.dropped.append(f"{side}:{key}")
            continue
        if key not in state:
            raise WarmStartError(f"{side} source state dict lacks {key!r}: refusing a partial load")
        origins[name] = _copy(side, key, state[key], target[name])


def _copy(side: str, key: str, value: Tensor, param: Tensor) -> TensorOrigin:
    origin = f"{side}:{key}"
    if value.shape == param.shape:
        param.copy_(value)
        return TensorOrigin("copied", origin)
    if key == RESIZABLE and value.shape[1:] == param.shape[1:]:
        rows = min(value.shape[0], param.shape[0])
        param[:rows].copy_(value[:rows])
        what = "extended, new rows initialised" if param.shape[0] > rows else "truncated"
        return TensorOrigin(
            "resized", origin, f"{value.shape[0]} -> {param.shape[0]} positions ({what})"
        )
    if key == "embed.tok.weight":
        raise WarmStartError(
            f"vocabulary mismatch: {side} source {key} has {value.shape[0]} rows, "
            f"the Seq2Seq {param.shape[0]}"
        )
    raise WarmStartError(
        f"shape mismatch: {side} source {key} is {tuple(value.shape)}, the "
        f"Seq2Seq's is {tuple(param.shape)}"
    )


def _tied_aliases(module: nn.Module) -> Dict[str, str]:
    """Keys whose tensor is an earlier key's (tied weights): alias -> first key holding it."""
    first: Dict[int, str] = {}
    aliases = {}
    for key, tensor in module.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            aliases[key] = first[id(tensor)]
        else:
            first[id(tensor)] = key
    return aliases
