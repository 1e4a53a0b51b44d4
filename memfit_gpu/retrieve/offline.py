"""Batched retrieval over a benchmark's evaluated questions, with diagnostics (`memfit retrieve`).

Runs MemFit retrieval (SPEC read path 1-9) for every evaluated question, all questions in one batched
pass per stage, and writes:
  OUT/packs.jsonl       one line per question: ranked candidates with stage scores (bm25, dense,
                        fused, boost, source, rerank), the pack (episode rows + turn ids, summaries
                        with members), the excerpt text, and its retrieval diagnostics
  OUT/diagnostics.json  hit@5/10/20/30 over the final ranked episode list, pack_hit, pack_hit_window,
                        all_gold_pack, mrr, overall and per category; which reranker ran, with which weights

The episode store is built in memory from the benchmark (one encoder pass) unless an existing store
directory is named (then its summaries are used too).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from memfit_gpu.config import MemFitConfig, to_dict
from memfit_gpu.data import load_benchmark, select_from_config
from memfit_gpu.index.encoders import load_bi_encoder
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.diagnostics import compute_diagnostics
from memfit_gpu.retrieve.rerank import load_reranker, reranker_info
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store import EpisodeStore

log = logging.getLogger(__name__)


def retrieve_benchmark(cfg: MemFitConfig, out: Path, store_path: str | Path | None = None) -> dict[str, Any]:
    """Retrieve for every evaluated question of cfg.data's benchmark; write OUT/packs.jsonl and
    OUT/diagnostics.json (module docstring).

    Args:
        store_path: an existing EpisodeStore directory to read (keeps its summaries); None builds the
            store in memory from the benchmark.
    Returns:
        diagnostics.json's content.
    Raises:
        FileNotFoundError: the store at `store_path` lacks memories of the benchmark.
    """
    timings: dict[str, float] = {}
    started = time.perf_counter()
    # The reranker first: a missing cross-encoder fails before any encoding work.
    reranker = load_reranker(cfg.rerank, cfg.index)
    benchmark = select_from_config(load_benchmark(cfg.data.benchmark, cfg.data.path, split=cfg.data.split), cfg.data)
    questions = [q for q in benchmark.questions() if q.evaluated]
    timings["load_s"] = time.perf_counter() - started

    t0 = time.perf_counter()
    encoder = load_bi_encoder(cfg.index)
    if store_path:
        store = EpisodeStore(store_path, cfg, encoder)
        missing = [m.memory_id for m in benchmark.memories if m.memory_id not in store.memory_ids]
        if missing:
            raise FileNotFoundError(f"store {store_path} lacks memories {missing[:5]} of {cfg.data.benchmark}")
    else:
        store = EpisodeStore(None, cfg, encoder)
        store.add_memories(benchmark.memories, progress=True)
    view = ReadView.from_store(store)
    timings["store_s"] = time.perf_counter() - t0
    log.info("retrieve: %d questions over %d memories (%d episodes, %d summaries; summaries %s)",
             len(questions), len(benchmark.memories), view.num_episodes, len(view.sm_text),
             "used" if cfg.retrieve.summaries and view.has_summaries else "not used")

    def embed(texts: list[str]) -> torch.Tensor:
        return encoder.encode(texts, batch_size=cfg.index.encode_batch_size)

    t0 = time.perf_counter()
    results = retrieve_batch(view, cfg, [q.question for q in questions], [q.memory_id for q in questions],
                             embed=embed, reranker=reranker, progress=True)
    timings["retrieve_s"] = time.perf_counter() - t0
    info = reranker_info(cfg.rerank, reranker)
    diagnostics, records = compute_diagnostics(results, questions, view, info)
    diagnostics["encoder"] = view.encoder_info or encoder.info()
    diagnostics["summaries_used"] = bool(cfg.retrieve.summaries and view.has_summaries)
    diagnostics["timings"] = timings
    diagnostics["config"] = to_dict(cfg)

    out.mkdir(parents=True, exist_ok=True)
    with open(out / "packs.jsonl", "w") as fh:
        for q, result, record in zip(questions, results, records, strict=True):
            row = {"question_id": q.question_id, "category": q.category, "gold": q.answer,
                   "evidence": q.evidence, **result.to_json(view), "retrieval": record}
            fh.write(json.dumps(row) + "\n")
    (out / "diagnostics.json").write_text(json.dumps(diagnostics, indent=2) + "\n")
    return diagnostics
