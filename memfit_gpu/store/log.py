"""Append-only record log: one JSON object per line, framed by its length and CRC32.

A line is `{length:08x} {crc32:08x} {json}\n`, where length and crc32 are those of the UTF-8 JSON
bytes. The frame lets an open tell a complete record from one torn by a killed process (short
line, bad checksum, missing newline) without trusting anything after it: the first bad record
and everything after it are dropped, logged at WARNING with the byte and line counts, and the file
is truncated back to the last good record so that later appends start on a clean boundary.

Appends never rewrite bytes already written: the file only grows (or, on open after a crash, is
cut back to its last good record).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memfit_gpu import faults

log = logging.getLogger(__name__)

_HEADER = 18  # "llllllll cccccccc "


def encode_record(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


def _parse(data: bytes) -> tuple[list[dict[str, Any]], list[int], int, str | None]:
    """Records, the end offset of each, the offset of the last good byte, and why parsing stopped early."""
    records: list[dict[str, Any]] = []
    ends: list[int] = []
    offset = 0
    total = len(data)
    while offset < total:
        header = data[offset : offset + _HEADER]
        if len(header) < _HEADER:
            return records, ends, offset, "short header"
        try:
            if header[8:9] != b" " or header[17:18] != b" ":
                raise ValueError("bad separators")
            length = int(header[0:8], 16)
            crc = int(header[9:17], 16)
        except ValueError:
            return records, ends, offset, "malformed header"
        start = offset + _HEADER
        end = start + length
        if end + 1 > total:
            return records, ends, offset, "record cut short"
        payload = data[start:end]
        if data[end : end + 1] != b"\n":
            return records, ends, offset, "missing newline"
        if zlib.crc32(payload) != crc:
            return records, ends, offset, "checksum mismatch"
        try:
            record = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            return records, ends, offset, "checksum matches but JSON does not parse"
        if not isinstance(record, dict):
            return records, ends, offset, "record is not a JSON object"
        records.append(record)
        offset = end + 1
        ends.append(offset)
    return records, ends, offset, None


class RecordLog:
    """One append-only file of records. `records` holds every valid record, in order."""

    def __init__(self, path: str | Path, fsync: bool = False):
        self.path = Path(path)
        self.fsync = fsync
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = []
        self.ends: list[int] = []  # byte offset just past each record
        self.dropped_bytes = 0
        self.dropped_lines = 0
        if self.path.exists():
            self._recover()
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open for the store's lifetime)

    def _recover(self) -> None:
        data = self.path.read_bytes()
        records, ends, good, reason = _parse(data)
        self.records, self.ends = records, ends
        if reason is None:
            return
        tail = data[good:]
        self.dropped_bytes = len(tail)
        # Lines in the dropped tail: a torn record is one line with no newline; appended garbage may be more.
        self.dropped_lines = tail.count(b"\n") + (0 if tail.endswith(b"\n") else 1)
        log.warning(
            "%s: %s at byte %d after %d good records: dropping the last %d bytes (%d partial or corrupt "
            "record line%s) and truncating the file back to the last good record",
            self.path, reason, good, len(records), self.dropped_bytes, self.dropped_lines,
            "" if self.dropped_lines == 1 else "s",
        )
        with open(self.path, "r+b") as handle:
            handle.truncate(good)
            handle.flush()
            os.fsync(handle.fileno())

    def __len__(self) -> int:
        return len(self.records)

    @property
    def size_bytes(self) -> int:
        return self.ends[-1] if self.ends else 0

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Append records in one write; returns how many records the log holds now."""
        batch = list(records)
        if not batch:
            return len(self.records)
        blobs = [encode_record(r) for r in batch]
        position = self.size_bytes
        for blob in blobs:
            position += len(blob)
            self.ends.append(position)
        self._file.write(b"".join(blobs))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        faults.point("store.log")
        self.records.extend(batch)
        return len(self.records)

    def fingerprint(self, count: int) -> dict[str, int]:
        """What a snapshot covering the first `count` records stores to prove it belongs to this log."""
        if count == 0:
            return {"records": 0, "bytes": 0, "last_crc": 0}
        last = zlib.crc32(json.dumps(self.records[count - 1], ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
        return {"records": count, "bytes": self.ends[count - 1], "last_crc": last}

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
