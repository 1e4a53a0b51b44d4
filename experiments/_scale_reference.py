"""The reference side of bench_scale.py: the packs of the older read and write paths (a FAISS index per memory,
one-chunk writes) on the same data.

`reference_packs` builds one `ReadView.from_memories` over every memory in ONE batch (all texts and
vectors at once, BM25 added in one call) with a FAISS index per memory
(`index.dense_batched_max_rows = 0`), then retrieves every question with `retrieve_batch`. It uses only
APIs that predate the batched dense product, so the same file runs against an older checkout of the package
(`bench_scale.py --reference-repo PATH` runs it as a subprocess with PATH first on PYTHONPATH), where
the attribute is ignored and every memory is a FAISS memory anyway:

    PYTHONPATH=/work/main python experiments/_scale_reference.py --like longmemeval-s --questions 500 \
        --embed-cache cache.pt --out packs.pt

PRF query vectors come from the cache that bench_scale.py's own run filled (text -> vector), so both
sides embed the same texts identically; a PRF text missing from the cache is itself a difference and is
reported.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.data.synth import iter_memories
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.view import ReadView


def scale_config() -> MemFitConfig:
    """What bench_scale.py runs: no LLM anywhere (no summaries, no reranker), everything else SPEC."""
    cfg = MemFitConfig()
    cfg.summary.enabled = False
    cfg.retrieve.summaries = False
    cfg.rerank.backend = "none"
    return cfg


def reference_packs(like: str, questions: int, seed: int, dim: int,
                    cache: dict[str, torch.Tensor]) -> tuple[dict[str, Any], dict[str, float]]:
    """({question id: [episodes, selected, summaries]}, timings) of the one-batch, FAISS-per-memory path."""
    memories = list(iter_memories(like, questions, seed=seed, embedding_dim=dim))
    cfg = scale_config()
    cfg.index.dense_batched_max_rows = 0  # a FAISS index per memory (ignored by code older than the batched product)
    start = time.perf_counter()
    embeddings = torch.from_numpy(np.concatenate([m.extra["embeddings"] for m in memories]))
    view = ReadView.from_memories(memories, None, cfg, embeddings=embeddings)
    build_s = time.perf_counter() - start
    asked = [q for m in memories for q in m.questions]
    q_emb = torch.from_numpy(np.stack([q.extra["embedding"] for q in asked]))
    missing: list[str] = []

    def lookup(texts: list[str]) -> torch.Tensor:
        out = []
        for text in texts:
            if text not in cache:
                missing.append(text)
                out.append(torch.zeros(dim))
            else:
                out.append(cache[text])
        return torch.stack(out)

    start = time.perf_counter()
    results = retrieve_batch(view, cfg, [q.question for q in asked], [q.memory_id for q in asked], embed=lookup,
                             question_embeddings=q_emb)
    retrieve_s = time.perf_counter() - start
    packs = {q.question_id: [list(part) for part in r.pack_key()] for q, r in zip(asked, results, strict=True)}
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1 << 20)
    return packs, {"build_s": build_s, "retrieve_s": retrieve_s, "prf_texts_missing": len(missing), "peak_rss_gib": peak}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--like", required=True)
    parser.add_argument("--questions", type=int, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dim", type=int, default=384)
    parser.add_argument("--embed-cache", required=True, help="torch file: {text: vector} of the PRF queries")
    parser.add_argument("--out", required=True, help="torch file for {packs, timings}")
    args = parser.parse_args(argv)
    cache = torch.load(args.embed_cache, weights_only=True)
    packs, timings = reference_packs(args.like, args.questions, args.seed, args.dim, cache)
    torch.save({"packs": packs, "timings": timings}, args.out)


if __name__ == "__main__":
    main()
