"""`memfit serve`: one live memory behind uvicorn on one port, until SIGTERM or Ctrl-C.

The memory is opened first (its lock taken, the store replayed: a second server on the same folder is
refused before any port is bound), then uvicorn serves the app (serve/app.py). On SIGTERM uvicorn stops
accepting connections, lets in-flight requests finish (serve.drain_timeout_s at most), and the app's
lifespan runs what the batchers still hold, then closes the memory (index snapshot, lock released), and
the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn

try:  # uvicorn's own choice for http="auto": httptools when installed (uvicorn[standard]), else h11
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as _HTTP_PROTOCOL
except ImportError:
    from uvicorn.protocols.http.h11_impl import H11Protocol as _HTTP_PROTOCOL  # type: ignore[assignment]

from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.files import StorageError
from memfit_gpu.live.memory import Memory
from memfit_gpu.serve.app import make_app
from memfit_gpu.serve.engine import ServedMemory, memory_worker
from memfit_gpu.serve.keys import KeyRing
from memfit_gpu.serve.mcp import make_mcp

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    """uvicorn raises a captured SIGTERM / SIGINT again once its graceful shutdown is done, so the process
    would end as killed by the signal; by then memfit serve has drained and closed the memory: exit 0."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        with super().capture_signals():
            yield
            if self._captured_signals:
                log.info("memfit serve: stopped by signal %s after draining", self._captured_signals[-1])
            self._captured_signals.clear()


def stall_guarded(timeout_s: float) -> type:
    """uvicorn's HTTP protocol (httptools when installed, else h11) that closes a connection whose client
    has not completed a request's headers within `timeout_s` of connecting, or of starting the next
    request after a reply. A request whose headers are in is the app's to time (its body: 408)."""
    class StallGuarded(_HTTP_PROTOCOL):  # type: ignore[misc, valid-type]
        _stall: asyncio.TimerHandle | None = None
        _stall_cycle: Any = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is None or self.cycle.response_complete:  # still waiting for a request's headers
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._stall is not None:
                self._stall.cancel()
                self._stall = None
            super().connection_lost(exc)

        def _arm(self) -> None:
            """A deadline for the headers of the request now arriving (kept when one is set for it)."""
            if self._stall is not None and self._stall_cycle is self.cycle:
                return
            if self._stall is not None:
                self._stall.cancel()
            self._stall_cycle = self.cycle
            self._stall = self.loop.call_later(timeout_s, self._stalled)

        def _stalled(self) -> None:
            self._stall = None
            waiting = self.cycle is None or self.cycle.response_complete
            if waiting and self.cycle is self._stall_cycle and not self.transport.is_closing():
                log.info("memfit serve: closing a connection that sent no complete request in %.0f s", timeout_s)
                self.transport.close()

    return StallGuarded


def freeze_loaded_objects(cfg: MemFitConfig) -> None:
    """With serve.freeze_gc, move every object the process holds now (the libraries, the models, the opened
    store) out of reach of Python's cyclic garbage collector (gc.freeze). A full collection walks every
    tracked object: ~500k in a served memory, 0.2-0.4 s during which no request moves, now and then.
    Objects made later are collected as before; frozen ones are still freed when their last reference goes,
    only a reference cycle among them would be kept."""
    if not cfg.serve.freeze_gc:
        return
    gc.collect()  # what is garbage already is not frozen
    gc.freeze()
    log.info("%d objects loaded at start left out of the cyclic garbage collector (serve.freeze_gc)",
             gc.get_freeze_count())


def serve(store: str | Path, cfg: MemFitConfig, keys_file: str | Path | None = None, host: str | None = None,
          port: int | None = None) -> None:
    """Serve the memory in folder `store` (created when missing) until stopped."""
    keys_path = keys_file or cfg.serve.keys_file
    if keys_path is None:
        raise ConfigError("memfit serve needs API keys: --keys FILE or serve.keys_file "
                          "(make one with `memfit keys new --keys FILE --user USER_ID`)")
    keys = KeyRing.load(keys_path)
    # opened on the thread that will run every call on it: one thread does all of the torch work
    worker = memory_worker()
    try:
        memory = worker.submit(Memory.open, store, cfg).result()
    except BaseException:
        worker.shutdown(wait=True)
        raise
    try:
        app = make_app(memory, keys, cfg, worker)
    except BaseException:
        worker.submit(memory.close).result()
        worker.shutdown(wait=True)
        raise
    config = uvicorn.Config(app, host=host or cfg.serve.host, port=cfg.serve.port if port is None else port,
                            log_level="info", timeout_graceful_shutdown=cfg.serve.drain_timeout_s, lifespan="on",
                            access_log=False, http=stall_guarded(cfg.serve.read_timeout_s))
    server = _Server(config)
    log.info("memfit serve: %s with %d keys on http://%s:%d (OpenAPI: /docs)", store, len(keys.keys), config.host,
             config.port)
    freeze_loaded_objects(cfg)
    try:
        server.run()
    finally:
        # the lifespan has closed the memory and shut the worker down; when uvicorn failed to start, not yet
        try:
            worker.submit(memory.close).result()
        except RuntimeError:  # the worker is shut down: the memory was closed on it
            pass
        worker.shutdown(wait=True)
        with contextlib.suppress(Exception):  # a no-op once closed; a close that failed is reported below
            memory.close()
    failed = getattr(app.state, "shutdown_error", None)
    if failed is not None:
        message = (f"{store}: drained, but closing the memory failed: {failed}; every acknowledged add is in the "
                   f"store's log, and the next start replays it")
        if isinstance(failed, StorageError):
            raise StorageError(failed.path, message, failed.errno) from failed
        raise RuntimeError(message) from failed


def serve_mcp_stdio(store: str | Path, cfg: MemFitConfig, user_id: str) -> None:
    """`memfit mcp`: the memory in folder `store` (created when missing) as an MCP server over stdin and
    stdout for one user (a desktop agent's own process starts it), until stdin closes. The memory is
    opened first, on its worker thread (a second process on the folder is refused); logs go to stderr."""
    worker = memory_worker()
    try:
        memory = worker.submit(Memory.open, store, cfg).result()
    except BaseException:
        worker.shutdown(wait=True)
        raise
    served = ServedMemory(memory, cfg, worker)
    mcp = make_mcp(served, only_user=user_id)
    freeze_loaded_objects(cfg)

    async def main() -> BaseException | None:
        served.start()
        try:
            await mcp.run_stdio_async()
        finally:
            failed = await served.stop()
        return failed

    failed = asyncio.run(main())
    if failed is not None:
        message = f"{store}: closing the memory failed: {failed}; every acknowledged add is in the store's log"
        if isinstance(failed, StorageError):
            raise StorageError(failed.path, message, failed.errno) from failed
        raise RuntimeError(message) from failed
