"""A live memory served for a long stretch: does anything grow that should not? A real `memfit serve` on
127.0.0.1 (configs/demo.yaml: the packaged MiniLM, SmolLM2 as the reader, rerank.backend=none,
live.consolidate=manual) takes --requests mixed requests from --clients concurrent clients (one aiohttp
session), each client writing and reading its own user: adds of one turn (LoCoMo's turns in turn), searches
(LoCoMo's questions), reads of the user's turns, and a share of answers (--answer-share, SmolLM2 with a
short answer; every answer question is new, so none is a cache hit).

Sampled every --sample requests: the server's RSS (/proc/PID/status VmRSS), its open files
(/proc/PID/fd), ledger.json's size and the /metrics page's size. The figures compare the start with the
end: RSS and open files after the first window against after the last one, and the P95 latency of the
first --window requests against the last --window (searches and adds apart). The memory grows with every
add, so the end is also set beside a fresh server over the same memory folder: its RSS (warmed as the soak
began) and the P95s of the last window asked of it again at the same concurrency (its adds under new turn
ids, its answer questions new). Flat within noise is the goal: a server answering for months must not
write quadratically more or hold more per request.

    PYTHONPATH=. .venv/bin/python experiments/bench_soak.py                       # 20,000 requests
    PYTHONPATH=. .venv/bin/python experiments/bench_soak.py --requests 2000 --sample 250

Last line: JSON with the samples, the start/end figures, their ratios, the request counts per kind and the
machine's load.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import random
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import httpx  # noqa: E402
from bench_online import BENCH_OVERRIDES, DEFAULT_CONFIG, DEFAULT_DATA, percentiles, served  # noqa: E402

from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.serve.keys import new_key  # noqa: E402


def server_pid(log_path: Path) -> int:
    """The pid uvicorn logs ("Started server process [PID]")."""
    for line in log_path.read_text(errors="replace").splitlines():
        if "Started server process [" in line:
            return int(line.split("[")[-1].split("]")[0])
    raise RuntimeError(f"no server pid in {log_path}")


def sample(pid: int, url: str, key: str, folder: Path, done: int) -> dict[str, Any]:
    status = Path(f"/proc/{pid}/status").read_text()
    rss_kib = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:")))
    ledger = folder / "ledger.json"
    return {"requests": done, "rss_mib": round(rss_kib / 1024, 1), "open_files": len(os.listdir(f"/proc/{pid}/fd")),
            "ledger_bytes": ledger.stat().st_size if ledger.exists() else 0,
            "metrics_bytes": len(httpx.get(url + "/metrics", timeout=30, headers={"Authorization": f"Bearer {key}"}).content)}


async def soak(url: str, key: str, plan: list[tuple[int, str, dict[str, Any]]], clients: int, every: int,
               on_sample: Any) -> list[tuple[int, str, float]]:
    """Run the plan (request index, kind, body) with `clients` concurrent workers; (index, kind, seconds)."""
    headers = {"Authorization": f"Bearer {key}"}
    queue: asyncio.Queue[tuple[int, str, dict[str, Any]]] = asyncio.Queue()
    for item in plan:
        queue.put_nowait(item)
    timings: list[tuple[int, str, float]] = []
    finished = 0
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=600)) as session:
        async def worker() -> None:
            nonlocal finished
            while not queue.empty():
                index, kind, body = queue.get_nowait()
                user = body.pop("user")
                method, path = ("GET", f"/v1/users/{user}/turns") if kind == "read" else \
                    ("POST", f"/v1/users/{user}/{ {'add': 'turns', 'search': 'search', 'answer': 'answer'}[kind] }")
                t0 = time.perf_counter()
                async with session.request(method, url + path, json=body or None) as reply:
                    await reply.read()
                    if reply.status != 200:
                        raise RuntimeError(f"{method} {path}: {reply.status} {await reply.text()}")
                timings.append((index, kind, time.perf_counter() - t0))
                finished += 1
                if finished % every == 0:
                    await asyncio.get_running_loop().run_in_executor(None, on_sample, finished)

        await asyncio.gather(*(worker() for _ in range(clients)))
    return timings


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--answer-share", type=float, default=0.002, help="share of requests that are answers")
    parser.add_argument("--sample", type=int, default=1000, help="sample the server every N requests")
    parser.add_argument("--window", type=int, default=2000, help="requests in the start and end latency windows")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    bench = select_questions(load_benchmark("locomo", args.data), exclude_categories=["5"])
    texts = [(t.speaker, t.text) for m in bench.memories for t in m.turns()]
    questions = [q.question for q in bench.questions()]
    rng = random.Random(args.seed)
    users = [f"soak{c:02d}" for c in range(args.clients)]
    plan: list[tuple[int, str, dict[str, Any]]] = []
    for n in range(args.requests):
        user = users[n % len(users)]
        roll = rng.random()
        if n < len(users) or roll < 0.45:
            speaker, text = texts[n % len(texts)]
            plan.append((n, "add", {"user": user, "turns": [{"speaker": speaker, "text": text, "turn_id": f"t{n}"}]}))
        elif roll < 0.45 + args.answer_share:
            plan.append((n, "answer", {"user": user, "questions": [f"{rng.choice(questions)} (asked {n})"], "k": 5}))
        elif roll < 0.9:
            plan.append((n, "search", {"user": user, "queries": [rng.choice(questions)], "k": 10}))
        else:
            plan.append((n, "read", {"user": user}))
    # the end window again, for the fresh server below: the same mix, its adds under new turn ids and its answer
    # questions new (so none is a duplicate or a cache hit); soak() takes "user" out of each body
    end_window = copy.deepcopy(plan[-args.window:])
    for _, kind, body in end_window:
        if kind == "add":
            body["turns"][0]["turn_id"] += "-again"
        elif kind == "answer":
            body["questions"] = [f"{q} again" for q in body["questions"]]
    samples: list[dict[str, Any]] = []
    overrides = [*BENCH_OVERRIDES, "reader.max_new_tokens=8"]
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as folder:
        root = Path(folder)
        keys = root / "keys.jsonl"
        key = new_key(keys, users, name="soak", admin=True)  # admin: it reads /metrics too
        with served(root / "memory", args.config, keys, overrides, root / "server.log") as url:
            pid = server_pid(root / "server.log")
            samples.append(sample(pid, url, key, root / "memory", 0))
            started = time.perf_counter()
            timings = asyncio.run(soak(url, key, plan, args.clients, args.sample,
                                       lambda done: samples.append(sample(pid, url, key, root / "memory", done))))
            seconds = time.perf_counter() - started
        # The store grows with every add, so RSS cannot stay where it started: what the served memory should
        # hold after the soak is what a fresh server holds over the same memory. The soak's server stops (its
        # SIGTERM drain), a new one opens the folder, is warmed as the soak began (a search per user, one
        # answer so the reader is loaded) and is sampled once.
        with served(root / "memory", args.config, keys, overrides, root / "server-fresh.log") as url:
            pid = server_pid(root / "server-fresh.log")
            warm = [(n, "search", {"user": u, "queries": [questions[n]], "k": 10}) for n, u in enumerate(users)]
            warm.append((len(users), "answer", {"user": users[0], "questions": [f"{questions[0]} (fresh)"], "k": 5}))
            asyncio.run(soak(url, key, warm, args.clients, len(warm) + 1, lambda done: None))
            fresh = sample(pid, url, key, root / "memory", len(timings))
            # the soak's last window again at the same concurrency on the same memory: what the grown memory
            # itself costs a request, apart from anything the soak's server accumulated
            again = asyncio.run(soak(url, key, end_window, args.clients, len(end_window) + 1, lambda done: None))
    fresh_window = {kind: percentiles([sec for _, k, sec in again if k == kind]) for kind in ("add", "search")}
    by_index = sorted(timings)
    first, last = by_index[:args.window], by_index[-args.window:]
    windows = {name: {kind: percentiles([s for _, k, s in part if k == kind]) for kind in ("add", "search")}
               for name, part in (("start", first), ("end", last))}
    start, end = samples[1] if len(samples) > 1 else samples[0], samples[-1]
    result = {
        "requests": len(timings), "clients": args.clients, "seconds": round(seconds, 1),
        "requests_per_s": round(len(timings) / seconds, 1),
        "kinds": {k: sum(1 for _, kind, _ in timings if kind == k) for k in ("add", "search", "read", "answer")},
        "latency": windows,
        "fresh_server_end_window": fresh_window,
        "p95_end_over_fresh": {k: round(windows["end"][k]["p95_ms"] / fresh_window[k]["p95_ms"], 3)
                               for k in ("add", "search")},
        "p95_ratio_end_over_start": {k: round(windows["end"][k]["p95_ms"] / windows["start"][k]["p95_ms"], 3)
                                     for k in ("add", "search")},
        "rss_mib": {"start": start["rss_mib"], "end": end["rss_mib"], "ratio": round(end["rss_mib"] / start["rss_mib"], 3),
                    "fresh_server_same_memory": fresh["rss_mib"],
                    "end_over_fresh": round(end["rss_mib"] / fresh["rss_mib"], 3)},
        "open_files": {"start": start["open_files"], "end": end["open_files"]},
        "ledger_bytes": {"start": start["ledger_bytes"], "end": end["ledger_bytes"]},
        "metrics_bytes": {"start": start["metrics_bytes"], "end": end["metrics_bytes"]},
        "samples": samples, "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
