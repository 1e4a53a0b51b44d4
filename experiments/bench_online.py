"""Online latency of the live memory: LoCoMo replayed turn by turn, through the Python API
(memfit_gpu.Memory) and through HTTP (a real `memfit serve` subprocess on 127.0.0.1), per live method.

Replay. Every turn of each selected LoCoMo conversation (one user per conversation) is added on its own,
in conversation order (one `add` call / one POST per turn: the insertion latency). Each evaluated question
(category 5 is not scored and not asked) is asked right AFTER the turn that completes its evidence, i.e.
once the memory holds every turn up to its last evidence turn (in conversation order) and nothing later
has been added yet; a question whose evidence names no turn of the file is asked after the last turn.
One search per question (k=10; the retrieval latency). With the reader (--reader, default), a few
questions (--reader-questions, spread evenly over the replay) are also answered with `answer` at the same
point (the end-to-end latency: retrieval, prompt, SmolLM2 on the CPU), through the Python API only (the
HTTP answer path is the same call behind one more hop; loading a second SmolLM2 into every server would
only slow this 2-core machine down). Latencies are wall-clock per call, measured by the caller: for HTTP
they include the client, JSON and, with the default batching, the serve.batch_window_ms wait that a lone
request sits out (5 ms). Before the replay each memory gets one untimed warm-up add, search (and answer),
of a throwaway user that is deleted again.

Concurrency. For the first method (default memfit) two servers hold the same turns: the replay's own
server, with the defaults (dynamic batching: serve.batch_window_ms=5, serve.max_batch=64), and a second
one, one-at-a-time (serve.max_batch=1), over a copy of the memory the Python API built. For N = --clients
(1, 4, 16, 64) concurrent clients (asyncio tasks sharing one aiohttp session, each issuing its next
search when its last one is answered; --requests in all per level, the replay's questions in turn, after
a few untimed ones), the two servers are measured alternately, never both at once: throughput
(searches/s) and P50/P95/P99 latency, with the ratios batched / one-at-a-time in the same run, and the
mean batch size the batched server formed (its /metrics). The search results of the two servers for the
same queries are compared (kind, turn ids and text of every hit, and the largest score difference).

Where the encoding goes. With `live.indexing: on_add` (the default) an add encodes its turn before it
returns; with `live.indexing=deferred` (an override) an add returns once its turn is logged (fsynced) and
the next read encodes every pending turn in one pass before it searches, so that search's latency
includes it. On the Python API path of the methods whose searches read the store's
indexes (memfit, plain) the JSON also gives `time_to_searchable` per turn (its add's start to the end of
the call that indexed it) and `deferred_indexing` (how many reads indexed turns, how many, their
indexing ms and its share of the summed retrieval time).

Config: configs/demo.yaml (packaged all-MiniLM-L6-v2, SmolLM2-135M-Instruct) with rerank.backend=none
and live.consolidate=manual (MemFit's summaries and LightMem's notes are off the query path; building
them with SmolLM2 on two cores would take minutes and run beside the timed calls, so none is built and
the memories hold only turns). lightmem_slm runs only when --methods names it (its query path calls the
SLM). Targets (on the 2-core CPU, one conversation) are checked on the Python API path of
every method of ours and printed as booleans with their thresholds; HTTP figures are printed beside them.
A peer system (mem0, from its own package) runs only when --methods names it: its every add makes its LLM
calls (mem0's extraction, SmolLM2 here: seconds per turn), so a few --turns suffice; it is held to no
target, and `peer_ratios` gives its insertion and search P50/P95 over our first method's in the same run.

    PYTHONPATH=. .venv/bin/python experiments/bench_online.py                  # the default run
    PYTHONPATH=. .venv/bin/python experiments/bench_online.py --no-reader --methods memfit --clients 1 16
    PYTHONPATH=. .venv/bin/python experiments/bench_online.py --no-reader --methods memfit mem0 --turns 8 --clients

Last line: JSON with `replay` (per method and path: insert/search/e2e P50/P95/P99 ms), `concurrency`
(per N: batched and unbatched throughput and tail latency, ratios), `identical_results`, `targets`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import aiohttp  # noqa: E402
import httpx  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.data.schema import Memory as Conversation  # noqa: E402
from memfit_gpu.data.schema import Question, written_turn_id  # noqa: E402
from memfit_gpu.files import write_output  # noqa: E402
from memfit_gpu.live.memory import Memory  # noqa: E402
from memfit_gpu.methods.registry import method_entry  # noqa: E402
from memfit_gpu.serve.keys import new_key  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
BENCH_OVERRIDES = ["rerank.backend=none", "live.consolidate=manual"]
DEFAULT_METHODS = ["memfit", "plain", "naive_rag"]
K = 10
WARMUP_USER = "bench-warmup"
WARMUP_TURN = {"speaker": "Ann", "text": "A warm-up turn about a grey cat named Pixel.",
               "timestamp": "2020-01-01T10:00:00", "turn_id": "w1"}
WARMUP_QUERY = "What is the name of Ann's cat?"
# the live memory's targets: (method path, metric, threshold in ms); checked on the Python API path
TARGETS = {"insert_p50_ms": 10.0, "search_p50_ms": 20.0, "search_p95_ms": 50.0}
# Methods whose searches read the store's episode indexes (so a deferred add is searchable once the next
# read has indexed it); naive_rag reads only its chunk index, which its add updates before it returns.
READS_STORE_INDEXES = {"memfit", "plain", "lightmem_slm"}
CONCURRENCY_TARGET = {"clients": 16, "throughput_ratio_min": 5.0, "p95_over_single_client_p95_max": 2.0}


# ------------------------------------------------------------------------------------------ the replay
def percentiles(samples_s: list[float]) -> dict[str, float | int | None]:
    """P50 / P95 / P99 / mean in ms (linear interpolation), and the sample count."""
    if not samples_s:
        return {"n": 0, "p50_ms": None, "p95_ms": None, "p99_ms": None, "mean_ms": None}
    ms = np.asarray(samples_s) * 1000.0
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"n": len(ms), "p50_ms": round(float(p50), 2), "p95_ms": round(float(p95), 2),
            "p99_ms": round(float(p99), 2), "mean_ms": round(float(ms.mean()), 2)}


def turn_payload(turn: Any, session_id: str) -> dict[str, Any]:
    """A LoCoMo turn as `add` and POST /turns take it."""
    out: dict[str, Any] = {"speaker": turn.speaker, "text": turn.text, "turn_id": turn.turn_id,
                           "session_id": session_id, "date_text": turn.date_text}
    if turn.timestamp:
        out["timestamp"] = turn.timestamp
    images = [{k: v for k, v in (("caption", i.caption), ("image_id", i.image_id), ("path", i.path)) if v is not None}
              for i in turn.images]
    if images:
        out["images"] = images
    return out


def schedule(conversation: Conversation, questions: list[Question]) -> list[tuple[dict[str, Any], list[Question]]]:
    """[(turn, questions asked right after it)]: each question after the turn that completes its evidence
    (the last of its evidence turns in conversation order), one without a known evidence turn after the
    last turn."""
    turns = [(t, s.session_id) for s in conversation.sessions for t in s.turns]
    position = {}
    for n, (turn, _) in enumerate(turns):
        position.setdefault(written_turn_id(turn.turn_id), n)
        position.setdefault(turn.turn_id, n)
    after: dict[int, list[Question]] = {}
    for q in questions:
        known = [position[e] for e in q.evidence if e in position]
        after.setdefault(max(known) if known else len(turns) - 1, []).append(q)
    return [(turn_payload(t, s), after.get(n, [])) for n, (t, s) in enumerate(turns)]


def spread(items: list[Any], n: int) -> list[Any]:
    """n items evenly spaced over the list (all when n >= len)."""
    if n >= len(items):
        return list(items)
    if n <= 0:
        return []
    return [items[round(i * (len(items) - 1) / max(n - 1, 1))] for i in range(n)]


def replay(label: str, plan: list[tuple[str, list[tuple[dict[str, Any], list[Question]]]]],
           add: Callable[[str, dict[str, Any]], Any], search: Callable[[str, str], Any],
           answer: Callable[[str, str], Any] | None, answered: set[str],
           store: Any | None = None) -> dict[str, Any]:
    """Timed replay of every conversation: one add per turn, one search per question after its turn;
    answer() for the questions in `answered`. store: the API path's EpisodeStore, to see where the
    encoding went (live.indexing): time-to-searchable per turn (its add's start to the end of the call
    that indexed it: the add itself with on_add, the next read when deferred) and the deferred indexing
    each read did first (included in its latency)."""
    times: dict[str, list[float]] = {"insert": [], "search": [], "e2e": []}
    cpu: dict[str, list[float]] = {"insert": [], "search": [], "e2e": []}
    waiting: list[float] = []  # add start of each turn not indexed yet, oldest first
    searchable: list[float] = []
    flushes: dict[str, list[tuple[int, float]]] = {"insert": [], "search": [], "e2e": []}

    def timed(kind: str, call: Callable[[str, Any], Any], user: str, item: Any) -> None:
        before = dict(store.deferred_indexed) if store is not None else None
        wall, own = time.perf_counter(), time.process_time()
        call(user, item)
        end = time.perf_counter()
        times[kind].append(end - wall)
        cpu[kind].append(time.process_time() - own)
        if store is not None and before is not None:
            if kind == "insert":
                waiting.append(wall)
            while len(waiting) > store.pending:
                searchable.append(end - waiting.pop(0))
            done = store.deferred_indexed
            if done["episodes"] > before["episodes"]:
                flushes[kind].append((done["episodes"] - before["episodes"], done["seconds"] - before["seconds"]))

    total = sum(len(turns) for _, turns in plan)
    with tqdm(total=total, desc=label, unit="turn", leave=False, mininterval=1.0) as bar:
        for user, turns in plan:
            for turn, questions in turns:
                timed("insert", add, user, turn)
                for q in questions:
                    timed("search", search, user, q.question)
                    if answer is not None and q.question_id in answered:
                        timed("e2e", answer, user, q.question)
                bar.update(1)
    out: dict[str, Any] = {kind: percentiles(times[kind]) for kind in ("insert", "search")}
    out["e2e"] = percentiles(times["e2e"]) if answer is not None else None
    # process CPU seconds per call: this process's own work (the API path: the memory's; HTTP: the client's)
    out["cpu_p50_ms"] = {kind: percentiles(cpu[kind])["p50_ms"] for kind in out if out[kind] is not None}
    # the insertion P50 over the first and the last quarter of the replay's turns: does an add grow with
    # the history?
    quarter = max(len(times["insert"]) // 4, 1)
    out["insert"]["first_quarter_p50_ms"] = percentiles(times["insert"][:quarter])["p50_ms"]
    out["insert"]["last_quarter_p50_ms"] = percentiles(times["insert"][-quarter:])["p50_ms"]
    if store is not None:
        out["time_to_searchable"] = {**percentiles(searchable), "turns_never_read_after": len(waiting)}
        reads = flushes["search"] + flushes["e2e"]
        out["deferred_indexing"] = {
            "reads_that_indexed": len(reads), "turns_indexed_by_reads": sum(n for n, _ in reads),
            "turns_per_indexing_read_p50": float(np.median([n for n, _ in reads])) if reads else None,
            "index_ms": percentiles([t for _, t in reads]),
            # the share of the summed retrieval latency spent indexing the turns added before it
            "share_of_search_time": round(sum(t for _, t in flushes["search"]) / sum(times["search"]), 3)
            if times["search"] else None,
            "turns_indexed_by_adds": sum(n for n, _ in flushes["insert"])}  # a snapshot due on an add
    return out


# ------------------------------------------------------------------------------------------ a server
RUNNING = re.compile(r"Uvicorn running on (http://127\.0\.0\.1:\d+)")


@contextmanager
def served(store: Path, config: Path, keys: Path, overrides: list[str], log_path: Path,
           timeout_s: float = 300.0) -> Iterator[str]:
    """A `memfit serve` subprocess on 127.0.0.1 (this interpreter, PYTHONPATH as given): its base URL once
    /healthz answers; SIGTERM (a drain) on exit. It binds any free port (--port 0) and the URL is read from
    uvicorn's log line, so no other process on this shared machine can take the port in between."""
    log_path.write_bytes(b"")
    with open(log_path, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "memfit_gpu.cli", "serve", "--store", str(store), "--config",
                                 str(config), "--keys", str(keys), "--port", "0", *overrides],
                                stdout=out, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        url = None
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"memfit serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if url is None:
                found = RUNNING.search(log_path.read_text(errors="replace"))
                url = found.group(1) if found else None
            if url is not None:
                try:
                    if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"memfit serve did not answer /healthz in {timeout_s} s")
            time.sleep(0.2)
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)


def checked(reply: httpx.Response) -> Any:
    if reply.status_code != 200:
        raise RuntimeError(f"{reply.request.method} {reply.request.url}: {reply.status_code} {reply.text[:300]}")
    return reply.json()


# ------------------------------------------------------------------------------------- concurrency
async def closed_loop(url: str, key: str, user_queries: list[tuple[str, str]], clients: int,
                      requests: int) -> tuple[dict[str, Any], dict[str, list[Any]]]:
    """`clients` tasks issue `requests` searches in all, each its next when its last is answered.

    The clients share one aiohttp session (keep-alive connections). Not httpx, which the replay uses: its
    async client cost 1.2-2.6 ms of CPU per request here (aiohttp 0.1-0.3 ms; /healthz from 16 clients
    433 req/s against 7,370), on the same two cores as the server it measures, so it throttled both
    servers alike and its requests trickled in one by one."""
    latencies: list[float] = []
    results: dict[str, list[Any]] = {}
    counter = iter(range(requests))
    connector = aiohttp.TCPConnector(limit=clients + 4)
    headers = {"Authorization": f"Bearer {key}"}
    async with aiohttp.ClientSession(base_url=url, headers=headers, connector=connector,
                                     timeout=aiohttp.ClientTimeout(total=300)) as client:
        async def one(i: int) -> None:
            user, text = user_queries[i % len(user_queries)]
            start = time.perf_counter()
            async with client.post(f"/v1/users/{user}/search", json={"queries": [text], "k": K}) as reply:
                if reply.status != 200:
                    raise RuntimeError(f"POST {reply.url}: {reply.status} {(await reply.text())[:300]}")
                found = await reply.json()
            latencies.append(time.perf_counter() - start)
            results[f"{user}\t{text}"] = found["results"][0]

        async def worker() -> None:
            for i in counter:
                await one(i)

        for i in range(min(clients, 4)):  # warm-up: connections open, first calls made (untimed)
            await one(i)
        latencies.clear()
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    return {"clients": clients, "requests": requests, "wall_s": round(wall, 3),
            "throughput_rps": round(requests / wall, 2), **percentiles(latencies)}, results


def batch_sizes(url: str, key: str) -> dict[str, float]:
    """The search batcher's batch-size histogram so far (/metrics, an admin key's): count and mean."""
    text = httpx.get(url + "/metrics", timeout=30, headers={"Authorization": f"Bearer {key}"}).text
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith('memfit_batch_size_sum{op="search"}'):
            total = float(line.split()[-1])
        elif line.startswith('memfit_batch_size_count{op="search"}'):
            count = float(line.split()[-1])
    return {"batches": count, "searches": total}


def same_hits(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    return [(h["kind"], h["turn_ids"], h["text"]) for h in a] == [(h["kind"], h["turn_ids"], h["text"]) for h in b]


def score_gap(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> float:
    return max((abs(x["score"] - y["score"]) for x, y in zip(a, b, strict=False)), default=0.0)


def concurrency(batched_url: str, key: str, keys: Path, folder: Path, root: Path, config: Path, overrides: list[str],
                user_queries: list[tuple[str, str]], client_counts: list[int], requests: int) -> dict[str, Any]:
    """The replay's HTTP server (batched defaults) against a second one, serve.max_batch=1, over a copy of
    the memory the Python API built from the same turns; measured alternately, never both at once."""
    copy = root / "concurrency-unbatched"
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns(".lock"))
    levels: list[dict[str, Any]] = []
    identical = {"queries": 0, "identical": 0, "max_score_diff": 0.0}
    sizes: dict[str, Any] = {}
    with served(copy, config, keys, [*overrides, "serve.max_batch=1"], root / "unbatched.log") as unbatched_url:
        for clients in tqdm(client_counts, desc="concurrency", unit="level", leave=False):
            n = max(requests, 2 * clients)
            before = batch_sizes(batched_url, key)
            row: dict[str, Any] = {"clients": clients}
            found = {}
            for name, url in (("batched", batched_url), ("unbatched", unbatched_url)):
                row[name], found[name] = asyncio.run(closed_loop(url, key, user_queries, clients, n))
            after = batch_sizes(batched_url, key)
            batches = after["batches"] - before["batches"]
            row["batched"]["mean_batch"] = round((after["searches"] - before["searches"]) / batches, 2) if batches else None
            b, u = row["batched"], row["unbatched"]
            row["throughput_ratio"] = round(b["throughput_rps"] / u["throughput_rps"], 3)
            row["p95_ratio"] = round(b["p95_ms"] / u["p95_ms"], 3)
            levels.append(row)
            for query in found["batched"]:
                if query in found["unbatched"]:
                    identical["queries"] += 1
                    identical["identical"] += same_hits(found["batched"][query], found["unbatched"][query])
                    identical["max_score_diff"] = max(identical["max_score_diff"],
                                                      score_gap(found["batched"][query], found["unbatched"][query]))
        sizes = batch_sizes(batched_url, key)
    single = {name: next((lv[name]["p95_ms"] for lv in levels if lv["clients"] == 1), None)
              for name in ("batched", "unbatched")}
    for lv in levels:
        lv["batched"]["p95_over_single_client_p95"] = (
            round(lv["batched"]["p95_ms"] / single["unbatched"], 3) if single["unbatched"] else None)
        lv["batched"]["p95_over_batched_single_client_p95"] = (
            round(lv["batched"]["p95_ms"] / single["batched"], 3) if single["batched"] else None)
    identical["max_score_diff"] = float(f"{identical['max_score_diff']:.3g}")
    identical["all"] = identical["queries"] > 0 and identical["identical"] == identical["queries"]
    return {"levels": levels, "identical_results": identical, "batched_search_batches": sizes}


# -------------------------------------------------------------------------------------------- main
def run_method(method: str, plan: list[tuple[str, list[tuple[dict[str, Any], list[Question]]]]], root: Path,
               config: Path, overrides: list[str], reader: bool, answered: set[str], users: list[str],
               keep: ExitStack | None = None) -> dict[str, Any]:
    """The replay through the Python API (its folder kept for the concurrency part), then through HTTP;
    with `keep`, the HTTP server stays up (on that stack) and `server` is its (url, key, keys file)."""
    out: dict[str, Any] = {}
    folder = root / f"{method}-api"
    memory = Memory.open(folder, config, method=method, overrides=overrides)
    try:
        memory.add(WARMUP_USER, [WARMUP_TURN])
        memory.search(WARMUP_USER, [WARMUP_QUERY], k=K)
        if reader:
            memory.answer(WARMUP_USER, [WARMUP_QUERY], k=K)  # loads the reader (untimed)
        memory.delete_user(WARMUP_USER)
        out["api"] = replay(f"{method} api", plan, lambda u, t: memory.add(u, [t]),
                            lambda u, q: memory.search(u, [q], k=K),
                            (lambda u, q: memory.answer(u, [q], k=K)) if reader else None, answered,
                            store=memory.store if method in READS_STORE_INDEXES else None)
        out["api"]["indexing"] = memory.cfg.live.indexing
    finally:
        memory.close()
    keys = root / f"keys-{method}.jsonl"
    key = new_key(keys, [*users, WARMUP_USER], name=method, admin=True)  # admin: it reads /metrics too
    with ExitStack() as stack:
        # the HTTP server never loads the reader (no answer calls): it times adds and searches only
        url = stack.enter_context(served(root / f"{method}-http", config, keys, [*overrides, f"method={method}"],
                                         root / f"{method}-http.log"))
        with httpx.Client(base_url=url, timeout=300, headers={"Authorization": f"Bearer {key}"}) as client:
            checked(client.post(f"/v1/users/{WARMUP_USER}/turns", json={"turns": [WARMUP_TURN]}))
            checked(client.post(f"/v1/users/{WARMUP_USER}/search", json={"queries": [WARMUP_QUERY], "k": K}))
            checked(client.delete(f"/v1/users/{WARMUP_USER}"))
            out["http"] = replay(f"{method} http", plan,
                                 lambda u, t: checked(client.post(f"/v1/users/{u}/turns", json={"turns": [t]})),
                                 lambda u, q: checked(client.post(f"/v1/users/{u}/search",
                                                                  json={"queries": [q], "k": K})),
                                 None, answered)
        if keep is not None:
            keep.enter_context(stack.pop_all())
            out["server"] = (url, key, keys)
    out["api_folder"] = str(folder)
    return out


def method_table(replays: dict[str, Any]) -> list[dict[str, Any]]:
    """LightMem-SLM Table 4's layout: one row per method (and path), latency columns."""
    rows = []
    for method, paths in replays.items():
        for path in ("api", "http"):
            r = paths[path]
            row = {"method": method, "path": path}
            for kind, name in (("insert", "insert"), ("search", "retrieval"), ("e2e", "e2e")):
                for p in ("p50_ms", "p95_ms", "p99_ms"):
                    row[f"{name}_{p}"] = r[kind][p] if r.get(kind) else None
            rows.append(row)
    return rows


def peer_ratios(replays: dict[str, Any]) -> dict[str, Any]:
    """Per peer system (mem0) and path: its insertion and search P50/P95 over those of the first of our methods
    replayed in the same run (how many times slower than MemFit; None where either is missing)."""
    ours = next((m for m in replays if not method_entry(m).peer), None)
    out: dict[str, Any] = {}
    for method, paths in replays.items():
        if ours is None or not method_entry(method).peer:
            continue
        for path in ("api", "http"):
            row: dict[str, Any] = {"over": ours}
            for kind in ("insert", "search"):
                for p in ("p50_ms", "p95_ms"):
                    theirs, base = (paths[path].get(kind) or {}).get(p), (replays[ours][path].get(kind) or {}).get(p)
                    row[f"{kind}_{p.removesuffix('_ms')}_x"] = round(theirs / base, 1) if theirs and base else None
            out[f"{method}/{path}"] = row
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] + "\n\n" + __doc__.split("\n\n")[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The module docstring (experiments/bench_online.py) has the whole procedure; docs/benchmarks/history.md "
               "'Online latency' the figures.")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="LoCoMo's locomo10.json (default: %(default)s)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG),
                        help="YAML config (default configs/demo.yaml; rerank.backend=none and "
                             "live.consolidate=manual are added)")
    parser.add_argument("--conversations", type=int, default=1,
                        help="LoCoMo conversations replayed, one user each (default 1: conv-26, 419 turns)")
    parser.add_argument("--turns", type=int, default=None,
                        help="replay only each conversation's first N turns (and the questions they complete); "
                             "for smoke tests")
    parser.add_argument("--methods", nargs="+", default=DEFAULT_METHODS,
                        help="live methods (default: memfit plain naive_rag; lightmem_slm too only when named: its "
                             "query path calls the SLM). The first one is served for the concurrency part")
    parser.add_argument("--questions", type=int, default=None,
                        help="at most N evaluated questions per conversation, in replay order (default: all)")
    parser.add_argument("--reader", action=argparse.BooleanOptionalAction, default=True,
                        help="time end-to-end answers (SmolLM2 on the CPU) on --reader-questions questions "
                             "(default: on)")
    parser.add_argument("--reader-questions", type=int, default=5,
                        help="questions answered per method, spread over the replay (default 5)")
    parser.add_argument("--clients", type=int, nargs="*", default=[1, 4, 16, 64],
                        help="concurrent HTTP search clients per level (default 1 4 16 64; none: skip the part)")
    parser.add_argument("--requests", type=int, default=256,
                        help="searches per concurrency level and server (at least 2 per client; default 256)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads here and in the servers (OMP_NUM_THREADS; 0 = torch's "
                             "default: every core)")
    parser.add_argument("--work-dir", default=None, help="keep the memories and server logs here (default: a temp dir)")
    parser.add_argument("--json-out", default=None, help="also write the JSON result to this file")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="more config overrides")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    overrides = [*BENCH_OVERRIDES, *args.overrides]
    if args.threads:
        os.environ["OMP_NUM_THREADS"] = str(args.threads)  # the servers' torch reads it when it starts
        torch.set_num_threads(args.threads)
    benchmark = select_questions(load_benchmark("locomo", args.data), exclude_categories=["5"],
                                 limit_memories=args.conversations)
    plan = []
    for conversation in benchmark.memories:
        questions = [q for q in conversation.questions if q.evaluated]
        steps = schedule(conversation, questions)
        if args.turns is not None:
            steps = steps[:args.turns]
        if args.questions is not None:
            left = args.questions
            kept = []
            for turn, asked in steps:
                kept.append((turn, asked[:max(left, 0)]))
                left -= len(kept[-1][1])
            steps = kept
        plan.append((conversation.memory_id, steps))
    users = [user for user, _ in plan]
    asked = [q for _, steps in plan for _, qs in steps for q in qs]
    answered = {q.question_id for q in spread(asked, args.reader_questions)} if args.reader else set()

    load_before = os.getloadavg()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-online-") as tmp:
        root = Path(args.work_dir) if args.work_dir else Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        replays = {}
        with ExitStack() as servers:
            for n, method in enumerate(args.methods):
                replays[method] = run_method(method, plan, root, Path(args.config), overrides, args.reader, answered,
                                             users, keep=servers if n == 0 and args.clients else None)
            conc = None
            if args.clients:
                queries = [(user, q.question) for user, steps in plan for _, qs in steps for q in qs]
                if not queries:
                    raise SystemExit("no question is asked in this setting: the concurrency part needs queries")
                first = args.methods[0]
                url, key, keys = replays[first].pop("server")
                conc = concurrency(url, key, keys, Path(replays[first]["api_folder"]), root, Path(args.config),
                                   [*overrides, f"method={first}"], queries, sorted(args.clients), args.requests)
                conc["method"] = first
        for r in replays.values():
            r.pop("api_folder")

    targets: dict[str, Any] = {}
    for method, r in replays.items():
        if method_entry(method).peer:  # another system: measured beside ours, not held to our targets
            continue
        for name, limit in TARGETS.items():
            kind, stat = name.split("_", 1)
            value = r["api"][kind][stat]
            targets[f"{method}/api/{name}"] = {"value": value, "target_max": limit,
                                               "held": value is not None and value <= limit}
    if conc is not None:
        level = next((lv for lv in conc["levels"] if lv["clients"] == CONCURRENCY_TARGET["clients"]), None)
        if level is not None:
            t, p = level["throughput_ratio"], level["batched"]["p95_over_single_client_p95"]
            targets[f"{conc['method']}/http/16_clients_throughput_ratio"] = {
                "value": t, "target_min": CONCURRENCY_TARGET["throughput_ratio_min"],
                "held": t >= CONCURRENCY_TARGET["throughput_ratio_min"]}
            targets[f"{conc['method']}/http/16_clients_p95_over_single_client_p95"] = {
                "value": p, "target_max": CONCURRENCY_TARGET["p95_over_single_client_p95_max"],
                "held": p is not None and p <= CONCURRENCY_TARGET["p95_over_single_client_p95_max"]}
    result = {
        "bench": "online",
        "data": args.data,
        "conversations": users,
        "turns": sum(len(steps) for _, steps in plan),
        "questions": len(asked),
        "answered_questions": len(answered),
        "methods": args.methods,
        "config": str(args.config),
        "overrides": overrides,
        "ask_point": "right after the turn that completes the question's evidence",
        "replay": replays,
        "table": method_table(replays),
        "peer_ratios": peer_ratios(replays),
        "concurrency": conc,
        "identical_results": conc["identical_results"]["all"] if conc else None,
        "targets": targets,
        "targets_held": all(t["held"] for t in targets.values()),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "wall_s": round(time.perf_counter() - started, 1),
    }
    if args.json_out:
        write_output(args.json_out, json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
