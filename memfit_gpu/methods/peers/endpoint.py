"""An OpenAI-compatible endpoint over the run's reader and encoder, for the systems we compare with.

A peer system (mem0, ...) runs from its own package and talks to "OpenAI". Pointed here, every chat
completion it asks for is one `Request` through the run's caching reader (`MethodRun.reader()`: the
response cache, the ledger, resumable), under a role naming the system and the phase (`mem0_write` while
memories are written, `mem0_read` while questions are searched), and every embedding is the run's own
bi-encoder, accounted in the same ledger (`mem0_embed_write` / `mem0_embed_read`, backend "encoder").
So what a peer costs is counted exactly like MemFit's own calls, by the same code.

The server binds 127.0.0.1 on a port the system picks, runs in a daemon thread of the run's process and
serves one request at a time (the reader serves one batch at a time anyway). Every request must carry the
endpoint's own key (`Authorization: Bearer <PeerEndpoint.api_key>`, made afresh per endpoint and never
written down; the peer is configured with it): another process or user of the machine cannot spend the
run's reader (a paid API key), add calls to its ledger, or have a call recorded as a live memory's user's. Routes:
`POST /v1/chat/completions`, `POST /v1/embeddings`, `GET /v1/models`. The logic (`EndpointLogic`) is apart
from the HTTP skin (`PeerEndpoint`), as in vLLM's entrypoints.

`response_format` (JSON mode, `json_object`) goes on the Request: the vllm and openai backends constrain the
reply to one JSON object; the transformers backend cannot, so each such request it serves counts under
`served["response_format_unhonoured"]` and the method reports it. A `json_schema` format is served as JSON
mode (the schema itself is not enforced) and counted under `served["json_schema_as_json_object"]`.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from memfit_gpu.readers.reader import Reader, background_calls
from memfit_gpu.readers.registry import ENCODER_BACKEND
from memfit_gpu.readers.types import ROLE_PHASES, Request, Response

MAX_BODY_BYTES = 16 * 1024 * 1024


class EndpointError(ValueError):
    """A request the endpoint cannot serve: answered with `status` and the message, OpenAI's error shape."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Embedder:
    """The run's bi-encoder as the endpoint uses it: texts -> rows of floats, and each text's token count."""

    model: str
    encode: Callable[[list[str]], list[list[float]]]
    count_tokens: Callable[[list[str]], list[int]]


@dataclass
class Serving:
    """What the calls of the moment are for: the phase (write | read), the user whose data they carry
    (Request.owner, so erasing the user drops them), and the ledger key."""

    phase: str = "write"
    owner: str | None = None
    key: str = ""


def _text_of(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI's content parts: only text parts are served
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise EndpointError(f"{where}.content[{i}]: only text parts are served")
            parts.append(part["text"])
        return "".join(parts)
    raise EndpointError(f"{where}.content must be a string or a list of text parts")


@dataclass
class EndpointLogic:
    """Chat completions through the reader and embeddings through the encoder, each accounted once."""

    system: str  # the peer's name: its roles are f"{system}_{phase}" and f"{system}_embed_{phase}"
    reader: Reader
    embedder: Embedder
    serving: Serving = field(default_factory=Serving)
    # what was served, for the method's diagnostics and the tests: chat calls, embedding requests and
    # inputs, tokens, JSON-mode requests that no backend constrained
    served: Counter[str] = field(default_factory=Counter)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        for role in self.roles():
            if role not in ROLE_PHASES:
                raise ValueError(f"endpoint for {self.system!r}: role {role!r} is not in readers.types.ROLE_PHASES")

    def roles(self) -> list[str]:
        return [f"{self.system}_{phase}" for phase in ("write", "read")] + \
            [f"{self.system}_embed_{phase}" for phase in ("write", "read")]

    @contextlib.contextmanager
    def serve(self, phase: str, owner: str | None, key: str) -> Iterator[None]:
        """Calls made inside are for `phase`, carry `owner`'s data and are recorded under `key`."""
        before = self.serving
        self.serving = Serving(phase, owner, key)
        try:
            yield
        finally:
            self.serving = before

    def chat(self, body: dict[str, Any]) -> dict[str, Any]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise EndpointError("messages must be a non-empty list")
        chat = []
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise EndpointError(f"messages[{i}] must be an object with a role")
            chat.append({"role": message["role"], "content": _text_of(message.get("content"), f"messages[{i}]")})
        if body.get("tools"):
            raise EndpointError("tool calls are not served (the run's reader writes text)")
        if int(body.get("n") or 1) != 1:
            raise EndpointError("n must be 1")
        limit = body.get("max_completion_tokens") or body.get("max_tokens")
        temperature = body.get("temperature")
        wanted = body.get("response_format")
        kind = wanted.get("type") if isinstance(wanted, dict) else None
        if kind not in (None, "text", "json_object", "json_schema"):
            raise EndpointError(f"response_format type {kind!r} is not served (text, json_object, json_schema)")
        json_object = kind in ("json_object", "json_schema")
        serving = self.serving
        request = Request(chat, role=f"{self.system}_{serving.phase}",
                          max_new_tokens=None if limit is None else int(limit),
                          temperature=None if temperature is None else float(temperature),
                          key=serving.key, owner=serving.owner, response_format="json_object" if json_object else None)
        # the peer's write-time calls (mem0's extraction) are background work: a live memory's answers go first
        with self._lock, background_calls() if serving.phase == "write" else contextlib.nullcontext():
            response = self.reader.generate([request], partial=True)[0]
            self.served["chat_calls"] += 1
            self.served["chat_cached"] += int(response.cached)
            if json_object and not self.reader.backend.json_mode:
                self.served["response_format_unhonoured"] += 1
            if kind == "json_schema":
                self.served["json_schema_as_json_object"] += 1
            if not response.cached:
                self.served["chat_input_tokens"] += response.input_tokens
                self.served["chat_output_tokens"] += response.output_tokens
        if not response.answered or response.error is not None:
            raise EndpointError(f"the reader gave no answer: {response.error}", status=502)
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": self.reader.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": response.text},
                             "finish_reason": "stop"}],
                "usage": {"prompt_tokens": response.input_tokens, "completion_tokens": response.output_tokens,
                          "total_tokens": response.input_tokens + response.output_tokens}}

    def embeddings(self, body: dict[str, Any]) -> dict[str, Any]:
        given = body.get("input")
        texts = [given] if isinstance(given, str) else given
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise EndpointError("input must be a string or a non-empty list of strings (token ids are not served)")
        serving = self.serving
        with self._lock:
            started = time.perf_counter()
            rows = self.embedder.encode(list(texts))
            latency = time.perf_counter() - started
            dims = body.get("dimensions")
            if dims is not None and int(dims) != len(rows[0]):
                raise EndpointError(f"dimensions={dims}: {self.embedder.model} embeds in {len(rows[0])}")
            tokens = self.embedder.count_tokens(list(texts))
            response = Response("", int(sum(tokens)), 0, latency, model=self.embedder.model)
            self.reader.record_call(f"{self.system}_embed_{serving.phase}", serving.key, response, ENCODER_BACKEND,
                                    owner=serving.owner)
            self.served["embed_requests"] += 1
            self.served["embed_inputs"] += len(texts)
            self.served["embed_tokens"] += int(sum(tokens))
        return {"object": "list", "model": self.embedder.model,
                "data": [{"object": "embedding", "index": i, "embedding": row} for i, row in enumerate(rows)],
                "usage": {"prompt_tokens": int(sum(tokens)), "total_tokens": int(sum(tokens))}}

    def models(self) -> dict[str, Any]:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "memfit"}
                                           for name in (self.reader.model, self.embedder.model)]}


class _Handler(BaseHTTPRequestHandler):
    logic: EndpointLogic  # set on the subclass the endpoint makes
    api_key: str  # likewise: the bearer key every request must carry
    protocol_version = "HTTP/1.1"

    def _refused(self) -> bool:
        """Answers 401 (and says so) unless the request carries the endpoint's key."""
        given = self.headers.get("Authorization") or ""
        if hmac.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            return False
        self.close_connection = True  # its body, if any, is left unread
        self._error(401, "this endpoint serves its run's peer system only: a request needs its bearer key")
        return True

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the stdlib's name
        pass  # the ledger records every call; no access log

    def _send(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, message: str) -> None:
        self._send(status, {"error": {"message": message, "type": "invalid_request_error" if status < 500
                                      else "server_error", "code": status}})

    def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
        if self._refused():
            return
        if self.path.rstrip("/") in ("/v1/models", "/models"):
            self._send(200, self.logic.models())
        else:
            self._error(404, f"no route GET {self.path}")

    def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
        if self._refused():
            return
        route = self.path.split("?")[0].rstrip("/").removeprefix("/v1")
        handlers = {"/chat/completions": self.logic.chat, "/embeddings": self.logic.embeddings}
        if route not in handlers:
            self._error(404, f"no route POST {self.path}")
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._error(413, f"body of {length} bytes is over {MAX_BODY_BYTES}")
            return
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise EndpointError("the body must be a JSON object")
            self._send(200, handlers[route](body))
        except json.JSONDecodeError as exc:
            self._error(400, f"the body is not JSON: {exc}")
        except EndpointError as exc:
            self._error(exc.status, str(exc))
        except Exception as exc:  # noqa: BLE001 - the peer gets a 500 naming it; the run sees it in the peer's error
            self._error(500, f"{type(exc).__name__}: {exc}")


class PeerEndpoint:
    """The HTTP skin: `start()` serves `logic` on 127.0.0.1:<free port> and returns the base URL (ending
    in /v1); `close()` stops it. A context manager. `api_key`: the key its clients must send."""

    def __init__(self, logic: EndpointLogic) -> None:
        self.logic = logic
        self.api_key = secrets.token_urlsafe(32)
        handler = type("PeerHandler", (_Handler,), {"logic": logic, "api_key": self.api_key})
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self._thread: threading.Thread | None = None

    @property
    def base_url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}/v1"

    def start(self) -> str:
        if self._thread is None:
            self._thread = threading.Thread(target=self._server.serve_forever, name="peer-endpoint", daemon=True)
            self._thread.start()
        return self.base_url

    def close(self) -> None:
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join()
            self._thread = None
        self._server.server_close()

    def __enter__(self) -> PeerEndpoint:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def embedder_of(encoder: Any, model: str) -> Embedder:
    """An Embedder over a loaded bi-encoder (index/encoders): rows as lists of floats; token counts from its
    tokenizer, truncated as the encoder truncates (chars/4 where it has none)."""
    tokenizer = getattr(encoder, "tokenizer", None)
    max_length = int(getattr(encoder, "max_length", 512) or 512)

    def encode(texts: list[str]) -> list[list[float]]:
        return encoder.encode(texts).tolist()

    def count_tokens(texts: Sequence[str]) -> list[int]:
        if tokenizer is None:
            return [max(1, len(t) // 4) for t in texts]
        ids = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
        return [len(row) for row in ids]

    return Embedder(model, encode, count_tokens)
