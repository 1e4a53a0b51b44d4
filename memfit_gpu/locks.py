"""One writer per directory: an exclusive `flock` on `DIR/.lock` (or a named lock file).

`memfit run` holds its run directory's lock for the whole run, `memfit store delete|compact` for
their edit, and a sweep asks whether a point's directory is held before it counts a refused start
as an error. The kernel drops a flock when its process ends, however it ends, so a killed process
never leaves a stale lock; the file records the holder's pid for the message.

A refused start fails at once unless the caller waits: `MEMFIT_LOCK_WAIT_S` (seconds, default 0) lets
`memfit run` wait for a predecessor that is still being killed. The SLURM launcher sets it for its
tasks, because a requeued task can start on the node before SLURM has finished killing the task it
replaces.
"""

from __future__ import annotations

import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LOCK_FILE = ".lock"
LOCK_WAIT_ENV = "MEMFIT_LOCK_WAIT_S"
_POLL_S = 0.2


class DirectoryBusyError(RuntimeError):
    """Another process holds the lock (the message names the directory and the holder's pid)."""


def lock_path(directory: str | Path) -> Path:
    return Path(directory) / LOCK_FILE


def lock_wait_s() -> float:
    """Seconds to wait for a held lock, from MEMFIT_LOCK_WAIT_S (0: refuse at once)."""
    raw = os.environ.get(LOCK_WAIT_ENV, "0")
    try:
        seconds = float(raw)
    except ValueError:
        raise ValueError(f"{LOCK_WAIT_ENV}={raw!r} is not a number of seconds") from None
    if not seconds >= 0:
        raise ValueError(f"{LOCK_WAIT_ENV}={raw!r} must be >= 0 seconds")
    return seconds


@contextmanager
def exclusive(lock: str | Path, hint: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold `lock` for the block; if another process holds it, retry for up to `wait_s` seconds, then
    raise DirectoryBusyError; `hint` ends the message (what the refused caller can do)."""
    lock = Path(lock)
    handle = open(lock, "a+", encoding="utf-8")  # noqa: SIM115  (held for the whole block)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() < deadline:
                    time.sleep(_POLL_S)
                    continue
                handle.seek(0)
                holder = handle.read().strip() or "unknown"
                waited = f" after waiting {wait_s:g} s" if wait_s > 0 else ""
                raise DirectoryBusyError(f"{lock.parent} is in use by another memfit process (pid {holder}){waited}; "
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
