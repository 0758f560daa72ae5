"""What a training run needs before it builds anything expensive, checked in seconds at most.

Without these checks the same mistakes end the run late and as tracebacks: a model shorter
than the data's inputs fails with a ValueError from the position embedding at the first batch
that is too long (for translation, whenever such a pair comes up), after the process group and
the DeepSpeed engine are built; a run directory that cannot be written fails at the first
file, after all of that too. Each check here returns (or raises as a `UserError`) one line
naming the key to change. They read the dataset's manifest and, only when it cannot answer,
its shards; they build no model and join no process group. Rendezvous problems (MASTER_PORT
taken) are found where the process group is joined, in `launch.distributed`.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from common.configure import UserError
from launch.tasks import TASKS
from model import ModelConfig
from pipeline import remote
from pipeline.format import (
    DATASET_FOR_TASK,
    FIELDS,
    dataset_specials,
    has_target_tokenizer,
    shard_entries,
    tokenizer_files,
    tokenizer_record,
)
from pipeline.load.collate import pack, unpack
from pipeline.load.shards import Shard, ShardError, read_shard, stored_fields
from pipeline.specials import Specials

TRAINING_SPLITS = ("train", "valid")  # what the trainer reads; test stays for evaluation


@dataclass(frozen=True)
class LongestInput:
    """The most positions one model input of the data takes, and where that figure comes from."""

    positions: int
    # for the message: "packed blocks of seq_len 128", "the longest source, 40 tokens, in the train
    # split"
    source: str


@dataclass(frozen=True)
class TargetSide:
    """A translation target's own tokenizer (`pipeline.format.SIDES`): the decoder's vocabulary
    size and special ids."""

    vocab_size: int
    specials: Specials
    sha256: str = ""
    files: tuple[str, ...] = ()  # in the dataset (under target/), the one that fixes its ids first


def target_side(manifest: dict) -> TargetSide | None:
    """The dataset's target tokenizer, when its translation targets have one of their own."""
    if not has_target_tokenizer(manifest):
        return None
    record = tokenizer_record(manifest, "target")
    return TargetSide(
        int(record["vocab_size"]),
        dataset_specials(manifest, "target"),
        record["sha256"],
        tuple(tokenizer_files(manifest, "target")),
    )


def with_data_tokenizer(
    model_cfg: ModelConfig,
    data_vocab: int,
    specials: Specials | None,
    data_dir: str | os.PathLike,
    init_model: str = "",
    target: TargetSide | None = None,
) -> tuple[ModelConfig, str | None]:
    """The model config with the data's vocabulary size (`model.vocab_size: 0` asks for it) and
    its tokenizer's special ids (`model_ids`; None: a dataset not yet prepared, ids unknown), and
    the problem, in words, when the config names another size: the one rule of the trainer and
    its dry run. The data's vocabulary is its tokenizer's id range (highest id + 1, as prepare
    records it), so a model with fewer embedding rows than some id needs is refused here. A
    Seq2Seq's decoder takes `target`'s, when the targets have a tokenizer of their own; the
    shared fields (and the encoder) stay the source side's."""
    if specials is not None:
        model_cfg = replace(model_cfg, **model_ids(specials))
    if model_cfg.arch == "seq2seq":
        model_cfg, problem = _stack_vocabularies(model_cfg, data_vocab, specials, data_dir, target)
        if problem:
            return model_cfg, problem
    if model_cfg.vocab_size == 0:
        return replace(model_cfg, vocab_size=int(data_vocab)), None
    if model_cfg.vocab_size != data_vocab and init_model:  # the size is the directory's
        return model_cfg, (
            f"init.model: {init_model} has a vocabulary of {model_cfg.vocab_size}, the tokenizer "
            f"of {data_dir} {_id_range(data_vocab)}: the dataset was prepared with another "
            f"tokenizer than the model's (prepare it with tokenizer.path={init_model})"
        )
    if model_cfg.vocab_size != data_vocab:
        return model_cfg, (
            f"model.vocab_size={model_cfg.vocab_size} but the tokenizer of {data_dir} has "
            f"{_id_range(data_vocab)}: set model.vocab_size=0 to take it from the data"
        )
    return model_cfg, None


def _id_range(vocab: int) -> str:
    """A tokenizer's vocabulary as the model needs it: its id range, not its count of tokens."""
    return f"a vocabulary of {vocab} (ids 0 to {vocab - 1})"


def _stack_vocabularies(
    model_cfg: ModelConfig,
    data_vocab: int,
    specials: Specials | None,
    data_dir: str | os.PathLike,
    target: TargetSide | None,
) -> tuple[ModelConfig, str | None]:
    """A Seq2Seq's stacks with their sides' vocabularies: with a target tokenizer of its own, the
    encoder takes the source side's size and ids and the decoder the target side's; with one
    tokenizer, both stacks share the model's (a stack's own size must then be the data's)."""
    sizes = {
        "encoder": int(data_vocab),
        "decoder": target.vocab_size if target else int(data_vocab),
    }
    for stack, size in sizes.items():
        own = getattr(model_cfg, stack).vocab_size
        if own is not None and own != size:
            side = "source" if stack == "encoder" else "target"
            whose = f"{side} tokenizer" if target is not None else "tokenizer (both sides')"
            return model_cfg, (
                f"model.{stack}.vocab_size={own} but the {whose} of {data_dir} has "
                f"{_id_range(size)}: the {stack} was made for another tokenizer"
            )
    if target is None:
        return model_cfg, None
    stacks = {}
    for stack, side in (("encoder", specials), ("decoder", target.specials)):
        ids = model_ids(side) if side is not None else {}
        stacks[stack] = replace(getattr(model_cfg, stack), vocab_size=sizes[stack], **ids)
    return replace(model_cfg, **stacks), None


def model_ids(specials: Specials) -> dict[str, int]:
    """The model config's special ids for a tokenizer: its padding id; the id a decoder starts
    from (the target frame's first: <s>, or GPT-2's <|endoftext|>), its eos; its mask (-1: none)."""
    before, _ = specials.target
    start = before[0] if before else (specials.bos if specials.bos is not None else specials.pad_id)
    return {
        "pad_id": specials.pad_id,
        "bos_id": start,
        "eos_id": specials.eos if specials.eos is not None else specials.pad_id,
        "mask_id": specials.mask if specials.mask is not None else -1,
    }


def local_tokenizer(
    data_dir: str, fetch: remote.FetchConfig | None, sha256: str, name: str
) -> Path:
    """The dataset's tokenizer file `name` (the one that fixes its ids) as a local path, fetched
    through the shard cache when data_dir is a URL, checked against the manifest's sha256."""
    return Path(remote.local_file(remote.join(data_dir, name), fetch, sha256=sha256))


def data_fits_model(
    data_dir: str | os.PathLike, manifest: dict, task: str, model_cfg: ModelConfig
) -> str | None:
    """One line if some input of `task`'s data needs more positions than
    `model.max_seq_len`, else None.

    Packed blocks (causal_lm, mlm) are exactly the manifest's `seq_len` long. A translation pair's
    sides are bounded by prepare's `translation.max_tokens`; when that bound fits the model,
    nothing is read. Otherwise the pairs themselves decide (their longest sides, from the shards),
    so a model shorter than the bound still trains on data that fits it."""
    longest = longest_input(data_dir, manifest, task, bound_ok=model_cfg.max_seq_len)
    if longest is None or longest.positions <= model_cfg.max_seq_len:
        return None
    return (
        f"model.max_seq_len={model_cfg.max_seq_len} is shorter than the inputs of {data_dir}, "
        f"which need {longest.positions} positions ({longest.source}); set "
        f"model.max_seq_len={longest.positions} or more"
    )


def longest_input(
    data_dir: str | os.PathLike, manifest: dict, task: str, bound_ok: int = 0
) -> LongestInput | None:
    """The most positions an input of `task`'s training splits takes; None if there are no samples.
    A recorded bound that needs at most `bound_ok` positions is answer enough (no shard is read)."""
    dataset = DATASET_FOR_TASK[task]
    specials, target = dataset_specials(manifest), dataset_specials(manifest, "target")
    record = manifest.get("datasets", {}).get(dataset, {})
    if dataset == "packed" and isinstance(record.get("seq_len"), int):
        seq_len = record["seq_len"]
        return LongestInput(
            input_positions(task, {"input_ids": seq_len}, specials)["input_ids"],
            f"packed blocks of seq_len {seq_len}",
        )
    max_tokens = ((manifest.get("config") or {}).get("translation") or {}).get("max_tokens")
    if dataset == "translation" and isinstance(max_tokens, int):
        bound = max(
            input_positions(
                task, {name: max_tokens for name in FIELDS[dataset]}, specials, target
            ).values()
        )
        if bound <= bound_ok:
            return LongestInput(
                bound, f"pairs of at most translation.max_tokens={max_tokens} tokens a side"
            )
    stored = _longest_stored(data_dir, manifest, task)
    if not stored:
        return None
    positions = input_positions(
        task, {name: length for name, (length, _) in stored.items()}, specials, target
    )
    name = max(positions, key=positions.get)
    length, split = stored[name]
    return LongestInput(
        positions[name], f"the longest {_SIDE[name]}, {length} tokens, in the {split} split"
    )


# Each stored field, by the model input it becomes and what the message calls it.
_MODEL_INPUT = {"input_ids": "input_ids", "src_ids": "src_ids", "tgt_ids": "decoder_input_ids"}
_SIDE = {"input_ids": "block", "src_ids": "source", "tgt_ids": "target"}


def input_positions(
    task: str,
    lengths: dict[str, int],
    specials: Specials,
    target_specials: Specials | None = None,
) -> dict[str, int]:
    """The positions of the model input each stored field of a sample becomes, for arrays of these
    lengths. Asked of the code that builds the inputs, the collation (`pipeline.load.collate`: the
    tokenizer's frames around a source and a target) and the task (`launch.tasks`: the decoder
    reads the target without its last token), so that what they add or drop is counted in one
    place: theirs."""
    dataset = DATASET_FOR_TASK[task]
    collated_as = "causal_lm" if dataset == "packed" else task  # MLM's masking changes no length
    # not doc_starts: no input of its own
    token_fields = [name for name in FIELDS[dataset] if name in _MODEL_INPUT]
    # any id stands for a token here: only the lengths count
    sample = [np.full(lengths[name], specials.pad_id, dtype=np.int64) for name in token_fields]
    packed = pack(collated_as, [sample], specials, target_specials=target_specials)
    inputs = TASKS[collated_as].model_inputs(unpack(collated_as, packed))
    return {name: int(inputs[_MODEL_INPUT[name]].shape[1]) for name in token_fields}


def _longest_stored(
    data_dir: str | os.PathLike, manifest: dict, task: str
) -> dict[str, tuple[int, str]]:
    """Per field, the longest array of the training splits' shards and its split, from the .npy
    headers. A shard or sample that cannot be read is passed over, as the loader passes it over."""
    fields = stored_fields(manifest, task)  # every member, as the loader reads them
    longest: dict[str, tuple[int, str]] = {}
    for split in TRAINING_SPLITS:
        try:
            entries = shard_entries(manifest, task, split)
        except UserError:  # no such split: the loader says so where it matters
            continue
        for index, entry in enumerate(entries):
            shard = Shard(
                index,
                remote.join(data_dir, entry["path"]),
                int(entry["samples"]),
                entry.get("bytes"),
                entry.get("sha256"),
            )
            try:
                samples = read_shard(shard, fields, set(range(shard.samples)))
            except ShardError:
                continue
            for members in samples.values():
                for name in (name for name in fields if name in _MODEL_INPUT):
                    length = _npy_length(members[name])
                    if length is not None and length > longest.get(name, (-1, ""))[0]:
                        longest[name] = (length, split)
    return longest


def _npy_length(raw: bytes) -> int | None:
    """The number of elements of a .npy array, from its header alone."""
    stream = io.BytesIO(raw)
    try:
        major, _ = np.lib.format.read_magic(stream)
        read_header = (
            np.lib.format.read_array_header_1_0
            if major == 1
            else np.lib.format.read_array_header_2_0
        )
        shape, _, _ = read_header(stream)
    except ValueError:
        return None
    return int(np.prod(shape))


def check_writable_dir(path: str | os.PathLike, key: str) -> Path:
    """Make directory `path` (and its parents) and write a file in it, or raise one line naming
    `key`: the run would otherwise fail at its first file, after the engine is built. Trying is
    the only sure answer: permission bits say nothing to root, nor of a read-only mount."""
    path = Path(path)
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".writable-"):
            pass
    except OSError as err:
        raise UserError(f"{key}={path}: {_why_not_writable(path, err)}") from err
    return path


def _why_not_writable(path: Path, err: OSError) -> str:
    blocker = path.absolute()
    while not blocker.exists() and blocker != blocker.parent:
        blocker = blocker.parent
    if not blocker.is_dir():
        return f"{blocker} is a file, not a directory"
    where = "" if blocker == path.absolute() else f" in {blocker}"
    return f"cannot create files{where}: {err.strerror or err}"
