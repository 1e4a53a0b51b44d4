"""Triton kernels vs the torch path, same inputs, one run: from LoCoMo size to LongMemEval-M size.

Synthetic data (memfit_gpu/data/synth.py, seeded), one BM25Index per size on the device:

    locomo   1,540 questions over 10 memories of ~600 turns (154 questions each)
    s          500 questions, each its own ~550-turn memory (~275k turns)
    m          500 questions, each its own ~5,500-turn memory (~2.75M turns)
    NAME:Q   the same shape with Q questions (e.g. m:100)

Timed per size, best of --repeats, question tokens given: the episode stage of the read path.
  torch:  BM25Index.search(kernels="torch") (padded blocks + topk) -> fuse -> add_boosts -> ranked()
  triton: BM25Index.search(kernels="triton") (ragged scores + running top-k) -> hybrid_topk (one launch)
The dense top lists are seeded random rows of each question's memory with sorted random cosines (the
dense search is FAISS, not one of these kernels); boosts use random question constraints and the rows'
real speaker / year / month. `identical` compares every BM25 score bit and row and all six columns of
the fused candidates. On a CPU only the torch path is timed: the Triton kernels need CUDA (under
TRITON_INTERPRET=1 they run for correctness only, in tests/kernels/test_kernels.py).

    .venv/bin/python experiments/bench_kernels.py [--sizes locomo,s,m] [--device auto] [--repeats 5]

Last line: JSON {device, sizes: {size: {questions, memories, turns, postings, torch_s, triton_s, ratio,
identical}}}. experiments/gpu_check.py calls `run_gpu_stage(sizes, device)` for its GPU stage.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import BoostConfig, RetrieveConfig
from memfit_gpu.data.synth import iter_memories
from memfit_gpu.devices import first_device
from memfit_gpu.index.bm25 import BM25Index
from memfit_gpu.index.tokenize import tokenize, tokenize_many
from memfit_gpu.kernels.hybrid_topk import BoostInputs, hybrid_topk_triton
from memfit_gpu.retrieve.boosts import add_boosts
from memfit_gpu.retrieve.hybrid import fuse

SIZES = {"locomo": ("locomo", 1540), "s": ("longmemeval-s", 500), "m": ("longmemeval-m", 500)}
COLUMNS = ("rows", "bm25", "dense", "fused", "boost", "score")


def _parse(size: str) -> tuple[str, str, int]:
    name, _, count = size.partition(":")
    if name not in SIZES:
        raise SystemExit(f"bench_kernels: size {size!r}: expected one of {', '.join(SIZES)} (optionally NAME:QUESTIONS)")
    like, default = SIZES[name]
    return size, like, int(count) if count else default


def build(like: str, n_questions: int, device: torch.device, seed: int = 0) -> dict[str, Any]:
    """The index and one batch of inputs, memory by memory (M never sits in memory as text)."""
    bm25 = BM25Index(device=device)
    tokens, mems, speaker, year, month, first_rows = [], [], [], [], [], []
    turns = postings = 0
    for m_idx, memory in enumerate(iter_memories(like, n_questions, seed)):
        memory_turns = memory.turns()
        turn_tokens = tokenize_many([t.text for t in memory_turns])
        bm25.add(turn_tokens, [m_idx] * len(memory_turns))
        postings += sum(len(set(t)) for t in turn_tokens)  # one posting per distinct term of a turn
        speaker += [1 if t.speaker == "user" else 2 for t in memory_turns]
        year += [int(t.timestamp[:4]) for t in memory_turns]
        month += [int(t.timestamp[5:7]) for t in memory_turns]
        for question in memory.questions:
            tokens.append(tokenize(question.question))
            mems.append(m_idx)
            first_rows.append((turns, len(memory_turns)))
        turns += len(memory_turns)
    k = RetrieveConfig().scan_top_k
    rng = np.random.default_rng(seed)
    d_rows = np.full((len(tokens), k), -1, dtype=np.int64)
    d_scores = np.zeros((len(tokens), k), dtype=np.float32)
    for q, (first, count) in enumerate(first_rows):
        n = min(k, count)
        d_rows[q, :n] = first + rng.choice(count, size=n, replace=False)
        d_scores[q, :n] = np.sort(rng.uniform(0.05, 0.9, size=n).astype(np.float32))[::-1]
    n_q = len(tokens)
    return {
        "bm25": bm25, "tokens": tokens, "mems": mems, "k": k, "turns": turns, "postings": postings,
        "memories": mems[-1] + 1 if mems else 0,
        "d_scores": torch.from_numpy(d_scores), "d_rows": torch.from_numpy(d_rows),
        "bits": torch.from_numpy(rng.integers(0, 4, n_q)),
        "years": torch.from_numpy(rng.choice([-1, 2023, 2024], size=(n_q, 1))),
        "months": torch.from_numpy(rng.choice([-1, 3, 7, 11], size=(n_q, 1))),
        "row_meta": [np.asarray(v, dtype=np.int64) for v in (speaker, year, month)],
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(fn: Any, repeats: int, device: torch.device) -> tuple[float, Any]:
    best, out = float("inf"), None
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        out = fn()
        _sync(device)
        best = min(best, time.perf_counter() - start)
    return best, out


def bench_size(data: dict[str, Any], device: torch.device, repeats: int, with_triton: bool) -> dict[str, Any]:
    bm25, tokens, mems, k = data["bm25"], data["tokens"], data["mems"], data["k"]
    cfg, alpha = BoostConfig(), RetrieveConfig().alpha

    def torch_path() -> tuple[Any, ...]:
        scores, rows = bm25.search(tokens, mems, k, kernels="torch")
        hits = fuse(scores.cpu(), rows.cpu(), data["d_scores"], data["d_rows"], alpha)
        hits = add_boosts(hits, cfg, data["bits"], data["years"], data["months"], *data["row_meta"]).ranked()
        return scores, rows, hits

    bm25.search(tokens[:1], mems[:1], k)  # builds the weight cache, outside the clock
    row = {"questions": len(tokens), "memories": data["memories"], "turns": data["turns"],
           "postings": data["postings"]}
    row["torch_s"], (t_scores, t_rows, hits) = _best(torch_path, repeats, device)
    row["triton_s"] = row["ratio"] = row["identical"] = None
    if not with_triton:
        return row
    d_scores, d_rows = data["d_scores"].to(device), data["d_rows"].to(device)
    inputs = BoostInputs(cfg.speaker, cfg.month, cfg.year, data["bits"].to(device), data["years"].to(device),
                         data["months"].to(device), *(torch.from_numpy(a).to(device) for a in data["row_meta"]))

    def triton_path() -> tuple[Any, ...]:
        scores, rows = bm25.search(tokens, mems, k, kernels="triton")
        return scores, rows, hybrid_topk_triton(scores, rows, d_scores, d_rows, alpha, boosts=inputs)

    triton_path()  # compiles the kernels, outside the clock
    row["triton_s"], (g_scores, g_rows, columns) = _best(triton_path, repeats, device)
    row["ratio"] = row["torch_s"] / row["triton_s"]
    row["identical"] = bool(torch.equal(t_scores.cpu(), g_scores.cpu()) and torch.equal(t_rows.cpu(), g_rows.cpu())
                            and all(torch.equal(c.cpu(), getattr(hits, n)) for c, n in zip(columns, COLUMNS, strict=True)))
    return row


def run(sizes: list[str], device: torch.device, repeats: int = 5, with_triton: bool | None = None,
        progress: bool = True) -> dict[str, Any]:
    with_triton = device.type == "cuda" if with_triton is None else with_triton
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "sizes": {}}
    for size in sizes:
        label, like, n_questions = _parse(size)
        start = time.perf_counter()
        data = build(like, n_questions, device)
        build_s = time.perf_counter() - start
        row = bench_size(data, device, repeats, with_triton)
        row["build_s"] = build_s
        out["sizes"][label] = row
        del data
        if progress:
            triton = (f"triton {row['triton_s'] * 1e3:9.1f} ms  ratio {row['ratio']:6.2f}  identical {row['identical']}"
                      if row["triton_s"] is not None else "triton: not timed on the CPU (the kernels need CUDA)")
            print(f"{label:>10}: {row['questions']:>5} questions, {row['turns']:>9,d} turns, {row['postings']:>11,d} "
                  f"postings  torch {row['torch_s'] * 1e3:9.1f} ms  {triton}", flush=True)
    return out


def run_gpu_stage(sizes: tuple[str, ...] | list[str] = ("locomo", "s", "m"), device: str = "cuda",
                  repeats: int = 5) -> dict[str, Any]:
    """The GPU check's stage: Triton vs torch per size on a CUDA device; every row must be identical."""
    dev = first_device(device)
    if dev.type != "cuda":
        raise RuntimeError(f"bench_kernels GPU stage: device {device!r} is {dev}, not a GPU")
    return run(list(sizes), dev, repeats, with_triton=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="locomo,s,m", help="comma list of locomo, s, m (NAME:QUESTIONS to scale)")
    parser.add_argument("--device", default="auto", help="index.device style: auto, cpu, cuda, cuda:1")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per path; the best is kept")
    args = parser.parse_args(argv)
    device = first_device(args.device)
    if device.type != "cuda":
        print("bench_kernels: no CUDA device: the torch path is timed, the Triton path is not timed on the CPU")
    result = run([s for s in args.sizes.split(",") if s.strip()], device, args.repeats)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
