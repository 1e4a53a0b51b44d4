"""API keys of `memfit serve`: a file of hashed keys, each bound to the user ids it may touch.

The file is JSON Lines, one key per line: `{"name": "agent-1", "sha256": "<hex of the key>", "users":
["u1", "u2"], "admin": false}`. Only the SHA-256 of a key is stored: keys are 256-bit random tokens
(`memfit keys new`), so a fast hash is enough and the file reveals no key. A request names its key in
`Authorization: Bearer <key>` (or `X-API-Key`); a missing or unknown key is 401, a known key asking for
a user it is not bound to is 403, and neither reads anything. `admin` keys may also call the store-wide
operations (compact; consolidate of every user), which return no user's data; a consolidate that names users
needs a key bound to each of them.

A server reads its keys file again when the file changes (its size, time or inode), at the next request: a key
added (`memfit keys new`) or revoked (`memfit keys revoke`) takes effect without a restart. A keys file that no
longer reads (a hand edit gone wrong) refuses every key until it reads again: a key meant to be revoked is never
served from the file as it was.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import secrets
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from memfit_gpu.data.schema import DataError
from memfit_gpu.files import atomic_write_text
from memfit_gpu.locks import exclusive
from memfit_gpu.names import user_id_problem

KEY_PREFIX = "mfk_"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiKey:
    name: str
    sha256: str
    users: frozenset[str]
    admin: bool = False

    def may(self, user_id: str) -> bool:
        return user_id in self.users

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "sha256": self.sha256, "users": sorted(self.users), "admin": self.admin}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def _signature(path: Path) -> tuple[int, int, int] | None:
    """What tells a changed keys file (a rewrite replaces it: another inode), None when it cannot be read."""
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


class KeyRing:
    """The keys of a keys file, looked up by the hash of a presented key; read again when the file changes
    (module doc)."""

    def __init__(self, keys: Sequence[ApiKey], path: Path | None = None) -> None:
        self.keys = list(keys)
        self._by_hash = {k.sha256: k for k in self.keys}
        self.path = path  # the file the keys came from (None: given in code, never read again)
        self._signature = _signature(path) if path is not None else None

    def _refresh(self) -> None:
        if self.path is None:
            return
        now = _signature(self.path)
        if now == self._signature:
            return
        self._signature = now
        try:
            ring = KeyRing.load(self.path)
        except (DataError, OSError) as exc:  # fail closed: the edit may have been a revocation
            log.error("memfit serve: the keys file changed and does not read (%s): every key is refused until it "
                      "does", exc)
            self.keys, self._by_hash = [], {}
            return
        self.keys, self._by_hash = ring.keys, ring._by_hash
        log.info("memfit serve: %s changed: %d keys", self.path, len(self.keys))

    @classmethod
    def load(cls, path: str | Path) -> KeyRing:
        """Read a keys file; a bad line is a DataError naming the file, the line and the field."""
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"keys file {path} not found (make one with `memfit keys new --keys {path} "
                                    "--user USER_ID`)")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(str(path), None, None, f"not UTF-8 text (byte {exc.start}): a keys file is JSON Lines") from None
        return cls.parse(text, path)

    @classmethod
    def parse(cls, text: str, path: Path) -> KeyRing:
        """The keys of a keys file's `text` (what `load` read from `path`); a DataError naming the line and the
        field."""
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataError(str(path), f"line {number}", None, f"not JSON: {exc.msg}") from None
            if not isinstance(raw, dict):
                raise DataError(str(path), f"line {number}", None, "a key is a JSON object")
            sha = raw.get("sha256")
            if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdef" for c in sha):
                raise DataError(str(path), f"line {number}", "sha256", "must be 64 lowercase hex digits")
            users = raw.get("users")
            if not isinstance(users, list) or not all(isinstance(u, str) and u for u in users):
                raise DataError(str(path), f"line {number}", "users", "must be a list of user ids")
            bad = next((p for p in map(user_id_problem, users) if p is not None), None)
            if bad is not None:
                raise DataError(str(path), f"line {number}", "users", bad)
            if sha in {k.sha256 for k in keys}:
                raise DataError(str(path), f"line {number}", "sha256", "the same key is listed twice")
            admin = raw.get("admin", False)
            if not isinstance(admin, bool):  # "false" is a truthy string: never read a key as admin by accident
                raise DataError(str(path), f"line {number}", "admin", "must be true or false (a JSON boolean)")
            name = raw.get("name")
            if name is not None and not isinstance(name, str):
                raise DataError(str(path), f"line {number}", "name", "must be a string")
            name = name or f"key{number}"
            if name in {k.name for k in keys}:  # names appear in errors and logs: each names one key
                raise DataError(str(path), f"line {number}", "name", f"{name!r} is the name of another key too")
            keys.append(ApiKey(name, sha, frozenset(users), admin))
        if not keys:
            raise DataError(str(path), None, None, "holds no key: every request would be refused")
        return cls(keys, path)

    def find(self, presented: str | None) -> ApiKey | None:
        """The key a request presented, or None (unknown or missing)."""
        self._refresh()
        if not presented:
            return None
        found = self._by_hash.get(digest(presented))
        # the lookup is by hash; compare again in constant time so timing says nothing about near misses
        return found if found is not None and hmac.compare_digest(found.sha256, digest(presented)) else None


def _changing(path: Path) -> AbstractContextManager[None]:
    """The keys file to this command alone while it reads, changes and replaces it (`memfit keys new` and
    `revoke` at once each keep the other's change)."""
    return exclusive(path.with_name(f".{path.name}.lock"), "another `memfit keys` command is changing the file",
                     wait_s=60.0)


def new_key(path: str | Path, users: Sequence[str], name: str | None = None, admin: bool = False) -> str:
    """Add a fresh key bound to `users` to the keys file (created when missing); returns the key itself,
    which is shown once and stored nowhere."""
    path = Path(path)
    for user in users:
        problem = user_id_problem(user)
        if problem is not None:
            raise DataError(str(path), None, "users", problem)
    path.parent.mkdir(parents=True, exist_ok=True)
    # read, add, replace under a lock of the file's own: concurrent `memfit keys new` each add their key
    with _changing(path):
        raw = path.read_bytes() if path.is_file() else b""
        existing = KeyRing.load(path).keys if raw.strip() else []  # checked: a bad file is refused, not rewritten
        text = raw.decode("utf-8")
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        taken = {k.name for k in existing}
        if name is not None and not name.strip():  # stored as no name: key<line>, maybe another key's name
            raise DataError(str(path), None, "name", "a key's name is a non-empty label (leave it out for key<N>)")
        if name is not None and name in taken:
            raise DataError(str(path), None, "name", f"{name!r} is the name of another key in it")
        # named by the line it goes on, as a hand-written key without a name is (a revoked key's line stays,
        # empty: a revoked name is not given again); past any name in use (a key removed by hand)
        number = len(text.splitlines()) + 1
        while name is None and f"key{number}" in taken:
            number += 1
        entry = ApiKey(name or f"key{number}", digest(key), frozenset(users), admin)
        kept = text.rstrip("\n") + "\n" if text.strip() else ""  # the other keys' lines as they were, byte for byte
        # never write a file that does not read: a server serving from it would refuse every key
        KeyRing.parse(kept + json.dumps(entry.to_json()) + "\n", path)
        atomic_write_text(path, kept + json.dumps(entry.to_json()) + "\n")
    return key


def revoke_key(path: str | Path, name: str) -> ApiKey:
    """Remove the key named `name` from the keys file (the other lines kept byte for byte, its own left empty:
    a hand-written key without a name is named by its line, `key<line>`, and the names of the keys after it
    must not move, or the next revoke of `key<n>` would remove another key than the one meant); a server
    serving from the file refuses it from its next request on. Returns the key removed."""
    path = Path(path)
    with _changing(path):
        keys = KeyRing.load(path).keys  # checked: a bad file is refused, not rewritten
        if name not in {k.name for k in keys}:
            raise DataError(str(path), None, "name", f"no key named {name!r} (the keys: {', '.join(k.name for k in keys)})")
        removed = next(k for k in keys if k.name == name)
        lines = path.read_text(encoding="utf-8").split("\n")
        kept = ["" if line.strip() and json.loads(line).get("sha256") == removed.sha256 else line for line in lines]
        atomic_write_text(path, "\n".join(kept))
    return removed
