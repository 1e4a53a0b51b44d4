"""Dynamic batching: concurrent requests of one kind answered by one batched call (as vLLM batches
concurrent generations), shared fairly between the clients that wait.

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

Fairness. Each item is submitted for a `tenant` (the server passes the API key): a batch takes the waiting
items round-robin, one per tenant in turn (a tenant that waited longest first), not in arrival order, and
holds at most `max_weight` of `weight(item)` (queries, questions or turns: what a batch's time grows with;
an item heavier than that runs alone). So a client that queued many large requests delays another
client's request by at most one such batch, not by all of its own.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Any, Generic, NamedTuple, TypeVar

Item = TypeVar("Item")


class _Waiting(NamedTuple):
    item: Any
    future: asyncio.Future[Any]
    arrived: float  # the event loop's clock


class Batcher(Generic[Item]):
    def __init__(self, name: str, run: Callable[[list[Item]], Sequence[Any]], window_s: float, max_batch: int,
                 executor: Executor, observe: Callable[[str, int, float], None] | None = None,
                 weight: Callable[[Item], int] | None = None, max_weight: int | None = None) -> None:
        self.name, self.run, self.window_s, self.max_batch = name, run, window_s, max_batch
        self.executor = executor
        self.observe = observe  # (name, batch size, seconds of the batched call): the server's metrics
        self.weight, self.max_weight = weight or (lambda item: 1), max_weight
        # per tenant, its items in arrival order; `turns`: the tenants with items waiting, next to serve first
        self.waiting: dict[str, collections.deque[_Waiting]] = {}
        self.turns: collections.deque[str] = collections.deque()
        self.arrived: asyncio.Event | None = None  # set when an item (or the stop) arrives
        self.stopping = False
        self.task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.arrived = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._loop(), name=f"batcher-{self.name}")

    async def submit(self, item: Item, tenant: str = "") -> Any:
        """The item's result once its batch has run (its own exception raised here); `tenant`: whose share of
        the batches it takes (module doc)."""
        assert self.arrived is not None, "submit before start"
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        queue = self.waiting.get(tenant)
        if queue is None:
            queue = self.waiting[tenant] = collections.deque()
            self.turns.append(tenant)
        queue.append(_Waiting(item, future, loop.time()))
        self.arrived.set()
        return await future

    async def stop(self) -> None:
        """Run what is queued, then end the loop (the server's drain)."""
        if self.task is not None:
            assert self.arrived is not None
            self.stopping = True
            self.arrived.set()
            await self.task
            self.task = None

    def _take(self, weight_so_far: int, first: bool) -> _Waiting | None:
        """The next tenant's oldest item, or None when none waits or it would take the batch past max_weight."""
        if not self.turns:
            return None
        tenant = self.turns[0]
        queue = self.waiting[tenant]
        entry = queue[0]
        if not first and self.max_weight is not None and weight_so_far + self.weight(entry.item) > self.max_weight:
            return None
        queue.popleft()
        self.turns.popleft()
        if queue:
            self.turns.append(tenant)  # its next item waits for every other tenant's turn
        else:
            del self.waiting[tenant]
        return entry

    async def _gather(self) -> list[_Waiting]:
        assert self.arrived is not None
        first = self._take(0, first=True)
        assert first is not None
        batch, weight = [first], self.weight(first.item)
        loop = asyncio.get_running_loop()
        deadline = first.arrived + self.window_s  # from the first item's arrival (module doc)
        while len(batch) < self.max_batch:
            entry = self._take(weight, first=False)
            if entry is not None:
                batch.append(entry)
                weight += self.weight(entry.item)
                continue
            if self.turns or self.stopping:  # full by weight, or draining: what waits goes next
                break
            left = deadline - loop.time()
            if left <= 0:
                break
            self.arrived.clear()
            try:
                await asyncio.wait_for(self.arrived.wait(), left)
            except TimeoutError:
                break
        return batch

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
        assert self.arrived is not None
        loop = asyncio.get_running_loop()
        while True:
            if not self.turns:
                if self.stopping:
                    break
                self.arrived.clear()
                await self.arrived.wait()
                continue
            batch = await self._gather()
            started = time.perf_counter()
            items = [entry.item for entry in batch]
            try:
                results = await loop.run_in_executor(self.executor, self.run, items)
            except Exception as exc:  # noqa: BLE001  (the callers get their own errors; the loop lives on)
                results = [exc] if len(items) == 1 else await self._alone(items)
            if self.observe is not None:
                self.observe(self.name, len(batch), time.perf_counter() - started)
            for entry, result in zip(batch, results, strict=True):
                if entry.future.done():  # the caller went away (its connection closed)
                    continue
                if isinstance(result, BaseException):
                    entry.future.set_exception(result)
                else:
                    entry.future.set_result(result)
