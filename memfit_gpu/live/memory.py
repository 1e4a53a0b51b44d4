"""memfit_gpu.Memory: a live memory that an agent writes turn by turn and asks questions of.

A Memory is a folder: `store/` (the EpisodeStore: every turn verbatim in its append-only log, BM25 and
dense indexes), `cache.sqlite` and `ledger.json` (the reader's response cache and its calls, as in a run
directory), `lightmem/` for method=lightmem_slm, and `.lock`: one process writes a memory at a time (the
run-directory lock of locks.py; a second `Memory.open` or `memfit serve` on it is refused naming the
holder's pid). Inside that process every call is thread-safe (one lock; searches and writes take turns).

Every method of the method seam whose registry entry is `live` runs behind it (methods/base.py
LiveMethod: memfit, plain, naive_rag, lightmem_slm, and mem0 from its own package): the Memory owns the
store of turns, whatever the method, and the method derives its own state from it (MemFit: nothing, the
store is its index; naive_rag: chunks; LightMem: MTM notes and an LTM graph; mem0: its own memories, written
by its LLM as turns arrive). So the same turns, encoder and reader serve every method,
and the online table compares them on equal terms.

Batch first, like the rest: `add` takes many turns of many users and writes them as ONE store batch (one
log append, fsynced before it returns, one encoder pass; with `live.indexing: deferred` that pass runs at
the next read, over every turn added since, so no search misses an acknowledged turn); `search` answers every query given with one
batched read of the method (MemFit: one `retrieve_batch`); `answer` makes one reader call per question,
all in one batch. Work that is not on the query path (MemFit's segment summaries, LightMem's notes) is
`consolidate()`, which a background worker runs once a user has `live.consolidate_after_turns` new turns
(`live.consolidate: manual` leaves it to the caller); its LLM calls run without holding the memory.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import threading
from collections.abc import Container, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import faults
from memfit_gpu.config import ConfigError, MemFitConfig, load_config
from memfit_gpu.data.jsonl import date_text, local_time, memory_json
from memfit_gpu.data.schema import Benchmark, DataError, Image, Question, Turn, encoding_problem
from memfit_gpu.data.schema import Memory as DataMemory
from memfit_gpu.devices import in_fresh_thread
from memfit_gpu.files import read_json_object, write_json_atomic
from memfit_gpu.index.encoders import load_bi_encoder
from memfit_gpu.index.tokenize import query_length_problem
from memfit_gpu.locks import exclusive, lock_path
from memfit_gpu.methods.answers import answer_requests
from memfit_gpu.methods.base import Hit, LiveMethod, MethodRun, query
from memfit_gpu.methods.registry import METHODS, method_entry
from memfit_gpu.names import LABEL_MAX, MAX_SPEAKERS, user_id_problem
from memfit_gpu.readers.cache import ResponseCache
from memfit_gpu.readers.clean import clean_answer
from memfit_gpu.readers.ledger import Ledger
from memfit_gpu.readers.prompts import BenchmarkPrompts
from memfit_gpu.readers.reader import Reader, background_calls, make_reader
from memfit_gpu.readers.types import Request, owner_of
from memfit_gpu.run.directory import is_run_directory
from memfit_gpu.store.episodes import DeletePlan, EpisodeStore
from memfit_gpu.store.summaries import summary_records
from memfit_gpu.store.text import episode_body, episode_text

log = logging.getLogger(__name__)

TURN_FIELDS = ("turn_id", "speaker", "text", "timestamp", "session_id", "date_text", "images")
IMAGE_FIELDS = ("caption", "image_id", "path")
LIVE_SESSION = "live"  # the session of a turn given without timestamp or session_id
# The users whose cached replies a compaction must drop, written before the store is rewritten and removed once
# cache.sqlite is: a compaction stopped between the two finishes dropping them when the memory is next opened
FORGET_PENDING = "forget.pending.json"
# A deletion's summaries are rebuilt off the memory, then the deletion planned again: when another call changed
# them meanwhile, this many tries before the deletion lands without its rebuilt summaries.
DELETE_ATTEMPTS = 3


class UnknownUserError(KeyError):
    """A read or delete for a user id that has no live turns in the memory."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "unknown user"


class TurnConflictError(ValueError):
    """An add that reuses a stored turn id of the user with another speaker or text."""


class MemoryClosedError(RuntimeError):
    """A call on a Memory after `close()` (or one a close overtook: a background consolidation)."""


class UserFullError(Exception):
    """An add past what a user may hold (`add_batch`'s max_turns_per_user: memfit serve's
    serve.max_turns_per_user; max_text_bytes_per_user: serve.max_text_mb_per_user). `limit` names which:
    "turns" or "text"."""

    def __init__(self, message: str, limit: str) -> None:
        super().__init__(message)
        self.limit = limit


@dataclass(frozen=True)
class Added:
    """One turn of an add: where it is (turn id, store row) and whether it was there already (the same
    turn id with the same speaker and text: an add retried after a lost reply is stored once)."""

    user_id: str
    turn_id: str
    row: int
    duplicate: bool = False

    def to_json(self) -> dict[str, Any]:
        """As a server replies: without `row`, which counts every user's turns (a user adding a turn now and
        then would watch how many turns the others store)."""
        return {"user_id": self.user_id, "turn_id": self.turn_id, "duplicate": self.duplicate}


@dataclass(frozen=True)
class Answer:
    """One answer call's result: the cleaned answer, the reader's raw text, and the pack it read."""

    user_id: str
    question: str
    answer: str
    raw_output: str
    abstained: bool
    hits: list[Hit]
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"user_id": self.user_id, "question": self.question, "answer": self.answer,
                "raw_output": self.raw_output, "abstained": self.abstained, "error": self.error,
                "hits": [h.to_json() for h in self.hits]}


@dataclass(frozen=True)
class _NewTurn:
    user_id: str
    turn: Turn
    session_id: str


@dataclass
class PreparedAnswers:
    """`Memory.prepare_answers`' result: per request its error or None, and the answer calls to make
    (request index, the question, the hits to return, the method's pack row)."""

    users: list[str]
    results: list[Any]
    calls: list[tuple[int, Question, list[Hit], dict[str, Any]]]
    compactions: int = 0  # Memory's compaction count when the packs were read


@dataclass
class _BatchPlan:
    """What the adds of one write batch planned so far, per user: turn ids with their words, turns, speakers."""

    planned: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)  # (user, turn id) -> words
    counts: dict[str, int] = field(default_factory=dict)  # turns stored or planned
    max_turns: int | None = None  # turns a user may hold, deleted ones until compaction (None: no bound)
    text_bytes: dict[str, int] = field(default_factory=dict)  # episode text stored or planned (UTF-8 bytes)
    max_text_bytes: int | None = None  # episode text a user may hold, deleted turns' until compaction
    speakers: dict[str, set[str]] = field(default_factory=dict)  # speaker names stored or planned


LABELS = ("speaker", "turn_id", "session_id")  # bounded to names.LABEL_MAX characters


def parse_turn(raw: Mapping[str, Any] | Turn, user_id: str, position: int, source: str = "add", *,
               item: str | None = None, where: str = "") -> tuple[Turn, str | None]:
    """A turn as given to `add` (a dict with TURN_FIELDS, or a data.schema.Turn) -> (Turn, session id or
    None). Bad input is a DataError naming the source, the user and turn position, and the field. A caller
    that read the turn from a file names it there instead: `item` (default "user 'u1' turn 3") and `where`,
    the turn's path that prefixes each field ("sessions[1].turns[0]." gives "sessions[1].turns[0].text")."""
    item = f"user {user_id!r} turn {position}" if item is None else item
    if isinstance(raw, Turn):
        return raw, None
    if not isinstance(raw, Mapping):
        raise DataError(source, item, where.rstrip(".") or None, f"a turn is an object with {', '.join(TURN_FIELDS)}, not {type(raw).__name__}")
    unknown = sorted(set(raw) - set(TURN_FIELDS))
    if unknown:
        raise DataError(source, item, f"{where}{unknown[0]}", f"unknown field (a turn has {', '.join(TURN_FIELDS)})")

    def text(key: str, required: bool) -> str | None:
        value = raw.get(key)
        if value is None:
            if required:
                raise DataError(source, item, f"{where}{key}", "is required")
            return None
        if not isinstance(value, str) or (required and not value.strip()):
            raise DataError(source, item, f"{where}{key}", f"must be a non-empty string, got {value!r:.60}")
        problem = encoding_problem(value)
        if problem is not None:
            raise DataError(source, item, f"{where}{key}", problem)
        if key in LABELS and len(value) > LABEL_MAX:
            raise DataError(source, item, f"{where}{key}", f"{len(value):,} characters; a {key} is at most {LABEL_MAX}")
        return value

    speaker, body = text("speaker", True), text("text", True)
    stamp = text("timestamp", False)
    if stamp is not None:
        stamp = _stored_time(stamp, source, item, f"{where}timestamp")
    images = []
    if not isinstance(raw.get("images") or [], (list, tuple)):
        raise DataError(source, item, f"{where}images", f"a list of images, got {type(raw['images']).__name__}")
    for n, image in enumerate(raw.get("images") or []):
        if not isinstance(image, Mapping) or not isinstance(image.get("caption"), str) or set(image) - set(IMAGE_FIELDS):
            raise DataError(source, item, f"{where}images[{n}]", f"an image is an object with a caption and optionally "
                                                          f"image_id, path: got {image!r:.60}")
        for key in IMAGE_FIELDS:
            value = image.get(key)
            if value is not None and not isinstance(value, str):
                raise DataError(source, item, f"{where}images[{n}].{key}", f"must be a string, got {type(value).__name__}")
            problem = None if value is None else encoding_problem(value)
            if problem is not None:
                raise DataError(source, item, f"{where}images[{n}].{key}", problem)
        images.append(Image(image["caption"], image.get("image_id"), image.get("path")))
    written = text("date_text", False)
    turn = Turn(text("turn_id", False) or "", str(speaker), str(body), stamp or "",
                written if written is not None else (date_text(stamp) if stamp else ""), images)
    session = text("session_id", False) or (stamp[:10] if stamp else None)
    if session is None and written and len(written) > LABEL_MAX:
        # with neither a session id nor a timestamp, the date text names the turn's session (_plan_add): a
        # label, bounded as a session_id is
        raise DataError(source, item, f"{where}date_text", f"{len(written):,} characters; a date_text is at most "
                                                           f"{LABEL_MAX} when it names the session (a turn without "
                                                           "session_id or timestamp)")
    return turn, session


def _import_turns(memory: DataMemory) -> list[tuple[str, dict[str, Any]]]:
    """A memory's turns as `import_memories` adds them, each with its path in the own-data format
    ("sessions[1].turns[0].", what a refusal names)."""
    return [(f"sessions[{s}].turns[{t}].",
             {"turn_id": turn.turn_id, "speaker": turn.speaker, "text": turn.text, "session_id": session.session_id,
              **({"timestamp": turn.timestamp} if turn.timestamp else {}), "date_text": turn.date_text,
              **({"images": [{"caption": i.caption, **({"image_id": i.image_id} if i.image_id else {})}
                             for i in turn.images]} if turn.images else {})})
            for s, session in enumerate(memory.sessions) for t, turn in enumerate(session.turns)]


def import_problems(memories: Sequence[DataMemory], source: str = "import",
                    items: Sequence[str] | None = None) -> list[DataError]:
    """Why `import_memories` would refuse these memories for what they hold, found without opening a memory
    (`memfit store import` checks a file before it creates or opens anything): a user id outside
    names.USER_ID_RULE, and each turn `add` refuses (parse_turn, the rules add applies). One DataError per
    bad user id or turn, naming `source`, the memory (items[n], default "user 'u1'") and the field by its
    path in the own-data format ("sessions[1].turns[0].text"). What depends on the memory's content (a turn
    id stored with other words, a user past its 63 speakers) is refused by the import itself."""
    problems: list[DataError] = []
    for n, memory in enumerate(memories):
        item = items[n] if items is not None else f"user {memory.memory_id!r}"
        problem = user_id_problem(memory.memory_id)
        if problem is not None:
            problems.append(DataError(source, item, "user_id", problem))
            continue
        for position, (where, raw) in enumerate(_import_turns(memory)):
            try:
                parse_turn(raw, memory.memory_id, position, source, item=item, where=where)
            except DataError as exc:
                problems.append(exc)
        problems += _summary_problems(memory, source, item)
    return problems


def _stored_time(value: Any, source: str, item: str | None, field_path: str) -> str:
    """A turn's or an imported summary's time by data/jsonl.py's rule (a file's times), as a DataError naming
    the field."""
    try:
        return local_time(value)
    except ValueError as exc:
        raise DataError(source, item, field_path, str(exc)) from None


def _summary_problems(memory: DataMemory, source: str, item: str) -> list[DataError]:
    """Why a memory's exported summaries (`extra["summaries"]`) would fail once its turns are stored: checked
    first, so that the import stays all or nothing (data/jsonl.py checks a file's the same way)."""
    problems: list[DataError] = []
    own = {turn.turn_id for session in memory.sessions for turn in session.turns}
    for n, summary in enumerate(memory.extra.get("summaries", [])):
        where = f"summaries[{n}]."
        if not isinstance(summary, dict):
            problems.append(DataError(source, item, f"summaries[{n}]", "expected an object"))
            continue
        text, covered = summary.get("text"), summary.get("turn_ids")
        if not isinstance(text, str) or not text.strip():
            problems.append(DataError(source, item, f"{where}text", "a summary's text is a non-empty string"))
        if (not isinstance(covered, (list, tuple)) or not covered
                or not all(isinstance(t, str) and t in own for t in covered)):
            problems.append(DataError(source, item, f"{where}turn_ids",
                                      "a list of the turn ids of this memory's own turns, at least one"))
        for name in ("event", "recorded"):
            try:
                if summary.get(name) is not None:
                    _stored_time(summary[name], source, item, f"{where}{name}")
            except DataError as exc:
                problems.append(exc)
    return problems


def _check_queries(texts: Sequence[Any], k: int) -> None:
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"k={k!r:.40}: ask for at least one hit (an integer >= 1)")
    if isinstance(texts, (str, bytes)) or not texts:
        raise ValueError("give a non-empty list of queries")
    for n, text in enumerate(texts):
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"queries[{n}]: a query is a non-empty string, got {ascii(text)[:60]}")
        problem = encoding_problem(text)
        if problem is not None:
            raise ValueError(f"queries[{n}]: {problem}")
        problem = query_length_problem(text)
        if problem is not None:
            raise ValueError(f"queries[{n}]: {problem}")


def _check_question_date(value: Any) -> None:
    """An answer request's question_date: free text the prompt quotes as the current date."""
    if not isinstance(value, str):
        raise ValueError(f"question_date: a string (the current date as the prompt writes it), got "
                         f"{type(value).__name__}")
    problem = encoding_problem(value)
    if problem is not None:
        raise ValueError(f"question_date: {problem}")


def _names(values: Any, what: str) -> list[str]:
    """A list of ids (turn ids, user ids): one string given alone is refused, not read letter by letter."""
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{what} must be a list of strings, got {type(values).__name__} {values!r:.40}")
    for n, value in enumerate(values):
        if not isinstance(value, str):
            raise TypeError(f"{what}[{n}] must be a string, got {type(value).__name__}")
    return list(values)


def _as_batch(user_ids: str | Sequence[str], items: Sequence[Any], what: str) -> list[tuple[str, Any]]:
    """(user, item) pairs: one user for every item, or one user per item."""
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise TypeError(f"{what} must be a list, got {type(items).__name__}")
    if isinstance(user_ids, str):
        return [(user_ids, item) for item in items]
    users = list(user_ids)
    if len(users) != len(items):
        raise ValueError(f"{len(users)} user ids for {len(items)} {what}: give one user id, or one per item")
    for user in users:
        if not isinstance(user, str) or not user:
            raise ValueError(f"a user id is a non-empty string, got {user!r}")
    return list(zip(users, items, strict=True))


class Memory:
    """A live memory (module doc). Open it with `Memory.open`; close it (or use `with`)."""

    def __init__(self, path: Path, cfg: MemFitConfig, lock: contextlib.ExitStack) -> None:
        self.path, self.cfg = path, cfg
        self._exit = lock
        self._lock = threading.RLock()
        self._consolidating = threading.Lock()  # one consolidation at a time
        self._compacting = threading.Lock()  # one compaction at a time, its erasure of cached replies included
        self._loading_reader = threading.Lock()
        self.entry = method_entry(cfg.method)
        self.ledger_path = path / "ledger.json"
        # counts only (Ledger.per_question): its keys would grow by one per answer and name users
        self.ledger = (Ledger.load(self.ledger_path, per_question=False) if self.ledger_path.exists()
                       else Ledger(per_question=False))
        self._reader: Reader | None = None
        # compactions so far, and per user the compaction count at which its cached replies were last dropped: a
        # reply to a request prepared before that (its prompt may quote a deleted turn) is dropped again
        self._compactions = 0
        self._forgotten_at: dict[str, int] = {}
        self.store = EpisodeStore(path / "store", cfg, load_bi_encoder(cfg.index))  # finishes a killed compaction
        self.method: LiveMethod = self.entry.make()  # type: ignore[assignment]
        self.run = self._method_run([])
        self.method.attach(self.run, self.store)
        if (path / FORGET_PENDING).exists():
            # a compaction stopped after the store's rows were renumbered may have stopped before the method's
            # files followed them (LightMem's notes name rows): following again is the same on either side
            self.method.compact(self.run, self.store, self._pending_forget())
        self._finish_pending_forget()
        # per user: its turns no consolidation has taken up yet (added since, or before this open)
        self._new_turns: dict[str, int] = {
            u: n for u, n in self.method.unconsolidated(list(self.store.memory_ids)).items() if n}
        self._since_snapshot = 0
        self._closed = False
        self._wake = threading.Event()
        self._worker: threading.Thread | None = None
        self.consolidation_error: BaseException | None = None
        # the background worker's failures per user: the waiting count it failed at; it tries that user again once
        # more turns wait (an explicit consolidate() tries at once), not at every other user's add
        self._failed_at: dict[str, int] = {}
        if cfg.live.consolidate == "background":
            self._worker = threading.Thread(target=self._consolidate_forever, name="memfit-consolidate", daemon=True)
            self._worker.start()
            self._wake_if_due()

    # --------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, path: str | Path, config: str | Path | MemFitConfig | None = None, *, method: str | None = None,
             overrides: Sequence[str] = ()) -> Memory:
        """Open (or create) the memory in folder `path`.

        Args:
            config: a YAML config (configs/demo.yaml), a MemFitConfig, or None for the defaults.
            method: the method to run (default: the config's `method`); any registered live method.
            overrides: dot-list overrides on a YAML config (rerank.backend=none).
        Raises:
            ConfigError: the method is not live, or a bad config value; or `path` is a run directory.
            DirectoryBusyError: another process has this memory open.
        """
        if is_run_directory(path):
            raise ConfigError(f"{path}: a run directory (config.yaml inside), a finished experiment whose packs and "
                              "predictions were made from its store as it is: not opened as a live memory (open a new "
                              "folder; `memfit store import` adds an own-data file to it)")
        if isinstance(config, MemFitConfig):
            if overrides:
                raise ConfigError("overrides apply to a YAML config; pass a MemFitConfig already overridden")
            cfg = config
        else:
            cfg = load_config(config, overrides)
        if method is not None:
            cfg = replace(cfg, method=method)
        entry = method_entry(cfg.method)
        if not entry.live:
            raise ConfigError(f"method={cfg.method} has no live write path (live methods: "
                              f"{', '.join(live_methods())})")
        noise = {name: value for name, value in asdict(cfg.lightmem.noise).items() if name != "seed" and value}
        if noise:  # its replacements are drawn from the other memories: in a live memory, other users' words
            raise ConfigError(f"{', '.join(f'lightmem.noise.{n}={v}' for n, v in noise.items())}: error injection is "
                              "for benchmark runs; in a live memory it would put other users' notes and queries "
                              "into a user's memory. Set it to 0")
        # durable when add returns: every write batch is fsynced; the memory's own folder holds the store
        cfg = replace(cfg, store=replace(cfg.store, fsync=True, path=None))
        folder = Path(path)
        created = not folder.exists()
        folder.mkdir(parents=True, exist_ok=True)
        stack = contextlib.ExitStack()
        stack.enter_context(exclusive(lock_path(folder), "close the Memory (or stop `memfit serve`) that has it open"))
        try:
            return cls(folder, cfg, stack)
        except BaseException:
            if created:  # an open that failed leaves no folder it made (its lock file, a store with nothing in it);
                shutil.rmtree(folder, ignore_errors=True)  # removed while the lock is held: no other open is in it
            stack.close()
            raise

    def _method_run(self, questions: list[Question]) -> MethodRun:
        return MethodRun(self.cfg, self.path, Benchmark("live", str(self.path)), [], questions, reader=self.reader,
                         account=self._account)

    def _account(self, point: str) -> None:
        """MethodRun.account: the ledger saved, then the kill point passed (as in a run)."""
        self.ledger.save(self.ledger_path)
        faults.point(point)

    def reader(self) -> Reader:
        """The memory's reader (reader.*): loaded on first use, cached in cache.sqlite, counted in ledger.json."""
        with self._loading_reader:  # its own lock: loading a model (seconds) holds no search or add
            if self._reader is None:
                self._reader = make_reader(self.cfg.reader, self.path, ledger=self.ledger, progress=False,
                                           per_owner=True)
            return self._reader

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Hold the memory (no add, search or delete runs meanwhile)."""
        with self._lock:
            self._check_open()
            yield

    def _check_open(self) -> None:
        if self._closed:
            raise MemoryClosedError(f"the Memory at {self.path} is closed")

    # ---------------------------------------------------------------------------------------- writes
    def add(self, user_id: str | Sequence[str], turns: Sequence[Any]) -> list[Added]:
        """Store turns, durably: when add returns, its log record is fsynced.

        add("u1", [turn, ...]) stores turns of one user; add(["u1", "u2"], [[...], [...]]) one list of
        turns per user. A turn is a dict: speaker, text (required), timestamp (ISO 8601 local time),
        turn_id (default t1, t2, ... per user), session_id (default the timestamp's day), date_text
        (default "1:56 pm on 8 May, 2023" from the timestamp), images ([{caption, image_id, path}]).
        User ids follow names.USER_ID_RULE. Everything is one write batch: one log append, one encoder
        pass (live.indexing=deferred: at the next read, with every turn added since). All or nothing:
        when any turn of the call is refused (bad input, a turn id the user already has with other words:
        TurnConflictError, a user past its 63 speakers), nothing of the call is stored, for any user, and
        the error is raised; a turn id the user already has with the same speaker and text is not stored
        again (`duplicate`), so a retried call stores each turn once. Returns one Added per turn, in order."""
        if isinstance(user_id, str):
            requests = [(user_id, list(turns))]
        else:
            requests = [(u, list(t)) for u, t in _as_batch(user_id, turns, "turn lists")]
        results = self.add_batch(requests, atomic=True)
        return [added for result in results for added in result]  # type: ignore[union-attr]

    def add_batch(self, requests: Sequence[tuple[str, Sequence[Any]]], atomic: bool = False,
                  max_turns_per_user: int | None = None,
                  max_text_bytes_per_user: int | None = None) -> list[list[Added] | BaseException]:
        """Several adds (user id, turns) as ONE write batch (what the server's dynamic batching sends):
        per add, its Added list, or the error that refused that add alone (bad input, a turn-id conflict,
        too many speakers); the others are stored. Every add is checked whole before anything is logged,
        so a refused add leaves nothing behind; if the batched write itself fails, each add is written
        alone, so one add's failure is its own. atomic: refuse the whole batch (raise the first error,
        store nothing) when any add is refused (`add`). max_turns_per_user, max_text_bytes_per_user: an add
        that would leave its user holding more turns, or more bytes of episode text (UTF-8, as stored: the
        date and speaker prefix included), deleted ones counting until `compact`, is refused (UserFullError)."""
        parsed: list[list[tuple[Turn, str | None]] | BaseException] = []
        for user, turns in requests:
            try:
                problem = user_id_problem(user)
                if problem is not None:
                    raise DataError("add", None, "user_id", problem)
                parsed.append([parse_turn(t, user, n) for n, t in enumerate(turns)])
            except (DataError, TypeError) as exc:
                parsed.append(exc)
        with self.holding():
            outcome: list[list[Added] | BaseException] = []
            fresh: list[_NewTurn] = []
            plan = _BatchPlan(max_turns=max_turns_per_user, max_text_bytes=max_text_bytes_per_user)
            for (user, _), turns in zip(requests, parsed, strict=True):
                if isinstance(turns, BaseException):
                    outcome.append(turns)
                    continue
                try:
                    outcome.append(self._plan_add(user, turns, fresh, plan))
                except (TurnConflictError, DataError, UserFullError) as exc:
                    outcome.append(exc)
            if atomic:
                refused = next((o for o in outcome if isinstance(o, BaseException)), None)
                if refused is not None:
                    raise refused
            try:
                rows = self.store.append_turns([(t.user_id, t.turn, t.session_id, ()) for t in fresh],
                                               index=self.cfg.live.indexing == "on_add")
            except Exception:
                writing = [i for i, o in enumerate(outcome) if not isinstance(o, BaseException)
                           and any(not a.duplicate for a in o)]
                if atomic or len(writing) < 2:
                    raise
                # the store logged nothing of the failed batch (EpisodeStore._commit): write each add alone
                log.warning("memfit live: a write batch of %d adds failed; writing each alone", len(writing))
                for i in writing:
                    try:  # one add's failure is its own: the adds stored before and after it are answered as such
                        outcome[i] = self.add_batch([requests[i]], max_turns_per_user=max_turns_per_user,
                                                    max_text_bytes_per_user=max_text_bytes_per_user)[0]
                    except Exception as exc:  # noqa: BLE001  (that add's answer)
                        outcome[i] = exc
                return outcome
            row_of = {(t.user_id, t.turn.turn_id): row for t, row in zip(fresh, rows, strict=True)}
            outcome = [o if isinstance(o, BaseException) else
                       [a if a.duplicate else replace(a, row=row_of[(a.user_id, a.turn_id)]) for a in o]
                       for o in outcome]
            touched = list(dict.fromkeys(t.user_id for t in fresh))
            if touched:
                self.method.changed(self.run, touched)
                for user in touched:
                    self._new_turns[user] = self._new_turns.get(user, 0) + sum(1 for t in fresh if t.user_id == user)
                self._since_snapshot += len(fresh)
                if self._since_snapshot >= self.cfg.live.snapshot_after_turns:
                    self._snapshot()
                self._wake_if_due()
            return outcome

    def _snapshot(self) -> None:
        """A snapshot after writes the log already holds (fsynced): one that fails (a full disk) is logged, not
        raised, so that a stored write is never answered as failed (its client would store it again); the
        next open replays the log past the last snapshot, and the next write batch tries again."""
        try:
            self.store.snapshot()
        except Exception:  # noqa: BLE001
            log.exception("memfit live: %s: a snapshot failed; the log holds every write (opening replays it)",
                          self.path)
            return
        self._since_snapshot = 0

    def _plan_add(self, user: str, turns: list[tuple[Turn, str | None]], fresh: list[_NewTurn],
                  plan: _BatchPlan) -> list[Added]:
        """The Added of one request's turns; its new turns join `fresh` (and the batch's plan) only when
        none is refused (a conflicting turn id, a speaker past MAX_SPEAKERS)."""
        mine: list[_NewTurn] = []
        out: list[Added] = []
        mine_planned: dict[tuple[str, str], tuple[str, str]] = {}
        known = user in self.store.memory_ids
        if user not in plan.counts:
            plan.counts[user] = len(self.store.memory_rows(self.store.memory_of(user), live=False)) if known else 0
            plan.speakers[user] = set(self.store.memory_speakers[self.store.memory_of(user)]) if known else set()
            plan.text_bytes[user] = self.store.text_bytes(user) if known else 0
        speakers = set(plan.speakers[user])
        count, text_bytes = plan.counts[user], plan.text_bytes[user]
        # an automatic id takes none of the ids this add names; a later add of the batch is planned as if it
        # came after this one (a batch is its adds one after another), so its ids are not reserved here
        given = {(user, turn.turn_id) for turn, _ in turns if turn.turn_id}
        for position, (turn, session) in enumerate(turns):
            if not turn.turn_id:
                turn = replace(turn, turn_id=self._next_turn_id(user, count, plan.planned, mine_planned, given))
            key = (user, turn.turn_id)
            words = (turn.speaker, episode_body(turn))  # as the store keeps it: image captions first
            earlier = plan.planned.get(key) or mine_planned.get(key)
            row = self.store.has_turn(user, turn.turn_id) if known else None
            if row is not None:
                earlier = (self.store.speaker_name(row), self.store.body(row))
            if earlier is not None:
                if earlier != words:
                    raise TurnConflictError(f"user {user!r} turn {turn.turn_id!r}: that turn id is already stored "
                                            f"with other words ({earlier[0]}: {earlier[1][:60]!r})")
                out.append(Added(user, turn.turn_id, -1 if row is None else row, duplicate=True))
                continue
            speakers.add(turn.speaker)
            if len(speakers) > MAX_SPEAKERS:
                raise DataError("add", f"user {user!r} turn {position}", "speaker",
                                f"{turn.speaker!r:.40} would be the user's {len(speakers)}th speaker; a user's "
                                f"memory holds at most {MAX_SPEAKERS} speakers")
            mine_planned[key] = words
            mine.append(_NewTurn(user, turn, session or turn.date_text or LIVE_SESSION))
            out.append(Added(user, turn.turn_id, -1))
            count += 1
            text_bytes += len(episode_text(turn).encode("utf-8"))  # what the store's text column will hold
        if plan.max_turns is not None and count > plan.max_turns:
            raise UserFullError(f"user {user!r} would hold {count:,} turns (deleted ones count until compaction); "
                                f"at most {plan.max_turns:,}", "turns")
        if plan.max_text_bytes is not None and text_bytes > plan.max_text_bytes:
            raise UserFullError(f"user {user!r} would hold {text_bytes:,} bytes of turn text (deleted turns count "
                                f"until compaction); at most {plan.max_text_bytes:,}", "text")
        plan.planned.update(mine_planned)
        plan.speakers[user] = speakers
        plan.counts[user], plan.text_bytes[user] = count, text_bytes
        fresh.extend(mine)
        return out

    def _next_turn_id(self, user: str, count: int, *taken: Container[tuple[str, str]]) -> str:
        n = count + 1
        while any((user, f"t{n}") in t for t in taken) or (
                user in self.store.memory_ids and self.store.has_turn(user, f"t{n}") is not None):
            n += 1
        return f"t{n}"

    def delete(self, user_id: str, turn_ids: Sequence[str]) -> dict[str, int]:
        """Delete turns of a user (SPEC write path 5): gone from every index at once; a summary covering one
        is retired and rebuilt over the rest with the reader. Their text leaves the disk with `compact()`.
        A deletion never waits on the reader's health: when the rebuild fails (the reader unreachable), the
        turns are deleted and the covering summaries retired all the same, and their segment stays without
        a summary (logged; `summaries_rebuilt` counts what was rebuilt)."""
        turn_ids = _names(turn_ids, "delete: turn_ids")
        if not turn_ids:
            raise ValueError(f"delete: no turn ids given for user {user_id!r}")

        def planned() -> DeletePlan:  # holding the memory
            self._live_rows(user_id)
            try:
                return self.store.plan_delete(user_id, [self.store.row_of(user_id, t) for t in turn_ids])
            except KeyError as exc:
                raise UnknownUserError(str(exc.args[0])) from None

        with self.holding():
            plan = planned()
            if not plan.rebuilds:
                return self._commit_delete(plan, [], generated=False)
        # the rebuilt summaries' LLM calls hold neither the memory (every user's searches and writes go on) nor
        # the reader ahead of answers waiting (background work); the deletion lands with them, planned again,
        # and rebuilt again (still off the memory) when another call changed this user's summaries meanwhile
        for attempt in range(DELETE_ATTEMPTS):
            with background_calls():
                rebuilt = self._rebuilt(plan)
            with self.holding():
                again = planned()
                if rebuilt is None or again.same_as(plan):
                    return self._commit_delete(again, [] if rebuilt is None else rebuilt, generated=rebuilt is not None)
                if attempt == DELETE_ATTEMPTS - 1:  # the user's summaries keep changing: the deletion goes first
                    log.warning("memfit live: %s: a deletion's summaries changed under it %d times; the turns are "
                                "deleted and the covering summaries retired without a rebuild", self.path,
                                DELETE_ATTEMPTS)
                    return self._commit_delete(again, [], generated=True)
            plan = again
        raise AssertionError("unreachable")

    def _rebuilt(self, plan: DeletePlan) -> list[dict[str, Any]] | None:
        """The summaries rebuilt over a deletion's remaining turns, or None when the reader failed (the
        deletion goes ahead without them)."""
        try:
            return summary_records(plan.rebuilds, self._summary_generate, self.cfg.summary, 0)
        except Exception as exc:  # noqa: BLE001  (a deletion must not wait on the reader)
            log.warning("memfit live: %s: a deletion's %d summar%s could not be rebuilt (%s: %s); the turns are "
                        "deleted and the covering summaries retired, their segment left without one", self.path,
                        len(plan.rebuilds), "y" if len(plan.rebuilds) == 1 else "ies", type(exc).__name__,
                        str(exc)[:200])
            return None

    def _commit_delete(self, plan: DeletePlan, rebuilt: list[dict[str, Any]], generated: bool) -> dict[str, int]:
        """The deletion and its rebuilt summaries in one write batch (holding the memory); the ledger saved
        first when calls were made (the store never logs a summary whose call the ledger does not know)."""
        if generated:
            self._account("summaries.ledger")
        counts = self.store.commit_delete(plan, rebuilt)
        self.method.changed(self.run, [plan.memory_id])
        return counts

    def delete_user(self, user_id: str) -> dict[str, int]:
        """Delete every turn of a user (and the summaries over them): nothing of it is found any more;
        after `compact()` its turns' text and vectors are not on disk either."""
        with self.holding():
            counts = self.store.delete_rows(user_id, self._live_rows(user_id), self._summary_generate)
            self.method.changed(self.run, [user_id])
            self._new_turns.pop(user_id, None)
            self._failed_at.pop(user_id, None)
            return counts

    def _summary_generate(self, prompts: list[str]) -> list[str]:
        requests = [Request([{"role": "user", "content": str(p)}], role="summary",
                            max_new_tokens=self.cfg.summary.max_new_tokens, temperature=self.cfg.summary.temperature,
                            key=f"summary:{i}", owner=owner_of(p)) for i, p in enumerate(prompts)]
        return [r.text.strip() for r in self.reader().generate(requests)]

    def compact(self) -> dict[str, int]:
        """Rewrite the store on disk without deleted turns (EpisodeStore.compact), then reopen it: the
        same search results, and deleted text is nowhere under the folder. A user every turn of whom was
        deleted is erased from every file: the store keeps no record of it, the method's own files follow,
        and cache.sqlite drops every response and call record its data went into (ledger.json keeps the
        counts). A user some of whose turns were deleted loses every cached response (answers and summaries
        may quote those turns; they are asked again when needed), not its call records.

        The cached replies are dropped once the memory is no longer held: that waits for the reader's turn
        (an answer being generated for another user), which would otherwise hold every user's searches and
        adds. A kill before they are dropped leaves the pending record, and the next open drops them. A
        compaction first waits for a consolidation in flight (it planned over the rows a compaction
        renumbers; the next one plans anew); other users' searches and adds go on meanwhile."""
        # a consolidation in flight planned its summaries and notes over the rows as they are: the compaction
        # renumbers them (and the users), so it waits for the consolidation, and the next one plans anew
        with self._consolidating, self._compacting:
            pending = self.path / FORGET_PENDING
            with self.holding():
                counts, erased, purged = self._compact_store(pending)
            counts.update({f"cache_{k}_dropped": v for k, v in self._forget(erased, purged).items()})
            pending.unlink(missing_ok=True)
            return counts

    def _compact_store(self, pending: Path) -> tuple[dict[str, int], list[str], list[str]]:
        """compact's part that holds the memory: the store rewritten and reopened, the method following it;
        (counts, users erased, users with deleted turns)."""
        purged = self.store.memories_with_deleted_turns()
        if purged:  # before the store is rewritten: a kill after it still drops their replies (on open)
            write_json_atomic(pending, {"responses_of": purged})
            faults.point("compact.pending")
        waiting = self.method.unconsolidated([u for u in purged if u in self.store.memory_ids])
        counts = self.store.compact()
        erased = self.store.erased
        self.store = EpisodeStore(self.path / "store", self.cfg, self.store.encoder)
        self.method.compact(self.run, self.store, purged)  # the method follows (rows were renumbered)
        faults.point("compact.method")
        # what the method dropped with the deleted turns (LightMem: the users' notes, whose windows moved)
        # is made again by the next consolidation, whatever live.consolidate_after_turns says
        present = [u for u in purged if u in self.store.memory_ids]
        for user, n in self.method.unconsolidated(present).items():
            if n > waiting.get(user, 0):
                self._new_turns[user] = max(n, self._new_turns.get(user, 0), self.cfg.live.consolidate_after_turns)
                self._failed_at.pop(user, None)  # what the worker failed at is gone with the compaction
        self._wake_if_due()
        counts["users_erased"] = len(erased)
        counts["users_with_deleted_turns"] = len(purged)
        self._compactions += 1
        self._forgotten_at.update(dict.fromkeys(purged, self._compactions))
        return counts, list(erased), purged

    def _pending_forget(self) -> list[str]:
        """The users of FORGET_PENDING: those with deleted turns when the last compaction began."""
        pending = self.path / FORGET_PENDING
        users = read_json_object(pending, fields={"responses_of": list})["responses_of"]
        if not all(isinstance(user, str) for user in users):  # erasing other names would leave theirs behind
            raise DataError(str(pending), None, "responses_of", "expected a list of user ids; nothing was dropped")
        return users

    def _finish_pending_forget(self) -> None:
        """Drop the cached replies a compaction stopped before dropping (FORGET_PENDING), then its record: every
        reply of those users, and every call record of those the store no longer holds (erased)."""
        pending = self.path / FORGET_PENDING
        if not pending.exists():
            return
        users = self._pending_forget()
        log.warning("memfit live: %s: finishing the last compaction's erasure of %d user(s)' cached replies",
                    self.path, len(users))
        self._forget([u for u in users if u not in self.store.memory_ids], users)
        pending.unlink()

    def _forget_stale(self, users: Sequence[str], compactions: int) -> None:
        """Drop again the cached replies of the users that a compaction erased after `compactions` (the count
        when a request was prepared: its reply, committed since, may quote a deleted turn). Call it without
        holding the memory: dropping waits for the reader's turn."""
        with self._lock:
            stale = sorted({u for u in users if self._forgotten_at.get(u, 0) > compactions})
        if stale:
            self._forget([], stale)

    def _forget(self, users: Sequence[str], responses_of: Sequence[str] = ()) -> dict[str, int]:
        """Every cached response and call record of `users`, and the cached responses of `responses_of`,
        dropped from cache.sqlite (rewritten), and ledger.json written again (counts only)."""
        if not users and not responses_of:
            return {"responses": 0, "calls": 0}
        if self._reader is not None and self._reader.cache is not None:
            dropped = self._reader.forget(users, responses_of)  # no commit of its meanwhile
        elif (self.path / "cache.sqlite").exists():
            cache = ResponseCache(self.path / "cache.sqlite")
            try:
                dropped = cache.forget(users, responses_of)
            finally:
                cache.close()
        else:
            dropped = {"responses": 0, "calls": 0}
        self.ledger.save(self.ledger_path)
        return dropped

    def consolidate(self, user_ids: Sequence[str] | None = None) -> dict[str, int]:
        """The write-time work of the method that stays off the query path (MemFit: segment summaries of
        the new turns; lightmem_slm: MTM notes and LTM consolidation), for the given users (default: those
        with turns waiting, also turns added before this memory was opened: LiveMethod.unconsolidated).
        Its LLM calls do not hold the memory; searches go on meanwhile, and answers waiting for the reader go
        between its chunks of calls (readers.reader.background_calls)."""
        with self._consolidating:
            with self.holding():
                users = (_names(user_ids, "consolidate: user_ids") if user_ids is not None
                         else [u for u, n in self._new_turns.items() if n])
                users = [u for u in users if u in self.store.memory_ids]
                taken = {user: self._new_turns.get(user, 0) for user in users}
                for user in users:
                    self._new_turns[user] = 0
                compactions = self._compactions
            if not users:
                return {}
            try:
                with background_calls():  # answers waiting for the reader go first, a chunk at a time
                    counts = self.method.consolidate(self.run, users, self.holding)
            except BaseException:
                with self._lock:  # those turns still wait (and turns added meanwhile)
                    for user, n in taken.items():
                        if user in self.store.memory_ids:
                            self._new_turns[user] = self._new_turns.get(user, 0) + n
                raise
            with self.holding():
                for user in users:
                    self._failed_at.pop(user, None)
                self._snapshot()
            self._forget_stale(users, compactions)
            return counts

    def _wake_if_due(self) -> None:
        """Wake the background consolidation when a user has live.consolidate_after_turns turns waiting."""
        if self._worker is not None and any(
                n >= self.cfg.live.consolidate_after_turns for n in self._new_turns.values()):
            self._wake.set()

    def _consolidate_forever(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            try:
                ready = [u for u, n in list(self._new_turns.items())
                         if n >= self.cfg.live.consolidate_after_turns and n > self._failed_at.get(u, 0)]
                if ready:  # on a thread of its own that then ends (devices.in_fresh_thread says why)
                    self._consolidate_apart(ready)
            except BaseException as exc:  # noqa: BLE001  (kept for the owner; the worker must not die silently)
                if isinstance(exc, MemoryClosedError):  # the next open finds those turns waiting (unconsolidated)
                    log.info("memfit live: %s closed during a background consolidation; it is taken up on the "
                             "next open", self.path)
                    return
                log.exception("memfit live: background consolidation failed")
                self.consolidation_error = exc

    def _consolidate_apart(self, users: list[str]) -> None:
        """The worker's consolidation of `users`, one batch; when it fails, each user alone, so that what one
        user's turns make fail (a prompt too long for the reader's server) fails that user only. A user that
        fails waits for more turns before the worker tries it again; the first failure is raised."""
        try:
            in_fresh_thread(self.consolidate, users)
            return
        except MemoryClosedError:
            raise
        except Exception as exc:  # noqa: BLE001  (tried again apart; raised below when a user fails alone)
            if len(users) == 1:
                self._failed_at[users[0]] = self._new_turns.get(users[0], 0)
                raise
            log.warning("memfit live: consolidating %d users together failed (%s); consolidating each alone",
                        len(users), exc)
        first: Exception | None = None
        for user in users:
            try:
                in_fresh_thread(self.consolidate, [user])
            except MemoryClosedError:
                raise
            except Exception as exc:  # noqa: BLE001
                self._failed_at[user] = self._new_turns.get(user, 0)
                log.warning("memfit live: consolidating user %r failed: %s", user, exc)
                first = first or exc
        if first is not None:
            raise first

    # ----------------------------------------------------------------------------------------- reads
    def users(self) -> list[str]:
        """User ids with at least one live turn."""
        with self.holding():
            return [u for u in self.store.memory_ids if self.store.live_turns(u)]

    def turns(self, user_id: str) -> list[dict[str, Any]]:
        """A user's live turns in conversation order: turn_id, speaker, text, timestamp, session_id."""
        with self.holding():
            out = []
            for row in self._live_rows(user_id):
                stamp = self.store.timestamp[row]
                out.append({"turn_id": str(self.store.turn_id[row]), "speaker": self.store.speaker_name(row),
                            "text": self.store.body(row), "timestamp": None if np.isnat(stamp) else str(stamp),
                            "session_id": self.store.session_ids[int(self.store.session_idx[row])]})
            return out

    def export(self, user_id: str, summaries: bool = False) -> dict[str, Any]:
        """A user's live turns (and with `summaries`, its live segment summaries with the turn ids they
        cover) as one line of the own-data jsonl format (data/jsonl.py): sessions in the order their
        first turn came, each turn with its id, speaker, text, timestamp, date text and images (caption
        and id; the store keeps no image paths). `import_memories` of it into an empty memory stores the
        same episodes, so searches give the same results."""
        with self.holding():
            store = self.store
            self._live_rows(user_id)
            memory = store.conversation(user_id)
            if summaries:
                table = store.summaries
                memory.extra["summaries"] = [
                    {"text": table.text[s], "turn_ids": [str(store.turn_id[int(r)]) for r in table.members[s]],
                     "event": None if np.isnat(table.event_time.view[s]) else str(table.event_time.view[s]),
                     "recorded": None if np.isnat(table.recorded_time.view[s]) else str(table.recorded_time.view[s])}
                    for s in table.live_rows(store.memory_of(user_id))]
            return memory_json(memory)

    def import_memories(self, memories: Sequence[DataMemory]) -> dict[str, int]:
        """Add memories (what `export` wrote, read back by data/jsonl.py, or any benchmark's) as users: one
        all-or-nothing add of every turn (ids, sessions, timestamps, date texts, images), then each
        memory's exported summaries with their provenance. Importing a file again stores nothing twice.
        A memory `add` would refuse is refused first (`import_problems`: the first one, its field named by
        its path, sessions[i].turns[j].text, not by its place in the one add)."""
        problems = import_problems(memories)
        if problems:
            raise problems[0]
        turns = [[raw for _, raw in _import_turns(m)] for m in memories]
        added = self.add([m.memory_id for m in memories], turns) if memories else []
        records = []
        with self.holding():
            for memory in memories:
                for summary in memory.extra.get("summaries", []):
                    times = {name: None if summary.get(name) is None else _stored_time(summary[name], "import", None, name)
                             for name in ("event", "recorded")}  # as the store keeps a turn's (checked above)
                    records.append({"t": "summary", "row": 0, "memory": self.store.memory_of(memory.memory_id),
                                    "text": summary["text"], **times, "replaces": None,
                                    "members": [self.store.row_of(memory.memory_id, t) for t in summary["turn_ids"]]})
            stored = self.store.commit_summaries(records) if records else 0
        return {"users": len(memories), "turns": sum(not a.duplicate for a in added),
                "duplicates": sum(a.duplicate for a in added), "summaries": stored}

    def _live_rows(self, user_id: str) -> list[int]:
        rows = self.store.live_turns(user_id)
        if not rows:
            raise UnknownUserError(f"user {user_id!r} has no turns in this memory")
        return rows

    def search(self, user_id: str | Sequence[str], queries: Sequence[str], k: int = 10) -> list[list[Hit]]:
        """Ranked hits for each query: search("u1", [q, ...]) asks one user, search(["u1", "u2"], [q1, q2])
        one user per query. One batched read of the method over every query (MemFit: one retrieve_batch);
        a hit holds the text, the turn ids, the final score and its stage scores."""
        return [hits for _, hits in self._read(_as_batch(user_id, queries, "queries"), k)]

    def search_batch(self, requests: Sequence[tuple[str, Sequence[str], int]]) -> list[list[list[Hit]] | BaseException]:
        """Several searches (user id, queries, k) answered by ONE batched read (what the server's dynamic
        batching sends): per search its hits per query, or the error that refused it alone (an unknown
        user, a bad query; a search that fails inside the batched read is read again alone, so it fails
        alone)."""
        with self.holding():
            out, found = self._read_requests(requests)
        for i, packs in found.items():
            out[i] = [hits[:requests[i][2]] for _, hits in packs]
        return out

    def _admit(self, requests: Sequence[tuple[Any, ...]]) -> tuple[list[int], list[Any]]:
        """Which requests of a batch can be read, and the error of each one that cannot."""
        ok, refused = [], []
        for i, (user, texts, k, *rest) in enumerate(requests):
            try:
                self._live_rows(user)
                _check_queries(texts, k)
                if rest and rest[0] is not None:
                    _check_question_date(rest[0])
                ok.append(i)
                refused.append(None)
            except (UnknownUserError, ValueError) as exc:
                refused.append(exc)
        return ok, refused

    def _read_requests(self, requests: Sequence[tuple[Any, ...]]
                       ) -> tuple[list[Any], dict[int, list[tuple[dict[str, Any], list[Hit]]]]]:
        """Per request of a batch (user, texts, k, ...): its error, or its (pack row, hits) per text from
        ONE batched read of every admitted request; if that read fails, each request is read alone and
        gets its own result or error."""
        ok, out = self._admit(requests)
        k = max((requests[i][2] for i in ok), default=1)

        def read(indexes: list[int]) -> dict[int, list[tuple[dict[str, Any], list[Hit]]]]:
            pairs = [(requests[i][0], text) for i in indexes for text in requests[i][1]]
            found, cursor, split = self._read(pairs, k), 0, {}
            for i in indexes:
                split[i] = found[cursor:cursor + len(requests[i][1])]
                cursor += len(requests[i][1])
            return split

        if not ok:
            return out, {}
        try:
            return out, read(ok)
        except Exception:
            if len(ok) < 2:
                raise
            log.warning("memfit live: a batched read of %d requests failed; reading each alone", len(ok))
        found = {}
        for i in ok:
            try:
                found.update(read([i]))
            except Exception as exc:  # noqa: BLE001  (this request's own failure, its caller gets it)
                out[i] = exc
        return out, found

    def _read(self, pairs: list[tuple[str, str]], k: int) -> list[tuple[dict[str, Any], list[Hit]]]:
        _check_queries([text for _, text in pairs], k)
        with self.holding():
            for user in dict.fromkeys(u for u, _ in pairs):
                self._live_rows(user)
            questions = [query(u, q, question_id=f"{u}:q{i}") for i, (u, q) in enumerate(pairs)]
            rows, _ = self.method.read(replace(self.run, questions=questions))
            return [(row, self.method.hits(row, k)) for row in rows]

    def answer(self, user_id: str | Sequence[str], questions: Sequence[str], k: int = 10,
               question_date: str | None = None) -> list[Answer]:
        """One reader call per question (all in one batch), each on the excerpts the method packs for it
        (MemFit: pack.k turns with their neighbours); `k` bounds the hits returned with each answer;
        question_date: when the questions are asked (the prompt's "current date", as in a run)."""
        found = self.answer_batch([(user_id, questions, k, question_date)] if isinstance(user_id, str) else
                                  [(u, [q], k, question_date) for u, q in _as_batch(user_id, questions, "questions")])
        for result in found:
            if isinstance(result, BaseException):
                raise result
        return [a for result in found for a in result]  # type: ignore[union-attr]

    def answer_batch(self, requests: Sequence[tuple[Any, ...]]) -> list[list[Answer] | BaseException]:
        """Several answer requests (user id, questions, k[, question_date]): one batched read, then one
        reader batch with one answer call per question; per request its answers or the error that refused
        it alone. The same as `finish_answers(prepare_answers(requests))`: a server runs the first on the
        thread that searches and writes and the second beside it, so generation never holds the memory."""
        return self.finish_answers(self.prepare_answers(requests))

    def prepare_answers(self, requests: Sequence[tuple[Any, ...]]) -> PreparedAnswers:
        """The read half of `answer_batch`: each request's packs (holds the memory while it reads, as a
        search does; nothing of the reader is needed yet)."""
        with self.holding():
            out, found = self._read_requests(requests)
            compactions = self._compactions
        calls = []
        for i, packs in found.items():
            user, question_date = requests[i][0], requests[i][3] if len(requests[i]) > 3 else None
            for text, (row, hits) in zip(requests[i][1], packs, strict=True):
                calls.append((i, query(user, text, question_date=question_date), hits[:requests[i][2]], row))
        return PreparedAnswers([r[0] for r in requests], out, calls, compactions)

    def finish_answers(self, prepared: PreparedAnswers) -> list[list[Answer] | BaseException]:
        """The generating half of `answer_batch`: the answer calls (the run's own builder: the prompt
        leaves the answer reader.max_new_tokens, in reader.protocol) in one reader batch, the reader loaded
        first if it is not yet; the memory is not held meanwhile (searches and writes go on). Then the
        answers per request."""
        out = list(prepared.results)
        if not prepared.calls:
            return out
        bench = self.run.bench
        make = answer_requests(self.cfg, bench, self.reader(),
                               BenchmarkPrompts.find(self.cfg.reader.protocol, bench.name, bench.source))
        requests = [make(question, row, key="live:answer")[0] for _, question, _, row in prepared.calls]
        responses = self.reader().generate(requests)
        with self.holding():
            self.ledger.save(self.ledger_path)
        self._forget_stale([prepared.users[i] for i, _, _, _ in prepared.calls], prepared.compactions)
        for (i, question, hits, _), response in zip(prepared.calls, responses, strict=True):
            cleaned = clean_answer(response.text)
            if not isinstance(out[i], list):
                out[i] = []
            out[i].append(Answer(prepared.users[i], question.question, cleaned.text, response.text, cleaned.abstained,
                                 hits, response.error))
        return out

    # --------------------------------------------------------------------------------------- closing
    def close(self) -> None:
        """Stop the worker, snapshot the store, release the reader and the lock. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._wake.set()
        if self._worker is not None:
            self._worker.join()
        with self._compacting, self._lock:  # a compaction dropping cached replies finishes first
            # every step runs even when one before it fails (a full disk refusing the snapshot): the first
            # failure is raised once the reader, the log and the lock are released
            failures: list[BaseException] = []
            steps = [self.method.close, self.store.close]
            if self._reader is not None:
                steps += [lambda: self.ledger.save(self.ledger_path), self._reader.close]
            for step in steps:
                try:
                    step()
                except Exception as exc:  # noqa: BLE001  (raised below, after the rest)
                    failures.append(exc)
            self._exit.close()
            if failures:
                raise failures[0]

    def __enter__(self) -> Memory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def live_methods() -> list[str]:
    """The registered methods a Memory can run (the registry's `live` capability)."""
    return [name for name, entry in METHODS.entries.items() if entry.live]
