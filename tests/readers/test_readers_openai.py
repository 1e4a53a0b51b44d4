"""The OpenAI-compatible HTTP reader against a local HTTP server that misbehaves on purpose.

The server is real (http.server on 127.0.0.1, one thread per connection); the path picks the behaviour:
/flaky (503 twice, then a reply without usage), /slow (the first call hangs past the client timeout),
/broken (always 500), /bad (400), /limited (429 with Retry-After once), /null (200 with `content: null` and
only `reasoning_content`), /nullonce (that once, then an answer), /nochoices (200 with `choices: []`),
/garbage (200 that is not JSON), /ok-* (echo after 0.2 s, with usage, recording how many calls were in
flight at once). GET .../models lists the model, except under /locked (401).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from memfit_gpu.config import ConfigError, ReaderConfig
from memfit_gpu.readers.cache import ResponseCache, request_key
from memfit_gpu.readers.images import with_image_parts
from memfit_gpu.readers.openai import probe_base_urls
from memfit_gpu.readers.reader import make_reader
from memfit_gpu.readers.registry import make_backend
from memfit_gpu.readers.types import ReaderError, Request


class FaultServer:
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.bodies: dict[str, list[dict]] = defaultdict(list)  # the request bodies each mode received
        self.in_flight: Counter[str] = Counter()
        self.max_in_flight: Counter[str] = Counter()
        self.lock = threading.Lock()
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                # GET /<mode>/v1/models: what the start-of-run probe asks; /locked refuses the key
                mode = self.path.split("/")[1]
                with server.lock:
                    server.calls[f"GET {mode}"] += 1
                if mode == "locked":
                    return self._send(401, {"error": "invalid api key"})
                return self._send(200, {"object": "list", "data": [{"id": "test-model"}]})

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                mode = self.path.split("/")[1]
                with server.lock:
                    server.calls[mode] += 1
                    server.bodies[mode].append(body)
                    n = server.calls[mode]
                    server.in_flight[mode] += 1
                    server.max_in_flight[mode] = max(server.max_in_flight[mode], server.in_flight[mode])
                try:
                    self._answer(mode, n, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client gave up on a hanging call
                finally:
                    with server.lock:
                        server.in_flight[mode] -= 1

            def _send(self, status: int, payload: dict | str, headers: dict[str, str] | None = None) -> None:
                data = (payload if isinstance(payload, str) else json.dumps(payload)).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, mode: str, n: int, body: dict) -> None:
                question = body["messages"][-1]["content"]
                reply = {"model": body["model"], "choices": [{"message": {"role": "assistant",
                                                                           "content": f"echo: {question}"}}]}
                if mode == "flaky":
                    if n <= 2:
                        return self._send(503, {"error": "overloaded"})
                    reply["choices"][0]["message"]["content"] = "Paris"
                    return self._send(200, reply)  # no usage: the client must count
                if mode == "slow":
                    if n == 1:
                        time.sleep(1.5)
                    return self._send(200, {**reply, "usage": {"prompt_tokens": 11, "completion_tokens": 3}})
                if mode == "broken":
                    return self._send(500, "internal boom")
                if mode == "null" or (mode == "nullonce" and n == 1):
                    thinking = {"role": "assistant", "content": None, "reasoning_content": "Let me think..."}
                    return self._send(200, {"model": body["model"], "choices": [{"message": thinking}]})
                if mode == "nochoices":
                    return self._send(200, {"model": body["model"], "choices": []})
                if mode == "garbage":
                    return self._send(200, "<html>upstream proxy error</html>")
                if mode == "bad":
                    return self._send(400, {"error": "max_tokens too large"})
                if mode == "limited":
                    if n == 1:
                        return self._send(429, {"error": "slow down"}, {"Retry-After": "0"})
                    return self._send(200, {**reply, "usage": {"prompt_tokens": 5, "completion_tokens": 2}})
                if mode == "ok-partial" and question == "please refuse":
                    return self._send(400, {"error": "refused"})
                # ok-wide: long enough that every call the client allows is in flight before one returns,
                # however loaded the machine
                time.sleep(2.0 if mode == "ok-wide" else 0.2)
                return self._send(200, {**reply, "usage": {"prompt_tokens": 7, "completion_tokens": 2}})

        class Server(ThreadingHTTPServer):
            request_queue_size = 256  # listen() backlog: a burst of 100 connections must not be reset

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, mode: str) -> str:
        return f"http://127.0.0.1:{self.port}/{mode}/v1"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture(scope="module")
def server() -> Iterator[FaultServer]:
    s = FaultServer()
    yield s
    s.close()


def _reader(urls: list[str], **cfg: object):  # noqa: ANN202
    settings = {"backend": "openai", "model": "test-model", "base_urls": urls, "max_retries": 3, "timeout_s": 5.0,
                "concurrency": 4}
    settings.update(cfg)
    return make_reader(ReaderConfig(**settings), None, progress=False, backoff_base_s=0.01)  # type: ignore[arg-type]


def _ask(text: str, key: str = "q1") -> Request:
    return Request([{"role": "user", "content": text}], "answer", max_new_tokens=16, key=key)


def test_503_twice_then_answer_with_estimated_tokens(server: FaultServer) -> None:
    reader = _reader([server.url("flaky")])
    out = reader.generate([_ask("What is the capital of France?")])
    assert server.calls["flaky"] == 3
    assert reader.backend.attempts == 3  # type: ignore[attr-defined]
    assert out[0].text == "Paris"
    # No usage in the reply and no tokenizer for "test-model": chars / 4, rounded up (30 -> 8, 5 -> 2).
    assert (out[0].input_tokens, out[0].output_tokens, out[0].tokens_estimated) == (8, 2, True)
    assert reader.ledger.roles["answer"].estimated_token_calls == 1


def test_a_request_without_sampling_settings_gets_the_readers_config(server: FaultServer) -> None:
    """Called directly (no Reader to fill them), the backend sends reader.max_new_tokens and reader.temperature,
    the one default there is, not numbers of its own; a sampled request carries reader.seed, a greedy one none."""
    backend = make_backend(ReaderConfig(backend="openai", model="test-model", base_urls=[server.url("ok-defaults")],
                                        max_new_tokens=7, temperature=0.25, seed=11))
    backend.generate([Request([{"role": "user", "content": "Hi"}], "answer", key="q1"),
                      Request([{"role": "user", "content": "Hi"}], "answer", max_new_tokens=3, temperature=0.0)])
    sent = sorted((body["max_tokens"], body["temperature"], body.get("seed")) for body in server.bodies["ok-defaults"])
    assert sent == [(3, 0.0, None), (7, 0.25, 11)]


def test_json_mode_travels_as_the_servers_response_format_and_keys_another_cache_entry(server: FaultServer) -> None:
    reader = _reader([server.url("ok-json")])
    free = Request([{"role": "user", "content": "Hi"}], "answer", max_new_tokens=4, key="free")
    as_json = Request([{"role": "user", "content": "Hi"}], "answer", max_new_tokens=4, key="json",
                      response_format="json_object")
    reader.generate([free, as_json])
    # the two requests are in flight together, so the server may receive them in either order
    formats = sorted((body.get("response_format") for body in server.bodies["ok-json"]), key=repr)
    assert formats == [None, {"type": "json_object"}]
    assert reader.backend.json_mode is True
    # the same prompt asked in JSON mode is another call; without it the key is what it always was
    keys = [request_key("openai", "test-model", r) for r in (free, as_json)]
    assert keys[0] != keys[1]
    assert keys[0] == request_key("openai", "test-model", Request(free.messages, "answer", max_new_tokens=4))
    with pytest.raises(ValueError, match="response_format 'json' is not one of"):
        Request([{"role": "user", "content": "Hi"}], "answer", response_format="json")


def test_timeout_is_retried(server: FaultServer) -> None:
    reader = _reader([server.url("slow")], timeout_s=0.5)
    out = reader.generate([_ask("Where?")])
    assert server.calls["slow"] == 2
    assert out[0].text == "echo: Where?"
    assert (out[0].input_tokens, out[0].output_tokens, out[0].tokens_estimated) == (11, 3, False)


def test_429_is_retried(server: FaultServer) -> None:
    out = _reader([server.url("limited")]).generate([_ask("Who?")])
    assert server.calls["limited"] == 2 and out[0].text == "echo: Who?"


def test_always_500_fails_after_max_retries_naming_url_and_status(server: FaultServer) -> None:
    reader = _reader([server.url("broken")], max_retries=2)
    with pytest.raises(ReaderError) as info:
        reader.generate([_ask("Anything", key="conv-26:q7")])
    message = str(info.value)
    assert f"{server.url('broken')}/chat/completions" in message
    assert "HTTP 500: internal boom" in message and "after 3 attempts" in message and "conv-26:q7" in message
    assert server.calls["broken"] == 3


def test_400_is_not_retried(server: FaultServer) -> None:
    with pytest.raises(ReaderError, match=r"refused request 'q1': HTTP 400"):
        _reader([server.url("bad")]).generate([_ask("x")])
    assert server.calls["bad"] == 1


def test_requests_spread_over_urls_with_bounded_concurrency_in_order(server: FaultServer) -> None:
    reader = _reader([server.url("ok-a"), server.url("ok-b")], concurrency=2)
    questions = [f"question {i}" for i in range(10)]
    out = reader.generate([_ask(q, key=f"q{i}") for i, q in enumerate(questions)])
    assert [r.text for r in out] == [f"echo: {q}" for q in questions]
    assert server.calls["ok-a"] == 5 and server.calls["ok-b"] == 5
    assert server.max_in_flight["ok-a"] == 2 and server.max_in_flight["ok-b"] == 2
    assert all((r.input_tokens, r.output_tokens, r.tokens_estimated) == (7, 2, False) for r in out)
    assert reader.ledger.roles["answer"].input_tokens == 70
    reader.ledger.check_one_answer_per_question([f"q{i}" for i in range(10)])


def test_images_travel_as_data_url_parts(tmp_path: Path) -> None:
    image = tmp_path / "cat.png"
    image.write_bytes(b"\x89PNG\r\n\x1a\nfake pixels")
    message = with_image_parts([{"role": "user", "content": "What animal?"}], [str(image)])[0]
    assert message["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgpmYWtlIHBpeGVscw=="}},
        {"type": "text", "text": "What animal?"},
    ]
    with pytest.raises(FileNotFoundError, match="missing.png"):
        with_image_parts([{"role": "user", "content": "x"}], [str(tmp_path / "missing.png")])


def _closed_port_url() -> str:
    """A URL nothing listens on: a port the OS just handed out and took back."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


def test_probe_passes_servers_that_answer(server: FaultServer) -> None:
    before = server.calls["GET ok-probe"]
    probe_base_urls("reader.base_urls", [server.url("ok-probe"), server.url("broken")], "NO_SUCH_KEY_VARIABLE")
    assert server.calls["GET ok-probe"] == before + 1 and server.calls["GET broken"] >= 1


def test_probe_names_the_unreachable_url(server: FaultServer) -> None:
    dead = _closed_port_url()
    with pytest.raises(ConfigError) as err:
        probe_base_urls("reader.base_urls", [server.url("ok-probe"), dead], "NO_SUCH_KEY_VARIABLE", timeout_s=2.0)
    message = str(err.value)
    assert message.startswith(f"reader.base_urls[1]={dead!r} is not reachable: GET {dead}/models failed within 2 s "
                              "(ConnectError: ")
    with pytest.raises(ConfigError, match=r"eval\.judge\.base_urls\[0\]=.* refused the API key: .* HTTP 401 "
                                          r"\(the key is read from \$MY_KEY\)"):
        probe_base_urls("eval.judge.base_urls", [server.url("locked")], "MY_KEY")


def test_batches_do_not_bound_what_is_in_flight(server: FaultServer, tmp_path: Path) -> None:
    """generate_batches offers every request at once: `concurrency` alone bounds the calls in flight (the
    flush size used to: 64), batches come in position order, each cached before it is handed out."""
    reader = _reader([server.url("ok-wide")], concurrency=100)
    reader.cache = ResponseCache(tmp_path / "cache.sqlite")
    requests = [_ask(f"question {i}", key=f"q{i}") for i in range(150)]
    handed: list[int] = []
    for batch in reader.generate_batches(requests, batch_size=10):
        assert [i for i, _ in batch] == sorted(i for i, _ in batch) and len(batch) >= 10 or len(handed) + len(batch) == 150
        handed.extend(i for i, _ in batch)
        assert len(reader.cache) >= len(handed)  # committed as they arrive, handed out afterwards
        assert all(response.text == f"echo: question {i}" for i, response in batch)
    assert sorted(handed) == list(range(150)) and server.max_in_flight["ok-wide"] > 64
    assert reader.generate(requests[:3])[0].cached  # a second pass is served by the cache


def test_a_failed_call_keeps_the_answers_that_finished(server: FaultServer, tmp_path: Path) -> None:
    """One request refused (400) among answered ones: it alone comes back unanswered (not cached), the
    others are in the cache, so a rerun asks only for what failed; `generate` raises once all are in."""
    reader = _reader([server.url("ok-partial")], concurrency=4)
    reader.cache = ResponseCache(tmp_path / "cache.sqlite")
    requests = [_ask(f"question {i}", key=f"q{i}") for i in range(6)] + [_ask("please refuse", key="bad")]
    out = {i: r for batch in reader.generate_batches(requests, batch_size=100) for i, r in batch}
    assert [i for i, r in out.items() if not r.answered] == [6] and "refused request 'bad'" in str(out[6].error)
    assert len(reader.cache) == 6 and reader.ledger.roles["answer"].errors == 1
    with pytest.raises(ReaderError, match=r"1 of 7 answer calls to openai got no answer \(first: .*refused request"):
        reader.generate(requests)


@pytest.mark.parametrize(("mode", "why"), [
    ("null", "message.content is null (the reply holds only reasoning_content: a reasoning model that spent "
             "max_tokens thinking; raise reader.max_new_tokens or turn its thinking off)"),
    ("nochoices", "reply is not a chat completion (IndexError"),
    ("garbage", "reply is not a chat completion (JSONDecodeError"),
])
def test_a_reply_without_an_answer_is_retried_then_that_question_alone_fails(server: FaultServer, tmp_path: Path,
                                                                            mode: str, why: str) -> None:
    """`content: null` used to become an empty answer, cached, never asked again; empty `choices` and a
    body that is not JSON stopped the run. Each is retried like a 5xx, then is a response without an
    answer for that request alone: never cached, counted as an error, asked again next time."""
    reader = _reader([server.url(mode)], max_retries=2)
    reader.cache = ResponseCache(tmp_path / "cache.sqlite")
    before = server.calls[mode]
    out = reader.generate([_ask("Where?", key="q1")], partial=True)
    assert server.calls[mode] - before == 3  # retried with the transport's policy
    assert out[0].answered is False and out[0].text == ""
    assert why in str(out[0].error) and "after 3 attempts" in str(out[0].error)
    assert len(reader.cache) == 0 and reader.ledger.roles["answer"].errors == 1


def test_a_null_reply_once_is_retried_and_answered(server: FaultServer) -> None:
    out = _reader([server.url("nullonce")]).generate([_ask("Who?")])
    assert server.calls["nullonce"] == 2 and out[0].answered and out[0].text == "echo: Who?"


def test_responses_are_committed_as_they_arrive(server: FaultServer, tmp_path: Path) -> None:
    """Responses that arrived while the caller was busy with an earlier batch waited, uncommitted,
    until it asked for the next one: a kill then lost calls the server had been paid for. They are
    committed on arrival, with their ledger entries."""
    reader = _reader([server.url("ok-arrive")], concurrency=4)
    reader.cache = ResponseCache(tmp_path / "cache.sqlite")
    batches = reader.generate_batches([_ask(f"question {i}", key=f"q{i}") for i in range(4)], batch_size=1)
    first = next(batches)
    assert len(first) == 1
    deadline = time.monotonic() + 20
    while len(reader.cache) < 4 and time.monotonic() < deadline:  # the caller holds the first batch meanwhile
        time.sleep(0.05)
    assert len(reader.cache) == 4 and len(reader.cache.entries()) == 4
    assert sum(1 for _ in batches) == 3
