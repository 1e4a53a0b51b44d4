"""Response cache: every reader call keyed by what determines its output, stored in the run's SQLite file.

The key is sha256 over (backend, model, messages, images, generation parameters); an image that is a
local file enters by the sha256 of its bytes, so renaming a folder does not invalidate answers but changing
a picture does. WAL mode and one commit per batch: a run killed mid-way keeps every finished call, and a
rerun makes no repeat calls.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit_gpu.digests import file_sha256
from memfit_gpu.readers.images import is_remote
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
    notes TEXT NOT NULL DEFAULT '{}'
)
"""


def image_fingerprint(image: str) -> str:
    """A local file by the sha256 of its bytes; a URL (or a path that is not a file) as written."""
    path = Path(image)
    if not is_remote(image) and path.is_file():
        return "sha256:" + file_sha256(path)
    return image


def request_key(backend: str, model: str, request: Request, template_kwargs: dict[str, Any] | None = None,
                seed: int = 0) -> str:
    """The cache key of `request` on `model`: sha256 over everything that determines the output (the
    sampling seed only when the request samples: greedy keys stay what they were)."""
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
    blob = json.dumps(payload, sort_keys=True, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()


class ResponseCache:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # A Reader may be built on one thread and used on another; calls on it are never concurrent.
        self._conn = sqlite3.connect(str(self.path), timeout=60.0, check_same_thread=False)
        self._conn.execute("PRAGMA journal_mode=WAL")
        self._conn.execute("PRAGMA synchronous=NORMAL")
        self._conn.execute(_SCHEMA)
        columns = {row[1] for row in self._conn.execute("PRAGMA table_info(responses)")}
        if "notes" not in columns:  # a cache written before responses carried notes
            self._conn.execute("ALTER TABLE responses ADD COLUMN notes TEXT NOT NULL DEFAULT '{}'")
        self._conn.commit()

    def get_many(self, keys: Sequence[str]) -> dict[str, Response]:
        found: dict[str, Response] = {}
        unique = list(dict.fromkeys(keys))
        # SQLite limits bound parameters per statement; 500 stays far below every build's limit.
        for i in range(0, len(unique), 500):
            part = unique[i:i + 500]
            rows = self._conn.execute(
                "SELECT key, text, input_tokens, output_tokens, latency_s, tokens_estimated, model, notes "
                f"FROM responses WHERE key IN ({','.join('?' * len(part))})", part
            ).fetchall()
            for key, text, n_in, n_out, latency, estimated, model, notes in rows:
                found[key] = Response(text, n_in, n_out, latency, True, model, bool(estimated), json.loads(notes))
        return found

    def put_many(self, backend: str, rows: Sequence[tuple[str, str, Response]]) -> None:
        """rows = (key, role, response) from `backend`; one transaction, committed before returning."""
        now = time.time()
        with self._conn:
            self._conn.executemany(
                "INSERT OR REPLACE INTO responses (key, backend, model, role, text, input_tokens, output_tokens, "
                "latency_s, tokens_estimated, created, notes) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                [(k, backend, r.model, role, r.text, r.input_tokens, r.output_tokens, r.latency_s,
                  int(r.tokens_estimated), now, json.dumps(r.notes, sort_keys=True)) for k, role, r in rows],
            )

    def __len__(self) -> int:
        return int(self._conn.execute("SELECT COUNT(*) FROM responses").fetchone()[0])

    def close(self) -> None:
        self._conn.close()
