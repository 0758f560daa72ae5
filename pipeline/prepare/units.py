"""A unit of a prepare's input and reading it: the work unit (a file, a byte range, a run of
parquet row groups, a chunk of a compressed stream), its lines, (de)compressed files read to
their end, and the text helpers every reader and the de-duplication share.

The design and its reasons: docs/design.md#pipelinepreparesourcespy.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import re
import unicodedata
from dataclasses import dataclass, field
from typing import IO, Iterator, Optional

from common.configure import UserError
from pipeline.prepare.config import SourceConfig

Record = tuple[str, Optional[str]]

_WHITESPACE = re.compile(r"\s+")


# ---------------------------------------------------------------- text helpers


def decode_counting(data: bytes, encoding: str = "utf-8") -> tuple[str, int]:
    """Decode `data`, replacing each undecodable sequence with U+FFFD; also return how many
    bytes were replaced."""
    try:
        return data.decode(encoding), 0
    except UnicodeDecodeError:
        pass
    parts, bad, pos = [], 0, 0
    while pos < len(data):
        try:
            parts.append(data[pos:].decode(encoding))
            break
        except UnicodeDecodeError as err:
            parts.append(data[pos : pos + err.start].decode(encoding))
            parts.append("\ufffd")
            bad += err.end - err.start
            pos += err.end
    return "".join(parts), bad


def clean_text(text: str) -> str:
    """NFC, whitespace runs (newlines included) collapsed to one space, stripped."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def normalize_key(text: str) -> str:
    """The form under which two texts count as the same (dedup) and share a split."""
    return _WHITESPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


def text_hash(text: str, salt: str) -> int:
    """A stable 64-bit hash of a normalized text (independent of PYTHONHASHSEED)."""
    digest = hashlib.blake2b(
        normalize_key(text).encode("utf-8"), digest_size=8, person=salt.encode()[:16]
    )
    return int.from_bytes(digest.digest(), "little")


# ---------------------------------------------------------------- work units


@dataclass(frozen=True)
class Unit:
    """One Ray task's share of the input: a whole file, a byte range of a large text file, a
    run of row groups [start, end) of a parquet file, or a chunk of a streamed compressed file:
    its lines in `data`, [start, end) their offsets in the decompressed stream."""

    path: str
    start: int = 0
    end: int = -1  # -1: to the end of the file
    source: int = 0  # index in `source_list(cfg)`
    # A compressed file larger than a unit: the driver cuts it into chunks (`stream_chunks`);
    # read as it is (`read_unit`), it is the whole file.
    stream: bool = False
    data: Optional[bytes] = field(default=None, repr=False, compare=False)


def stream_chunks(unit: Unit, chunk_bytes: int) -> Iterator[Unit]:
    """A `stream` unit's decompressed lines, in order, in chunks of at most `chunk_bytes`, each
    ending at a newline (a chunk holding a longer line holds that line and what follows it up to
    `chunk_bytes` more): units of their own, read from `data`. The cuts depend on the bytes
    alone, never on the number of workers; and since a reader's records are per line, the
    chunks yield the records of the whole file."""
    with reading_file(unit.path), open_binary(unit.path) as fh:
        offset, carry = 0, b""
        while block := _read_full(
            fh, chunk_bytes - len(carry) if len(carry) < chunk_bytes else chunk_bytes
        ):
            data = carry + block
            cut = data.rfind(b"\n") + 1
            if cut == 0:  # no newline yet: one long line, read on
                carry = data
                continue
            yield Unit(unit.path, offset, offset + cut, unit.source, data=data[:cut])
            offset, carry = offset + cut, data[cut:]
        if carry:
            yield Unit(unit.path, offset, offset + len(carry), unit.source, data=carry)


def parquet_columns(cfg: SourceConfig) -> list[str]:
    return [cfg.text_field] + ([cfg.target_field] if cfg.target_field else [])


def open_binary(path: str) -> IO[bytes]:
    if path.endswith(".gz"):
        return gzip.open(path, "rb")
    if path.endswith(".zst"):
        # Buffered, for readline and line iteration, which the raw reader lacks.
        return io.BufferedReader(_ZstdFrames(path))
    return open(path, "rb")


class _ZstdFrames(io.RawIOBase):
    """A .zst file's decompressed bytes, frame after frame to the end of the file. A file that
    ends inside a frame (a cut download or copy) raises EOFError, as gzip does for a cut member:
    zstandard's stream reader returns what it could decode of a cut frame and ends without a
    word, so a truncated file read as a shorter one."""

    def __init__(self, path: str):
        import zstandard

        self._zstd = zstandard
        self._file = open(path, "rb")
        self._frame = None  # the decompressor of the frame being read; None between frames
        self._out, self._pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos == len(self._out):
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out) - self._pos)
        buffer[:n] = self._out[self._pos : self._pos + n]
        self._pos += n
        return n

    def _decompress_more(self) -> bool:
        """Decompress the next block of the file; False at its end."""
        data = self._file.read(self._zstd.DECOMPRESSION_RECOMMENDED_INPUT_SIZE)
        if not data:
            if self._frame is not None:
                raise EOFError(
                    "Compressed file ended before the end of its last zstd frame (a truncated file)"
                )
            return False
        out = []
        while data:
            if self._frame is None:
                self._frame = self._zstd.ZstdDecompressor().decompressobj()
            out.append(self._frame.decompress(data))
            data = b""
            if self._frame.eof:  # what follows the frame starts the next one
                data, self._frame = self._frame.unused_data, None
        self._out, self._pos = b"".join(out), 0
        return True

    def close(self) -> None:
        self._file.close()
        super().close()


def _read_full(fh: IO[bytes], size: int) -> bytes:
    """`size` bytes, fewer only at the end: a short read must not move a chunk's cut."""
    parts, left = [], size
    while left > 0 and (part := fh.read(left)):
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def unit_lines(unit: Unit) -> Iterator[bytes]:
    """Raw lines of a unit. A range owns the lines that start inside it; a chunk's are in `data`."""
    if unit.data is not None:
        yield from io.BytesIO(unit.data)
        return
    with open_binary(unit.path) as fh:
        if unit.start > 0:
            fh.seek(unit.start - 1)
            # Whatever line the previous byte belongs to is the previous unit's.
            fh.readline()
        pos = fh.tell() if unit.start > 0 else 0  # a .zst stream cannot tell(); it is read whole
        for line in fh:
            if unit.end >= 0 and pos >= unit.end:
                break
            pos += len(line)
            yield line


@contextlib.contextmanager
def reading_file(path: str) -> Iterator[None]:
    """A file that cannot be read or decompressed ends the run in one line naming it."""
    try:
        yield
    except (OSError, EOFError, gzip.BadGzipFile, *_decompress_errors(path)) as err:
        raise UserError(
            f"cannot read {path}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"
        ) from err


def _decompress_errors(path: str) -> tuple[type[BaseException], ...]:
    """What a corrupt .zst stream or parquet file raises (the libraries are
    imported only when used)."""
    if path.endswith(".zst"):
        import zstandard

        return (zstandard.ZstdError,)
    if path.endswith(".parquet"):
        import pyarrow as pa

        return (pa.ArrowException,)
    return ()
