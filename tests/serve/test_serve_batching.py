"""serve/batching.py's Batcher on its own: which items share a batch, and when a batch starts.

The run function records each batch and when it started; a thread pool of one worker plays the
memory's worker thread, as in serve/app.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from memfit_gpu.serve.batching import Batcher


class Recorder:
    """run(items): records (start time, items), sleeps `hold_s`, answers each item with item * 10, and
    refuses the item 13 alone."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.batches: list[tuple[float, list[int]]] = []
        self.lock = threading.Lock()

    def __call__(self, items: list[int]) -> list[object]:
        with self.lock:
            self.batches.append((time.perf_counter(), list(items)))
        time.sleep(self.hold_s)
        return [ValueError("thirteen") if i == 13 else i * 10 for i in items]


def run_async(coro):  # noqa: ANN001, ANN201 - a test helper
    return asyncio.run(coro)


def test_items_queued_while_a_batch_runs_form_the_next_batch_at_once() -> None:
    # window 1 s, each batch holds the worker 1.2 s: B and C arrive 0.1 s into the first batch, so their
    # window has passed when it ends and the second batch starts then, not a window later.
    record = Recorder(hold_s=1.2)

    async def main() -> tuple[list[int], float]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=1.0, max_batch=8, executor=worker)
            batcher.start()
            first = asyncio.create_task(batcher.submit(1))
            while not record.batches:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.1)
            rest = [asyncio.create_task(batcher.submit(i)) for i in (2, 3)]
            got = [await first] + [await t for t in rest]
            ended_first = record.batches[0][0] + record.hold_s
            await batcher.stop()
            return got, record.batches[1][0] - ended_first

    got, gap = run_async(main())
    assert got == [10, 20, 30]
    assert [items for _, items in record.batches] == [[1], [2, 3]]
    assert gap < 0.5, f"the second batch started {gap:.2f} s after the first ended (the window is 1 s)"


def test_a_lone_item_waits_for_the_window_then_runs_alone() -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> tuple[int, float]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.3, max_batch=8, executor=worker)
            batcher.start()
            start = time.perf_counter()
            got = await batcher.submit(4)
            waited = time.perf_counter() - start
            await batcher.stop()
            return got, waited

    got, waited = run_async(main())
    assert got == 40
    assert [items for _, items in record.batches] == [[4]]
    assert 0.25 <= waited < 2.0


def test_max_batch_caps_a_batch_and_an_error_refuses_its_item_alone() -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.5, max_batch=3, executor=worker)
            batcher.start()
            tasks = [asyncio.create_task(batcher.submit(i)) for i in (11, 12, 13, 14, 15)]
            out: list[object] = []
            for task in tasks:
                try:
                    out.append(await task)
                except ValueError as exc:
                    out.append(str(exc))
            await batcher.stop()
            return out

    assert run_async(main()) == [110, 120, "thirteen", 140, 150]
    assert [items for _, items in record.batches] == [[11, 12, 13], [14, 15]]


def test_stop_runs_what_is_queued() -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=5.0, max_batch=8, executor=worker)
            batcher.start()
            tasks = [asyncio.create_task(batcher.submit(i)) for i in (1, 2)]
            await asyncio.sleep(0.05)
            await batcher.stop()
            return [await t for t in tasks]

    assert run_async(main()) == [10, 20]


@pytest.mark.parametrize("max_batch", [1])
def test_max_batch_one_runs_every_item_alone(max_batch: int) -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.5, max_batch=max_batch, executor=worker)
            batcher.start()
            got = await asyncio.gather(*(batcher.submit(i) for i in (1, 2, 3)))
            await batcher.stop()
            return list(got)

    assert run_async(main()) == [10, 20, 30]
    assert [items for _, items in record.batches] == [[1], [2], [3]]


def test_an_item_that_breaks_the_batched_call_fails_alone() -> None:
    """A request that passes validation but makes the batched call raise (a lone surrogate deep in the
    write path, a query the index refuses) used to fail every request of its batch with its error; each
    item now runs again alone and gets its own result."""
    calls: list[list[int]] = []

    def run(items: list[int]) -> list[int]:
        calls.append(list(items))
        if 666 in items:
            raise ValueError("poisoned batch")
        return [i * 10 for i in items]

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", run, window_s=0.2, max_batch=8, executor=worker)
            batcher.start()
            tasks = [asyncio.create_task(batcher.submit(i)) for i in (1, 666, 2)]
            got = await asyncio.gather(*tasks, return_exceptions=True)
            await batcher.stop()
            return got

    got = run_async(main())
    assert got[0] == 10 and got[2] == 20
    assert isinstance(got[1], ValueError) and str(got[1]) == "poisoned batch"
    assert calls == [[1, 666, 2], [1], [666], [2]]


def test_a_client_with_many_queued_requests_holds_another_for_one_batch_at_most() -> None:
    """One client (tenant A) queues six requests of 4 texts each, where a batch holds 8 texts; B's one
    request, arriving while A's first batch runs, goes in the next batch, not after all of A's (FIFO put it
    in the fourth)."""
    record = Recorder(hold_s=0.3)

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.05, max_batch=64, executor=worker,
                              weight=lambda item: 4, max_weight=8)
            batcher.start()
            tasks = [asyncio.create_task(batcher.submit(i, "A")) for i in range(21, 27)]
            while not record.batches:
                await asyncio.sleep(0.01)
            tasks.append(asyncio.create_task(batcher.submit(99, "B")))
            got = [await t for t in tasks]
            await batcher.stop()
            return got

    assert run_async(main()) == [210, 220, 230, 240, 250, 260, 990]
    assert [items for _, items in record.batches] == [[21, 22], [23, 99], [24, 25], [26]]


def test_a_batch_takes_waiting_requests_round_robin_between_clients() -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> None:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.2, max_batch=2, executor=worker)
            batcher.start()
            tasks = [asyncio.create_task(batcher.submit(i, "A")) for i in (1, 2, 3)]
            tasks += [asyncio.create_task(batcher.submit(i, "B")) for i in (4, 5, 6)]
            await asyncio.gather(*tasks)
            await batcher.stop()

    run_async(main())
    assert [items for _, items in record.batches] == [[1, 4], [2, 5], [3, 6]]


def test_a_request_heavier_than_a_batch_runs_alone_and_the_rest_follow() -> None:
    record = Recorder(hold_s=0.0)

    async def main() -> list[object]:
        with ThreadPoolExecutor(1) as worker:
            batcher = Batcher("t", record, window_s=0.2, max_batch=8, executor=worker,
                              weight=lambda item: item, max_weight=10)
            batcher.start()
            got = await asyncio.gather(*(batcher.submit(i, t) for i, t in ((30, "A"), (4, "B"), (5, "C"), (3, "D"))))
            await batcher.stop()
            return list(got)

    assert run_async(main()) == [300, 40, 50, 30]
    assert [items for _, items in record.batches] == [[30], [4, 5], [3]]
