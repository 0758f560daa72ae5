"""The on-disk contract between `pipeline.prepare` and everything that reads its output.

The design and its reasons: docs/design.md#pipelineformatpy.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import posixpath
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np

from common.configure import UserError
from pipeline import remote
from pipeline.specials import Specials
from pipeline.tokenizer import (
    KINDS,
    SENTENCEPIECE_FILE,
    Tokenizer,
    load_tokenizer,
    tokenizer_from_files,
)
from pipeline.tokenizer_identity import difference

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
SPLITS = ("train", "valid", "test")

# Task -> the shard set that serves it: causal_lm and mlm read the same packed
# blocks (masks are drawn at load time, so every epoch sees new ones).
DATASET_FOR_TASK = {"causal_lm": "packed", "mlm": "packed", "translation": "translation"}
TASKS = tuple(DATASET_FOR_TASK)


def shard_sets(tasks) -> set[str]:
    """The shard sets that `tasks` read ('packed', 'translation'); unknown tasks read none."""
    return {DATASET_FOR_TASK[task] for task in tasks if task in DATASET_FOR_TASK}


FIELDS = {"packed": ("input_ids", "doc_starts"), "translation": ("src_ids", "tgt_ids")}
# Members that hold positions in another member rather than token ids: what they index. Every
# other member holds token ids, and only those count as tokens (manifest, validate, loader).
POSITION_FIELDS = {"doc_starts": "input_ids"}


def is_token_field(name: str) -> bool:
    return name not in POSITION_FIELDS


BATCH_FIELDS = {
    "causal_lm": ("input_ids", "attention_mask"),
    "mlm": ("input_ids", "attention_mask", "original_ids", "masked_positions"),
    "translation": ("src_ids", "src_mask", "tgt_ids", "tgt_mask"),
}


# A translation dataset may have two tokenizers, one per side (Rothe et al.'s BERT2GPT2: the
# encoder's WordPiece, the decoder's BPE). The source side's is the dataset's `tokenizer` (the only
# one of a monolingual dataset); a target tokenizer of its own is `target_tokenizer`, its files
# under TARGET_DIR. Without one, the target side uses the source side's.
SIDES = ("source", "target")
TARGET_DIR = "target"
# The token fields of each side: what a side's tokenizer encoded, checked against its vocabulary.
SIDE_OF_FIELD = {"input_ids": "source", "src_ids": "source", "tgt_ids": "target"}


def has_target_tokenizer(manifest: dict) -> bool:
    return isinstance(manifest.get("target_tokenizer"), dict)


def tokenizer_record(manifest: dict, side: str = "source") -> dict:
    """The manifest's record of one side's tokenizer (the source's when the target has none)."""
    if side not in SIDES:
        raise ValueError(f"side must be one of {SIDES}, got {side!r}")
    if side == "target" and has_target_tokenizer(manifest):
        return manifest["target_tokenizer"]
    return manifest["tokenizer"]


def tokenizer_files(manifest: dict, side: str = "source") -> list[str]:
    """One side's tokenizer files, relative to the dataset, the one that fixes its ids (and whose
    sha256 the manifest records) first: `tokenizer.model`, or a Hugging Face tokenizer's
    `tokenizer.json` and the files that name its special tokens; a target tokenizer's under
    `target/`."""
    tokenizer = tokenizer_record(manifest, side)
    main = tokenizer.get("file", SENTENCEPIECE_FILE)
    names = [main, *(name for name in tokenizer.get("files", ()) if name != main)]
    if side == "target" and has_target_tokenizer(manifest):
        return [f"{TARGET_DIR}/{name}" for name in names]
    return names


def dataset_tokenizer(
    data_dir: str | os.PathLike, manifest: dict, fetch=None, side: str = "source"
) -> Tokenizer:
    """One side's tokenizer of the dataset (at a URL too), its file checked against the
    manifest's sha256."""
    names = tokenizer_files(manifest, side)
    record = tokenizer_record(manifest, side)
    files = {
        posixpath.basename(name): remote.read_bytes(remote.join(data_dir, name), fetch)
        for name in names
    }
    main = posixpath.basename(names[0])
    actual = hashlib.sha256(files[main]).hexdigest()
    if actual != record["sha256"]:
        raise UserError(
            f"{remote.join(data_dir, names[0])}: sha256 {actual[:12]}... differs from the "
            f"manifest's {record['sha256'][:12]}...: not the tokenizer the shards were made with"
        )
    tags = list(record.get("lang_tags") or ())
    return tokenizer_from_files(files, str(remote.join(data_dir, names[0])), tags)


def dataset_specials(manifest: dict, side: str = "source") -> Specials:
    """The special ids and frames of one side's tokenizer, as prepare recorded them."""
    return Specials.from_manifest(tokenizer_record(manifest, side))


def field_vocab(manifest: dict) -> dict[str, int]:
    """The vocabulary each token field's ids must fall in: its side's tokenizer's."""
    return {
        name: int(tokenizer_record(manifest, side)["vocab_size"])
        for name, side in SIDE_OF_FIELD.items()
    }


def dataset_tokenizer_difference(
    path: str | os.PathLike,
    data_dir: str | os.PathLike,
    manifest: dict,
    side: str = "source",
    fetch=None,
) -> str | None:
    """None if the tokenizer at `path` (a file, or a directory holding one) is one side's tokenizer
    of the dataset, else what differs, in words: a tokenizer is known by the ids it gives
    (`pipeline.tokenizer_identity.difference`), the same file as the manifest records (sha256) being
    answer enough."""
    path = Path(path)
    file = path if path.is_file() else path / posixpath.basename(tokenizer_files(manifest, side)[0])
    recorded = tokenizer_record(manifest, side)["sha256"]
    if file.is_file() and hashlib.sha256(file.read_bytes()).hexdigest() == recorded:
        return None
    try:
        theirs = load_tokenizer(path)
    except UserError as err:
        return str(err)
    ours = dataset_tokenizer(data_dir, manifest, fetch, side)
    return difference(ours, theirs, ("in the dataset's", f"in {path}'s"))


def vocabulary_problem(data_dir: str | os.PathLike, manifest: dict, fetch=None) -> str | None:
    """One line if a side's recorded vocab_size is not its tokenizer's id range (highest id + 1),
    else None. A Hugging Face tokenizer's ids may have gaps; a dataset whose manifest counted its
    tokens instead records too small a vocabulary, and every reader would take its shards' higher
    ids for damage. Only that kind is read (a SentencePiece model's ids have no gaps); a tokenizer
    that cannot be read is None here, its problem said where it is read."""
    for side in SIDES[: 1 + has_target_tokenizer(manifest)]:
        record = tokenizer_record(manifest, side)
        if record.get("kind") != "hf":
            continue
        try:
            tokenizer = dataset_tokenizer(data_dir, manifest, fetch, side)
        except (UserError, OSError, remote.FetchError):
            continue
        if tokenizer.vocab_size != int(record["vocab_size"]):
            whose = f"{side} tokenizer" if has_target_tokenizer(manifest) else "tokenizer"
            return (
                f"{data_dir}: the manifest records a vocabulary of {record['vocab_size']}, but its "
                f"{whose}'s ids run to {tokenizer.vocab_size - 1} (a vocabulary of "
                f"{tokenizer.vocab_size}, its highest id + 1): written by a prepare that counted "
                "the tokens; prepare it again"
            )
    return None


def sample_key(bucket: int, index: int) -> str:
    return f"{bucket:04d}_{index:08d}"


def shard_name(dataset: str, split: str, bucket: int, part: int, source: str | None = None) -> str:
    """A shard's path in the dataset; `source` names the source's own folder when a
    prepare has several."""
    folder = f"{dataset}/{split}/{source}" if source else f"{dataset}/{split}"
    return f"{folder}/{bucket:04d}-{part:04d}.tar"


def encode_array(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(array), allow_pickle=False)
    return buf.getvalue()


def decode_array(data: bytes) -> np.ndarray:
    return np.load(io.BytesIO(data), allow_pickle=False)


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16) if vocab_size <= np.iinfo(np.uint16).max + 1 else np.dtype(np.int32)


@dataclass(frozen=True)
class Dataset:
    """A prepared dataset with its manifest read once: what training resolves from `data_dir`
    and hands to its loaders, its tokenizer copies and its run directory, rather than each
    reading the manifest (and building the fetch settings) again."""

    data_dir: str
    fetch: object  # `pipeline.remote.FetchConfig` for a URL; None reads with the defaults
    manifest: dict
    sha256: str  # of manifest.json's bytes: the dataset's fingerprint


def open_dataset(data_dir: str | os.PathLike, fetch=None) -> Dataset:
    """The dataset in a directory or at a URL (`pipeline.remote`, fetched with the `fetch`
    settings, never cached), its manifest checked; one clear line naming the file if it is
    missing, unreachable, unreadable, or lacks what every reader relies on (the tokenizer's
    identity and size, the datasets), rather than a KeyError or TypeError later, wherever the
    first reader stumbles."""
    if remote.is_url(data_dir):
        path = remote.join(data_dir, MANIFEST)
        try:
            text = remote.read_bytes(path, fetch)
        except FileNotFoundError as err:
            raise UserError(
                f"no {MANIFEST} at {data_dir}: not a prepared dataset (run pipeline.prepare)"
            ) from err
        except remote.FetchError as err:
            raise UserError(f"{path}: cannot fetch the manifest: {err}") from err
    else:
        path = Path(data_dir) / MANIFEST
        if not path.is_file():
            raise UserError(
                f"no {MANIFEST} in {data_dir}: not a prepared dataset (run pipeline.prepare)"
            )
        text = path.read_bytes()
    try:
        manifest = json.loads(text.decode())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{path}: unreadable manifest: {err}") from err
    problem = _manifest_problem(manifest)
    if problem:
        raise UserError(f"{path}: {problem}")
    return Dataset(str(data_dir), fetch, manifest, hashlib.sha256(text).hexdigest())


def read_manifest(data_dir: str | os.PathLike, fetch=None) -> dict:
    """The checked manifest of the dataset at `data_dir` (`open_dataset`)."""
    return open_dataset(data_dir, fetch).manifest


PREPARE_CONFIG = "config.yaml"  # the prepare's resolved configuration, beside the manifest


def is_dataset(directory: str | os.PathLike) -> bool:
    """Whether a local `directory` is a dataset prepare wrote and nothing else: what prepare may
    replace with `overwrite=true`."""
    return not foreign_to_dataset(directory)


def foreign_to_dataset(directory: str | os.PathLike) -> list[str]:
    """What in a local `directory` prepare did not write, as paths relative to it (a foreign
    folder once, not each file in it): everything, without a readable manifest; otherwise what
    the manifest does not account for (its shards, its tokenizers, the prepare's config.yaml)."""
    directory = Path(directory)
    everything = sorted(path.name for path in directory.iterdir())
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        if _manifest_problem(manifest):
            return everything
        files = {MANIFEST, PREPARE_CONFIG, *tokenizer_files(manifest)}
        if has_target_tokenizer(manifest):
            files.update(tokenizer_files(manifest, "target"))
        for entry in manifest["datasets"].values():
            for split in entry["splits"].values():
                files.update(shard["path"] for shard in split["shards"])
        # the curation stages' samples of what they dropped
        files.update(manifest.get("curation", {}).get("sample_files", []))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return everything
    folders = {str(parent) for name in files for parent in PurePosixPath(name).parents}
    foreign: list[str] = []
    for path in sorted(directory.rglob("*")):
        name = path.relative_to(directory).as_posix()
        if any(name.startswith(outer + "/") for outer in foreign):
            continue
        if name not in (files | folders if path.is_dir() else files):
            foreign.append(name)
    return foreign


def _manifest_problem(manifest) -> str | None:
    if not isinstance(manifest, dict):
        return f"not a dataset manifest: a JSON {_json_kind(manifest)}, expected an object"
    if manifest.get("format_version") != FORMAT_VERSION:
        return f"format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}"
    tokenizer = manifest.get("tokenizer")
    if not isinstance(tokenizer, dict):
        return (
            "no tokenizer record (an object with the tokenizer's sha256 and vocab_size)"
            if tokenizer is None
            else f"the tokenizer record is a JSON {_json_kind(tokenizer)}, expected an object"
        )
    if "target_tokenizer" in manifest:
        target = manifest["target_tokenizer"]
        if not isinstance(target, dict):
            return f"the target_tokenizer record is a JSON {_json_kind(target)}, expected an object"
        if problem := _tokenizer_problem(target, "target tokenizer"):
            return problem
    if problem := _tokenizer_problem(tokenizer, "tokenizer"):
        return problem
    if "datasets" not in manifest:
        return "no datasets record"
    if not isinstance(manifest["datasets"], dict):
        return f"datasets is a JSON {_json_kind(manifest['datasets'])}, expected an object"
    return None


def _tokenizer_problem(tokenizer: dict, what: str) -> str | None:
    for key in ("sha256", "vocab_size"):
        if key not in tokenizer:
            return f"the {what} record has no {key}"
    if tokenizer.get("kind", KINDS[0]) not in KINDS:
        return f"the {what}'s kind {tokenizer['kind']!r} is not one of {', '.join(KINDS)}"
    sha256 = tokenizer["sha256"]
    if not (
        isinstance(sha256, str)
        and len(sha256) == 64
        and all(c in "0123456789abcdef" for c in sha256)
    ):
        return f"the {what}'s sha256 {sha256!r} is not 64 hex digits"
    vocab_size = tokenizer["vocab_size"]
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        return f"the {what}'s vocab_size {vocab_size!r} is not a positive integer"
    return None


def _json_kind(value) -> str:
    return {dict: "object", list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number"
    )


class ManifestError(UserError):
    """A shard list that cannot be read as written (`shard_list_problems`): a damaged dataset, which
    stops every reader, unlike a setting that does not fit the data (a valid split smaller than a
    batch only costs the evaluation)."""


def shard_entries(manifest: dict, task: str, split: str, where: str = MANIFEST) -> list[dict]:
    """The manifest's shard records for a task and split, each shard once with a positive sample
    count: else a `ManifestError` naming the first offending shard, in one line (`where`: the
    manifest, as the message names it)."""
    if task not in DATASET_FOR_TASK:
        raise UserError(f"unknown task {task!r}; expected one of {sorted(DATASET_FOR_TASK)}")
    name = DATASET_FOR_TASK[task]
    dataset = manifest.get("datasets", {}).get(name)
    if dataset is None:
        raise UserError(
            f"the dataset has no {name!r} shards (needed by {task}); prepare it "
            f"with tasks including {task}"
        )
    if split not in dataset["splits"]:
        raise UserError(f"the {name!r} shards have no split {split!r}")
    shards = dataset["splits"][split]["shards"]
    problems = shard_list_problems(shards, f"{name}/{split}")
    if problems:
        more = (
            f" (and {len(problems) - 1} more; pipeline.validate lists them)"
            if len(problems) > 1
            else ""
        )
        raise ManifestError(f"{where}: {problems[0]}{more}")
    return shards


def shard_list_problems(shards: list, where: str) -> list[str]:
    """What is wrong with a split's list of shard records (`where`: "packed/train"), one line per
    shard: listed more than once (the loader would read it as often each epoch), or a sample
    count that is not a positive integer (prepare writes no empty shard, and the loader plans
    every epoch from the counts, so it cannot read around a wrong one)."""
    paths = [entry.get("path") if isinstance(entry, dict) else None for entry in shards]
    listed = Counter(posixpath.normpath(path) for path in paths if isinstance(path, str))
    problems, seen = [], set()
    for index, (entry, path) in enumerate(zip(shards, paths)):
        if not isinstance(path, str):
            problems.append(f"{where}: shard record {index} has no path")
            continue
        key = posixpath.normpath(path)
        if key in seen:
            continue
        seen.add(key)
        if listed[key] > 1:
            problems.append(
                f"{path}: listed {listed[key]} times in {where} (read {listed[key]} times an epoch)"
            )
        samples = entry.get("samples")
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            problems.append(f"{path}: samples {samples!r} in the manifest, not a positive integer")
    return problems
