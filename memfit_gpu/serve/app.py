"""The HTTP API of `memfit serve` over one live memory (memfit_gpu.Memory), as a FastAPI app.

Routes (OpenAPI at /docs and /openapi.json; every /v1 route needs an API key, serve/keys.py):

    POST   /v1/users/{user_id}/turns     {"turns": [{speaker, text, timestamp?, turn_id?, session_id?, ...}]}
    GET    /v1/users/{user_id}/turns     the user's live turns, in order
    GET    /v1/users/{user_id}/export    the user as own-data jsonl (?summaries=true: with its summaries)
    POST   /v1/users/{user_id}/search    {"queries": [...], "k": 10}      -> one list of hits per query
    POST   /v1/users/{user_id}/answer    {"questions": [...], "k": 10}    -> one reader call per question
    POST   /v1/users/{user_id}/delete    {"turn_ids": [...]}
    DELETE /v1/users/{user_id}           every turn of the user
    POST   /v1/compact, /v1/consolidate  admin keys only: the whole store (consolidate {"user_ids": [...]}: those
                                         users, each bound to the key)
    GET    /healthz                      liveness (no key)
    GET    /metrics                      Prometheus: request latency histograms per route, batch sizes, turns
                                         (admin keys only, unless serve.open_metrics)

Before any body is read, a request's key is checked (401 missing or unknown, 403 a user the key is not
bound to, 422 a user id outside names.USER_ID_RULE, 429 with Retry-After when the key already has
serve.max_in_flight_per_key requests being served) and its size (413 above serve.max_body_bytes), in one
ASGI middleware, so a refused request reads nothing; the route checks the binding again on the user id
it was given, so the id authorised is the id used (the path is decoded once, by the server). A body that
does not arrive within serve.read_timeout_s is 408. Bodies are validated by pydantic (422 naming the
field, wrong types included; `k` a JSON integer; a body that is not UTF-8, JSON nested too deep to parse or
holding an integer of more digits than Python converts: 422 naming `body`) and by the serve.max_* limits
(422 with the limit; the words of a request's queries together: serve.max_query_words_per_request); a 4xx
body names the field (pydantic's copy of the input is left out; a message may quote the offending value,
never the rest of the request). An unknown user is 404, a turn id reused with other words 409, a full disk 507 naming the
file (the memory writes again once space is freed), and so is an add past serve.max_turns_per_user or while
the disk has less than serve.min_free_disk_mb free (one client cannot take what every user shares).
Searches, answers and adds go through dynamic batching (serve/batching.py; serve.batch_window_ms,
serve.max_batch): one batched call per batch, and a request that fails inside it is run again alone, so
it fails alone. Searches, adds and the read half of answers run on one worker thread, in arrival order;
an answer's generation runs beside it (Memory.finish_answers on a thread of its own), so one user's
answers never hold another user's searches. A user's turns and export (replies as large as the user's
memory) run on the worker one at a time, round-robin between keys, a key's one at a time (the next waits
its turn), their JSON rendered off the event loop (serve/engine.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
import re
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from mcp.server.transport_security import TransportSecuritySettings
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException

from memfit_gpu.config import MemFitConfig
from memfit_gpu.live.memory import Memory
from memfit_gpu.names import user_id_problem
from memfit_gpu.serve.engine import Refused, ServedMemory, checked_user, memory_worker
from memfit_gpu.serve.keys import ApiKey, KeyRing
from memfit_gpu.serve.mcp import MCP_PATH, make_mcp
from memfit_gpu.serve.schemas import AddIn, AnswerIn, ConsolidateIn, DeleteIn, SearchIn, turn_dicts

log = logging.getLogger(__name__)

_USER_PATH = re.compile(r"^/v1/users/([^/]+)(?:/|$)")
_ADMIN_PATHS = ("/v1/compact", "/v1/consolidate", "/metrics")
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


# ------------------------------------------------------------------------------------------- metrics
HTTP_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("memfit_request_seconds", "HTTP request latency", ["route", "method", "status"],
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.batch_size = Histogram("memfit_batch_size", "requests answered by one batched call", ["op"],
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.batch_seconds = Histogram("memfit_batch_seconds", "wall time of one batched call", ["op"],
                                       buckets=LATENCY_BUCKETS, registry=self.registry)
        self.turns = Counter("memfit_turns_added", "turns stored", registry=self.registry)
        self.in_flight = Gauge("memfit_requests_in_flight", "requests being served", registry=self.registry)

    def batch(self, op: str, size: int, seconds: float) -> None:
        self.batch_size.labels(op).observe(size)
        self.batch_seconds.labels(op).observe(seconds)


# ---------------------------------------------------------------------------------------- the guard
_JSON = json.JSONEncoder(ensure_ascii=True, allow_nan=False, separators=(",", ":"))


class SafeJSONResponse(JSONResponse):
    """Every reply renders: ASCII-escaped (a lone surrogate in a message cannot break it), no NaN."""

    def render(self, content: Any) -> bytes:
        return _JSON.encode(content).encode("ascii")


def _split(value: Any) -> bool:
    """Whether _json_pieces writes `value` in parts: a list, or an object holding a list or an object."""
    return isinstance(value, list) or (isinstance(value, dict) and any(isinstance(v, (dict, list))
                                                                       for v in value.values()))


def _size(value: Any) -> int:
    """About how many characters a plain value (no list or object inside an object) writes."""
    if isinstance(value, str):
        return len(value) + 2
    if isinstance(value, dict):
        return sum(len(k) + _size(v) + 4 for k, v in value.items())
    return 8


PIECE_CHARS = 1 << 16  # plain elements of a list written together, up to about this many characters a piece


def _json_pieces(value: Any, depth: int) -> Iterator[str]:
    """`value` as SafeJSONResponse writes it, in pieces: the lists, and the objects holding lists or objects,
    of its first `depth` levels are written part by part (a list's plain elements, turns, together up to about
    PIECE_CHARS a piece), so no one call holds the interpreter for long (a turn of 1 MB is a piece of its own)."""
    if not depth or not _split(value):
        yield _JSON.encode(value)
    elif isinstance(value, dict):
        yield "{"
        for n, (key, item) in enumerate(value.items()):
            yield ("," if n else "") + _JSON.encode(key) + ":"
            yield from _json_pieces(item, depth - 1)
        yield "}"
    else:
        yield "["
        plain: list[Any] = []
        chars = 0
        for n, item in enumerate(value):
            if plain and (_split(item) or chars >= PIECE_CHARS):
                yield ("," if n > len(plain) else "") + _JSON.encode(plain)[1:-1]
                plain, chars = [], 0
            if _split(item):
                yield "," if n else ""
                yield from _json_pieces(item, depth - 1)
            else:
                plain.append(item)
                chars += _size(item)
        if plain:
            yield ("," if len(value) > len(plain) else "") + _JSON.encode(plain)[1:-1]
        yield "]"


def json_bytes(content: Any) -> bytes:
    """What SafeJSONResponse.render(content) gives, built piece by piece: a thread writing a reply of many MB
    (a user's turns, its export) lets the event loop run between the pieces."""
    return "".join(_json_pieces(content, depth=6)).encode("ascii")


def _json_reply(content: Any) -> Response:
    return Response(json_bytes(content), media_type="application/json")


def _unparsed(exc: BaseException | None) -> str | None:
    """Why a body that is valid JSON text could not be parsed (Python's own limits), or None: not that."""
    if isinstance(exc, RecursionError):
        return "JSON nested too deeply to parse"
    if isinstance(exc, UnicodeDecodeError):
        return f"not UTF-8 text ({exc.reason} at byte {exc.start})"
    if isinstance(exc, ValueError) and "integer string conversion" in str(exc):
        return f"an integer of more than {sys.get_int_max_str_digits():,} digits"
    return None


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return SafeJSONResponse({"detail": message}, status_code=status, headers=headers)


class Guard:
    """ASGI middleware: request size (413), API key (401), user binding (403) and the key's requests in
    flight (429) before the app reads anything; the request's latency into the metrics."""

    def __init__(self, app: Any, keys: KeyRing, max_body_bytes: int, metrics: Metrics, read_timeout_s: float = 30.0,
                 max_in_flight_per_key: int = 64, open_metrics: bool = False) -> None:
        self.app, self.keys, self.max_body, self.metrics = app, keys, max_body_bytes, metrics
        self.read_timeout_s = read_timeout_s
        self.open_metrics = open_metrics
        self.max_in_flight_per_key = max_in_flight_per_key
        self.key_in_flight: collections.Counter[str] = collections.Counter()  # per key hash (one event loop)

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[dict[str, Any]]],
                       send: Callable[[dict[str, Any]], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        status = {"code": 500}

        async def sending(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        self.metrics.in_flight.inc()
        holder: str | None = None  # the key this request counts against while it is served
        try:
            refusal = self._refusal(scope)
            key: ApiKey | None = scope.get("memfit.key")
            if refusal is None and key is not None:
                if self.key_in_flight[key.sha256] >= self.max_in_flight_per_key:
                    refusal = _error(429, f"key {key.name!r} has {self.key_in_flight[key.sha256]} requests being served; "
                                          f"at most serve.max_in_flight_per_key={self.max_in_flight_per_key}",
                                     headers={"retry-after": "1"})
                else:
                    holder = key.sha256
                    self.key_in_flight[holder] += 1
            body = b""
            if refusal is None:
                try:
                    body, too_big = await asyncio.wait_for(self._body(receive), self.read_timeout_s)
                except TimeoutError:
                    body, too_big = b"", False
                    refusal = _error(408, f"request body not received within serve.read_timeout_s="
                                          f"{self.read_timeout_s:g} s", headers={"connection": "close"})
                if too_big:
                    refusal = _error(413, f"request body larger than serve.max_body_bytes={self.max_body:,} bytes")
            if refusal is not None:
                await refusal(scope, receive, sending)
                return
            replayed = False

            async def replay() -> dict[str, Any]:
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": body, "more_body": False}
                return await receive()

            await self.app(scope, replay, sending)
        finally:
            if holder is not None:
                self.key_in_flight[holder] -= 1
                if not self.key_in_flight[holder]:
                    del self.key_in_flight[holder]
            self.metrics.in_flight.dec()
            route = scope.get("route")
            path = getattr(route, "path", None) or ("other" if not scope["path"].startswith("/v1/") else "/v1/unmatched")
            # label values from a bounded set only: a client's own method names would grow the series without end
            method = scope["method"] if scope["method"] in HTTP_METHODS else "other"
            self.metrics.latency.labels(path, method, str(status["code"])).observe(time.perf_counter() - started)

    def _refusal(self, scope: dict[str, Any]) -> JSONResponse | None:
        path = scope["path"]
        keyed = path.startswith("/v1/") or path == MCP_PATH or path.startswith(MCP_PATH + "/") or (
            path == "/metrics" and not self.open_metrics)
        if not keyed:  # /healthz, /docs, /openapi.json (and /metrics with serve.open_metrics)
            return None
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        presented = headers.get("x-api-key")
        bearer = headers.get("authorization", "")
        if presented is None and bearer.lower().startswith("bearer "):
            presented = bearer[7:].strip()
        key = self.keys.find(presented)
        if key is None:
            return _error(401, "missing or unknown API key (send Authorization: Bearer <key>)")
        scope["memfit.key"] = key
        user = _USER_PATH.match(path)
        if user is not None:
            # scope["path"] is decoded already (once, by the server), as the router sees it: never again
            problem = user_id_problem(user.group(1))
            if problem is not None:
                return _error(422, f"path: {problem}")
            if not key.may(user.group(1)):
                return _error(403, f"key {key.name!r} is not bound to user {user.group(1)!r}")
        elif path in _ADMIN_PATHS and not key.admin:
            return _error(403, f"key {key.name!r} is not an admin key ({path} is about the whole store)")
        elif (path == MCP_PATH or path.startswith(MCP_PATH + "/")) and scope["method"] == "GET":
            # the streamable-HTTP event stream: a stateless server never sends on it, so it stayed open, counted
            # against the key's share of requests in flight and outside serve.read_timeout_s
            return _error(405, "GET /mcp opens no event stream on this server (stateless): POST JSON-RPC requests",
                          headers={"allow": "POST"})
        return None

    async def _body(self, receive: Callable[[], Awaitable[dict[str, Any]]]) -> tuple[bytes, bool]:
        """The whole body, or (b"", True) when it passes the limit (read to its end, then dropped, so the
        client gets the 413 instead of a broken pipe)."""
        parts, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size <= self.max_body:
                parts.append(chunk)
            more = message.get("more_body", False)
        return (b"", True) if size > self.max_body else (b"".join(parts), False)


# -------------------------------------------------------------------------------------------- the app
def make_app(memory: Memory, keys: KeyRing, cfg: MemFitConfig | None = None,
             worker: ThreadPoolExecutor | None = None) -> FastAPI:
    """The app over an open memory: REST routes and (serve/mcp.py) the MCP endpoint at /mcp, both over one
    ServedMemory (serve/engine.py). Its lifespan starts the batchers and, at shutdown, drains them and
    closes the memory, then shuts the worker down (a close that fails, e.g. a snapshot on a full disk, is
    logged and left in `app.state.shutdown_error` for the server to exit non-zero). worker: the memory's
    thread (`memory_worker()`, the one that opened it); None: a new one."""
    cfg = cfg or memory.cfg
    metrics = Metrics()
    served = ServedMemory(memory, cfg, worker, metrics.batch, metrics.turns.inc)
    mcp = make_mcp(served, bound_key_of)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        served.start()
        app.state.shutdown_error = None
        log.info("memfit serve: %s (method %s), batching window %.1f ms, max batch %d; MCP at /mcp", memory.path,
                 cfg.method, cfg.serve.batch_window_ms, cfg.serve.max_batch)
        try:
            async with mcp.session_manager.run():
                yield
        finally:  # uvicorn has let in-flight requests finish; run what is still queued
            failed = await served.stop()
            app.state.shutdown_error = failed
            if failed is None:
                log.info("memfit serve: drained; %s closed", memory.path)
            else:
                log.error("memfit serve: drained, but closing %s failed: %s", memory.path, failed)

    app = FastAPI(title="memfit serve", version="1", lifespan=lifespan, default_response_class=SafeJSONResponse,
                  description="A live MemFit memory: add turns, search and answer per user (memfit_gpu/serve/app.py); "
                              "the same over MCP at /mcp (serve/mcp.py).")
    # The SDK's DNS-rebinding protection (a Host / Origin allow-list, by default localhost only) is off: it refused
    # every MCP call sent to a hostname, a --host 0.0.0.0 address or through a reverse proxy (421). It guards a
    # server that trusts whoever reaches it; this one reads nothing without a bearer key (the Guard, 401), which a
    # page rebound to it cannot send (a browser sends no Authorization header of its own accord, and none across
    # origins without a CORS preflight this server does not answer), and the REST routes check no Host either.
    mcp_http = mcp.streamable_http_app(streamable_http_path="/", stateless_http=True, json_response=True,
                                       transport_security=TransportSecuritySettings(
                                           enable_dns_rebinding_protection=False))
    app.mount(MCP_PATH, mcp_http)

    def bound(request: Request, user_id: str) -> str:
        """The route's own user id, authorised again (the Guard checked the path it saw): the id a request
        was authorised for is the id it uses."""
        key: ApiKey | None = request.scope.get("memfit.key")
        try:
            checked_user(user_id)
        except Refused as exc:
            raise Refused(422, f"path: {exc.message}") from None
        if key is None or not key.may(user_id):
            raise Refused(403, f"key {getattr(key, 'name', None)!r} is not bound to user {user_id!r}")
        return user_id

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        # what was wrong and where, never the input itself (it may not render, and it is the client's own)
        errors = [{"loc": [str(p) for p in e.get("loc", ())], "msg": str(e.get("msg", "invalid")),
                   "type": str(e.get("type", ""))} for e in exc.errors()]
        first = errors[0] if errors else {"loc": [], "msg": "invalid request"}
        message = f"{'.'.join(first['loc'])}: {first['msg']}"
        raw = exc.errors()[0] if exc.errors() else {}
        if tuple(raw.get("loc", ())) == ("body",) and isinstance(raw.get("input"), bytes):
            message = "body: not read as JSON: send it with Content-Type: application/json"
        return SafeJSONResponse({"detail": message, "errors": errors}, status_code=422)

    @app.exception_handler(HTTPException)
    async def unparsed(request: Request, exc: HTTPException) -> Response:
        # FastAPI answers a body json.loads cannot parse though it is JSON text (nested past the recursion
        # limit, an integer of more than 4,300 digits, bytes that are not UTF-8) with a bare 400 "There was an
        # error parsing the body"; it is malformed input like any other: 422 naming the body
        why = _unparsed(exc.__cause__) if exc.status_code == 400 else None
        if why is not None:
            return _error(422, f"body: not read as JSON: {why}")
        return await http_exception_handler(request, exc)

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> JSONResponse:
        return _error(exc.status, exc.message)

    @app.get("/healthz")
    async def healthz() -> dict[str, Any]:
        return {"status": "ok", "method": cfg.method}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/users/{user_id}/turns")
    async def add(request: Request, body: AddIn, user_id: str = Depends(bound)) -> dict[str, Any]:
        """Store turns of the user, durably (fsynced when the reply comes); concurrent adds are batched."""
        added = await served.add(user_id, turn_dicts(body.turns), client_of(request.scope))
        return {"added": [a.to_json() for a in added]}

    @app.get("/v1/users/{user_id}/turns", response_class=SafeJSONResponse)
    async def turns(request: Request, user_id: str = Depends(bound)) -> Response:
        """The user's live turns in order (a key's reads of turns and exports are served one at a time)."""
        return await served.turns(user_id, client_of(request.scope),
                                  lambda found: _json_reply({"user_id": user_id, "turns": found}))

    @app.get("/v1/users/{user_id}/export", response_class=SafeJSONResponse)
    async def export(request: Request, user_id: str = Depends(bound), summaries: bool = False) -> Response:
        """The user as one line of the own-data jsonl format (`memfit store import` adds it back); a key's
        reads of turns and exports are served one at a time."""
        return await served.export(user_id, summaries, client_of(request.scope), _json_reply)

    @app.post("/v1/users/{user_id}/search")
    async def search(request: Request, body: SearchIn, user_id: str = Depends(bound)) -> dict[str, Any]:
        """Ranked hits per query (text, turn ids, final and stage scores); concurrent searches are batched."""
        found = await served.search(user_id, body.queries, body.k, client_of(request.scope))
        return {"results": [[h.to_json() for h in hits] for hits in found]}

    @app.post("/v1/users/{user_id}/answer")
    async def answer(request: Request, body: AnswerIn, user_id: str = Depends(bound)) -> dict[str, Any]:
        """One reader call per question on the method's pack; concurrent answers are batched."""
        found = await served.answer(user_id, body.questions, body.k, body.question_date, client_of(request.scope))
        return {"answers": [a.to_json() for a in found]}

    @app.post("/v1/users/{user_id}/delete")
    async def delete(body: DeleteIn, user_id: str = Depends(bound)) -> dict[str, Any]:
        return {"deleted": await served.delete(user_id, body.turn_ids)}

    @app.delete("/v1/users/{user_id}")
    async def delete_user(user_id: str = Depends(bound)) -> dict[str, Any]:
        return {"deleted": await served.delete_user(user_id)}

    @app.post("/v1/compact")
    async def compact() -> dict[str, Any]:
        return {"compacted": await served.compact()}

    @app.post("/v1/consolidate")
    async def consolidate(request: Request, body: ConsolidateIn | None = None) -> dict[str, Any]:
        """Every user's pending consolidation (no body, or user_ids unset), or the named users', each bound to
        the key."""
        user_ids = None if body is None or body.user_ids is None else [bound(request, u) for u in body.user_ids]
        return {"consolidated": await served.consolidate(user_ids)}

    guarded = Guard(app, keys, cfg.serve.max_body_bytes, metrics, cfg.serve.read_timeout_s,
                    cfg.serve.max_in_flight_per_key, cfg.serve.open_metrics)
    guarded.state = app.state  # the server reads app.state.shutdown_error after it stops
    return guarded  # type: ignore[return-value]


def bound_key_of(scope: dict[str, Any]) -> ApiKey | None:
    """The key the Guard found for a request (None: no key was checked)."""
    return scope.get("memfit.key")


def client_of(scope: dict[str, Any]) -> str | None:
    """The client a request's share of the batches is counted for: its key's hash (None: no key)."""
    key = bound_key_of(scope)
    return None if key is None else key.sha256


__all__ = ["ApiKey", "Metrics", "make_app", "memory_worker"]
