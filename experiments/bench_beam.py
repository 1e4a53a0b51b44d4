"""BEAM at scale on this machine: `memfit retrieve` (the store built from the benchmark in one encoder pass,
then every question retrieved in one batched pass per stage) over one synthetic BEAM-10M conversation
(`memfit data synth --like beam-10m`: ~21,000 messages with the real splits' message lengths) and over the
real 100K split (../shared/data/beam/100K: 20 conversations, 5,732 messages).

Each run is a child process of its own (`python -m memfit_gpu.cli retrieve`), timed wall-clock, its peak
RSS read from the kernel when it ends (os.wait4's ru_maxrss), its hit@10 and pack hit from the
diagnostics.json it writes. Config: configs/demo.yaml (the packaged all-MiniLM-L6-v2) with
rerank.backend=none; no summaries (retrieve builds none). The reference measured in the same run is the
100K split: the JSON gives seconds and peak RSS per message of each, and their ratio 10M / 100K, which is
how far from linear the 10M conversation scales (1.0: linear in messages). The memory target is 16 GiB.

    PYTHONPATH=. .venv/bin/python experiments/bench_beam.py                  # both (~10-15 min on 2 cores)
    PYTHONPATH=. .venv/bin/python experiments/bench_beam.py --like beam-1m   # a smaller synthetic one

Last line: JSON with both runs (messages, questions, seconds, questions/s, peak RSS GiB, hit@10, pack hit),
the per-message ratios and whether the 10M run stayed within 16 GiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from memfit_gpu.data import load_benchmark
from memfit_gpu.data.synth import write_beam
from memfit_gpu.methods.packs import read_diagnostics

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REAL = REPO.parent / "shared" / "data" / "beam" / "100K"
CONFIG = REPO / "configs" / "demo.yaml"
LIMIT_GIB = 16.0


def retrieve(data: Path, out: Path, threads: int | None) -> dict[str, Any]:
    """One `memfit retrieve` child over `data`: wall seconds, peak RSS and its diagnostics."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "memfit_gpu.cli", "retrieve", "--config", str(CONFIG),
                             "--benchmark", "beam", "--data", str(data), "--out", str(out), "rerank.backend=none",
                             "data.limit_memories=null", "data.limit_questions=null"],
                            cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr is not None
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"memfit retrieve on {data} failed:\n{stderr.decode(errors='replace')[-3000:]}")
    diagnostics = read_diagnostics(out)
    overall = diagnostics.get("overall", diagnostics)
    bench = load_benchmark("beam", data)
    messages = sum(len(m.turns()) for m in bench.memories)
    questions = sum(len(m.questions) for m in bench.memories)
    return {"data": str(data), "messages": messages, "questions": questions, "seconds": round(seconds, 1),
            "questions_per_s": round(questions / seconds, 3), "peak_rss_gib": round(usage.ru_maxrss / 2**20, 2),
            "hit_at_10": overall.get("hit@10"), "pack_hit": overall.get("pack_hit")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--like", default="beam-10m", help="the synthetic shape (data/synth.py beam-*)")
    parser.add_argument("--real", type=Path, default=DEFAULT_REAL, help="the real split to compare with")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the runs (default: torch's)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-beam-") as tmp:
        root = Path(tmp)
        written = write_beam(root / "synth", args.like, conversations=1, seed=args.seed)
        synthetic = retrieve(root / "synth", root / "synth-run", args.threads)
        synthetic["characters"] = written["characters"]
        real = retrieve(args.real, root / "real-run", args.threads)
    per = {name: {"seconds_per_message": run["seconds"] / run["messages"],
                  "rss_gib_per_message": run["peak_rss_gib"] / run["messages"]} for name, run in
           (("synthetic", synthetic), ("real", real))}
    result = {
        "like": args.like, "synthetic": synthetic, "real": real,
        "ratio_seconds_per_message_synthetic_over_real": round(per["synthetic"]["seconds_per_message"]
                                                               / per["real"]["seconds_per_message"], 3),
        "ratio_rss_per_message_synthetic_over_real": round(per["synthetic"]["rss_gib_per_message"]
                                                           / per["real"]["rss_gib_per_message"], 3),
        "within_16_gib": synthetic["peak_rss_gib"] <= LIMIT_GIB,
        "load_avg_1m": round(os.getloadavg()[0], 2), "cpus": os.cpu_count(),
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
