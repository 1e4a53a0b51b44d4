"""Response cache: every reader call keyed by what determines its output, stored in the run's SQLite file.

The key is sha256 over (backend, model, messages, images, generation parameters); an image that is a
local file enters by the sha256 of its bytes, so renaming a folder does not invalidate answers but changing
a picture does. WAL mode and one commit per group of responses: a run killed mid-way keeps every finished
call, and a rerun makes no repeat calls.

The same file holds the run's ledger entries (`calls`: every response handed out, a paid backend call or
a cache hit; readers/ledger.py), each committed in the transaction of the response it accounts for, so
the ledger a resumed run rebuilds counts every paid call exactly once. A failed request is an entry
without a cached response (asked again next time).

A damaged file (not a database, malformed pages), a full disk or a read-only one is a `StorageError`
naming the file and what to do: the cache holds nothing the run cannot make again, so deleting a
damaged one is safe. SQLite checks its pages but not what a row holds, so every response and call record
carries a sha256 of its own values (`digest`), checked whenever it is read: a row changed on disk or by
hand (or given no digest) is that same error, never a different answer or count. A file written before
rows carried a digest gets one for each row when first opened (its rows are taken as they were; PRAGMA
user_version then says every row has one).
"""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import sqlite3
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from memfit_gpu import faults
from memfit_gpu.digests import file_sha256
from memfit_gpu.files import RESUME, STORAGE_ADVICE, StorageError, storage_error
from memfit_gpu.readers.images import is_remote
from memfit_gpu.readers.ledger import ENTRY_FIELDS
from memfit_gpu.readers.types import Request, Response

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    key TEXT PRIMARY KEY,
    backend TEXT NOT NULL,
    model TEXT NOT NULL,
    role TEXT NOT NULL,
    text TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    tokens_estimated INTEGER NOT NULL,
    created REAL NOT NULL,
    notes TEXT NOT NULL DEFAULT '{}',
    owner TEXT,
    digest TEXT
)
"""
# What a response row's digest covers, in this order (every column but the digest itself).
_RESPONSE_FIELDS = ("key", "backend", "model", "role", "text", "input_tokens", "output_tokens", "latency_s",
                    "tokens_estimated", "created", "notes", "owner")
# Ledger entries (readers/ledger.py ENTRY_FIELDS), in commit order.
_CALLS = """
CREATE TABLE IF NOT EXISTS calls (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    session TEXT NOT NULL,
    served TEXT NOT NULL,
    role TEXT NOT NULL,
    key TEXT NOT NULL,
    backend TEXT NOT NULL,
    model TEXT NOT NULL,
    input_tokens INTEGER NOT NULL,
    output_tokens INTEGER NOT NULL,
    latency_s REAL NOT NULL,
    tokens_estimated INTEGER NOT NULL,
    gpu_seconds REAL NOT NULL,
    error TEXT,
    created REAL NOT NULL,
    owner TEXT,
    digest TEXT
)
"""
# A ledger.json written before this file held entries (Ledger.rebuilt's base), kept once taken.
_BASE = ("CREATE TABLE IF NOT EXISTS ledger_base (id INTEGER PRIMARY KEY CHECK (id = 1), ledger TEXT NOT NULL, "
         "digest TEXT)")
# PRAGMA user_version of a file whose every row carries its digest (0: written before digests)
_DIGESTS_VERSION = 1
# Each table's columns that its rows' digest covers. A row is digested as SQLite stored it (read back in
# the transaction that wrote it), so a column's type affinity never makes a sound row look changed.
_DIGESTED = {"responses": _RESPONSE_FIELDS, "calls": ENTRY_FIELDS, "ledger_base": ("ledger",)}
# SQLite's result codes (sqlite3.Error.sqlite_errorname) -> the errno whose advice applies.
_SQLITE_ERRNO = {"SQLITE_FULL": errno.ENOSPC, "SQLITE_READONLY": errno.EROFS, "SQLITE_PERM": errno.EACCES,
                 "SQLITE_CANTOPEN": errno.EACCES, "SQLITE_IOERR": errno.EIO}
_DAMAGED = ("SQLITE_CORRUPT", "SQLITE_NOTADB")


def _nearly_full(folder: Path) -> bool:
    """Whether the file system holding `folder` has (almost) no space left (under 1 MiB free)."""
    try:
        return shutil.disk_usage(folder).free < (1 << 20)
    except OSError:
        return False


def image_fingerprint(image: str) -> str:
    """A local file by the sha256 of its bytes; a URL (or a path that is not a file) as written."""
    path = Path(image)
    if not is_remote(image) and path.is_file():
        return "sha256:" + file_sha256(path)
    return image


def row_digest(values: Sequence[Any]) -> str:
    """sha256 over a row's values as stored (text, integers, floats, NULLs), in a fixed column order."""
    blob = json.dumps(list(values), ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


def _row_name(table: str, values: Sequence[Any]) -> str:
    """A row as a damaged-file message names it."""
    return (f"the cached response under key {values[0]}" if table == "responses"
            else "a call record" if table == "calls" else "the ledger base")


def _marks(values: Sequence[str]) -> str:
    """SQL placeholders for `values` (a NULL-free `IN ()` when there are none)."""
    return ",".join("?" * len(values)) or "NULL"


def request_key(backend: str, model: str, request: Request, template_kwargs: dict[str, Any] | None = None,
                seed: int = 0, owner: str | None = None) -> str:
    """The cache key of `request` on `model`: sha256 over everything that determines the output (the
    sampling seed only when the request samples: greedy keys stay what they were), and `owner` when given
    (a live memory's reader: one user's cached reply is never served to another whose prompt matched it)."""
    params: dict[str, Any] = {"max_new_tokens": request.max_new_tokens, "temperature": request.temperature}
    if request.temperature:
        params["seed"] = int(seed)
    payload = {
        "backend": backend,
        "model": model,
        "messages": request.messages,
        "images": [image_fingerprint(i) for i in request.images],
        "params": params,
    }
    if template_kwargs:  # absent when empty, so keys made before the option existed still hit
        payload["chat_template_kwargs"] = dict(template_kwargs)
    if request.response_format is not None:  # likewise: a JSON-mode reply is another call than a free one
        payload["response_format"] = request.response_format
    if owner is not None:
        payload["owner"] = owner
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with self._guard("opening"):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # A Reader may be built on one thread and used on another; calls on it are never concurrent.
            self._conn = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False)
            try:
                self._conn.execute("PRAGMA journal_mode=WAL")
                self._conn.execute("PRAGMA synchronous=NORMAL")
                self._conn.execute(_SCHEMA)
                self._conn.execute(_CALLS)
                self._conn.execute(_BASE)
                if "notes" not in self._columns("responses"):  # a cache written before responses carried notes
                    self._conn.execute("ALTER TABLE responses ADD COLUMN notes TEXT NOT NULL DEFAULT '{}'")
                for table in ("responses", "calls"):  # a cache written before rows named their owner
                    if "owner" not in self._columns(table):
                        self._conn.execute(f"ALTER TABLE {table} ADD COLUMN owner TEXT")
                self._conn.commit()
                if self._conn.execute("PRAGMA user_version").fetchone()[0] < _DIGESTS_VERSION:
                    self._add_digests()
            except BaseException:
                self._conn.close()
                raise

    def _columns(self, table: str) -> set[str]:
        return {row[1] for row in self._conn.execute(f"PRAGMA table_info({table})")}

    @property
    def _files(self) -> str:
        """This file and the two SQLite keeps beside it, as advice names them."""
        return f"{self.path} (with {self.path.name}-wal and {self.path.name}-shm beside it)"

    @contextmanager
    def _guard(self, doing: str) -> Iterator[None]:
        """SQLite's and the file system's failures as one StorageError naming this file and what to do."""
        try:
            yield
        except sqlite3.DatabaseError as exc:
            raise self._error(exc, doing) from None
        except OSError as exc:
            error = storage_error(self.path, exc, doing)
            if error is None:
                raise
            raise error from None

    def _error(self, exc: sqlite3.DatabaseError, doing: str) -> StorageError:
        name = str(getattr(exc, "sqlite_errorname", "") or "")
        text = str(exc)
        if name.startswith(_DAMAGED) or "malformed" in text or "not a database" in text:
            return self._damaged(text)
        code = next((c for prefix, c in _SQLITE_ERRNO.items() if name.startswith(prefix)), None)
        if code is None and "disk is full" in text:
            code = errno.ENOSPC
        if code in (None, errno.EIO) and _nearly_full(self.path.parent):
            # SQLite reports a full disk met while creating its WAL or shared-memory file as an I/O error
            code, text = errno.ENOSPC, f"{text}: its file system is full"
        if code is None and "readonly" in text:
            code = errno.EROFS
        advice = STORAGE_ADVICE.get(code, "") if code is not None else ""
        if not advice:
            advice = f"if it persists, delete {self._files} (safe: it only caches responses and call records) and"
            return StorageError(self.path, f"{self.path}: {doing} failed ({text}); {advice} {RESUME}", code)
        return StorageError(self.path, f"{self.path}: {doing} failed ({text}); {advice}, {RESUME}", code)

    def _damaged(self, what: str) -> StorageError:
        return StorageError(self.path, (
            f"{self.path}: damaged ({what}); it holds only this run's response cache and call records, so "
            f"deleting it is safe: remove {self._files} and rerun the same command (the reader is asked again for "
            "what it held: a greedy reader gives the same answers, and ledger.json's counts are kept)"))

    def _add_digests(self) -> None:
        """A file written before rows carried digests: the column, then a digest for each row as it stands
        (taken as it was), then the file's version, in one transaction: a kill leaves it as it was."""
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            for table in _DIGESTED:
                if "digest" not in self._columns(table):
                    self._conn.execute(f"ALTER TABLE {table} ADD COLUMN digest TEXT")
                self._seal(table, "digest IS NULL")
            self._conn.execute(f"PRAGMA user_version = {_DIGESTS_VERSION}")
            self._conn.commit()
        except BaseException:
            self._conn.rollback()
            raise

    def _seal(self, table: str, where: str, params: Sequence[Any] = ()) -> None:
        """Give the rows of `table` that `where` selects their digest, over their values as stored: inside
        the transaction that wrote them (SQLite's type affinity is applied by then)."""
        fields = _DIGESTED[table]
        rows = self._conn.execute(f"SELECT rowid, {', '.join(fields)} FROM {table} WHERE {where}", params).fetchall()
        digests = []
        for row in rows:
            try:
                digests.append((row_digest(row[1:]), row[0]))
            except TypeError:  # a value no memfit writes (bytes where text belongs): changed by hand
                raise self._damaged(f"{_row_name(table, row[1:])} holds a value of no stored type") from None
        self._conn.executemany(f"UPDATE {table} SET digest = ? WHERE rowid = ?", digests)

    def _checked(self, table: str, row: Sequence[Any]) -> Sequence[Any]:
        """`row` (the table's digested fields, then its digest) without the digest, once it matches. A row
        without a digest was written around memfit (every memfit write seals its rows)."""
        values, digest = row[:-1], row[-1]
        try:
            sound = digest is not None and digest == row_digest(values)
        except TypeError:  # bytes where text belongs
            sound = False
        if not sound:
            raise self._damaged(f"{_row_name(table, values)} does not match its digest: changed on disk or by hand")
        return values

    def get_many(self, keys: Sequence[str]) -> dict[str, Response]:
        found: dict[str, Response] = {}
        unique = list(dict.fromkeys(keys))
        # SQLite limits bound parameters per statement; 500 stays far below every build's limit.
        with self._guard("reading"):
            for i in range(0, len(unique), 500):
                part = unique[i:i + 500]
                rows = self._conn.execute(
                    f"SELECT {', '.join(_RESPONSE_FIELDS)}, digest "
                    f"FROM responses WHERE key IN ({','.join('?' * len(part))})", part
                ).fetchall()
                for row in rows:
                    r = dict(zip(_RESPONSE_FIELDS, self._checked("responses", row), strict=True))
                    found[r["key"]] = Response(r["text"], r["input_tokens"], r["output_tokens"], r["latency_s"],
                                               True, r["model"], bool(r["tokens_estimated"]), json.loads(r["notes"]))
        return found

    def commit(self, backend: str, rows: Sequence[tuple[str, str, Response]],
               entries: Sequence[Mapping[str, Any]] = (), owners: Sequence[str | None] | None = None) -> None:
        """rows = (key, role, response) from `backend` to cache, and the ledger entries that account for
        what was handed out; one transaction, committed before returning. A response with an error, or
        one that never came (`answered` False), is not cached: a rerun asks again. owners: per row, the
        user whose data its request carried (Request.owner; `forget` drops a user's rows)."""
        now = time.time()
        owned = list(owners) if owners is not None else [None] * len(rows)
        kept = [(k, role, r, owner) for (k, role, r), owner in zip(rows, owned, strict=True)
                if r.error is None and r.answered]
        with self._guard("writing"), self._conn:
            faults.io_fault(self.path)
            last_call = self._conn.execute("SELECT COALESCE(MAX(seq), 0) FROM calls").fetchone()[0]
            self._conn.executemany(
                "INSERT OR REPLACE INTO responses (key, backend, model, role, text, input_tokens, output_tokens, "
                "latency_s, tokens_estimated, created, notes, owner) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
                [(k, backend, r.model, role, r.text, r.input_tokens, r.output_tokens, r.latency_s,
                  int(r.tokens_estimated), now, json.dumps(r.notes, sort_keys=True), owner)
                 for k, role, r, owner in kept],
            )
            self._conn.executemany(
                f"INSERT INTO calls ({', '.join(ENTRY_FIELDS)}) VALUES ({','.join('?' * len(ENTRY_FIELDS))})",
                [tuple(entry.get(name) for name in ENTRY_FIELDS) for entry in entries],
            )
            # this transaction's rows, sealed as stored (SQLite limits bound parameters: 500 keys a statement)
            keys = list(dict.fromkeys(k for k, _, _, _ in kept))
            for i in range(0, len(keys), 500):
                self._seal("responses", f"key IN ({_marks(keys[i:i + 500])})", keys[i:i + 500])
            self._seal("calls", "seq > ?", (last_call,))

    def forget(self, owners: Sequence[str], responses_of: Sequence[str] = ()) -> dict[str, int]:
        """Drop every cached response and call record of the users `owners` (Request.owner), and the cached
        responses of the users `responses_of` (their call records hold no text and stay), then rewrite the
        file (VACUUM) and empty its write-ahead log, so no byte of what they held is left in it: the
        ledger.json counts stay. Returns the rows dropped."""
        owners = list(dict.fromkeys(owners))
        texts_of = list(dict.fromkeys([*owners, *responses_of]))
        if not texts_of:
            return {"responses": 0, "calls": 0}
        with self._guard("writing"):
            with self._conn:
                responses = self._conn.execute(f"DELETE FROM responses WHERE owner IN ({_marks(texts_of)})",
                                               texts_of).rowcount
                calls = self._conn.execute(f"DELETE FROM calls WHERE owner IN ({_marks(owners)})", owners).rowcount
            self._conn.execute("VACUUM")
            self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        return {"responses": int(responses), "calls": int(calls)}

    def put_many(self, backend: str, rows: Sequence[tuple[str, str, Response]]) -> None:
        """rows = (key, role, response) from `backend`, cached in one transaction (no ledger entries)."""
        self.commit(backend, rows)

    def entries(self) -> list[dict[str, Any]]:
        """Every ledger entry, in commit order."""
        with self._guard("reading"):
            rows = self._conn.execute(f"SELECT {', '.join(ENTRY_FIELDS)}, digest FROM calls ORDER BY seq").fetchall()
        return [dict(zip(ENTRY_FIELDS, self._checked("calls", row), strict=True)) for row in rows]

    def ledger_base(self) -> dict[str, Any] | None:
        with self._guard("reading"):
            row = self._conn.execute("SELECT ledger, digest FROM ledger_base WHERE id = 1").fetchone()
        return None if row is None else json.loads(self._checked("ledger_base", row)[0])

    def set_ledger_base(self, ledger: dict[str, Any]) -> None:
        with self._guard("writing"), self._conn:
            self._conn.execute("INSERT OR REPLACE INTO ledger_base (id, ledger) VALUES (1, ?)", (json.dumps(ledger),))
            self._seal("ledger_base", "id = 1")

    def __len__(self) -> int:
        with self._guard("reading"):
            return int(self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._conn.close()
