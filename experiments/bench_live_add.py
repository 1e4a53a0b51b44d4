"""What one add costs as its user's history grows, against a small user's add in the same run.

A live memory (configs/demo.yaml: the packaged MiniLM, rerank.backend=none, no summaries, live.consolidate=manual:
no reader is loaded) holds a small user of one turn and a big user grown in
batches to each of --sizes turns. At each size, nine one-turn adds of each user alternate (big, small, big,
...); the median of each and their ratio are printed. A method whose write path depends on the user's history
(naive_rag chunks it again) shows a ratio that grows with the size; on the memory's lock, that is time every
other user's searches and adds wait.

    PYTHONPATH=. .venv/bin/python experiments/bench_live_add.py --method naive_rag
    PYTHONPATH=. .venv/bin/python experiments/bench_live_add.py --method memfit --sizes 2000 10000

Last line: JSON with the method, the CPU, and per size the two medians (ms) and their ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from memfit_gpu.live import Memory

REPO = Path(__file__).resolve().parents[1]
OVERRIDES = ["rerank.backend=none", "live.consolidate=manual", "summary.enabled=false"]


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--method", default="naive_rag", help="a live method (default naive_rag)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[2000, 10000, 20000],
                        help="the big user's turns at each measurement (default 2000 10000 20000)")
    parser.add_argument("--repeats", type=int, default=9, help="one-turn adds of each user per size (default 9)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as work, \
            Memory.open(Path(work) / "m", REPO / "configs" / "demo.yaml", overrides=OVERRIDES,
                        method=args.method) as memory:
        memory.add("small", [{"speaker": "A", "text": "hello"}])
        held = 0
        for size in sorted(args.sizes):
            while held < size:
                step = min(3000, size - held)
                memory.add("big", [{"speaker": "A", "text": f"w{i} falcon"} for i in range(held, held + step)])
                held += step
            taken: dict[str, list[float]] = {"big": [], "small": []}
            for j in range(args.repeats):
                for user in ("big", "small"):
                    began = time.perf_counter()
                    memory.add(user, [{"speaker": "A", "text": f"one more {held} {j}"}])
                    taken[user].append(time.perf_counter() - began)
                held += 1
            big, small = (statistics.median(taken[u]) * 1000 for u in ("big", "small"))
            rows.append({"turns": size, "big_ms": round(big, 1), "small_ms": round(small, 1),
                         "ratio": round(big / small, 2)})
            print(f"big user of {size:6d} turns: one-turn add {big:7.1f} ms, small user's {small:6.1f} ms, "
                  f"ratio {big / small:5.2f} (medians of {args.repeats})", flush=True)
    print(json.dumps({"method": args.method, "cpu": cpu_name(), "sizes": rows}))


if __name__ == "__main__":
    main()
