"""Durable file writes: the one atomic writer and the one JSONL reader/appender of the package.

A killed process may stop between any two writes. `atomic_write_text` writes beside the target,
fsyncs and renames, so a reader sees the old file or the new one, never half of either. JSONL files
(predictions, packs) are appended a batch at a time and fsynced; `read_jsonl` drops a torn last line
(what a kill mid-append leaves) by cutting it off the file, and refuses a bad line in the middle,
which is corruption, naming the file and line.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit_gpu.data.schema import DataError

log = logging.getLogger(__name__)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Replace `path` with `text` in one step (tmp file beside it, fsync, rename)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | Path, data: Any, indent: int | None = 2) -> None:
    """`data` as JSON (non-JSON values through `str`), replaced in one step."""
    atomic_write_text(path, json.dumps(data, indent=indent, default=str) + "\n")


def read_jsonl(path: str | Path, repair: bool = True) -> list[dict[str, Any]]:
    """Rows of a JSONL file ([] when missing); a torn last line is dropped, and cut off the file when
    `repair` (the file's writer resuming; a reader of another process's file, which may be mid-append,
    passes repair=False and leaves the file alone).

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
    if good_end < len(data) and repair:
        log.warning("%s: dropping a torn last line (%d bytes) left by a killed run", path, len(data) - good_end)
        with open(path, "r+b") as handle:
            handle.truncate(good_end)
    return rows


def append_jsonl(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    """Append rows, one JSON object per line, in one write, fsynced before returning."""
    payload = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(payload)
        handle.flush()
        os.fsync(handle.fileno())
