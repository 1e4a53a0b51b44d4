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
file, the record and the byte offset, and the file is left exactly as it was. A log opened `read_only`
(a report that must change nothing) reads the same records and leaves a torn tail in place.

Appends never rewrite bytes already written: the file only grows (or is cut back as above, or by
`drop_records` for a batch its owner never committed, or to its last whole record after an append the
file system refused, so that a full disk stops writes only until space is freed).

Records are not kept in memory: the log holds each record's end offset and running CRC32 (two int64
arrays), and `iter_records` streams records back from the file block by block (LongMemEval-M's log,
~2.75M records and ~2 GB, is never read whole).
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Iterable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from memfit_gpu import faults
from memfit_gpu.buffers import GrowableArray
from memfit_gpu.data.schema import DataError
from memfit_gpu.files import storage_errors

log = logging.getLogger(__name__)

_HEADER = 18  # "llllllll cccccccc "


class StoreCorruptError(DataError):
    """A store file damaged in a way a crash cannot explain: the run stops (CLI exit 2), nothing is rewritten."""


def encode_record(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return b"%08x %08x " % (len(payload), zlib.crc32(payload)) + payload + b"\n"


_READ_BYTES = 1 << 24  # the log is read in blocks of this many bytes (never whole)


class _Stop(Exception):
    """Parsing stopped before the end of the file: at `offset`, for `reason`."""

    def __init__(self, offset: int, reason: str):
        super().__init__(reason)
        self.offset, self.reason = offset, reason


def _frames(handle: BinaryIO, offset: int = 0) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
    """(end offset, the record's bytes, the record) of every valid record from `offset` (a record
    boundary) on, read block by block; raises _Stop at the first bad one."""
    handle.seek(offset)
    buffer, at = b"", 0  # bytes read ahead, and where the next record starts in them

    def fill(need: int) -> bool:
        nonlocal buffer, at
        while len(buffer) - at < need:
            more = handle.read(max(_READ_BYTES, need))
            if not more:
                return False
            buffer, at = buffer[at:] + more, 0
        return True

    while fill(1):
        if not fill(_HEADER):
            raise _Stop(offset, "short header")
        header = buffer[at : at + _HEADER]
        try:
            if header[8:9] != b" " or header[17:18] != b" ":
                raise ValueError("bad separators")
            length = int(header[0:8], 16)
            crc = int(header[9:17], 16)
        except ValueError:
            raise _Stop(offset, "malformed header") from None
        if not fill(_HEADER + length + 1):
            raise _Stop(offset, "record cut short")
        payload = buffer[at + _HEADER : at + _HEADER + length]
        if buffer[at + _HEADER + length : at + _HEADER + length + 1] != b"\n":
            raise _Stop(offset, "missing newline")
        if zlib.crc32(payload) != crc:
            raise _Stop(offset, "checksum mismatch")
        try:
            record = json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise _Stop(offset, "checksum matches but JSON does not parse") from None
        if not isinstance(record, dict):
            raise _Stop(offset, "record is not a JSON object")
        size = _HEADER + length + 1
        frame = buffer[at : at + size]
        at += size
        offset += size
        yield offset, frame, record


class RecordLog:
    """One append-only file of records, never held in memory: `len(log)` records, `ends` (byte offset
    past each), `iter_records` streams them from the file (`records` reads them all, for small logs)."""

    def __init__(self, path: str | Path, fsync: bool = False, read_only: bool = False):
        """read_only: read an existing log without changing a byte of it (`memfit store repair --dry-run`):
        a torn tail is left in place and only counted (`dropped_bytes`, what opening it to write would cut
        off), and append and drop_records are refused."""
        self.path = Path(path)
        self.fsync = fsync
        self.read_only = read_only
        if read_only and not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no record log there")
        if not read_only:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._ends = GrowableArray(np.int64)  # byte offset just past each record
        self._chain = GrowableArray(np.int64)  # CRC32 of the file's bytes up to the end of each record
        self.dropped_bytes = 0
        if self.path.exists():
            self._recover()
        self._file = open(self.path, "rb" if read_only else "ab")  # noqa: SIM115  (held open for the store's lifetime)
        if read_only:  # it holds no handle then: iter_records opens the file for each read
            self._file.close()

    @property
    def ends(self) -> np.ndarray:
        """Byte offset just past each record (read-only view)."""
        return self._ends.view

    @property
    def records(self) -> list[dict[str, Any]]:
        """Every record, read from the file (a list: for small logs and tests; stream with iter_records)."""
        return list(self.iter_records())

    def iter_records(self, start: int = 0, stop: int | None = None) -> Iterator[dict[str, Any]]:
        """Records start..stop-1 (default: to the last), streamed from the file."""
        stop = len(self) if stop is None else min(stop, len(self))
        if start >= stop:
            return
        if not self._file.closed:
            self._file.flush()
        with open(self.path, "rb") as handle:
            offset = int(self._ends.view[start - 1]) if start else 0
            number = start
            for _, _, record in _frames(handle, offset):
                yield record
                number += 1
                if number >= stop:
                    return

    def _recover(self) -> None:
        size = self.path.stat().st_size
        good, reason, chain = 0, None, 0
        with open(self.path, "rb") as handle:
            ends: list[int] = []
            chains: list[int] = []
            try:
                for end, frame, _ in _frames(handle):
                    chain = zlib.crc32(frame, chain)
                    ends.append(end)
                    chains.append(chain)
                    good = end
                    if len(ends) >= 1 << 16:
                        self._ends.extend(ends)
                        self._chain.extend(chains)
                        ends, chains = [], []
            except _Stop as stop:
                good, reason = stop.offset, stop.reason
            self._ends.extend(ends)
            self._chain.extend(chains)
            if reason is None:
                return
            # Every whole record ends in the only newline it holds. A tail without one is what a killed writer
            # (or a size extended before its data reached the disk) leaves: part of one record, nothing valid
            # after. A byte present where the frame puts the newline, but not a newline, was changed, not
            # left unwritten.
            handle.seek(good)
            newline = False
            while block := handle.read(_READ_BYTES):
                if b"\n" in block:
                    newline = True
                    break
        tail = size - good
        if newline or reason == "missing newline":
            raise StoreCorruptError(
                str(self.path), f"record {len(self) + 1} (line {len(self) + 1}, byte {good})", None,
                f"{reason}, {tail} bytes before the end of the file: damage inside the log, not a record torn "
                f"by a killed writer; the file was left unmodified (restore it from a copy, or move the store "
                f"aside to build it again)",
            )
        self.dropped_bytes = tail
        if self.read_only:
            log.warning(
                "%s: torn last record (%s) at byte %d after %d good records, left by a killed writer: its %d bytes "
                "are left in place (read only; the next open to write drops them)",
                self.path, reason, good, len(self), self.dropped_bytes,
            )
            return
        log.warning(
            "%s: torn last record (%s) at byte %d after %d good records, left by a killed writer: dropping its "
            "%d bytes and truncating the file back to the last good record",
            self.path, reason, good, len(self), self.dropped_bytes,
        )
        self._truncate(good)

    def _truncate(self, size: int) -> None:
        with open(self.path, "r+b") as handle:
            handle.truncate(size)
            handle.flush()
            os.fsync(handle.fileno())

    def drop_records(self, count: int) -> None:
        """Cut the log back to its first `count` records (the owner's uncommitted tail)."""
        self._check_writable()
        if count >= len(self):
            return
        size = int(self._ends.view[count - 1]) if count else 0
        self.dropped_bytes += self.size_bytes - size
        self._file.close()
        self._truncate(size)
        self._ends.truncate(count)
        self._chain.truncate(count)
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open for the store's lifetime)

    def _reopen(self) -> None:
        """After a failed append: the file cut back to its last whole record and opened for appends again."""
        if not self._file.closed:
            self._file.close()
        if self.path.stat().st_size > self.size_bytes:
            self._truncate(self.size_bytes)
        self._file = open(self.path, "ab")  # noqa: SIM115  (held open for the store's lifetime)

    def _check_writable(self) -> None:
        # refused here, before append's OSError handling, which would cut the file back to its last record
        if self.read_only:
            raise RuntimeError(f"{self.path}: the record log was opened read-only")

    def __len__(self) -> int:
        return self._ends.size

    @property
    def size_bytes(self) -> int:
        return int(self._ends.view[-1]) if self._ends.size else 0

    def append(self, records: Iterable[dict[str, Any]]) -> int:
        """Append records in one write; returns how many records the log holds now."""
        self._check_writable()
        blobs = [encode_record(r) for r in records]
        if not blobs:
            return len(self)
        position = self.size_bytes
        chain = int(self._chain.view[-1]) if self._chain.size else 0
        ends, chains = [], []
        for blob in blobs:
            position += len(blob)
            chain = zlib.crc32(blob, chain)
            ends.append(position)
            chains.append(chain)
        with storage_errors(self.path):
            if self._file.closed:  # an earlier append failed: cut its torn tail off first
                self._reopen()
            try:
                faults.io_fault(self.path)
                self._file.write(b"".join(blobs))
                self._file.flush()
                if self.fsync:
                    os.fsync(self._file.fileno())
            except OSError:
                # Part of the batch may be on disk: closed without writing the buffer again, and cut back
                # to the last whole record now, or by the next append (or the next open) if that fails too,
                # so the log takes appends again once the cause (a full disk) is gone.
                with suppress(OSError):
                    self._file.close()
                with suppress(OSError):
                    self._reopen()
                raise
        faults.point("store.log")
        self._ends.extend(ends)
        self._chain.extend(chains)
        return len(self)

    def fingerprint(self, count: int) -> dict[str, int]:
        """What a snapshot covering the first `count` records stores to prove it belongs to this log: the
        count, the byte length and the CRC32 of every byte of those records (a batch dropped and another
        of the same size written in its place does not match)."""
        if count == 0:
            return {"records": 0, "bytes": 0, "prefix_crc": 0}
        return {"records": count, "bytes": int(self._ends.view[count - 1]),
                "prefix_crc": int(self._chain.view[count - 1])}

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            self._file.close()
