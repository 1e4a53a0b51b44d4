"""MemFit beside the systems it is compared with, in one run, on the same data, reader and encoder: what
each costs to build its memory (LLM calls and tokens, seconds) and to answer, and how well it answers.

Each method is one `memfit run --config CONFIG method=M` child process over the same cut of a LoCoMo
conversation (its first `--turns` turns, the questions whose evidence lies in them, at most `--questions`, written in
memfit's own jsonl format),
one after the other, each with an empty run directory (no response cache shared): memfit, plain, naive_rag,
lightmem_slm and mem0 (mem0ai's own package, its LLM and embedder served by the run's reader and encoder
through methods/peers/endpoint.py, so its calls are counted by the same ledger). mem0 is fed as its own
LoCoMo evaluation feeds it: `--mem0-batch-size` messages per `add` (2, its evaluation's; each `add` is
one LLM call with its ~8,700-token extraction prompt).

From each run's files: write-time LLM calls and tokens (ledger.json phase write: every role that builds
memory; embeddings are phase embed, not LLM calls) per 1,000 turns, build seconds (timings.json build +
summaries) per turn, read-time tokens per answered question (phase read: the answer call and any read-time
calls), F1 (metrics.json), and for mem0 its own per-call timings (one `add` of a batch, one question's
searches). Then each method's ratio to MemFit's figure, measured in the same run: write calls, write tokens
and build seconds per turn (how many times fewer / faster MemFit is). Insertion and search latency: every
method with a live path (memfit, plain, naive_rag, lightmem_slm, mem0) is replayed again over the same turns
as a live memory (`memfit_gpu.Memory`, one turn per add, one question per search, as bench_online.py's API
path; mem0's live add feeds each turn to every speaker's memory, an LLM call each), and `live_ratio_to_memfit`
gives each one's insertion and search P50/P95 over MemFit's (`--no-live` skips this part).

    PYTHONPATH=. .venv/bin/python experiments/bench_peers.py --turns 8 --questions 3     # ~15 min on 2 cores
    PYTHONPATH=. .venv/bin/python experiments/bench_peers.py --methods memfit,mem0 --turns 4

Last line: JSON (the CPU, the data cut, one row per method, the ratios to memfit).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from memfit_gpu.data import load_benchmark  # noqa: E402
from memfit_gpu.data.jsonl import to_jsonl  # noqa: E402
from memfit_gpu.devices import describe  # noqa: E402
from memfit_gpu.evaluate.efficiency import efficiency_row  # noqa: E402
from memfit_gpu.evaluate.paper_tables import load_run  # noqa: E402
from memfit_gpu.live.memory import Memory  # noqa: E402
from memfit_gpu.methods.packs import read_diagnostics  # noqa: E402
from memfit_gpu.methods.peers.mem0 import percentiles  # noqa: E402
from memfit_gpu.methods.registry import method_entry  # noqa: E402
from memfit_gpu.readers.ledger import Ledger  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "demo.yaml"
LOCOMO = REPO.parent / "shared" / "data" / "locomo" / "locomo10.json"
METHODS = ("memfit", "plain", "naive_rag", "lightmem_slm", "mem0")


def cut_locomo(source: Path, folder: Path, turns: int, questions: int) -> tuple[Path, int, int]:
    """LoCoMo's first conversation (read by the LoCoMo loader) cut to its first `turns` turns (whole sessions
    first, the last one cut) and the questions (categories 1-4) whose evidence lies in them (at most
    `questions`), written in memfit's own jsonl format (data.benchmark=jsonl): (file, turns, questions)."""
    memory = load_benchmark("locomo", source).memories[0]
    sessions, kept, left = [], set(), turns
    for session in memory.sessions:
        if left <= 0:
            break
        sessions.append(replace(session, turns=session.turns[:left]))
        kept.update(t.turn_id for t in sessions[-1].turns)
        left -= len(sessions[-1].turns)
    asked = [q for q in memory.questions if q.evidence and set(q.evidence) <= kept and q.category != "5"][:questions]
    if not asked:
        raise SystemExit(f"no question of {source}'s first conversation has all its evidence in its first {turns} turns")
    path = folder / f"locomo_{memory.memory_id}_{turns}turns.jsonl"
    path.write_text(to_jsonl([replace(memory, sessions=sessions, questions=asked)]), encoding="utf-8")
    return path, sum(len(s.turns) for s in sessions), len(asked)


def run_method(method: str, data: Path, out: Path, config: Path, extra: list[str], threads: int) -> float:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "memfit_gpu.cli", "run", "--config", str(config), f"method={method}",
                           "data.benchmark=jsonl", f"data.path={data}", "data.limit_questions=null", *extra, "--out", str(out), "--quiet"],
                          cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"method={method} failed:\n{proc.stderr[-3000:]}")
    return time.perf_counter() - started


def figures(method: str, out: Path, turns: int, wall_s: float) -> dict[str, Any]:
    """One run's row, read as `memfit efficiency` reads it (evaluate.efficiency) plus its F1 and, for mem0, its
    own diagnostics."""
    row = efficiency_row(out, price=None)
    run = load_run(out)
    embed = Ledger.load(out / "ledger.json").phases()["embed"]
    questions = int(row["questions"])
    write_tokens = row["write_input_tokens"] + row["write_output_tokens"]
    figures: dict[str, Any] = {
        "method": method, "turns": turns, "questions": questions,
        "write_llm_calls": row["write_calls"], "write_input_tokens": row["write_input_tokens"],
        "write_output_tokens": row["write_output_tokens"],
        "write_llm_calls_per_1k_turns": round(row["write_calls"] * 1000 / turns, 1),
        "write_tokens_per_1k_turns": round(write_tokens * 1000 / turns),
        "build_s": row["build_s"], "build_s_per_turn": round(row["build_s"] / turns, 4),
        "read_llm_calls": row["read_calls"],
        "read_tokens_per_question": round((row["read_input_tokens"] + row["read_output_tokens"]) / questions, 1),
        "latency_s_per_question": row["latency_s_per_question"],
        "f1": ((run.metrics.get("overall") or {}).get(run.metrics.get("metric_variant", "paper")) or {}).get("f1"),
        "run_wall_s": round(wall_s, 1), "embed_requests": embed.calls + embed.cached,
    }
    if method == "mem0":
        held = read_diagnostics(out)["method"]
        figures.update({"mem0_add_s": held["add_seconds"], "mem0_search_s": held["search_seconds"],
                        "mem0_memories_stored": held["memories_stored"], "mem0_replies_unparsed": held["replies_unparsed"],
                        "mem0_batch_size": held["batch_size"]})
    return figures


def live_latency(method: str, data: Path, config: Path, work: Path, threads: int,
                 overrides: list[str]) -> dict[str, Any]:
    """A method as a live memory (memfit_gpu.Memory, the API path of bench_online.py) over the same turns: each
    turn added alone (MemFit: one durable write, its encoding and indexing; mem0: its `add` per speaker, each an
    LLM call), then each question searched alone (top 10), timed; one untimed warm-up search first (every
    read cache is built once; the search of a method that reads with the reader loads it)."""
    torch.set_num_threads(threads)
    bench = load_benchmark("jsonl", data)
    conversation = bench.memories[0]
    records = [{"speaker": t.speaker, "text": t.text, "timestamp": t.timestamp, "turn_id": t.turn_id,
                "session_id": s.session_id, "date_text": t.date_text} for s in conversation.sessions for t in s.turns]
    questions = [q.question for q in conversation.questions]
    adds, searches = [], []
    with Memory.open(work, str(config), method=method, overrides=["live.consolidate=manual", *overrides]) as memory:
        for record in records:
            started = time.perf_counter()
            memory.add(conversation.memory_id, [record])
            adds.append(time.perf_counter() - started)
        memory.search(conversation.memory_id, questions[:1], k=10)
        for question in questions:
            started = time.perf_counter()
            memory.search(conversation.memory_id, [question], k=10)
            searches.append(time.perf_counter() - started)
    return {"add_s_per_turn": percentiles(adds), "search_s": percentiles(searches)}


def live_ratios(live: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each live method's insertion (per turn) and search P50/P95 over MemFit's, in the same run."""
    base = live.get("memfit")
    if base is None:
        return {}
    out = {}
    for method, figures in live.items():
        if method == "memfit":
            continue
        row: dict[str, float | None] = {}
        for kind, name in (("add_s_per_turn", "insert"), ("search_s", "search")):
            for p in ("p50", "p95"):
                theirs, ours = figures[kind][p], base[kind][p]
                row[f"{name}_{p}_x"] = round(theirs / ours, 1) if theirs and ours else None
        out[method] = row
    return out


def ratios(rows: dict[str, dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Each method's figure over MemFit's: how many times more write calls, write tokens and build seconds."""
    base = rows.get("memfit")
    if base is None:
        return {}

    def over(a: float, b: float) -> float | None:
        return None if not b else round(a / b, 2)

    return {m: {"write_llm_calls": over(r["write_llm_calls"], base["write_llm_calls"]),
                "write_tokens": over(r["write_input_tokens"] + r["write_output_tokens"],
                                     base["write_input_tokens"] + base["write_output_tokens"]),
                "build_s": over(r["build_s"], base["build_s"]),
                "read_tokens_per_question": over(r["read_tokens_per_question"], base["read_tokens_per_question"])}
            for m, r in rows.items() if m != "memfit"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default=",".join(METHODS), help="comma-separated (default: %(default)s)")
    parser.add_argument("--locomo", type=Path, default=Path(os.environ.get("MEMFIT_DATA_DIR", LOCOMO.parent.parent))
                        / "locomo" / "locomo10.json", help="LoCoMo's locomo10.json (default: ../shared/data)")
    parser.add_argument("--turns", type=int, default=8, help="the conversation's first N turns (default: %(default)s)")
    parser.add_argument("--questions", type=int, default=3, help="at most this many questions (default: %(default)s)")
    parser.add_argument("--mem0-batch-size", type=int, default=2,
                        help="messages per mem0 add (default: %(default)s, mem0's LoCoMo evaluation)")
    parser.add_argument("--config", type=Path, default=CONFIG, help="the runs' config (default: configs/demo.yaml)")
    parser.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run (default: %(default)s)")
    parser.add_argument("--live", action=argparse.BooleanOptionalAction, default=True,
                        help="also time every live method's insertion and search through memfit_gpu.Memory (default: on)")
    parser.add_argument("--out", type=Path, default=None, help="keep the run directories here (default: a temporary one)")
    args = parser.parse_args()
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    root = args.out or Path(tempfile.mkdtemp(prefix="bench_peers-"))
    root.mkdir(parents=True, exist_ok=True)
    data, turns, questions = cut_locomo(args.locomo, root, args.turns, args.questions)
    rows = {}
    for method in methods:
        extra = [f"mem0.batch_size={args.mem0_batch_size}"] if method == "mem0" else []
        out = root / method
        wall = run_method(method, data, out, args.config, extra, args.threads)
        rows[method] = figures(method, out, turns, wall)
        print(json.dumps(rows[method]), file=sys.stderr, flush=True)
    live = {}
    for method in methods:
        if args.live and method_entry(method).live:
            extra = [f"mem0.batch_size={args.mem0_batch_size}"] if method == "mem0" else []
            live[method] = live_latency(method, data, args.config, root / f"{method}-live", args.threads, extra)
            rows[method]["live"] = live[method]
            print(json.dumps({"method": method, "live": live[method]}), file=sys.stderr, flush=True)
    print(json.dumps({"cpu": describe()["cpu"]["model"], "cores": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                      "data": {"file": data.name, "turns": turns, "questions": questions},
                      "config": str(args.config), "threads": args.threads, "runs": str(root),
                      "rows": list(rows.values()), "ratio_to_memfit": ratios(rows),
                      "live_ratio_to_memfit": live_ratios(live)}))


if __name__ == "__main__":
    main()
