"""sha256 of files, each read once per process: memoised by (path, size, mtime, ctime, inode), so an edited
file is read again.

The response cache keys a local image by it (readers/cache.py); provenance records benchmark files, weight
files and prompt files by it (provenance.py, inputs.py). A run hashes its weights when it starts and again
for the record it compares on resume: the memo makes the second time free. A large file's digest (weights:
hundreds of MB to tens of GB, read again by every `memfit` process) is also kept in memfit's cache
(`$MEMFIT_CACHE/digests`), under the same key: a file written again gets a new ctime (which no program can
set back), so it is read again.
"""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from memfit_gpu.models import cache_root

_BLOCK = 1 << 20


# Files from this size on have their digest kept across processes (smaller ones take milliseconds to read).
PERSIST_MIN_BYTES = 16 << 20
_HEX = frozenset("0123456789abcdef")


def _persisted(key: tuple[str, int, int, int, int, int]) -> Path:
    return cache_root() / "digests" / hashlib.sha256(repr(key).encode()).hexdigest()


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int, ctime_ns: int = 0, inode: int = 0, device: int = 0) -> str:
    # size, mtime, ctime and inode are part of this memo's key, so a file written again is hashed again.
    kept = _persisted((path, size, mtime_ns, ctime_ns, inode, device)) if size >= PERSIST_MIN_BYTES else None
    if kept is not None:
        try:
            known = kept.read_text(encoding="ascii").strip()
            if len(known) == 64 and set(known) <= _HEX:
                return known
        except (OSError, UnicodeDecodeError):
            pass
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(_BLOCK), b""):
            digest.update(block)
    hexdigest = digest.hexdigest()
    if kept is not None:
        try:  # best effort: a read-only cache only costs the next process this read
            kept.parent.mkdir(parents=True, exist_ok=True)
            staged = kept.with_name(f"{kept.name}.{os.getpid()}.tmp")
            staged.write_text(hexdigest + "\n", encoding="ascii")
            os.replace(staged, kept)
        except OSError:
            pass
    return hexdigest


def file_sha256(path: str | os.PathLike[str]) -> str:
    """The sha256 (hex) of the file's bytes (a symlink: of the file it points to)."""
    resolved = Path(path).resolve()
    stat = resolved.stat()
    return _file_digest(str(resolved), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)


def text_sha256(text: str) -> str:
    """The sha256 (hex) of `text` encoded as UTF-8."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def bytes_sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
