"""Append-only record log: one JSON object per line, framed by its length and CRC32.

A line is `{length:08x} {crc32:08x} {json}\n`, where length and crc32 are those of the UTF-8 JSON
bytes (the JSON never holds a raw newline, so the only newline of a record is its last byte).

Opening tells a torn tail from corruption. A process killed mid-append leaves part of its last record
at the end of the file (a header or a record cut short; at worst bytes never written), with no
newline in it. Only such a tail, where nothing valid follows the last good record, is dropped (logged
at WARNING) and the file is cut back to the last whole record so that later appends start on a clean
boundary. A bad record with a newline at or after it (a checksum mismatch in a complete line, a flipped
length, bytes cut out of the middle), or with another byte where its newline belongs, is damage a crash
cannot make: `StoreCorruptError`, naming the
file, the record and the byte offset, and the file is left exactly as it was.

Appends never rewrite bytes already written: the file only grows (or is cut back as above, or by
`drop_records` for a batch its owner never committed).
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
from memfit_gpu.data.schema import DataError

log = logging.getLogger(__name__)

_HEADER = 18  # "llllllll cccccccc "


class StoreCorruptError(DataError):
    """A store file damaged in a way a crash cannot explain: the run stops (CLI exit 2), nothing is rewritten."""


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
        self._chain: list[int] = []  # CRC32 of the file's bytes up to the end of each record
        self.dropped_bytes = 0
        if self.path.exists():
            self._recover()
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open for the store's lifetime)

    def _recover(self) -> None:
        data = self.path.read_bytes()
        records, ends, good, reason = _parse(data)
        self.records, self.ends = records, ends
        start = 0
        for end in ends:
            self._chain.append(zlib.crc32(data[start:end], self._chain[-1] if self._chain else 0))
            start = end
        if reason is None:
            return
        tail = data[good:]
        # Every whole record ends in the only newline it holds. A tail without one is what a killed writer
        # (or a size extended before its data reached the disk) leaves: part of one record, nothing valid after.
        # A byte present where the frame puts the newline, but not a newline, was changed, not left unwritten.
        if b"\n" in tail or reason == "missing newline":
            raise StoreCorruptError(
                str(self.path), f"record {len(records) + 1} (line {len(records) + 1}, byte {good})", None,
                f"{reason}, {len(tail)} bytes before the end of the file: damage inside the log, not a record torn "
                f"by a killed writer; the file was left unmodified (restore it from a copy, or move the store "
                f"aside to build it again)",
            )
        self.dropped_bytes = len(tail)
        log.warning(
            "%s: torn last record (%s) at byte %d after %d good records, left by a killed writer: dropping its "
            "%d bytes and truncating the file back to the last good record",
            self.path, reason, good, len(records), self.dropped_bytes,
        )
        self._truncate(good)

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as handle:
            handle.truncate(size)
            handle.flush()
            os.fsync(handle.fileno())

    def drop_records(self, count: int) -> None:
        """Cut the log back to its first `count` records (the owner's uncommitted tail); before any append."""
        if count >= len(self.records):
            return
        size = self.ends[count - 1] if count else 0
        self.dropped_bytes += self.size_bytes - size
        self._file.close()
        self._truncate(size)
        del self.records[count:], self.ends[count:], self._chain[count:]
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open for the store's lifetime)

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
            self._chain.append(zlib.crc32(blob, self._chain[-1] if self._chain else 0))
        self._file.write(b"".join(blobs))
        self._file.flush()
        if self.fsync:
            os.fsync(self._file.fileno())
        faults.point("store.log")
        self.records.extend(batch)
        return len(self.records)

    def fingerprint(self, count: int) -> dict[str, int]:
        """What a snapshot covering the first `count` records stores to prove it belongs to this log: the
        count, the byte length and the CRC32 of every byte of those records (a batch dropped and another
        of the same size written in its place does not match)."""
        if count == 0:
            return {"records": 0, "bytes": 0, "prefix_crc": 0}
        return {"records": count, "bytes": self.ends[count - 1], "prefix_crc": self._chain[count - 1]}

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
