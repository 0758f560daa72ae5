"""Writing a WebDataset shard byte-reproducibly (`write_shard`, `ShardWriter`): one tar of .npy
members per sample, the bytes webdataset.TarWriter writes with a fixed mtime, owner and mode,
written directly. Read back by `pipeline.load.shards`; the dataset's format: `pipeline.format`."""

from __future__ import annotations

import hashlib
import itertools
import os
from pathlib import Path

import numpy as np

from pipeline.format import encode_array, is_token_field


def write_shard(
    path: str | os.PathLike, keys: list[str], samples: list[dict[str, np.ndarray]]
) -> dict:
    """Write one WebDataset tar shard, byte-reproducibly (fixed mtime, owner and mode).

    Returns the shard's manifest record, with `path` as given. The file appears under its
    final name only once complete.
    """
    with ShardWriter(path) as writer:
        for key, sample in zip(keys, samples, strict=True):
            writer.write(key, sample)
    return writer.record


# The tar layout `write_shard` produces, byte for byte what webdataset.TarWriter(encoder=False,
# mtime=0, user="", group="", mode=0o444) writes through tarfile (tests/pipeline/test_prepare.py
# checks
# it): one ustar header per member, its data padded to 512 bytes, two zero blocks, then zeros
# up to a multiple of 10240 bytes. Written directly because TarWriter (tarfile's header code,
# np.save per member and importing webdataset, which imports torch) cost several times
# SentencePiece's own time in prepare's encode stage.
_BLOCK, _RECORD = 512, 20 * 512
_NAME_MAX = 100


def _octal(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


# The header's fields around the name (0:100) and size (124:136); the checksum field (148:156)
# counts as spaces while the checksum is summed.
_HEADER_MIDDLE = _octal(0o444, 8) + _octal(0, 8) + _octal(0, 8)  # mode, uid, gid
_HEADER_TAIL = (
    _octal(0, 12)
    + b"        "
    + b"0"
    + bytes(100)
    + b"ustar\x0000"
    + bytes(32)
    + bytes(32)
    + bytes(8)
    + bytes(8)
    + bytes(155)
    + bytes(12)
)  # mtime ... prefix, pad to 512
_HEADER_SUM = sum(_HEADER_MIDDLE) + sum(_HEADER_TAIL)


_NPY_HEADERS: dict[tuple, bytes] = {}


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The bytes `np.save` writes before an array's data (cached: shapes repeat)."""
    key = (shape, dtype.str)
    header = _NPY_HEADERS.get(key)
    if header is None:
        header = encode_array(np.zeros(shape, dtype=dtype))[
            : -np.dtype(dtype).itemsize * int(np.prod(shape)) or None
        ]
        _NPY_HEADERS[key] = header
    return header


_ZEROS = [bytes(n) for n in range(_BLOCK + 1)]
_MEMBERS: dict[tuple, tuple] = {}


def _member(field_name: str, shape: tuple[int, ...], dtype: np.dtype) -> tuple:
    """What one field's tar member has that does not depend on the sample's key: the name's
    suffix, the header from the size to the checksum, the checksum without the key's bytes,
    the npy header, the padding and the member's length (cached: a prepare's fields repeat a
    few hundred shapes; samples are written at a few microseconds each)."""
    found = _MEMBERS.get((field_name, shape, dtype))
    if found is not None:
        return found
    suffix = f".{field_name}.npy".encode()
    header = npy_header(shape, dtype)
    size = len(header) + np.dtype(dtype).itemsize * int(np.prod(shape))
    size_field = _octal(size, 12)
    between = _HEADER_MIDDLE + size_field + _HEADER_TAIL[:12]
    padding = _ZEROS[-size % _BLOCK]
    member = (
        suffix,
        between,
        _HEADER_SUM + sum(suffix) + sum(size_field),
        header,
        padding,
        _BLOCK + size + len(padding),
        is_token_field(field_name),
    )
    if len(_MEMBERS) >= 1 << 14:
        _MEMBERS.clear()
    _MEMBERS[(field_name, shape, dtype)] = member
    return member


_HEADER_END = _HEADER_TAIL[20:]


class ShardWriter:
    """Write one shard sample by sample, hashing as it goes (no second read for the sha256).

    Written to `PATH.partial` and renamed on `close`; `record` is then the manifest record.
    Fields are written in sorted order, as TarWriter does; fields ending in `_ids` count as tokens.
    """

    def __init__(self, path: str | os.PathLike, flush_bytes: int = 1 << 20):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.partial = self.path.with_name(self.path.name + ".partial")
        self._fh = open(self.partial, "wb")
        self._digest = hashlib.sha256()
        self._parts: list[bytes] = []
        self._pending = 0
        self._flush_bytes = flush_bytes
        self.bytes = self.samples = self.tokens = 0
        self.record: dict | None = None

    def write(self, key: str, sample: dict[str, np.ndarray]) -> None:
        self.write_many([key], {name: [array] for name, array in sample.items()})

    def write_many(self, keys: list[str], columns: dict[str, list[np.ndarray]]) -> None:
        """Samples given field by field (a column holds one array per key), in key order: the
        bytes of `write` per sample, with the per-member work done a column at a time."""
        names = [key.encode() for key in keys]
        sums = list(map(sum, names))
        longest = max(map(len, names), default=0)
        members = []
        for field_name in sorted(columns):
            arrays = [np.ascontiguousarray(array) for array in columns[field_name]]
            if len(arrays) != len(names):
                raise ValueError(f"{len(arrays)} {field_name!r} arrays for {len(names)} keys")
            shapes = [_member(field_name, array.shape, array.dtype) for array in arrays]
            if shapes and longest + len(shapes[0][0]) > _NAME_MAX:
                name = max(names, key=len) + shapes[0][0]
                raise ValueError(f"tar member name longer than {_NAME_MAX} bytes: {name!r}")
            members.append(
                [
                    (
                        name + suffix,
                        _ZEROS[_NAME_MAX - len(name) - len(suffix)],
                        between,
                        b"%06o\0 " % (checksum + name_sum),
                        _HEADER_END,
                        header,
                        array.tobytes(),
                        padding,
                    )
                    for name, name_sum, array, (
                        suffix,
                        between,
                        checksum,
                        header,
                        padding,
                        *_,
                    ) in zip(names, sums, arrays, shapes)
                ]
            )
            self._pending += sum(shape[5] for shape in shapes)
            if shapes and shapes[0][6]:
                self.tokens += sum(array.size for array in arrays)
        # sample by sample, each sample's fields in sorted order
        self._parts.extend(
            itertools.chain.from_iterable(itertools.chain.from_iterable(zip(*members)))
        )
        self.samples += len(names)
        if self._pending >= self._flush_bytes:
            self._flush()

    def _flush(self) -> None:
        data = b"".join(self._parts)
        self._fh.write(data)
        self._digest.update(data)
        self.bytes += len(data)
        self._parts, self._pending = [], 0

    def close(self) -> dict:
        if self.record is None:
            end = self.bytes + self._pending + 2 * _BLOCK
            self._parts.append(bytes(2 * _BLOCK + (-end % _RECORD)))
            self._flush()
            self._fh.close()
            os.replace(self.partial, self.path)
            self.record = {
                "path": str(self.path),
                "samples": self.samples,
                "tokens": int(self.tokens),
                "bytes": self.bytes,
                "sha256": self._digest.hexdigest(),
            }
        return self.record

    def abort(self) -> None:
        self._fh.close()
        self.partial.unlink(missing_ok=True)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()
