"""A real `memfit serve` process on 127.0.0.1 for the tests (and its keys), started and stopped by them.

`LiveServer.start` runs `python -m memfit_gpu.cli serve` in a new process group on a free port, waits for
/healthz, and `stop` sends SIGTERM (a drain) and waits; `kill` sends SIGKILL. The readers used by the
tests: `reader.backend=echo` (tests/seam_echo_backend.py, loaded with MEMFIT_PLUGINS): it checks the
answer machinery, never what a reader says.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs" / "demo.yaml"
# MiniLM, no reranker, no summaries, the echo reader, manual consolidation: the cheapest real server
CHEAP = ["rerank.backend=none", "summary.enabled=false", "reader.backend=echo", "live.consolidate=manual"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class LiveServer:
    store: Path
    keys: Path
    overrides: list[str]
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path = field(default_factory=lambda: Path("server.log"))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 240.0) -> LiveServer:
        self.port = free_port()
        env = {**os.environ, "MEMFIT_PLUGINS": "seam_echo_backend", "HF_HUB_OFFLINE": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
        self.log = self.store.parent / f"{self.store.name}.server.log"
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "memfit_gpu.cli", "serve", "--store", str(self.store), "--config", str(DEMO),
                 "--keys", str(self.keys), "--port", str(self.port), *self.overrides],
                stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"memfit serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/healthz", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"memfit serve did not answer /healthz in {timeout_s} s:\n{self.log.read_text()[-3000:]}")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM (drain) and wait; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        """SIGKILL, as a power cut would stop it."""
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

