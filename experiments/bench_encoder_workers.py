"""Encoding on several devices: our BiEncoder's worker processes and threads vs sentence-transformers'
multi-process pool (the reference to beat), and vs one device (the scaling).

Same weights (all-MiniLM-L6-v2, packaged offline), same texts (LoCoMo turns in the stored-episode format,
drawn with replacement up to --texts), normalised, on the same devices. Every arm's workers are started
and warmed before timing (pool start-up is not counted), and the arms alternate, medians kept, so all see
the same machine load. Wall clock only: the work happens in child processes, which this process's CPU
clock does not see. On the CPU the devices are `cpu,cpu` (two workers of one thread each on this 2-core
machine): that exercises the code, not GPU scaling; run it on a GPU node for the figures that matter.

Last line: JSON with texts/s per arm, `ratio` (processes vs the sentence-transformers pool), `threads_ratio`
(processes vs threads), `scaling` (processes vs one device) and the largest difference to one device.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from bench_encode import DEFAULT_LOCOMO, locomo_turns  # noqa: E402  (experiments/, this script's folder)

from memfit_gpu.devices import gpu_count, visible_devices  # noqa: E402
from memfit_gpu.index.encoders import BiEncoder  # noqa: E402


def timed_rounds(repeats: int, arms: dict[str, Callable[[], torch.Tensor]]) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median wall seconds of each arm over `repeats` alternating rounds, and each arm's last output."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    outputs: dict[str, torch.Tensor] = {}
    for _ in range(repeats):
        for name, run in arms.items():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            outputs[name] = run()
            samples[name].append(time.perf_counter() - start)
    return {name: statistics.median(s) for name, s in samples.items()}, outputs


def compare(model: str, spec: str, texts: list[str], repeats: int = 3, st_batch_size: int = 128) -> dict[str, Any]:
    """Every arm on the devices `spec` names (its first for one_device), workers started and warmed first:
    texts/s of each, the ratios, and the largest difference to one device's vectors. experiments/gpu_check.py
    runs it with two workers on one GPU."""
    devices = visible_devices(spec)
    one = BiEncoder.from_pretrained(model, device=str(devices[0]))
    processes = BiEncoder.from_pretrained(model, device=spec, workers="processes")
    threads = BiEncoder.from_pretrained(model, device=spec, workers="threads")
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(one.loaded_from.path, device=str(devices[0]))
    st_pool = reference.start_multi_process_pool(target_devices=[str(d) for d in devices])
    batch = 1 << 20  # rows uncapped: the token budget sizes our batches
    arms = {
        "processes": lambda: processes.encode(texts, batch_size=batch),
        "threads": lambda: threads.encode(texts, batch_size=batch),
        "one_device": lambda: one.encode(texts, batch_size=batch),
        "st_pool": lambda: torch.as_tensor(reference.encode(texts, pool=st_pool, batch_size=st_batch_size,
                                                            normalize_embeddings=True,
                                                            show_progress_bar=False)),
    }
    try:
        for run in arms.values():  # start the workers, warm every cache
            run()
        seconds, outputs = timed_rounds(repeats, arms)
    finally:
        reference.stop_multi_process_pool(st_pool)
        processes.close()
    n = len(texts)
    baseline = outputs["one_device"]
    return {
        "texts": n,
        "devices": [str(d) for d in devices],
        "torch_threads": torch.get_num_threads(),
        "batch_tokens": processes.max_batch_tokens,
        "st_batch_size": st_batch_size,
        **{f"{name}_tps": round(n / s, 1) for name, s in seconds.items()},
        "ratio": round(seconds["st_pool"] / seconds["processes"], 3),
        "threads_ratio": round(seconds["threads"] / seconds["processes"], 3),
        "scaling": round(seconds["one_device"] / seconds["processes"], 3),
        "max_abs_diff": max(float((outputs[name].float().cpu() - baseline).abs().max()) for name in outputs),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--locomo", type=Path, default=DEFAULT_LOCOMO)
    parser.add_argument("--model", default="sentence-transformers/all-MiniLM-L6-v2")
    parser.add_argument("--texts", type=int, default=4000, help="LoCoMo turns drawn with replacement")
    parser.add_argument("--devices", default="auto", help="auto = every GPU (cpu,cpu without one), or a list")
    parser.add_argument("--st-batch-size", type=int, default=128, help="the reference pool's batch size (rows)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")

    spec = args.devices if args.devices != "auto" else ("cuda" if gpu_count() else "cpu,cpu")
    devices = visible_devices(spec)
    if len(devices) < 2:
        raise SystemExit(f"--devices {spec!r} names {len(devices)} device; this benchmark compares several")
    turns = locomo_turns(args.locomo)
    rng = random.Random(args.seed)
    texts = [rng.choice(turns) for _ in range(args.texts)]

    result = {**compare(args.model, spec, texts, args.repeats, args.st_batch_size),
              "load_avg_1m": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
