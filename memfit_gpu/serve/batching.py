"""Dynamic batching: concurrent requests of one kind answered by one batched call (as vLLM batches
concurrent generations).

A `Batcher` collects what its callers submit: the first item opens a batch, which takes every item that
arrives within `window_s` of that item's arrival, or until `max_batch` items wait; the batch then runs as
ONE call of `run(items) -> results` (one result, or the exception that refused that item alone, per item,
in order) on the memory's worker thread, while the next batch gathers. If that call raises, no item is
failed for another's sake: each item of the batch runs again alone (`run([item])`), and gets its own
result or its own error (a request that breaks a batched call fails alone). The window counts from the first
item's arrival, not from when the batcher got to it: items that queued while a batch ran have waited
their window already and form the next batch at once (continuous batching), so under load batches grow
by themselves and the worker never idles with requests waiting, and an idle server answers a lone
request after at most the window. `max_batch` 1 turns batching off: every request is its own call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, TypeVar

Item = TypeVar("Item")

_STOP = object()


class Batcher(Generic[Item]):
    def __init__(self, name: str, run: Callable[[list[Item]], Sequence[Any]], window_s: float, max_batch: int,
                 executor: Executor, observe: Callable[[str, int, float], None] | None = None) -> None:
        self.name, self.run, self.window_s, self.max_batch = name, run, window_s, max_batch
        self.executor = executor
        self.observe = observe  # (name, batch size, seconds of the batched call): the server's metrics
        self.queue: asyncio.Queue[Any] = asyncio.Queue()
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def submit(self, item: Item) -> Any:
        """The item's result once its batch has run (its own exception raised here)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        await self.queue.put((item, future, loop.time()))
        return await future

    async def stop(self) -> None:
        """Run what is queued, then end the loop (the server's drain)."""
        if self.task is not None:
            await self.queue.put(_STOP)
            await self.task
            self.task = None

    async def _gather(self, first: Any) -> tuple[list[Any], bool]:
        batch, stopping = [first], False
        loop = asyncio.get_running_loop()
        deadline = first[2] + self.window_s  # from the first item's arrival (module doc)
        while len(batch) < self.max_batch:
            try:
                left = deadline - loop.time()
                entry = self.queue.get_nowait() if left <= 0 else await asyncio.wait_for(self.queue.get(), left)
            except (asyncio.QueueEmpty, TimeoutError):
                break
            if entry is _STOP:
                stopping = True
                break
            batch.append(entry)
        return batch, stopping

    async def _alone(self, items: list[Item]) -> list[Any]:
        """Each item of a batch whose batched call failed, run as a batch of one: its result or its error."""
        loop = asyncio.get_running_loop()
        out: list[Any] = []
        for item in items:
            try:
                out.extend(await loop.run_in_executor(self.executor, self.run, [item]))
            except Exception as exc:  # noqa: BLE001  (this item's own error, for its caller)
                out.append(exc)
        return out

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        stopping = False
        while not stopping:
            first = await self.queue.get()
            if first is _STOP:
                break
            batch, stopping = await self._gather(first)
            started = time.perf_counter()
            items = [item for item, _, _ in batch]
            try:
                results = await loop.run_in_executor(self.executor, self.run, items)
            except Exception as exc:  # noqa: BLE001  (the callers get their own errors; the loop lives on)
                results = [exc] if len(items) == 1 else await self._alone(items)
            if self.observe is not None:
                self.observe(self.name, len(batch), time.perf_counter() - started)
            for (_, future, _), result in zip(batch, results, strict=True):
                if future.done():  # the caller went away (its connection closed)
                    continue
                if isinstance(result, BaseException):
                    future.set_exception(result)
                else:
                    future.set_result(result)
