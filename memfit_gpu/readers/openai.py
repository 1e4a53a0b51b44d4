"""OpenAI-compatible HTTP backend (vLLM's server, hosted APIs): async httpx over one or more base URLs.

Request i goes to base_urls[i % n]; each URL has its own semaphore of `concurrency` in-flight calls.
Timeouts, transport errors, 429 and 5xx, and a 200 that is no chat completion (not JSON, no `choices`,
`message.content: null`, as a reasoning model that put its whole output in `reasoning_content` sends)
are retried with exponential backoff and jitter (a numeric Retry-After is honoured) up to `max_retries`
times; other 4xx answers are not retried (the request itself is wrong). A request that still has no
answer is a response with `answered=False` and an error naming the URL and the last failure: that
question alone fails (never cached; a rerun asks it again) and the others go on. A server that omits `usage` gets its
tokens counted with the model's tokenizer when one is on disk, else estimated as chars/4, and the response
is marked `tokens_estimated`.

`probe_base_urls` asks each server once (GET {url}/models, a few seconds at most) before a run does any
work, so a wrong or dead URL is a one-line error at the start instead of a failure after the store is
built and every retry has waited.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import queue
import random
import threading
import time
from collections.abc import Coroutine, Iterator, Sequence
from typing import Any, TypeVar

import httpx

from memfit_gpu.config import ConfigError, ReaderConfig
from memfit_gpu.readers.images import with_image_parts
from memfit_gpu.readers.types import Backend, ReaderError, Received, Request, Response

logger = logging.getLogger(__name__)

RETRY_STATUS = frozenset({429, 500, 502, 503, 504}) | frozenset(range(505, 600))
PROBE_TIMEOUT_S = 10.0
T = TypeVar("T")


class NoCompletion(ReaderError):
    """A 200 reply that holds no answer (not JSON, no choices, content null): retried like a 5xx."""


def probe_base_urls(key: str, urls: Sequence[str], api_key_env: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """ConfigError naming `key[i]`, the URL and the failure when a server does not answer GET {url}/models,
    or refuses the API key (401/403). Any other answer counts: the server is there (some have no /models)."""
    api_key = os.environ.get(api_key_env or "", "")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with httpx.Client(timeout=timeout_s, headers=headers) as client:
        for position, url in enumerate(urls):
            endpoint = f"{str(url).rstrip('/')}/models"
            try:
                reply = client.get(endpoint)
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                raise ConfigError(f"{key}[{position}]={url!r} is not reachable: GET {endpoint} failed within "
                                  f"{timeout_s:g} s ({type(exc).__name__}: {exc}); start the server or fix the URL") from None
            if reply.status_code in (401, 403):
                raise ConfigError(f"{key}[{position}]={url!r} refused the API key: GET {endpoint} answered HTTP "
                                  f"{reply.status_code} (the key is read from ${api_key_env})")


def _run_coroutine(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run, also from inside a running event loop (notebooks): then on a helper thread."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = asyncio.run(coro)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


class OpenAIBackend(Backend):
    name = "openai"
    json_mode = True  # sent as the server's response_format: OpenAI and vLLM servers honour JSON mode

    def __init__(self, cfg: ReaderConfig, backoff_base_s: float = 1.0, backoff_max_s: float = 60.0,
                 tokenizer: Any | None = None) -> None:
        if not cfg.base_urls:
            raise ValueError("reader.backend=openai needs reader.base_urls (e.g. ['http://127.0.0.1:8000/v1'])")
        super().__init__(cfg)
        self.base_urls = [u.rstrip("/") for u in cfg.base_urls]
        self.concurrency = max(1, int(cfg.concurrency))
        self.timeout_s = float(cfg.timeout_s)
        self.max_retries = max(0, int(cfg.max_retries))
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.api_key = os.environ.get(cfg.api_key_env or "", "")
        self.chunk_size = self.concurrency * len(self.base_urls) * 4
        self._tokenizer = tokenizer
        self._tokenizer_tried = tokenizer is not None
        self.attempts = 0  # HTTP requests sent, retries included

    # -- token counting when the server gives no usage --------------------------------------------------
    def _get_tokenizer(self) -> Any | None:
        if not self._tokenizer_tried:
            self._tokenizer_tried = True
            try:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self.model, local_files_only=True)
            except Exception:  # noqa: BLE001 - no tokenizer on disk: fall back to the chars/4 estimate
                self._tokenizer = None
        return self._tokenizer

    def _count(self, messages: list[dict[str, Any]], text: str) -> tuple[int, int]:
        tok = self._get_tokenizer()
        if tok is not None:
            try:
                ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
                if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
                return len(ids), len(tok.encode(text, add_special_tokens=False))
            except Exception:  # noqa: BLE001 - a tokenizer without a chat template: estimate instead
                pass
        prompt_chars = sum(len(m["content"]) if isinstance(m["content"], str) else 0 for m in messages)
        return math.ceil(prompt_chars / 4), math.ceil(len(text) / 4)

    # -- HTTP --------------------------------------------------------------------------------------------
    def _delay(self, attempt: int, retry_after: str | None) -> float:
        if retry_after:
            try:
                return min(self.backoff_max_s, float(retry_after))
            except ValueError:
                pass
        return min(self.backoff_max_s, self.backoff_base_s * 2 ** attempt) * (0.5 + random.random())

    async def _one(self, client: httpx.AsyncClient, url: str, sem: asyncio.Semaphore, request: Request) -> Response:
        max_new_tokens, temperature = self.sampling(request)
        body = {
            "model": self.model,
            "messages": with_image_parts(request.messages, request.images),
            "max_tokens": max_new_tokens,
            "temperature": temperature,
        }
        if temperature > 0:  # OpenAI-compatible servers (vLLM included) honour a per-request seed
            body["seed"] = int(self.cfg.seed)
        if self.template_kwargs:  # vLLM / SGLang servers read it; the OpenAI API does not need it
            body["chat_template_kwargs"] = self.template_kwargs
        if request.response_format is not None:  # the server constrains its decoding (vLLM: structured outputs)
            body["response_format"] = {"type": request.response_format}
        endpoint = f"{url}/chat/completions"
        last = "no attempt"
        start = time.perf_counter()
        for attempt in range(self.max_retries + 1):
            retry_after = None
            async with sem:
                self.attempts += 1
                try:
                    reply = await client.post(endpoint, json=body)
                except httpx.TimeoutException as exc:
                    last = f"timeout after {self.timeout_s:g} s ({type(exc).__name__})"
                    reply = None
                except httpx.TransportError as exc:
                    last = f"transport error {type(exc).__name__}: {exc}"
                    reply = None
            if reply is not None:
                if reply.status_code == 200:
                    try:
                        return self._parse(reply, endpoint, request, time.perf_counter() - start)
                    except NoCompletion as exc:
                        last = str(exc)
                else:
                    last = f"HTTP {reply.status_code}: {reply.text[:300]}"
                    if reply.status_code not in RETRY_STATUS:
                        return self._no_answer(request, f"{endpoint} refused request {request.key!r}: {last}", start)
                    retry_after = reply.headers.get("retry-after")
            if attempt < self.max_retries:
                delay = self._delay(attempt, retry_after)
                logger.warning("%s: %s; retry %d/%d in %.2f s", endpoint, last, attempt + 1, self.max_retries, delay)
                await asyncio.sleep(delay)
        return self._no_answer(request, f"{endpoint}: no answer to request {request.key!r} after {self.max_retries + 1} "
                               f"attempts (reader.max_retries={self.max_retries}); last: {last}", start)

    def _no_answer(self, request: Request, why: str, start: float) -> Response:
        """The response of a request that got no answer: that request alone failed; a rerun asks again."""
        logger.warning("%s", why)
        return Response("", 0, 0, time.perf_counter() - start, False, self.model, error=why, answered=False)

    def _parse(self, reply: httpx.Response, endpoint: str, request: Request, latency: float) -> Response:
        try:
            data = reply.json()
            message = data["choices"][0]["message"]
            text = message["content"]
        except (ValueError, KeyError, IndexError, TypeError) as exc:
            raise NoCompletion(f"reply is not a chat completion ({type(exc).__name__}: {exc}): {reply.text[:300]}") from None
        if not isinstance(text, str):
            hint = (" (the reply holds only reasoning_content: a reasoning model that spent max_tokens thinking; "
                    "raise reader.max_new_tokens or turn its thinking off)" if message.get("reasoning_content") else "")
            raise NoCompletion(f"message.content is {json.dumps(text)}{hint}: {reply.text[:300]}")
        usage = data.get("usage") or {}
        n_in, n_out = usage.get("prompt_tokens"), usage.get("completion_tokens")
        estimated = n_in is None or n_out is None
        if estimated:
            n_in, n_out = self._count(request.messages, text)
        return Response(text, int(n_in), int(n_out), latency, False, data.get("model") or self.model,
                        estimated)

    async def _all(self, requests: Sequence[Request],
                   finished: queue.SimpleQueue[tuple[int, Response | BaseException]] | None = None,
                   received: Received | None = None) -> list[Response]:
        """Every request at once, at most `concurrency` in flight per URL; each response goes to
        `received` (the caller's commit) and then to `finished` (position, response or exception) the
        moment it arrives. Once `received` fails (a full disk), no further request is sent."""
        sems = [asyncio.Semaphore(self.concurrency) for _ in self.base_urls]
        stopped: list[BaseException] = []
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        limits = httpx.Limits(max_connections=self.concurrency * len(self.base_urls),
                              max_keepalive_connections=self.concurrency * len(self.base_urls))

        async def one(client: httpx.AsyncClient, i: int, request: Request) -> Response:
            n = len(self.base_urls)
            try:
                if stopped:
                    raise ReaderError(f"request {request.key!r} not sent: committing an earlier response failed "
                                      f"({stopped[0]})")
                response = await self._one(client, self.base_urls[i % n], sems[i % n], request)
                if received is not None:
                    try:
                        received([(i, response)])
                    except Exception as exc:
                        stopped.append(exc)
                        raise
            except Exception as exc:
                if finished is not None:
                    finished.put((i, exc))
                raise
            if finished is not None:
                finished.put((i, response))
            return response

        async with httpx.AsyncClient(timeout=self.timeout_s, limits=limits, headers=headers) as client:
            tasks = [one(client, i, r) for i, r in enumerate(requests)]
            # Let every call finish before the client closes; then report the first failure.
            results = await asyncio.gather(*tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException):
                raise result
        return list(results)  # type: ignore[arg-type]

    def generate(self, requests: Sequence[Request]) -> list[Response]:
        if not requests:
            return []
        return _run_coroutine(self._all(requests))

    def generate_stream(self, requests: Sequence[Request], group_size: int | None = None,
                        received: Received | None = None) -> Iterator[list[tuple[int, Response]]]:
        """Every request offered to the servers at once (`concurrency` in flight per URL, whatever
        `group_size`, the caller's commit size, is), each response passed to `received` on the
        receiving thread as it arrives (committed while the caller may still be busy with an earlier
        one) and yielded. A request without an answer is a response with `answered=False`; an
        unexpected failure is raised once every other call has finished."""
        if not requests:
            return
        finished: queue.SimpleQueue[tuple[int, Response | BaseException]] = queue.SimpleQueue()
        failure: list[BaseException] = []

        def target() -> None:
            try:
                asyncio.run(self._all(requests, finished, received))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                failure.append(exc)

        thread = threading.Thread(target=target, name="openai-reader", daemon=True)
        thread.start()
        first_error: BaseException | None = None
        count = 0
        while count < len(requests):
            try:
                position, result = finished.get(timeout=0.5)
            except queue.Empty:
                if not thread.is_alive() and finished.empty():  # failed before answering everything
                    break
                continue
            count += 1
            if isinstance(result, BaseException):
                first_error = first_error or result
                continue
            yield [(position, result)]
        thread.join()
        if first_error is not None or failure:
            raise first_error or failure[0]
        if count < len(requests):
            raise ReaderError(f"openai reader: {len(requests) - count} of {len(requests)} requests got no response")
