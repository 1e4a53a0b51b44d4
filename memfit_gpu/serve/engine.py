"""The logic over one open live memory that `memfit serve`'s REST routes (serve/app.py) and its MCP tools
(serve/mcp.py) share: the dynamic batchers, the memory's worker thread, the serve.max_* limits, and the
memory's refusals as `Refused(status, message)` errors (each transport renders them its own way).

One thread runs every call on the memory (the one that opened it: `memory_worker()`); searches, adds and
the read half of answers are batched onto it (serve/batching.py), an answer's generation runs beside it
on a thread of its own that ends with the batch (devices.in_fresh_thread: a lasting second torch thread
slows the worker's every op), so one user's answers never hold another user's searches.

A user's turns and its export (the heavy reads: a reply as large as everything the user stored) go onto
the worker one at a time, round-robin between keys, so the worker runs at most one of them between two
search batches; a key's heavy reads are served one at a time (the next waits for the one before, within
the key's serve.max_in_flight_per_key), and a REST reply is rendered (`render`) off the event loop and
outside the memory's lock, within that turn (an MCP tool's reply the SDK renders itself): one key's heavy
reads hold another key's search for one such read at most, and hold one reply's memory at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import logging
import os
import shutil
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.schema import DataError
from memfit_gpu.devices import in_fresh_thread
from memfit_gpu.files import StorageError
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.live.memory import (
    Added,
    Answer,
    Memory,
    PreparedAnswers,
    TurnConflictError,
    UnknownUserError,
    UserFullError,
)
from memfit_gpu.methods.base import Hit
from memfit_gpu.names import user_id_problem
from memfit_gpu.readers.prompts import QuestionTooLongError
from memfit_gpu.readers.types import ReaderError
from memfit_gpu.serve.batching import Batcher

log = logging.getLogger(__name__)


class Refused(Exception):
    """A request the memory (or a limit) refuses: the HTTP status it maps to, and the message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def memory_worker() -> ThreadPoolExecutor:
    """The one thread every call on a served memory runs on (open it there too: `memory_worker().submit(
    Memory.open, ...)`), so that one thread runs all of the process's torch work (devices.in_fresh_thread
    says why a second one slows every op)."""
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-memory")


def checked_user(user_id: str) -> str:
    """`user_id` when it follows names.USER_ID_RULE, else Refused(422) naming the rule."""
    problem = user_id_problem(user_id)
    if problem is not None:
        raise Refused(422, problem)
    return user_id


async def outcome(pending: Awaitable[Any]) -> Any:
    """The memory's result, its refusals as Refused with their status and message."""
    try:
        return await pending
    except UnknownUserError as exc:
        raise Refused(404, str(exc)) from None
    except TurnConflictError as exc:
        raise Refused(409, str(exc)) from None
    except UserFullError as exc:
        setting = "serve.max_turns_per_user" if exc.limit == "turns" else "serve.max_text_mb_per_user"
        raise Refused(507, f"{exc}: {setting}") from None
    except (DataError, ValueError, TypeError, QuestionTooLongError) as exc:
        raise Refused(422, str(exc)) from None
    except ReaderError as exc:  # a server behind the reader failed or refused the calls after its retries
        # its message names the reader's endpoint and quotes that server's reply: the operator's log has it
        log.error("memfit serve: %s", exc)
        raise Refused(503, "the reader gave no answer to this request (its server failed or refused it; "
                           "the memory server's log says why); nothing was stored") from None
    except StorageError as exc:
        # the memory keeps serving reads and takes writes again once the cause is gone (store/log.py); the
        # server's log names the file, a client learns no path of the server's
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        log.error("memfit serve: %s", exc)
        cause = os.strerror(exc.errno) if exc.errno else "an I/O error"
        raise Refused(507 if full else 503, ("disk full: " if full else "storage unavailable: ") + cause
                      + "; what was stored before is kept (the server's log names the file)") from None


def _texts(item: tuple[Any, ...]) -> int:
    """A batched item's weight (serve.max_batch_texts a batch): its texts, the turns, queries or questions
    after its user id."""
    return len(item[1])


# Answer.error to a client: the cause only; the reader's own message (with vLLM: the engine's exception, which
# may name the model's path or the server's files) goes to the server's log
ANSWER_FAILED = "the reader could not answer this question (the memory server's log says why)"


def _tenant(client: str | None, user_id: str) -> str:
    """Whose share of the batches a request takes (serve/batching.py): its API key's (`client`, the key's
    hash), else (no key: a stdio MCP server, a library caller) its user's."""
    return f"key:{client}" if client else f"user:{user_id}"


class ServedMemory:
    """One open Memory behind the batchers; `start`/`stop` inside the server's event loop (its lifespan)."""

    def __init__(self, memory: Memory, cfg: MemFitConfig | None = None, worker: ThreadPoolExecutor | None = None,
                 observe: Callable[[str, int, float], None] | None = None,
                 turns_added: Callable[[int], None] | None = None) -> None:
        self.memory = memory
        self.cfg = cfg or memory.cfg
        self.worker = worker or memory_worker()
        self._turns_added = turns_added
        serve = self.cfg.serve
        # waits for an answer batch's read (on the worker) and its generation (on a thread of its own)
        self._answering = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memfit-answer")
        window, most, texts = serve.batch_window_ms / 1000.0, serve.max_batch, serve.max_batch_texts
        self.adds = Batcher("add", self._add_run, window, most, self.worker, observe, _texts, texts)
        self.searches = Batcher("search", memory.search_batch, window, most, self.worker, observe, _texts, texts)
        self.answers = Batcher("answer", self._answer_run, window, most, self._answering, observe, _texts, texts)
        # the heavy reads (a user's turns, its export): one at a time on the worker, round-robin between keys
        self.reads = Batcher("read", self._read_run, 0.0, 1, self.worker)
        # per tenant (a key's hash) with heavy reads being served or waiting: its turn, and how many hold or wait
        self._reading: dict[str, tuple[asyncio.Lock, int]] = {}

    # --------------------------------------------------------------------------------------- life
    def start(self) -> None:
        for batcher in (self.adds, self.searches, self.answers, self.reads):
            batcher.start()

    async def stop(self) -> BaseException | None:
        """Run what the batchers still hold, close the memory on its worker, shut the threads down; the
        error closing raised (a snapshot refused by a full disk), or None."""
        for batcher in (self.adds, self.searches, self.answers, self.reads):
            await batcher.stop()
        self._answering.shutdown(wait=True)
        failed: BaseException | None = None
        try:
            await asyncio.get_running_loop().run_in_executor(self.worker, self.memory.close)
        except Exception as exc:  # noqa: BLE001  (the server exits non-zero, saying why)
            failed = exc
        self.worker.shutdown(wait=True)
        return failed

    # ---------------------------------------------------------------------------------------- runs
    def _add_run(self, items: list[tuple[str, list[dict[str, Any]]]]) -> list[Any]:
        results = self.memory.add_batch(items, max_turns_per_user=self.cfg.serve.max_turns_per_user,
                                        max_text_bytes_per_user=self.cfg.serve.max_text_mb_per_user << 20)
        if self._turns_added is not None:
            self._turns_added(sum(1 for r in results if not isinstance(r, BaseException) for a in r if not a.duplicate))
        return results

    def _answer_run(self, items: list[tuple[Any, ...]]) -> list[Any]:
        prepared: PreparedAnswers = self.worker.submit(self.memory.prepare_answers, items).result()
        return in_fresh_thread(self.memory.finish_answers, prepared)

    def _read_run(self, items: list[tuple[str, str, bool]]) -> list[Any]:
        """One heavy read (the batcher's max_batch is 1): a user's turns, or its export."""
        (what, user_id, summaries), = items
        return [self.memory.turns(user_id) if what == "turns" else self.memory.export(user_id, summaries)]

    @contextlib.asynccontextmanager
    async def _turn_to_read(self, tenant: str) -> AsyncIterator[None]:
        """The tenant's one heavy read at a time (its read and its rendering); the next waits, in arrival order.
        Only the event loop touches `_reading`."""
        lock, users = self._reading.get(tenant) or (asyncio.Lock(), 0)
        self._reading[tenant] = (lock, users + 1)
        try:
            async with lock:
                yield
        finally:
            lock, users = self._reading[tenant]
            if users == 1:
                del self._reading[tenant]
            else:
                self._reading[tenant] = (lock, users - 1)

    async def _read(self, what: str, user_id: str, summaries: bool, client: str | None,
                    render: Callable[[Any], Any] | None) -> Any:
        tenant = _tenant(client, checked_user(user_id))
        async with self._turn_to_read(tenant):
            found = await outcome(self.reads.submit((what, user_id, summaries), tenant))
            if render is None:
                return found
            # off the event loop (a reply of many MB would hold every request) and outside the memory's lock
            return await asyncio.get_running_loop().run_in_executor(None, render, found)

    async def _on_worker(self, call: Callable[..., Any], *args: Any) -> Any:
        return await outcome(asyncio.get_running_loop().run_in_executor(self.worker, call, *args))

    def _limit(self, count: int, most: int, what: str, key: str) -> None:
        if count > most:
            raise Refused(422, f"{count} {what} in one request; at most {key}={most}")

    def _words(self, texts: Sequence[str], what: str) -> None:
        """The request's queries (questions) hold at most serve.max_query_words_per_request words together."""
        most = self.cfg.serve.max_query_words_per_request
        if sum(len(t) for t in texts) > most:  # a word is at least one character: short requests count nothing
            self._limit(sum(len(tokenize(t)) for t in texts), most, f"words of {what}",
                        "serve.max_query_words_per_request")

    def _disk_reserve(self) -> None:
        """An add while the store's disk has less than serve.min_free_disk_mb free is 507: what is left is kept
        for the memory's own work (snapshots, deletes, compaction), not filled by one client."""
        most = self.cfg.serve.min_free_disk_mb
        try:
            free = shutil.disk_usage(self.memory.path).free
        except OSError:
            return  # the write itself then says what is wrong
        if free < most * (1 << 20):
            raise Refused(507, f"disk nearly full: {free / (1 << 20):,.0f} MiB free for the memory, "
                               f"adds stop below serve.min_free_disk_mb={most:,}")

    # --------------------------------------------------------------------------------- operations
    async def add(self, user_id: str, turns: list[dict[str, Any]], client: str | None = None) -> list[Added]:
        self._limit(len(turns), self.cfg.serve.max_turns_per_request, "turns", "serve.max_turns_per_request")
        self._disk_reserve()
        return await outcome(self.adds.submit((checked_user(user_id), turns), _tenant(client, user_id)))

    async def search(self, user_id: str, queries: Sequence[str], k: int, client: str | None = None) -> list[list[Hit]]:
        self._limit(len(queries), self.cfg.serve.max_queries_per_request, "queries", "serve.max_queries_per_request")
        self._limit(k, self.cfg.serve.max_k, "hits (k)", "serve.max_k")
        self._words(queries, "queries")
        return await outcome(self.searches.submit((checked_user(user_id), list(queries), k), _tenant(client, user_id)))

    async def answer(self, user_id: str, questions: Sequence[str], k: int,
                     question_date: str | None = None, client: str | None = None) -> list[Answer]:
        self._limit(len(questions), self.cfg.serve.max_queries_per_request, "questions",
                    "serve.max_queries_per_request")
        self._limit(k, self.cfg.serve.max_k, "hits (k)", "serve.max_k")
        self._words(questions, "questions")
        found = await outcome(self.answers.submit((checked_user(user_id), list(questions), k, question_date),
                                                  _tenant(client, user_id)))
        return [self._cause_only(a) for a in found]

    @staticmethod
    def _cause_only(answer: Answer) -> Answer:
        """An answer whose reader call failed says so, and no more (as a 503 does): the reader's message goes
        to the server's log."""
        if answer.error is None:
            return answer
        log.warning("memfit serve: the reader could not answer a question: %s", answer.error)
        return dataclasses.replace(answer, error=ANSWER_FAILED)

    async def turns(self, user_id: str, client: str | None = None,
                    render: Callable[[list[dict[str, Any]]], Any] | None = None) -> Any:
        """The user's live turns (Memory.turns); with `render`, render(turns) computed off the event loop,
        within the key's turn to read (module doc)."""
        return await self._read("turns", user_id, False, client, render)

    async def delete(self, user_id: str, turn_ids: Sequence[str]) -> dict[str, int]:
        self._limit(len(turn_ids), self.cfg.serve.max_turns_per_request, "turn ids", "serve.max_turns_per_request")
        # not on the worker: a delete that rebuilds a summary makes an LLM call (without holding the memory),
        # which on the worker would hold up every user's searches and adds; the memory orders it with them
        return await outcome(asyncio.get_running_loop().run_in_executor(
            None, in_fresh_thread, self.memory.delete, checked_user(user_id), list(turn_ids)))

    async def delete_user(self, user_id: str) -> dict[str, int]:
        return await self._on_worker(self.memory.delete_user, checked_user(user_id))

    async def export(self, user_id: str, summaries: bool = False, client: str | None = None,
                     render: Callable[[dict[str, Any]], Any] | None = None) -> Any:
        """The user as own-data jsonl (Memory.export); `render` as for `turns`."""
        return await self._read("export", user_id, summaries, client, render)

    async def compact(self) -> dict[str, int]:
        # not on the worker: dropping the cached replies waits for the reader's turn (an answer being generated),
        # which on the worker would hold up every user's searches and adds; the memory orders the rest with them
        return await outcome(asyncio.get_running_loop().run_in_executor(None, in_fresh_thread, self.memory.compact))

    async def consolidate(self, user_ids: Sequence[str] | None) -> dict[str, int]:
        # not on the worker (its LLM calls would hold up every search) but on a thread that ends after it
        return await outcome(asyncio.get_running_loop().run_in_executor(
            None, in_fresh_thread, self.memory.consolidate, user_ids))
