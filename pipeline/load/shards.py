"""Read one WebDataset tar shard of a prepared dataset, checked as a whole, fast.

`read_shard` hands the loader the raw `.npy` members of the samples it wants from one shard,
after checking the whole shard against its manifest record: a shard is good or bad as a whole,
so every worker and every rank reaches the same verdict and the batch stream stays the same.
`decode_sample` turns a sample's members into arrays: token ids checked against the
vocabulary, a packed block's `doc_starts` checked to be positions of document starts in it.
`stored_fields` says which members a dataset's samples hold (the manifest's `fields`).

Speed without changing a verdict: a shard is taken apart by a scan of its 512-byte tar headers
(checksums and number fields checked), not through tarfile. The reference stays webdataset's
reader over tarfile (`read_shard_with_webdataset`): every shard the scan does not vouch for
(another member type, a damaged header, data cut short, no end-of-archive block...) goes to
it, so a shard is read, or refused for the same reason, either way. Arrays are `np.load`ed
without pickle.

A shard whose path is a URL is read from its copy in the shared shard cache (`pipeline.remote`),
fetched first if need be; one that cannot be fetched, after the retries, is a `ShardError` like
any other unreadable shard.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from typing import Mapping

import numpy as np

from common.configure import UserError
from pipeline import remote
from pipeline.format import DATASET_FOR_TASK, FIELDS, POSITION_FIELDS, decode_array


@dataclass(frozen=True)
class Shard:
    index: int  # position in the manifest's list: the stable name its in-shard order is seeded by
    path: str  # a local path or a URL
    samples: int
    bytes: int | None
    # the manifest's; names (and checks) a remote shard's copy in the cache
    sha256: str | None = None
    fetch: remote.FetchConfig | None = None  # how a remote shard is fetched (None: the defaults)


class ShardError(Exception):
    """A shard that cannot be used as a whole; the message says why."""


def read_shard(
    shard: Shard, fields: tuple[str, ...], wanted: set[int]
) -> dict[int, dict[str, bytes]]:
    """The raw members of the `wanted` samples (by position in the tar), after
    checking the whole shard.

    The whole shard is read even when few samples are wanted: a shard is good or bad as a whole,
    so every worker and every rank reaches the same verdict and the batch stream stays the same.
    A well-formed shard is taken apart by `scan_tar`; anything it does not vouch for goes to
    `read_shard_with_webdataset`, the reference reader, which gives the verdict.
    """
    if remote.is_url(shard.path):
        remote.reading(shard.path)
        try:
            with remote.cached(
                shard.path,
                shard.fetch or remote.FetchConfig(),
                size=shard.bytes,
                sha256=shard.sha256,
            ) as local:
                return read_shard(replace(shard, path=local), fields, wanted)
        except remote.FetchError as err:
            raise ShardError(f"cannot fetch: {err}") from err
    try:
        size = os.path.getsize(shard.path)
    except OSError as err:
        raise ShardError(f"cannot stat: {err}") from err
    # A size check catches most truncations before the tar reader sees them.
    if shard.bytes is not None and size != shard.bytes:
        raise ShardError(f"{size} bytes, the manifest says {shard.bytes}")
    try:
        with open(shard.path, "rb") as stream:
            data = stream.read()
    except OSError:
        data = b""  # the reference reader meets the error again and reports it
    samples = scan_tar(data, fields)
    if samples is None or len(samples) != shard.samples:
        return read_shard_with_webdataset(shard, fields, wanted)
    kept: dict[int, dict[str, bytes]] = {}
    for position in sorted(wanted):
        members = {}
        for name in fields:
            start, length = samples[position][f"{name}.npy"]
            members[name] = data[start : start + length]
        kept[position] = members
    return kept


def sample_sizes(shard: Shard, fields: tuple[str, ...]) -> np.ndarray | None:
    """Each sample's size in bytes (its members together, .npy headers included), in tar order:
    a sort key for its length in tokens. None for a shard `read_shard` refuses."""
    try:
        members = read_shard(shard, fields, set(range(shard.samples)))
    except ShardError:
        return None
    if len(members) != shard.samples:
        return None
    return np.array(
        [sum(len(data) for data in members[i].values()) for i in range(shard.samples)],
        dtype=np.int64,
    )


_BLOCK = 512  # tar's unit: a header, or a share of a member's data (zero-padded to whole blocks)
# What Python's stream reader ("r|*") takes for a compressed archive when it opens the file.
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\x5d\x00\x00\x80", b"\xfd7zXZ", b"\x28\xb5\x2f\xfd")
# The header's number fields (mode, uid, gid, size, mtime, checksum, devmajor, devminor) as
# (start, end). Python's tarfile rejects the header if any of them is not octal.
_NUMBER_FIELDS = (
    (100, 108),
    (108, 116),
    (116, 124),
    (124, 136),
    (136, 148),
    (148, 156),
    (329, 337),
    (337, 345),
)
_SIZE, _CHECKSUM = 3, 5
# The octal numbers tarfile reads (its `nti`): digits between optional spaces, ended by a NUL or
# the field's end. It reads a few more forms (base-256, other whitespace), left to it.
_OCTAL = re.compile(rb" *([0-7]*) *(?:\0|\Z)")
_REGULAR_FILE = (ord("0"), 0)  # ustar's type flag of a regular file, and the pre-POSIX one


def scan_tar(data: bytes, fields: tuple[str, ...]) -> list[dict[str, tuple[int, int]]] | None:
    """Where each sample's members lie in `data`, a plain (uncompressed) tar, in file order:
    {"<field>.npy": (start, length)} per sample, found from the 512-byte headers alone.

    It answers only for a tar the reference reader (webdataset over tarfile) would read the same
    way: regular files named "<key>.<field>.npy", whole and in place, each header's checksum and
    number fields valid, each sample holding exactly `fields`, an end-of-archive block at the end.
    For anything else - other member types (directories, links, pax or GNU extension headers),
    other names, a damaged header, missing data - it answers None, without telling why: the
    caller then asks the reference reader, so a shard gets the same verdict either way.
    """
    # webdataset's split of a name into key and suffix
    from webdataset.tariterators import base_plus_ext

    if data.startswith(_COMPRESSED):
        return None
    expected = {f"{name}.npy" for name in fields}
    samples: list[dict[str, tuple[int, int]]] = []
    key = None
    headers: list[int] = []
    checksums: list[int] = []
    offset = 0
    while True:
        if offset + _BLOCK > len(data):
            return None  # cut short: no end-of-archive block
        if data.count(0, offset, offset + _BLOCK) == _BLOCK:
            break  # the end-of-archive block; tar readers read no further
        numbers = []
        for start, end in _NUMBER_FIELDS:
            match = _OCTAL.match(data, offset + start, offset + end)
            if match is None:
                return None
            numbers.append(int(match[1] or b"0", 8))
        # Another member type, or a ustar name prefix (field 345:500) that would lengthen the name.
        if data[offset + 156] not in _REGULAR_FILE or data[offset + 345] != 0:
            return None
        name_end = data.find(b"\0", offset, offset + 100)
        raw_name = data[offset : name_end if name_end >= 0 else offset + 100]
        if not raw_name.isascii():
            return None
        name = raw_name.decode("ascii")
        # "__...": what webdataset skips as metadata; ".../": a directory in the old tar format.
        if name.startswith("__") or name.endswith("/"):
            return None
        prefix, suffix = base_plus_ext(name)
        if prefix is None:
            return None
        suffix = suffix.lower()  # webdataset's group_by_keys lowercases suffixes
        if prefix != key:  # members with the same key in a row form one sample
            if samples and len(samples[-1]) != len(expected):
                return None
            samples.append({})
            key = prefix
        if suffix not in expected or suffix in samples[-1]:
            return None
        start, length = offset + _BLOCK, numbers[_SIZE]
        if start + length > len(data):
            return None
        samples[-1][suffix] = (start, length)
        headers.append(offset)
        checksums.append(numbers[_CHECKSUM])
        offset = start + -(-length // _BLOCK) * _BLOCK
    if samples and len(samples[-1]) != len(expected):
        return None
    # A header's checksum is the sum of its bytes, the checksum field counted as 8 spaces. All the
    # headers lie before `offset`, the end-of-archive block, a whole number of blocks in.
    blocks = np.frombuffer(data, np.uint8, count=offset).reshape(-1, _BLOCK)
    blocks = blocks[np.array(headers, dtype=np.int64) // _BLOCK]
    sums = (
        blocks.sum(axis=1, dtype=np.int64)
        - blocks[:, 148:156].sum(axis=1, dtype=np.int64)
        + 8 * ord(" ")
    )
    if not np.array_equal(sums, checksums):
        return None
    return samples


def read_shard_with_webdataset(
    shard: Shard, fields: tuple[str, ...], wanted: set[int]
) -> dict[int, dict[str, bytes]]:
    """`read_shard` through webdataset's tar expander and Python's tarfile: slower, but it defines
    which shards are readable and what a readable shard holds."""
    from webdataset import tariterators

    expected = {f"{name}.npy" for name in fields}
    kept: dict[int, dict[str, bytes]] = {}
    count = 0
    try:
        with open(shard.path, "rb") as stream:
            members = tariterators.tar_file_expander([{"url": shard.path, "stream": stream}])
            for position, sample in enumerate(tariterators.group_by_keys(members)):
                found = {key for key in sample if not key.startswith("__")}
                if found != expected:
                    raise ShardError(
                        f"sample {sample['__key__']!r} has {sorted(found)}, "
                        f"expected {sorted(expected)}"
                    )
                if position in wanted:
                    kept[position] = {name: sample[f"{name}.npy"] for name in fields}
                count += 1
    except ShardError:
        raise
    # tarfile, I/O and webdataset errors alike mean one thing: an unusable shard
    except Exception as err:
        # webdataset appends the stream and url to the message; the path is in the warning already.
        message = str(err.args[0]).split(" @ <")[0] if err.args else ""
        raise ShardError(f"unreadable: {type(err).__name__}: {message}") from err
    # Python's tar reader ends quietly at a damaged header after the first; the count tells.
    if count != shard.samples:
        raise ShardError(f"{count} samples, the manifest says {shard.samples}")
    return kept


def stored_fields(manifest: dict, task: str) -> tuple[str, ...]:
    """The members each sample of the task's shards holds, as the manifest lists them (its
    dataset's `fields`); a manifest that lists none predates the list, when samples
    held token ids only."""
    name = DATASET_FOR_TASK[task]
    fields = manifest.get("datasets", {}).get(name, {}).get("fields")
    if fields is None:
        return tuple(field for field in FIELDS[name] if field not in POSITION_FIELDS)
    if not (
        isinstance(fields, list) and fields and all(isinstance(field, str) for field in fields)
    ):
        raise UserError(
            f"the manifest's {name!r} dataset lists its fields as "
            f"{fields!r}, expected a list of names"
        )
    return tuple(fields)


def sample_fields(
    manifest: dict, task: str, document_mask: bool, where: str
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the members a sample holds, those the loader decodes): every stored member is read, so
    that a shard's verdict does not depend on the flag; `doc_starts` is decoded only for the
    document mask, which a dataset prepared without document boundaries cannot serve."""
    stored = stored_fields(manifest, task)
    if not document_mask:
        return stored, tuple(field for field in stored if field not in POSITION_FIELDS)
    if DATASET_FOR_TASK[task] != "packed":
        raise UserError(
            f"data.document_mask applies to packed blocks (causal_lm, mlm), not to {task}"
        )
    if "doc_starts" not in stored:
        raise UserError(
            f"data.document_mask=true, but {where} was prepared without document boundaries "
            "(its packed shards hold no doc_starts): prepare it again with this version, or "
            "set data.document_mask=false"
        )
    return stored, ("input_ids", "doc_starts")


def decode_sample(
    raw: dict[str, bytes], fields: tuple[str, ...], vocab_size: int | Mapping[str, int]
) -> list[np.ndarray]:
    """The arrays of one sample's `fields`, in the integer dtype they are stored in: token ids
    checked to be in the vocabulary (one for all, or each field's: `pipeline.format.field_vocab`),
    `doc_starts` to be document starts of its block (0 first, strictly increasing, inside the
    block; the block's field comes first in `fields`)."""
    arrays: dict[str, np.ndarray] = {}
    for name in fields:
        vocab = vocab_size if isinstance(vocab_size, int) else vocab_size.get(name, 0)
        try:
            array = decode_array(raw[name])
        except Exception as err:
            raise ValueError(f"{name}: not a npy array: {type(err).__name__}: {err}") from err
        if array.ndim != 1 or array.dtype.kind not in "iu" or array.size == 0:
            raise ValueError(
                f"{name}: {array.dtype} array of shape {array.shape}, "
                "expected non-empty 1-D integers"
            )
        if name in POSITION_FIELDS:
            length = arrays[POSITION_FIELDS[name]].size
            starts = array.astype(np.int64)
            if starts[0] != 0 or (np.diff(starts) <= 0).any() or starts[-1] >= length:
                raise ValueError(
                    f"{name}: {_preview(starts)} are not document starts in a block of {length} "
                    f"tokens (0 first, strictly increasing, below {length})"
                )
        elif array.min() < 0 or array.max() >= vocab:
            raise ValueError(
                f"{name}: token ids in [{array.min()}, {array.max()}], "
                f"outside the vocabulary of {vocab}"
            )
        arrays[name] = array
    return list(arrays.values())


def _preview(values: np.ndarray, shown: int = 8) -> str:
    head = ", ".join(str(v) for v in values[:shown].tolist())
    return f"[{head}{', ...' if len(values) > shown else ''}]"
