"""Many users in one live memory (the server case): what a write to one user costs the next search
of another, against the same search with nothing written in between, measured in the same run.

Setup. LoCoMo's conversations become users of one `memfit_gpu.Memory` (configs/demo.yaml: the packaged
MiniLM, rerank.backend=none, live.consolidate=manual), each with all its turns but its last --searches,
written in one untimed `add` per user. The first user (conv-26) is the one asked; its evaluated questions
(category 5 is not scored) are asked in turn.

Each step i (of --searches) times three searches of the first user with the same question (k=10):
1. `after_other_add`: right after one held-back turn of another user (users 2..N in turn) is added;
2. `unchanged`: the same search again, nothing written since (every read cache is warm);
3. `after_own_add`: right after one held-back turn of the first user is added.
The ratio `after_other_add.p50 / unchanged.p50` is what a write elsewhere in the store costs a reader
(1.0: nothing); `after_own_add` shows the cost of the reader's own new turn. Searches 1 and 2 must return
the same hits with the same scores (`isolated`: another user's turn changes nothing a user reads).

    PYTHONPATH=. .venv/bin/python experiments/bench_users.py              # ten users, 40 steps (~2 min)
    PYTHONPATH=. .venv/bin/python experiments/bench_users.py --users 3 --searches 10

Last line: JSON with the three latency summaries (P50/P95/P99 ms), the ratio, `isolated`, the store's
size, and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.live.memory import Memory  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
DEFAULT_CONFIG = REPO / "configs" / "demo.yaml"
OVERRIDES = ["rerank.backend=none", "live.consolidate=manual"]
K = 10


def summary(seconds: list[float]) -> dict[str, float]:
    ms = np.asarray(seconds) * 1e3
    return {"n": len(ms), **{f"p{q}_ms": round(float(np.percentile(ms, q)), 2) for q in (50, 95, 99)}}


def hits_of(results: list[list[Any]]) -> list[tuple[tuple[str, ...], float]]:
    return [(tuple(h.turn_ids), h.score) for h in results[0]]


def turn_record(turn: Any, session_id: str) -> dict[str, Any]:
    return {"speaker": turn.speaker, "text": turn.text, "timestamp": turn.timestamp, "turn_id": turn.turn_id,
            "session_id": session_id, "date_text": turn.date_text}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="LoCoMo's locomo10.json (default: %(default)s)")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="YAML config (default configs/demo.yaml)")
    parser.add_argument("--users", type=int, default=10, help="conversations as users, at least 2 (default 10)")
    parser.add_argument("--turns", type=int, default=0,
                        help="keep only each conversation's first N turns (0: all; the tests' small setting)")
    parser.add_argument("--searches", type=int, default=40, help="timed steps (default 40)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--work-dir", help="where the memory is written (default: a temporary folder)")
    parser.add_argument("--json-out", help="also write the JSON here")
    args = parser.parse_args(argv)
    if args.users < 2:
        parser.error("--users must be at least 2 (one user is asked, the others are written to)")
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING)

    bench = select_questions(load_benchmark("locomo", args.data), exclude_categories=["5"])
    conversations = bench.memories[:args.users]
    if len(conversations) < args.users:
        parser.error(f"--users {args.users}: {args.data} holds {len(bench.memories)} conversations")
    turns = {c.memory_id: [turn_record(t, s.session_id) for s in c.sessions for t in s.turns] for c in conversations}
    if args.turns:
        turns = {user: records[:args.turns] for user, records in turns.items()}
    held = {user: records[-args.searches:] for user, records in turns.items()}
    if any(len(records) <= args.searches for records in turns.values()):
        parser.error(f"--searches {args.searches}: every user needs more turns than that")
    questions = [q.question for q in conversations[0].questions if q.evaluated]

    with tempfile.TemporaryDirectory(prefix="bench_users_") as scratch:
        work = Path(args.work_dir) if args.work_dir else Path(scratch)
        result = measure(work, args, turns, held, conversations, questions)
    text = json.dumps(result)
    print(text)
    if args.json_out:
        Path(args.json_out).write_text(text + "\n")
    return result


def measure(work: Path, args: argparse.Namespace, turns: dict[str, list[dict[str, Any]]],
            held: dict[str, list[dict[str, Any]]], conversations: list[Any], questions: list[str]) -> dict[str, Any]:
    asked = conversations[0].memory_id
    others = [c.memory_id for c in conversations[1:]]
    timings: dict[str, list[float]] = {"after_other_add": [], "unchanged": [], "after_own_add": []}
    isolated = True
    with Memory.open(work / "memory", str(args.config), overrides=OVERRIDES) as memory:
        for user, records in tqdm(turns.items(), desc="users", unit="user"):
            memory.add(user, records[:-args.searches])
        memory.search(asked, questions[:1], k=K)  # warm: every read cache built once, untimed

        def timed(question: str, kind: str) -> list[list[Any]]:
            started = time.perf_counter()
            found = memory.search(asked, [question], k=K)
            timings[kind].append(time.perf_counter() - started)
            return found

        for step in tqdm(range(args.searches), desc="steps", unit="step"):
            question = questions[step % len(questions)]
            other = others[step % len(others)]
            memory.add(other, [held[other][step // len(others)]])
            after = timed(question, "after_other_add")
            again = timed(question, "unchanged")
            isolated &= hits_of(after) == hits_of(again)
            memory.add(asked, [held[asked][step]])
            timed(question, "after_own_add")
        stored = memory.store.size

    figures = {kind: summary(seconds) for kind, seconds in timings.items()}
    return {
        "users": args.users, "turns_stored": stored, "searches": args.searches, "k": K,
        "threads": torch.get_num_threads(), "load_avg_1m": round(os.getloadavg()[0], 2),
        **figures,
        "ratio_after_other_add_to_unchanged": round(figures["after_other_add"]["p50_ms"]
                                                    / figures["unchanged"]["p50_ms"], 3),
        "isolated": bool(isolated),
    }


if __name__ == "__main__":
    main()
