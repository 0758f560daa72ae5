"""The sha256 of a file, read in chunks: what manifests, checkpoints and exports record."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()
