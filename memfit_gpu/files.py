"""Durable file writes: the one atomic writer and the one JSONL reader/appender of the package.

A killed process may stop between any two writes. `atomic_write_text` writes beside the target,
fsyncs and renames, so a reader sees the old file or the new one, never half of either. JSONL files
(predictions, packs) are appended a batch at a time and fsynced; `read_jsonl` drops a torn last line
(what a kill mid-append leaves) by cutting it off the file, and refuses a bad line in the middle,
which is corruption, naming the file and line.

A write the file system refuses (full disk, quota, permission, read-only, I/O error) is a `StorageError`
naming the file and what to do (exit code 2 from the CLI, one line): everything written before it is
complete, so the same command resumes once the cause is fixed.
"""

from __future__ import annotations

import errno
import functools
import glob
import hashlib
import json
import logging
import math
import os
import secrets
import socket
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import yaml

from memfit_gpu import faults
from memfit_gpu.data.schema import DataError

log = logging.getLogger(__name__)

# What to do about each refusal of the file system; any other OSError is not the user's to fix.
STORAGE_ADVICE: dict[int, str] = {
    errno.ENOSPC: "free space on its file system",
    errno.EDQUOT: "free space under the quota (or raise it)",
    errno.EFBIG: "the file system does not take a file this large: use another one",
    errno.EACCES: "give this user write permission there (or use another directory)",
    errno.EPERM: "give this user write permission there (or use another directory)",
    errno.EROFS: "the file system is read-only: remount it writable or use another directory",
    errno.EIO: "the disk reported an I/O error: check it (dmesg) before trusting the directory",
    # a path given where the other kind of thing is
    errno.EISDIR: "it is a folder: give the path of a file",
    errno.ENOTDIR: "a part of the path is a file, not a folder: give another path",
    errno.EEXIST: "something of that name is already there: give another path or move it",
}
RESUME = "then rerun the same command: what was written before is kept"


class StorageError(OSError):
    """A file the file system would not write (or a damaged database): the message names the file and
    what to do. Exit code 2 from the CLI, one line, like a bad setting."""

    def __init__(self, path: str | Path, message: str, code: int | None = None):
        super().__init__(code, message)
        self.path = str(path)
        self.message = message

    def __str__(self) -> str:
        return self.message


def storage_error(path: str | Path, exc: OSError, doing: str = "writing") -> StorageError | None:
    """The StorageError for a refusal `exc` of `doing` `path` (None for an error that is not one)."""
    advice = STORAGE_ADVICE.get(exc.errno or -1)
    if advice is None:
        return None
    code = errno.errorcode.get(exc.errno or -1, exc.errno)
    then = "" if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.EEXIST) else f", {RESUME}"  # another path, not a rerun
    return StorageError(path, f"{path}: {doing} failed: {exc.strerror or exc} ({code}); {advice}{then}", exc.errno)


@contextmanager
def storage_errors(path: str | Path, doing: str = "writing") -> Iterator[None]:
    """Turn a refusal of the file system inside the block into a StorageError naming `path`."""
    try:
        yield
    except StorageError:
        raise
    except OSError as exc:
        error = storage_error(path, exc, doing)
        if error is None:
            raise
        raise error from None


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one step (a temporary file of its own beside it, fsync, rename):
    writers racing on one file each rename a whole file of their own; the last rename wins."""
    path = Path(path)
    tmp: Path | None = None
    with storage_errors(path):
        try:
            faults.io_fault(path)
            # a name of this writer's own, created exclusively, with the mode any new file gets (umask)
            tmp = path.with_name(f".{path.name}.{os.getpid()}-{threading.get_ident()}-{secrets.token_hex(4)}"
                                 f"-{_writer_place()}.tmp")
            with open(tmp, "x", encoding="utf-8") as handle:
                handle.write(text)
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            if tmp is not None:
                with suppress(OSError):  # a full disk keeps no half-written copy beside the file
                    tmp.unlink(missing_ok=True)
            if isinstance(exc, FileNotFoundError) and not path.parent.is_dir():  # not the temporary's name
                raise StorageError(path, f"{path}: writing failed: its folder {path.parent} does not exist; make it "
                                         "or give another path", errno.ENOENT) from None
            raise
    _remove_stale_temporaries(path)


def temporaries(path: Path) -> list[Path]:
    """The temporary files atomic_write_text makes beside `path` (any writer's)."""
    return list(path.parent.glob(f".{glob.escape(path.name)}.*-*-*.tmp"))


# A temporary file whose writer cannot be asked whether it lives (another node's, another PID namespace's, an
# older memfit's without the place in its name) is another writer's for this long: no text write takes an hour.
FOREIGN_TEMPORARY_S = 3600.0


@functools.cache
def _writer_place() -> str:
    """Where this process's PIDs mean something: its host and PID namespace, hashed to 8 hex digits. A PID
    is asked after (os.kill) only in the place that gave it: two SLURM tasks on two nodes share the sweep's
    folder, and a PID of the one is a dead or unrelated process on the other."""
    try:
        namespace = os.readlink("/proc/self/ns/pid")
    except OSError:  # no /proc (macOS): the host alone
        namespace = ""
    return hashlib.sha256(f"{socket.gethostname()}\0{namespace}".encode()).hexdigest()[:8]


def _remove_stale_temporaries(path: Path) -> None:
    """Temporary files beside `path` left by writers that were killed before their rename: removed, so no
    old copy of the file's contents outlives it. A writer of this place is gone when its process is; any
    other's temporary goes once it is FOREIGN_TEMPORARY_S old (a live writer elsewhere keeps its own)."""
    for stray in temporaries(path):
        pid, *rest = stray.name[len(path.name) + 2:-len(".tmp")].split("-")
        if len(rest) == 3 and rest[2] == _writer_place() and pid.isdigit():
            if int(pid) == os.getpid():
                continue
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                with suppress(OSError):
                    stray.unlink()
            except PermissionError:  # another user's live process
                pass
            continue
        with suppress(OSError):
            if time.time() - stray.stat().st_mtime > FOREIGN_TEMPORARY_S:
                stray.unlink()


def write_output(path: str | Path, text: str) -> None:
    """A file the user names (`--csv`, `--md`, `--json-out`): replaced in one step (atomic_write_text) where it is a
    regular file or new, through a symlink to what it names; written in place where it is something else
    (/dev/stdout, a pipe), which cannot be replaced."""
    path = Path(path)
    if path.exists() and not path.resolve().is_file():
        with storage_errors(path), open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
        return
    atomic_write_text(path.resolve(), text)


def jsonl_text(rows: Iterable[dict[str, Any]]) -> str:
    """Rows as JSON Lines, one object a line, as every JSONL file memfit writes holds them."""
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def write_jsonl_atomic(path: str | Path, rows: Iterable[dict[str, Any]]) -> None:
    """A JSONL file replaced in one step (jsonl_text, atomic_write_text)."""
    atomic_write_text(path, jsonl_text(rows))


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> None:
    """`data` as JSON (non-JSON values through `str`), replaced in one step."""
    atomic_write_text(path, json.dumps(data, indent=indent, default=str) + "\n")


def is_finite_number(value: object) -> bool:
    """A JSON number a score or a timing can be: an int or a finite float; true and false are not numbers."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def read_json_object(path: str | Path, fields: dict[str, type | tuple[type, ...]] | None = None,
                     numbers: bool = False) -> dict[str, Any]:
    """A JSON object file memfit writes whole (metrics.json, ledger.json, timings.json): DataError naming the
    file when it is not UTF-8 JSON holding an object, when one of `fields` (name -> type) is missing or of
    another type, or (`numbers`) when any value is not a number (timings.json). FileNotFoundError when it
    does not exist. A JSON true or false is no number here."""
    path = Path(path)
    data = _read_mapping(path, json.loads, "JSON", "a JSON object")
    for name, kind in (fields or {}).items():
        value = data.get(name)
        if value is None or isinstance(value, bool) and kind is not bool or not isinstance(value, kind):
            names = " or ".join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))
            raise DataError(str(path), None, name, "missing" if value is None else f"expected {names}, got "
                                                                                  f"{type(value).__name__}")
    for name, value in data.items() if numbers else ():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise DataError(str(path), None, name, f"expected a number, got {value!r:.40}")
    return data


def read_yaml_mapping(path: str | Path) -> dict[str, Any]:
    """A YAML mapping file memfit writes whole (a run's config.yaml): DataError naming the file when it is not
    UTF-8 YAML holding a mapping. FileNotFoundError when it does not exist."""
    return _read_mapping(Path(path), yaml.safe_load, "YAML", "a mapping of keys")


def _read_mapping(path: Path, parse: Any, language: str, shape: str) -> dict[str, Any]:
    """`parse` of the file's UTF-8 text, which must be a mapping: DataError naming the file otherwise."""
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise DataError(str(path), None, None, f"not UTF-8 text (byte {exc.start})") from None
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise DataError(str(path), None, None, f"not valid {language} ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise DataError(str(path), None, None, f"expected {shape}, got {type(data).__name__}")
    return data


def read_jsonl(path: str | Path, repair: bool = True, finished: bool = False) -> list[dict[str, Any]]:
    """Rows of a JSONL file ([] when missing); a torn last line is dropped, and cut off the file when
    `repair` (the file's writer resuming; a reader of another process's file, which may be mid-append,
    passes repair=False and leaves the file alone). `finished`: the file's writer is done (a finished run's
    predictions): a torn last line is damage, a DataError, never a question silently left out.

    Raises DataError naming the file and line when a complete line is not JSON."""
    path = Path(path)
    if not path.exists():
        return []
    data = path.read_bytes()
    good_end = data.rfind(b"\n") + 1
    rows: list[dict[str, Any]] = []
    for number, line in enumerate(data[:good_end].splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise DataError(str(path), f"line {number}", None, f"not valid JSON ({exc.msg})") from None
            except UnicodeDecodeError as exc:  # json.loads decodes the bytes first
                raise DataError(str(path), f"line {number}", None, f"not UTF-8 text ({exc.reason} at byte "
                                f"{exc.start})") from None
    if good_end < len(data) and finished:
        line = data.count(b"\n", 0, good_end) + 1
        raise DataError(str(path), f"line {line}", None,
                        f"cut short ({len(data) - good_end} bytes without their end of line) though its writer had "
                        "finished: the file was damaged or cut afterwards")
    if good_end < len(data) and repair:
        log.warning("%s: dropping a torn last line (%d bytes) left by a killed run", path, len(data) - good_end)
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    return rows


def append_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Append rows, one JSON object per line, in one write, fsynced before returning."""
    payload = jsonl_text(rows)
    with storage_errors(path), open(path, "a", encoding="utf-8") as handle:
        faults.io_fault(path)
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
