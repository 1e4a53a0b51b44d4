"""method=mem0: mem0 (PyPI `mem0ai`, Apache-2.0) from its own package, on the run's reader and encoder.

mem0 is the memory system most papers compare with: an LLM reads each batch of new messages beside the
memories it already holds and writes or updates short facts, which a vector search returns. Here it runs
unmodified (`mem0.Memory`), configured so that everything it asks of "OpenAI" goes to the run's own
reader and bi-encoder through an OpenAI-compatible endpoint on 127.0.0.1 (methods/peers/endpoint.py): its
chat calls are in the response cache and the ledger under `mem0_write` / `mem0_read`, its embeddings under
`mem0_embed_write` / `mem0_embed_read`, counted by the same code as MemFit's. Its vector store is an
embedded on-disk Qdrant and its history SQLite, both in DIR/mem0/; its telemetry is off.

Write, as mem0's LoCoMo evaluation feeds it (its repository's evaluation/src/memzero/add.py): one mem0
user per speaker of a conversation (`<speaker>_<memory id>`); for each session and each speaker, the
session's turns as chat messages "<speaker>: <text>", the speaker's own as `user` and the others' as
`assistant`, added `mem0.batch_size` messages per `add` call, with the session's date as metadata
`timestamp`. mem0's own extraction prompt is used (the evaluation's hosted-platform custom instructions are
not part of the package). Each finished call is marked in DIR/mem0/added.jsonl (after the ledger is saved),
so a killed run resumes without adding a batch twice; a batch whose `add` finished before the kill but not
its mark is found in mem0's own files (its memories' `memfit_batch` payload in Qdrant, or its messages as
the user's last in mem0's history database) and is not added again either.

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

import importlib.util
import logging
import math
import os
import shutil
import tempfile
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from memfit_gpu import faults
from memfit_gpu.data.schema import Memory, Session
from memfit_gpu.files import append_jsonl, read_jsonl
from memfit_gpu.index.encoders.backends import load_bi_encoder
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.methods.peers.endpoint import EndpointLogic, PeerEndpoint, embedder_of
from memfit_gpu.readers.types import MissingBackendError

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
                  max_tokens: int) -> dict[str, Any]:
    """mem0's configuration: its LLM and embedder are "OpenAI" at `base_url` (the run's endpoint), its
    vector store an embedded Qdrant on disk and its history SQLite, both in `folder`."""
    return {
        "llm": {"provider": "openai", "config": {
            "model": llm_model, "openai_base_url": base_url, "api_key": "memfit-local",
            "temperature": temperature, "max_tokens": max_tokens}},
        "embedder": {"provider": "openai", "config": {
            "model": encoder, "openai_base_url": base_url, "api_key": "memfit-local", "embedding_dims": dims}},
        "vector_store": {"provider": "qdrant", "config": {
            "collection_name": COLLECTION, "path": str(folder / "qdrant"), "on_disk": True,
            "embedding_model_dims": dims}},
        "history_db_path": str(folder / "history.db"),
    }


def speakers_of(memory: Memory) -> list[str]:
    """The conversation's speakers: the loader's list, else the turns' speakers in order of appearance."""
    found = list(memory.speakers)
    for session in memory.sessions:
        for turn in session.turns:
            if turn.speaker not in found:
                found.append(turn.speaker)
    return found


def user_id(memory_id: str, speaker: str) -> str:
    """The mem0 user of one speaker of one conversation (mem0's evaluation: `<speaker>_<index>`)."""
    return f"{speaker}_{memory_id}"


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


class Mem0Method:
    name = SYSTEM

    def __init__(self) -> None:
        self.folder: Path | None = None
        self._temporary: Path | None = None
        self.memory: Any = None
        self.logic: EndpointLogic | None = None
        self.endpoint: PeerEndpoint | None = None
        self.encoder: Any = None
        self.parse_failures = _ParseFailures()
        self.added_now = 0  # add calls made by this process
        self.skipped = 0  # batches a mark (or Qdrant) said were added by an earlier process
        self.add_seconds: list[float] = []  # each `add` call of this process (one batch of messages)
        self.search_seconds: list[float] = []  # each question's searches (every speaker) in this process
        self._levels: dict[str, int] = {}  # the loggers quietened while mem0 runs, and their levels before

    # ---- set-up -----------------------------------------------------------------------------------------
    def _open(self, run: MethodRun) -> None:
        if self.memory is not None:
            return
        if run.reader is None:
            raise ValueError("method=mem0 needs the run's reader (its memories are written by an LLM): use memfit run")
        if run.out is not None:
            self.folder = Path(run.out) / "mem0"
        else:
            self._temporary = Path(tempfile.mkdtemp(prefix="memfit-mem0-"))
            self.folder = self._temporary
        self.folder.mkdir(parents=True, exist_ok=True)
        mem0_memory = memory_class(self.folder / "home")
        cfg = run.cfg
        self.encoder = load_bi_encoder(cfg.index)
        self.logic = EndpointLogic(SYSTEM, run.reader(), embedder_of(self.encoder, cfg.index.encoder))
        self.endpoint = PeerEndpoint(self.logic)
        config = memory_config(self.endpoint.start(), self.logic.reader.model, cfg.index.encoder,
                               int(self.encoder.dim), self.folder, cfg.mem0.temperature, cfg.mem0.max_tokens)
        self.memory = mem0_memory.from_config(config)
        logging.getLogger("mem0").addHandler(self.parse_failures)
        for name in QUIET:  # the OpenAI client logs every request at INFO; the ledger records them
            self._levels[name] = logging.getLogger(name).level
            logging.getLogger(name).setLevel(logging.WARNING)

    # ---- write ------------------------------------------------------------------------------------------
    def _added_before_kill(self, user: str, key: str, batch: list[dict[str, str]]) -> bool:
        """Whether an earlier process's `add` of this batch finished before its mark: mem0 keeps each user's
        last messages in its history database as the last step of every add (whatever it extracted), and
        the memories it stored carry the batch's key."""
        points, _ = self.memory.vector_store.list(filters={"user_id": user, "memfit_batch": key}, top_k=1)
        if points:
            return True
        # mem0's own scope string for a user (pinned release); one add's messages share one created_at
        from mem0.memory.main import _build_session_scope  # optional extra, as above

        last = self.memory.db.get_last_messages(_build_session_scope({"user_id": user}), limit=len(batch))
        return sorted((m["role"], m["content"]) for m in last) == sorted((m["role"], m["content"]) for m in batch)

    def write(self, run: MethodRun) -> None:
        self._open(run)
        assert self.folder is not None and self.logic is not None
        marks_path = self.folder / MARKS
        done = {row["batch"] for row in read_jsonl(marks_path)} if marks_path.exists() else set()
        size = max(1, int(run.cfg.mem0.batch_size))
        for memory in run.memories:
            speakers = speakers_of(memory)
            for session in memory.sessions:
                for speaker in speakers:
                    user = user_id(memory.memory_id, speaker)
                    messages = session_messages(session, speaker)
                    for start in range(0, len(messages), size):
                        key = f"{memory.memory_id}\t{session.session_id}\t{speaker}\t{start}"
                        if key in done:
                            self.skipped += 1
                            continue
                        batch = messages[start:start + size]
                        if self._added_before_kill(user, key, batch):
                            append_jsonl(marks_path, [{"batch": key, "stored": None, "found_in_store": True}])
                            self.skipped += 1
                            continue
                        started = time.perf_counter()
                        with self.logic.serve("write", memory.memory_id, key):
                            result = self.memory.add(batch, user_id=user,
                                                     metadata={"timestamp": session.date_text, "memfit_batch": key})
                        self.add_seconds.append(time.perf_counter() - started)
                        self.added_now += 1
                        run.account("mem0.add.ledger")  # the ledger is saved before the mark says done
                        append_jsonl(marks_path, [{"batch": key, "stored": len((result or {}).get("results", []))}])
                        faults.point("mem0.added")

    def stored_counts(self, run: MethodRun) -> dict[str, int]:
        """Memories mem0 holds per mem0 user of the selected conversations."""
        counts = {}
        for memory in run.memories:
            for speaker in speakers_of(memory):
                user = user_id(memory.memory_id, speaker)
                points, _ = self.memory.vector_store.list(filters={"user_id": user}, top_k=1_000_000)
                counts[user] = len(points)
        return counts

    # ---- read -------------------------------------------------------------------------------------------
    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        self._open(run)
        assert self.logic is not None
        by_id = {m.memory_id: m for m in run.memories}
        rows = []
        for q in run.questions:
            found: list[dict[str, Any]] = []
            started = time.perf_counter()
            with self.logic.serve("read", q.memory_id, q.question_id):
                for speaker in speakers_of(by_id[q.memory_id]):
                    hits = self.memory.search(q.question, top_k=run.cfg.mem0.top_k,
                                              filters={"user_id": user_id(q.memory_id, speaker)})
                    for hit in hits.get("results", []):
                        found.append({"speaker": speaker, "memory": hit["memory"], "score": float(hit["score"]),
                                      "timestamp": (hit.get("metadata") or {}).get("timestamp"), "id": hit["id"]})
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
                           "batches_already_added": self.skipped, "served": dict(self.logic.served),
                           "add_seconds": percentiles(self.add_seconds),
                           "search_seconds": percentiles(self.search_seconds)},
                "retrieval_note": "mem0's memories name no turns: hit@k and pack hit are not measurable for it"}

    def close(self) -> None:
        logging.getLogger("mem0").removeHandler(self.parse_failures)
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._levels.clear()
        if self.memory is not None:
            self.memory.close()
            self.memory = None
        if self.endpoint is not None:
            self.endpoint.close()
            self.endpoint = None
        if self.encoder is not None and hasattr(self.encoder, "close"):
            self.encoder.close()
        self.encoder = None
        if self._temporary is not None:
            shutil.rmtree(self._temporary, ignore_errors=True)
            self._temporary = None


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
