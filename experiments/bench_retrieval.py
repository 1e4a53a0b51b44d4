"""Retrieval throughput: the batched read path vs the one-question-at-a-time reference, same run.

All evaluated LoCoMo questions (1,540) over one EpisodeStore of the ten conversations (no summaries),
reranker none. The bi-encoder runs once, untimed, for every query text both paths need: one
batched pass over the questions, then one over the PRF queries (collected by a first batched run
whose embed hook records them). Both timed paths then read query embeddings from that cache, so the
ratio times everything else: BM25 and dense searches, fusion, boosts, pool, PRF term choice and the
PRF searches, ordering, packs and excerpt text. Each timed repeat starts from a fresh ReadView (no
per-row caches carried over); the two paths are interleaved and each keeps its best time. Objects
made during setup are frozen out of the garbage collector and each timed run starts after a
collection, so neither path pays for a full collection of the libraries' objects.

    .venv/bin/python experiments/bench_retrieval.py --data ../shared/data/locomo/locomo10.json

Last line: JSON with questions, batched_qps, loop_qps, ratio, identical_packs, encode_qps, ...
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from memfit_gpu.config import load_config  # noqa: E402
from memfit_gpu.data import load_benchmark, select_questions  # noqa: E402
from memfit_gpu.index.encoders import load_bi_encoder  # noqa: E402
from memfit_gpu.retrieve.batched import retrieve_batch  # noqa: E402
from memfit_gpu.retrieve.diagnostics import compute_diagnostics  # noqa: E402
from memfit_gpu.retrieve.reference import retrieve_one  # noqa: E402
from memfit_gpu.retrieve.view import ReadView  # noqa: E402
from memfit_gpu.store import EpisodeStore  # noqa: E402

DEFAULT_DATA = Path(__file__).resolve().parents[2] / "shared" / "data" / "locomo" / "locomo10.json"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(DEFAULT_DATA))
    parser.add_argument("--config", default=str(Path(__file__).resolve().parents[1] / "configs" / "memfit.yaml"))
    parser.add_argument("--limit-memories", type=int, default=None)
    parser.add_argument("--store", default=None,
                        help="EpisodeStore directory: built there on the first run, reopened (no re-encoding) later")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; each path keeps its best time")
    # A loop run lasts seconds and averages out short stalls of this shared host; a batched run lasts
    # a fraction of a second and can land wholly inside one, so each round times it several times.
    parser.add_argument("--batched-runs", type=int, default=5, help="batched runs per round")
    # Both paths run in this one process under the same setting; the batched path can use every core
    # (its tensors span all questions), the loop's batches of one barely can. --threads 1 shows the
    # single-core figure (docs/benchmarks/history.md records both).
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads while timing (0 = torch's default: every core)")
    parser.add_argument("overrides", nargs="*", help="config overrides (rerank.backend is forced to none)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)

    cfg = load_config(args.config, list(args.overrides) + ["rerank.backend=none", "retrieve.summaries=false"])
    benchmark = select_questions(load_benchmark("locomo", args.data), exclude_categories=["5"],
                                 limit_memories=args.limit_memories)
    questions = [q for q in benchmark.questions() if q.evaluated]
    texts = [q.question for q in questions]
    memory_ids = [q.memory_id for q in questions]

    encoder = load_bi_encoder(cfg.index)
    store = EpisodeStore(args.store, cfg, encoder)
    missing = [m for m in benchmark.memories if m.memory_id not in store.memory_ids]
    if len(missing) != len(benchmark.memories) and missing:
        raise SystemExit(f"--store {args.store} holds some but not all of the benchmark's memories")
    if missing:
        store.add_memories(missing, progress=True)

    # One shared, untimed encoder pass per kind of query text.
    cache: dict[str, torch.Tensor] = {}
    encoded = 0
    encode_s = 0.0

    def encode_into_cache(batch: list[str]) -> torch.Tensor:
        nonlocal encoded, encode_s
        todo = [t for t in dict.fromkeys(batch) if t not in cache]
        if todo:
            start = time.perf_counter()
            vectors = encoder.encode(todo, batch_size=cfg.index.encode_batch_size)
            encode_s += time.perf_counter() - start
            encoded += len(todo)
            cache.update(zip(todo, vectors, strict=True))
        return torch.stack([cache[t] for t in batch])

    question_embeddings = encode_into_cache(texts)
    retrieve_batch(ReadView.from_store(store), cfg, texts, memory_ids, embed=encode_into_cache,
                   question_embeddings=question_embeddings)  # collects and encodes every PRF query

    def lookup(batch: list[str]) -> torch.Tensor:
        return torch.stack([cache[t] for t in batch])

    if args.threads:
        torch.set_num_threads(args.threads)
    # The process holds ~500k GC-tracked objects from torch/transformers; one full collection of them
    # takes ~0.3 s and lands in whichever timed run it happens to. Freeze what setup made (as a
    # long-running server would) and collect before each timed run, for both paths alike.
    gc.collect()
    gc.freeze()
    best = {"batched": float("inf"), "loop": float("inf")}
    batched = loop = None
    for _ in range(args.repeats):
        for _ in range(args.batched_runs):
            view = ReadView.from_store(store)
            gc.collect()
            start = time.perf_counter()
            batched = retrieve_batch(view, cfg, texts, memory_ids, embed=lookup,
                                     question_embeddings=question_embeddings)
            best["batched"] = min(best["batched"], time.perf_counter() - start)
        ref_view = ReadView.from_store(store)
        gc.collect()
        start = time.perf_counter()
        loop = [retrieve_one(ref_view, cfg, t, m, lookup, question_embeddings[i])
                for i, (t, m) in enumerate(zip(texts, memory_ids, strict=True))]
        best["loop"] = min(best["loop"], time.perf_counter() - start)
    gc.unfreeze()
    assert batched is not None and loop is not None
    same_packs = sum(a.pack_key() == b.pack_key() for a, b in zip(batched, loop, strict=True))
    same_excerpts = sum(a.excerpts == b.excerpts for a, b in zip(batched, loop, strict=True))
    same_ranked = sum(
        [(c["kind"], c["row"]) for c in a.ranked] == [(c["kind"], c["row"]) for c in b.ranked]
        for a, b in zip(batched, loop, strict=True)
    )
    diagnostics, _ = compute_diagnostics(batched, questions, view, {"backend": "none"})
    overall = diagnostics["overall"]
    n = len(questions)
    result = {
        "questions": n,
        "batched_qps": n / best["batched"],
        "loop_qps": n / best["loop"],
        "ratio": best["loop"] / best["batched"],
        "identical_packs": same_packs == n,
        "identical_packs_count": same_packs,
        "identical_rankings_count": same_ranked,
        "identical_excerpts_count": same_excerpts,
        "encode_qps": encoded / encode_s if encode_s else None,
        "encoded_query_texts": encoded,
        "batched_s": best["batched"],
        "loop_s": best["loop"],
        "threads": torch.get_num_threads(),
        "loop_runs": args.repeats,
        "batched_runs": args.repeats * args.batched_runs,
        "pack_hit": overall["pack_hit"],
        "pack_hit_window": overall["pack_hit_window"],
        "hit@30": overall["hit@30"],
        "mrr": overall["mrr"],
        "scored_questions": overall["questions"],
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
