"""method=mem0: mem0 (PyPI `mem0ai`, Apache-2.0) from its own package, on the run's reader and encoder.

mem0 is the memory system most papers compare with: an LLM reads each batch of new messages beside the
memories it already holds and writes or updates short facts, which a vector search returns. Here it runs
unmodified (`mem0.Memory`), configured so that everything it asks of "OpenAI" goes to the run's own
reader and bi-encoder through an OpenAI-compatible endpoint on 127.0.0.1 (methods/peers/endpoint.py): its
chat calls are in the response cache and the ledger under `mem0_write` / `mem0_read`, its embeddings under
`mem0_embed_write` / `mem0_embed_read`, counted by the same code as MemFit's. Its vector store is an
embedded on-disk Qdrant and its history SQLite, both in DIR/mem0/; its telemetry is off.

Write, as mem0's LoCoMo evaluation feeds it (its repository's evaluation/src/memzero/add.py): one mem0
user per speaker of a conversation (named `<memory id>/<speaker>`, each percent-encoded, where the
evaluation wrote `<speaker>_<index>`: the name enters no prompt, and two users of a live memory must never
name one mem0 user); for each session and each speaker, the
session's turns as chat messages "<speaker>: <text>", the speaker's own as `user` and the others' as
`assistant`, added `mem0.batch_size` messages per `add` call, with the session's date as metadata
`timestamp`. mem0's own extraction prompt is used (the evaluation's hosted-platform custom instructions are
not part of the package). Each finished call is marked in DIR/mem0/added.jsonl with its turn ids (after the
ledger is saved), so a killed run resumes without adding a batch twice; a batch whose `add` finished before
the kill but not its mark is found in mem0's own files (its memories' `memfit_batch` payload in Qdrant, or
its messages as the user's last in mem0's history database) and is not added again either.

Live (`memfit_gpu.Memory.open(..., method="mem0")`, `memfit serve`): the live memory's store holds the
turns; after each add, mem0 is fed the turns it has not had, in the same batches (so an agent's add waits
for mem0's LLM calls, as with mem0 itself). Deleting a turn retires each batch that held it: the memories
that add wrote leave Qdrant and mem0's history, with the user's recent messages (mem0's context for its next
extraction), and the batch's other turns are fed again. `compact` rewrites mem0's SQLite files and
added.jsonl, so after `delete_user` and `compact` nothing of the user is under the memory's folder (the
memory's cache.sqlite drops the user's calls itself). mem0 writes nothing off the write path: its
`consolidate` does nothing. Note that mem0 puts today's date in every extraction prompt: a run resumed on
another day asks its LLM again for the adds still to come (their prompts differ; the cache holds the rest).

Read (evaluation/src/memzero/search.py): for each question, `search` with the question for the top
`mem0.top_k` memories of each speaker; the excerpts hold them as "<timestamp>: <memory>" per speaker, and
go through the shared answer call. mem0's memories name no turns, so its packs have no turn rows and its
pack rows' `retrieval` is null (hit@k is not measurable for it); diagnostics.json says how many memories
mem0 stored per user, how many of its LLM replies it could not parse, and how many JSON-mode requests no
backend constrained. A small reader may store little: the run says so in diagnostics.json and the log.

mem0's optional spaCy models (its `nlp` extra: entity linking, lemmatised keyword search) are not
installed, as in a plain `pip install mem0ai`; mem0 then skips those steps itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import os
import shutil
import sqlite3
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any
from urllib.parse import quote

from memfit_gpu import faults
from memfit_gpu.data.schema import DataError, Memory, Session
from memfit_gpu.files import append_jsonl, read_jsonl, write_jsonl_atomic
from memfit_gpu.index.encoders.backends import load_bi_encoder
from memfit_gpu.methods.base import Hit, MethodRun
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.methods.peers.endpoint import EndpointLogic, PeerEndpoint, embedder_of
from memfit_gpu.readers.types import MissingBackendError
from memfit_gpu.store.episodes import EpisodeStore

log = logging.getLogger(__name__)

SYSTEM = "mem0"
PACKAGE = "mem0ai"
MARKS = "added.jsonl"
COLLECTION = "memfit"
QUIET = ("httpx", "httpx2", "openai")


class MissingPeerError(MissingBackendError):
    """A peer system whose package is not installed."""


def require_mem0() -> None:
    if importlib.util.find_spec("mem0") is None:
        raise MissingPeerError(f"method=mem0 needs the Python package '{PACKAGE}', which is not installed: "
                               "pip install -e '.[peers]' (make setup installs it)")


def memory_class(home: Path) -> Any:
    """mem0's `Memory`, imported with its telemetry off and its home (a config file with an anonymous id)
    in `home` instead of ~/.mem0: mem0 reads both when it is first imported."""
    require_mem0()
    os.environ["MEM0_TELEMETRY"] = "False"
    os.environ["MEM0_DIR"] = str(home)
    from mem0 import Memory as Mem0Memory  # optional extra: imported only for method=mem0

    return Mem0Memory


def memory_config(base_url: str, llm_model: str, encoder: str, dims: int, folder: Path, temperature: float,
                  max_tokens: int, *, api_key: str) -> dict[str, Any]:
    """mem0's configuration: its LLM and embedder are "OpenAI" at `base_url` (the run's endpoint, whose
    `api_key` they send), its vector store an embedded Qdrant on disk and its history SQLite, both in `folder`."""
    return {
        "llm": {"provider": "openai", "config": {
            "model": llm_model, "openai_base_url": base_url, "api_key": api_key,
            "temperature": temperature, "max_tokens": max_tokens}},
        "embedder": {"provider": "openai", "config": {
            "model": encoder, "openai_base_url": base_url, "api_key": api_key, "embedding_dims": dims}},
        "vector_store": {"provider": "qdrant", "config": {
            "collection_name": COLLECTION, "path": str(folder / "qdrant"), "on_disk": True,
            "embedding_model_dims": dims}},
        "history_db_path": str(folder / "history.db"),
    }


def speakers_of(memory: Memory) -> list[str]:
    """The conversation's speakers who have a turn: in the loader's order, then the others in order of
    appearance. A live memory's speaker whose every turn was deleted is none (until `compact` the store still
    lists it): mem0 would be fed the others' turns again as that speaker's view and searched there."""
    speaking = list(dict.fromkeys(turn.speaker for session in memory.sessions for turn in session.turns))
    return [s for s in memory.speakers if s in speaking] + [s for s in speaking if s not in memory.speakers]


def user_id(memory_id: str, speaker: str) -> str:
    """The mem0 user of one speaker of one conversation: `<memory id>/<speaker>`, each percent-encoded, so
    no two (memory, speaker) pairs name one mem0 user and the name holds no whitespace (which mem0 refuses).
    mem0's evaluation wrote `<speaker>_<index>`; in a live memory, where ids and speakers are anyone's
    text, `{speaker}_{memory id}` gave user `x_a`'s speaker `user` and user `a`'s speaker `user_x` one mem0
    memory: each read the other's facts and wrote into them."""
    return f"{quote(memory_id, safe='')}/{quote(speaker, safe='')}"


def session_messages(session: Session, speaker: str) -> list[dict[str, str]]:
    """A session as `speaker` tells it to mem0: its own turns as the user's, the others' as the assistant's."""
    return [{"role": "user" if turn.speaker == speaker else "assistant", "content": f"{turn.speaker}: {turn.text}"}
            for turn in session.turns]


class _ParseFailures(logging.Handler):
    """Counts mem0's own log lines saying it could not parse an LLM reply (it then stores nothing)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if "parsing" in record.getMessage().lower():
            self.count += 1


@dataclass(frozen=True)
class Batch:
    """One mem0 `add`: consecutive turns of one session as one speaker tells them (session_messages)."""

    key: str  # memory id, session id, speaker and first turn id, tab-separated: the mark's name
    memory_id: str
    user: str  # the speaker's mem0 user
    turn_ids: list[str]
    messages: list[dict[str, str]]
    timestamp: str  # the session's date text (mem0's evaluation: metadata `timestamp`)


def pending_batches(memory: Memory, fed: dict[str, set[str]], size: int) -> list[Batch]:
    """The adds that feed mem0 what it has not been fed of `memory` (`fed`: per mem0 user, the turn ids it
    got), as mem0's evaluation feeds a conversation: per session, per speaker, `size` messages an add. With
    nothing fed, every turn of every session, cut at the session's start; in a live memory, the turns added
    since (and the rest of a batch retired by a deletion)."""
    batches = []
    speakers = speakers_of(memory)
    for session in memory.sessions:
        for speaker in speakers:
            user = user_id(memory.memory_id, speaker)
            todo = [t for t in session.turns if t.turn_id not in fed.get(user, ())]
            for start in range(0, len(todo), size):
                chunk = todo[start:start + size]
                batches.append(Batch(f"{memory.memory_id}\t{session.session_id}\t{speaker}\t{chunk[0].turn_id}",
                                     memory.memory_id, user, [t.turn_id for t in chunk],
                                     session_messages(replace(session, turns=chunk), speaker), session.date_text))
    return batches


class Marks:
    """DIR/mem0/added.jsonl: one line per finished add (its batch key, mem0 user and turn ids) and one per
    batch retired (a turn of it was deleted: its memories are gone from mem0). Read in order, it says what
    mem0 holds now: the batches added and not retired, and per mem0 user the turns it was fed."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.batches: dict[str, dict[str, Any]] = {}  # key -> the add's mark (memory, user, turns)
        for number, row in enumerate(read_jsonl(path) if path.exists() else [], 1):
            if "retired" in row:
                self.batches.pop(row["retired"], None)
            elif not isinstance(row.get("turns"), list) or "user" not in row:
                raise DataError(str(path), f"line {number}", "turns",
                                "a mark without its turns (written by an older memfit): run in a new directory")
            elif not str(row["user"]).startswith(user_id(str(row.get("memory")), "")):  # `<memory>/` as named now
                raise DataError(str(path), f"line {number}", "user", (
                    f"mem0 user {row['user']!r} has an older memfit's naming (`<speaker>_<memory id>`, "
                    "which two users of a live memory could share): run in a new directory, or for a live "
                    "memory export its users (memfit store export) into a new one"))
            else:
                self.batches[row["batch"]] = row

    def fed(self, memory_id: str) -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for row in self.batches.values():
            if row["memory"] == memory_id:
                out.setdefault(row["user"], set()).update(row["turns"])
        return out

    def add(self, batch: Batch, stored: int | None, found_in_store: bool = False) -> None:
        row = {"batch": batch.key, "memory": batch.memory_id, "user": batch.user, "turns": batch.turn_ids,
               "stored": stored, **({"found_in_store": True} if found_in_store else {})}
        append_jsonl(self.path, [row])
        self.batches[batch.key] = row

    def retire(self, key: str) -> None:
        append_jsonl(self.path, [{"retired": key}])
        self.batches.pop(key, None)

    def rewrite(self) -> None:
        """The file again with only the batches mem0 holds (no retired line names a deleted turn)."""
        write_jsonl_atomic(self.path, self.batches.values())


class Mem0Method:
    name = SYSTEM

    def __init__(self) -> None:
        self.folder: Path | None = None
        self._temporary: Path | None = None
        self.memory: Any = None
        self.logic: EndpointLogic | None = None
        self.endpoint: PeerEndpoint | None = None
        self.encoder: Any = None
        self._own_encoder = False  # loaded here (a run) rather than the live memory's store's
        self.store: EpisodeStore | None = None  # a live memory's store (attach)
        self.marks: Marks | None = None
        self.parse_failures = _ParseFailures()
        self.added_now = 0  # add calls made by this process
        self.skipped = 0  # batches a mark (or Qdrant) said were added by an earlier process
        self.retired = 0  # batches whose memories a deletion removed, in this process
        self.add_seconds: list[float] = []  # each `add` call of this process (one batch of messages)
        self.search_seconds: list[float] = []  # each question's searches (every speaker) in this process
        self._levels: dict[str, int] = {}  # the loggers quietened while mem0 runs, and their levels before

    # ---- set-up -----------------------------------------------------------------------------------------
    def _place(self, run: MethodRun) -> Path:
        if self.folder is None:
            if run.out is not None:
                self.folder = Path(run.out) / "mem0"
            else:
                self._temporary = Path(tempfile.mkdtemp(prefix="memfit-mem0-"))
                self.folder = self._temporary
            self.folder.mkdir(parents=True, exist_ok=True)
            self.marks = Marks(self.folder / MARKS)
        return self.folder

    def _open(self, run: MethodRun) -> None:
        """mem0 and the endpoint it talks to; the reader is loaded here, when mem0 is first needed."""
        if self.memory is not None:
            return
        if run.reader is None:
            raise ValueError("method=mem0 needs the run's reader (its memories are written by an LLM): use memfit run")
        folder = self._place(run)
        cfg = run.cfg
        if self.endpoint is None:
            if self.encoder is None:
                self.encoder, self._own_encoder = load_bi_encoder(cfg.index), True
            self.logic = EndpointLogic(SYSTEM, run.reader(), embedder_of(self.encoder, cfg.index.encoder))
            self.endpoint = PeerEndpoint(self.logic)
            self._base_url = self.endpoint.start()
            logging.getLogger("mem0").addHandler(self.parse_failures)
            for name in QUIET:  # the OpenAI client logs every request at INFO; the ledger records them
                self._levels[name] = logging.getLogger(name).level
                logging.getLogger(name).setLevel(logging.WARNING)
        assert self.logic is not None
        assert self.endpoint is not None
        config = memory_config(self._base_url, self.logic.reader.model, cfg.index.encoder, int(self.encoder.dim),
                               folder, cfg.mem0.temperature, cfg.mem0.max_tokens, api_key=self.endpoint.api_key)
        self.memory = memory_class(folder / "home").from_config(config)

    def _close_memory(self) -> None:
        """mem0's SQLite history and its embedded Qdrant (which holds its folder's lock until closed)."""
        if self.memory is not None:
            self.memory.close()
            client = getattr(self.memory.vector_store, "client", None)
            if client is not None:
                client.close()
            self.memory = None

    # ---- write ------------------------------------------------------------------------------------------
    def _added_before_kill(self, batch: Batch) -> bool:
        """Whether an earlier process's `add` of this batch finished before its mark: mem0 keeps each user's
        last messages in its history database as the last step of every add (whatever it extracted), and
        the memories it stored carry the batch's key."""
        points, _ = self.memory.vector_store.list(filters={"user_id": batch.user, "memfit_batch": batch.key}, top_k=1)
        if points:
            return True
        last = self.memory.db.get_last_messages(_session_scope(batch.user), limit=len(batch.messages))
        return sorted((m["role"], m["content"]) for m in last) == sorted((m["role"], m["content"]) for m in batch.messages)

    def _feed(self, run: MethodRun, memories: list[Memory]) -> None:
        """Add to mem0 every turn of `memories` it has not been fed (pending_batches), marking each add."""
        self._place(run)
        assert self.marks is not None
        size = max(1, int(run.cfg.mem0.batch_size))
        for memory in memories:
            for batch in pending_batches(memory, self.marks.fed(memory.memory_id), size):
                self._open(run)
                assert self.logic is not None
                if self._added_before_kill(batch):
                    self.marks.add(batch, None, found_in_store=True)
                    self.skipped += 1
                    continue
                started = time.perf_counter()
                with self.logic.serve("write", memory.memory_id, batch.key):
                    result = self.memory.add(batch.messages, user_id=batch.user,
                                             metadata={"timestamp": batch.timestamp, "memfit_batch": batch.key})
                self.add_seconds.append(time.perf_counter() - started)
                self.added_now += 1
                run.account("mem0.add.ledger")  # the ledger is saved before the mark says done
                self.marks.add(batch, len((result or {}).get("results", [])))
                faults.point("mem0.added")

    def write(self, run: MethodRun) -> None:
        self._place(run)
        assert self.marks is not None
        ids = {m.memory_id for m in run.memories}  # what an earlier process of this run added
        self.skipped += sum(row["memory"] in ids for row in self.marks.batches.values())
        self._feed(run, list(run.memories))

    def stored_counts(self, run: MethodRun) -> dict[str, int]:
        """Memories mem0 holds per mem0 user of the selected conversations."""
        counts = {}
        for memory in run.memories:
            for speaker in speakers_of(memory):
                user = user_id(memory.memory_id, speaker)
                points, _ = self.memory.vector_store.list(filters={"user_id": user}, top_k=1_000_000)
                counts[user] = len(points)
        return counts

    # ---- live (memfit_gpu.Memory) -------------------------------------------------------------------------
    def attach(self, run: MethodRun, store: EpisodeStore) -> None:
        """A live memory's store: mem0 is fed its turns as they are added (a turn stored before a kill and
        not yet fed is fed now); the reader and mem0 open when first needed."""
        self.store, self.encoder, self._own_encoder = store, store.encoder, False
        self.changed(run, list(store.memory_ids))

    def changed(self, run: MethodRun, memory_ids: list[str]) -> None:
        """Turns were added or deleted: a batch with a deleted turn is retired (its memories, their history
        and the user's recent messages leave mem0) and its other turns are fed again; new turns are fed."""
        assert self.store is not None
        self._place(run)
        assert self.marks is not None
        conversations = []
        for memory_id in memory_ids:
            live = {str(self.store.turn_id[r]) for r in self.store.live_turns(memory_id)}
            gone = [row for row in self.marks.batches.values()
                    if row["memory"] == memory_id and not set(row["turns"]) <= live]
            if gone:
                self._open(run)
                for row in gone:
                    self._retire(row)
            if live:
                conversations.append(self.store.conversation(memory_id))
        self._feed(run, conversations)

    def _retire(self, mark: dict[str, Any]) -> None:
        """Remove what one add stored: its memories from Qdrant, their rows from mem0's history, and the
        user's recent messages (mem0's context for its next extraction) from its database."""
        assert self.marks is not None
        points, _ = self.memory.vector_store.list(filters={"user_id": mark["user"], "memfit_batch": mark["batch"]},
                                                  top_k=1_000_000)
        ids = [str(p.id) for p in points]
        for memory_id in ids:
            self.memory.delete(memory_id)
        db = self.memory.db
        with db._lock:  # mem0's SQLiteManager (pinned release): its own lock and connection
            db.connection.executemany("DELETE FROM history WHERE memory_id = ?", [(i,) for i in ids])
            db.connection.execute("DELETE FROM messages WHERE session_scope = ?", (_session_scope(mark["user"]),))
            db.connection.commit()
        self.marks.retire(mark["batch"])
        self.retired += 1

    def hits(self, row: dict[str, Any], k: int) -> list[Hit]:
        """mem0's memories for one query, best first, each with the turns of the add that wrote it."""
        assert self.marks is not None
        found = sorted(row["mem0"], key=lambda hit: -hit["score"])[:k]
        return [Hit("memory", hit["memory"], hit["score"],
                    list(self.marks.batches.get(hit["batch"] or "", {}).get("turns", [])), {"mem0": hit["score"]})
                for hit in found]

    def consolidate(self, run: MethodRun, memory_ids: list[str],
                    holding: Callable[[], contextlib.AbstractContextManager[Any]]) -> dict[str, int]:
        return {}  # mem0 writes its memories in `add` (its LLM calls are on the write path)

    def unconsolidated(self, memory_ids: list[str]) -> dict[str, int]:
        return {}

    def compact(self, run: MethodRun, store: EpisodeStore, purged: list[str]) -> None:
        """The store was compacted (a deleted user's every byte leaves it): mem0's files follow. Its two
        SQLite files (the history and the embedded Qdrant's points) are rewritten without the free pages that
        deleted rows leave, and added.jsonl without the retired batches."""
        self.store, self.encoder = store, store.encoder
        if self.logic is not None:
            self.logic.embedder = embedder_of(self.encoder, run.cfg.index.encoder)
        folder = self._place(run)
        assert self.marks is not None
        reopen = self.memory is not None
        self._close_memory()
        for database in [folder / "history.db", *sorted((folder / "qdrant").rglob("*.sqlite"))]:
            if database.exists():
                connection = sqlite3.connect(database)
                try:
                    connection.execute("VACUUM")
                finally:
                    connection.close()
        self.marks.rewrite()
        if reopen:
            self._open(run)

    # ---- read -------------------------------------------------------------------------------------------
    def _speakers(self, run: MethodRun, memory_id: str) -> list[str]:
        """The speakers whose mem0 users a question searches (speakers_of)."""
        if self.store is not None:
            memory = self.store.memory_of(memory_id)
            speaking = set(self.store.speaker_id[self.store.memory_rows(memory)].tolist())
            return [s for i, s in enumerate(self.store.memory_speakers[memory]) if i in speaking]
        return speakers_of(next(m for m in run.memories if m.memory_id == memory_id))

    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._open(run)
        assert self.logic is not None
        rows = []
        for q in run.questions:
            found: list[dict[str, Any]] = []
            started = time.perf_counter()
            with self.logic.serve("read", q.memory_id, q.question_id):
                for speaker in self._speakers(run, q.memory_id):
                    hits = self.memory.search(q.question, top_k=run.cfg.mem0.top_k,
                                              filters={"user_id": user_id(q.memory_id, speaker)})
                    for hit in hits.get("results", []):
                        metadata = hit.get("metadata") or {}
                        found.append({"speaker": speaker, "memory": hit["memory"], "score": float(hit["score"]),
                                      "timestamp": metadata.get("timestamp"), "id": hit["id"],
                                      "batch": metadata.get("memfit_batch")})
            self.search_seconds.append(time.perf_counter() - started)
            lines = [f"EXCERPT {i} {hit['timestamp']}: {hit['memory']} (from {hit['speaker']}'s memories)"
                     for i, hit in enumerate(found, start=1)]
            rows.append(pack_row(q, self.name, {
                "pack": {"episodes": [], "selected": [], "summaries": []}, "excerpts": "\n".join(lines),
                "retrieval": None, "mem0": found}))
        return rows, self.diagnostics(run)

    def diagnostics(self, run: MethodRun) -> dict[str, Any]:
        assert self.logic is not None
        stored = self.stored_counts(run)
        if not any(stored.values()) and run.memories:
            log.warning("mem0 stored no memory for %d conversations: its LLM (%s) wrote no fact it could parse "
                        "(%d replies unparsed); its answers had no context", len(run.memories),
                        self.logic.reader.model, self.parse_failures.count)
        return {"method": {"name": self.name, "package": f"{PACKAGE} {_version()}", "batch_size": run.cfg.mem0.batch_size,
                           "top_k": run.cfg.mem0.top_k, "max_tokens": run.cfg.mem0.max_tokens,
                           "memories_stored": sum(stored.values()), "memories_per_user": stored,
                           "replies_unparsed": self.parse_failures.count, "add_calls_this_process": self.added_now,
                           "batches_already_added": self.skipped, "batches_retired": self.retired,
                           "served": dict(self.logic.served),
                           "add_seconds": percentiles(self.add_seconds),
                           "search_seconds": percentiles(self.search_seconds)},
                "retrieval_note": "mem0's memories name no turns: hit@k and pack hit are not measurable for it"}

    def close(self) -> None:
        logging.getLogger("mem0").removeHandler(self.parse_failures)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._levels.clear()
        self._close_memory()
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self._own_encoder and self.encoder is not None and hasattr(self.encoder, "close"):
            self.encoder.close()
        self.encoder = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


def _session_scope(user: str) -> str:
    """mem0's scope string for a user's recent messages (its pinned release's own function)."""
    from mem0.memory.main import _build_session_scope  # optional extra: imported only for method=mem0

    return str(_build_session_scope({"user_id": user}))


def percentiles(seconds: list[float]) -> dict[str, float | int | None]:
    """n, P50 and P95 (nearest rank) of timings in seconds; None where there were none (mem0's diagnostics,
    experiments/bench_peers.py)."""
    if not seconds:
        return {"n": 0, "p50": None, "p95": None}
    ordered = sorted(seconds)
    rank = lambda q: ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]  # noqa: E731
    return {"n": len(ordered), "p50": rank(0.50), "p95": rank(0.95)}


def _version() -> str:
    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "not installed"
