"""A counting OpenAI-compatible server for kill tests: a real HTTP server on 127.0.0.1 (a thread of the
test process) whose replies are a fixed function of the prompt, so that it provokes faults and counts
what it was paid for, and never stands in for a model whose numbers are reported.

Each client is told apart by its API key (`Authorization: Bearer <key>`; memfit reads it from
reader.api_key_env, which is not part of a run's configuration). Replies go out one at a time,
`gap_s` apart, and only to a client that is still connected: a request whose client was killed while
it waited is not answered and not counted, so `paid[key]` holds exactly the calls and tokens the
server delivered. `null_for[key]` holds prompt substrings whose replies carry `message.content: null`
(a reasoning model that spent its tokens thinking): delivered, counted as attempts, without usage.
"""

from __future__ import annotations

import hashlib
import json
import select
import socket
import threading
import time
from collections import Counter, defaultdict
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "counting-model"


def reply_text(prompt: str) -> str:
    """The server's answer to a prompt: short, fixed by the prompt's bytes."""
    return f"Answer: word{int(hashlib.sha256(prompt.encode()).hexdigest()[:4], 16) % 97}"


def prompt_tokens(prompt: str) -> int:
    return len(prompt) // 4 + 1


class CountingServer:
    def __init__(self, gap_s: float = 0.0) -> None:
        self.gap_s = gap_s
        self.paid: dict[str, Counter[str]] = defaultdict(Counter)  # key -> calls, input_tokens, output_tokens
        self.attempts: dict[str, Counter[str]] = defaultdict(Counter)  # key -> prompt substring -> requests
        self.null_for: dict[str, set[str]] = defaultdict(set)
        self._turn = threading.Lock()  # one reply at a time, gap_s apart
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                self._send({"object": "list", "data": [{"id": MODEL}]})

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                key = self.headers.get("Authorization", "").removeprefix("Bearer ")
                prompt = "\n".join(m["content"] for m in body["messages"] if isinstance(m["content"], str))
                with server._turn:
                    time.sleep(server.gap_s)
                    if not _connected(self.connection):
                        return  # its client died waiting: nothing delivered, nothing paid
                    null = next((s for s in server.null_for[key] if s in prompt), None)
                    if null is not None:
                        server.attempts[key][null] += 1
                        message: dict = {"role": "assistant", "content": None, "reasoning_content": "thinking..."}
                        return self._send({"model": MODEL, "choices": [{"message": message}]})
                    usage = {"prompt_tokens": prompt_tokens(prompt), "completion_tokens": 3}
                    self._send({"model": MODEL, "usage": usage,
                                "choices": [{"message": {"role": "assistant", "content": reply_text(prompt)}}]})
                    paid = server.paid[key]
                    paid["calls"] += 1
                    paid["input_tokens"] += usage["prompt_tokens"]
                    paid["output_tokens"] += usage["completion_tokens"]

            def _send(self, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                self.wfile.flush()

        class Server(ThreadingHTTPServer):
            request_queue_size = 64

        self.httpd = Server(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _connected(sock: socket.socket) -> bool:
    """False once the peer has closed the connection (a killed client's kernel closes its sockets)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK) != b""
    except OSError:
        return False
