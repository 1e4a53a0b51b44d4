"""One user's answers beside another user's searches, on a real `memfit serve` (127.0.0.1): a search's
latency while another user's answers are being generated, against the same searches with the server
idle, measured in the same run.

Setup. configs/demo.yaml (packaged all-MiniLM-L6-v2, SmolLM2-135M-Instruct as the reader, on this CPU),
rerank.backend=none, live.consolidate=manual. Two users: `reader` holds LoCoMo conv-26's first sessions,
`searcher` conv-30's (or the next conversation's). One untimed answer (it loads SmolLM2) and one search
warm the server up.

1. `idle`: --searches searches of `searcher` one after another (its evaluated questions in turn, k=10).
2. `busy`: the same searches again while a second client keeps `reader`'s answers coming (one question a
   request, each new so nothing is served from the cache; the next as soon as the last returns).
The ratio `busy.p95 / idle.p95` is what another user's generation costs a search (the target: <= 2).
The server's torch work runs on one thread per process role: searches on the memory's worker, the
generation beside it on a thread of its own, so on two cores the two share the machine, not a thread.

    PYTHONPATH=. .venv/bin/python experiments/bench_isolation.py              # 60 searches each (~3 min)
    PYTHONPATH=. .venv/bin/python experiments/bench_isolation.py --searches 20

Last line: JSON with both latency summaries (P50/P95/P99 ms), the ratio, the answers completed during
the busy phase and their mean seconds, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
from bench_online import (  # noqa: E402
    BENCH_OVERRIDES,
    DEFAULT_CONFIG,
    DEFAULT_DATA,
    checked,
    percentiles,
    served,
    turn_payload,
)

from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.serve.keys import new_key  # noqa: E402

K = 10
TARGET_RATIO = 2.0


def add_conversation(client: httpx.Client, url: str, key: str, user: str, memory: Any, sessions: int) -> int:
    turns = [turn_payload(t, s.session_id) for s in memory.sessions[:sessions] for t in s.turns]
    for start in range(0, len(turns), 256):
        checked(client.post(f"{url}/v1/users/{user}/turns", json={"turns": turns[start:start + 256]},
                            headers={"Authorization": f"Bearer {key}"}))
    return len(turns)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help="LoCoMo file (default ../shared)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--searches", type=int, default=60, help="searches per phase")
    parser.add_argument("--sessions", type=int, default=6, help="sessions of each conversation to store")
    args = parser.parse_args(argv)
    bench = select_questions(load_benchmark("locomo", args.data), exclude_categories=["5"])
    reader_memory, search_memory = bench.memories[0], bench.memories[1]
    queries = [q.question for q in search_memory.questions]
    asked = [q.question for q in reader_memory.questions]
    queries = (queries * (1 + args.searches // max(1, len(queries))))[:args.searches]
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-isolation-")))
        keys = root / "keys.jsonl"
        key = new_key(keys, ["reader", "searcher"], name="bench")
        url = stack.enter_context(served(root / "memory", args.config, keys, BENCH_OVERRIDES, root / "server.log"))
        headers = {"Authorization": f"Bearer {key}"}
        client = stack.enter_context(httpx.Client(timeout=600))
        stored = {user: add_conversation(client, url, key, user, memory, args.sessions)
                  for user, memory in (("reader", reader_memory), ("searcher", search_memory))}

        def search(query: str) -> float:
            t0 = time.perf_counter()
            checked(client.post(f"{url}/v1/users/searcher/search", json={"queries": [query], "k": K}, headers=headers))
            return time.perf_counter() - t0

        def answer(question: str, http: httpx.Client) -> float:
            t0 = time.perf_counter()
            checked(http.post(f"{url}/v1/users/reader/answer", json={"questions": [question], "k": K}, headers=headers))
            return time.perf_counter() - t0

        with httpx.Client(timeout=600) as warm:
            answer("What did we talk about first?", warm)
        search(queries[0])
        idle = [search(q) for q in queries]
        stop = threading.Event()
        answered: list[float] = []

        def keep_answering() -> None:
            with httpx.Client(timeout=600) as http:
                n = 0
                while not stop.is_set():  # a new question each time: never a cache hit
                    answered.append(answer(f"{asked[n % len(asked)]} (variant {n})", http))
                    n += 1

        worker = threading.Thread(target=keep_answering, daemon=True)
        worker.start()
        time.sleep(2.0)  # the first answer is generating
        busy = [search(q) for q in queries]
        during = len(answered)
        stop.set()
        worker.join()
    idle_stats, busy_stats = percentiles(idle), percentiles(busy)
    ratio = round(busy_stats["p95_ms"] / idle_stats["p95_ms"], 3)  # type: ignore[operator]
    result = {"idle": idle_stats, "busy": busy_stats, "p95_ratio_busy_over_idle": ratio,
              "target_ratio_max": TARGET_RATIO, "target_met": ratio <= TARGET_RATIO,
              "answers_during_busy": during,
              "answer_mean_s": round(sum(answered) / len(answered), 3) if answered else None,
              "turns_stored": stored, "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count()}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
