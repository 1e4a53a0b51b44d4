"""One writer per directory: an exclusive `flock` on `DIR/.lock` (or a named lock file).

`memfit run` holds its run directory's lock for the whole run, `memfit store delete|compact` for
their edit, and a sweep asks whether a point's directory is held before it counts a refused start
as an error. The kernel drops a flock when its process ends, however it ends, so a killed process
never leaves a stale lock; the file records the holder's pid for the message.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"


class DirectoryBusyError(RuntimeError):
    """Another process holds the lock (the message names the directory and the holder's pid)."""


def lock_path(directory: str | Path) -> Path:
    return Path(directory) / LOCK_FILE


@contextmanager
def exclusive(lock: str | Path, hint: str) -> Iterator[None]:
    """Hold `lock` for the block, or raise DirectoryBusyError at once; `hint` ends the message (what
    the refused caller can do)."""
    lock = Path(lock)
    handle = open(lock, "a+", encoding="utf-8")  # noqa: SIM115  (held for the whole block)
    try:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "unknown"
            raise DirectoryBusyError(f"{lock.parent} is in use by another memfit process (pid {holder}); "
                                     f"{hint}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        yield
    finally:
        handle.close()


def held(lock: str | Path) -> bool:
    """Whether another process holds `lock` right now (a missing file is not held)."""
    lock = Path(lock)
    if not lock.exists():
        return False
    with open(lock, "a+", encoding="utf-8") as handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False
