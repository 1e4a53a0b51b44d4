"""Timing shared by the encoder benchmarks: ours and the reference alternate, medians kept.

Runs alternate (ours, reference, ours, ...) so both see the same machine load; wall-clock and
process CPU seconds are both kept because the machine may be shared.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any


def alternate(repeats: int, ours: Callable[[], Any], reference: Callable[[], Any]) -> tuple[Any, Any, dict[str, float]]:
    """(ours' last output, the reference's last output, median seconds {ours_wall, ours_cpu, st_wall, st_cpu})."""
    samples: dict[str, list[tuple[float, float]]] = {"ours": [], "st": []}
    outputs: dict[str, Any] = {}
    for _ in range(repeats):
        for name, run in (("ours", ours), ("st", reference)):
            wall, cpu = time.perf_counter(), time.process_time()
            outputs[name] = run()
            samples[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    medians = {f"{name}_{kind}": statistics.median(s[i] for s in runs)
               for name, runs in samples.items() for i, kind in enumerate(("wall", "cpu"))}
    return outputs["ours"], outputs["st"], medians


def rate_fields(n: int, seconds: dict[str, float], unit: str) -> dict[str, float]:
    """The JSON fields both benchmarks print: times, items per second (`unit`), and the ratios."""
    return {
        "ours_s": round(seconds["ours_wall"], 2),
        "st_s": round(seconds["st_wall"], 2),
        f"ours_cpu_{unit}": round(n / seconds["ours_cpu"], 1),
        f"st_cpu_{unit}": round(n / seconds["st_cpu"], 1),
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "cpu_ratio": round(seconds["st_cpu"] / seconds["ours_cpu"], 3),
        f"ours_{unit}": round(n / seconds["ours_wall"], 1),
        f"st_{unit}": round(n / seconds["st_wall"], 1),
        "ratio": round(seconds["st_wall"] / seconds["ours_wall"], 3),
    }
