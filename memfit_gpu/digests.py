"""sha256 of files, each read once per process: memoised by (path, size, mtime), so an edited file is read again.

The response cache keys a local image by it (readers/cache.py); provenance records benchmark files, weight
files and prompt files by it (provenance.py, inputs.py). A run hashes its weights when it starts and again
for the record it compares on resume: the memo makes the second time free.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

_BLOCK = 1 << 20


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    # size and mtime are part of this memo's key, so a file written again is hashed again.
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of the file's bytes (a symlink: of the file it points to)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _file_digest(str(resolved), stat.st_size, stat.st_mtime_ns)


def text_sha256(text: str) -> str:
    """The sha256 (hex) of `text` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
