"""MemFit as a method: write = the episode store + segment summaries, read = batched hybrid retrieval.

write (SPEC write path): the cross-encoder loads first (missing weights fail before any encoding), then
every selected memory not in the store yet is stored verbatim (one encoder pass per write chunk; the
store at `MethodRun.store_location()`, persistent in a run directory) and the store snapshotted; with
summary.enabled every memory not summarised before gets its segment summaries, one batch of `summary`
calls through the run's reader, accounted before the store logs them (stage "summaries"; without a
reader, as in `memfit retrieve`, none are built).

read (SPEC read path 1-9): `retrieve_batch` over every question at once, its diagnostics
(retrieve/diagnostics.py: hit@k, pack hit, MRR), and one row per question (methods/packs.py) holding the
ranked candidates with their stage scores, the PRF terms, the reranker, the pack and the excerpts.

`plain` is this method with plain.SWITCHES applied and no summaries (methods/plain.py).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.files import atomic_write_text
from memfit_gpu.index.encoders import PairScorer, TextEncoder, load_bi_encoder
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.readers.types import Request
from memfit_gpu.retrieve.batched import retrieve_batch
from memfit_gpu.retrieve.diagnostics import compute_diagnostics
from memfit_gpu.retrieve.rerank import load_reranker, reranker_info
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store.episodes import EpisodeStore


def summary_generate(reader: Any, cfg: MemFitConfig) -> Callable[[list[str]], list[str]]:
    """The store's `generate(list_of_prompts) -> list_of_texts`, through a cached reader (role summary)."""
    def generate(prompts: list[str]) -> list[str]:
        requests = [Request([{"role": "user", "content": p}], role="summary",
                            max_new_tokens=cfg.summary.max_new_tokens, temperature=cfg.summary.temperature,
                            key=f"summary:{i}") for i, p in enumerate(prompts)]
        return [r.text.strip() for r in reader.generate(requests)]

    return generate


class MemFit:
    name = "memfit"

    def __init__(self) -> None:
        self.store: EpisodeStore | None = None
        self.encoder: TextEncoder | None = None
        self.reranker: PairScorer | None = None
        self.cfg: MemFitConfig | None = None

    def path_config(self, cfg: MemFitConfig) -> MemFitConfig:
        """The configuration MemFit's path runs with (plain: its switches applied)."""
        return cfg

    def info(self) -> dict[str, Any]:
        """diagnostics.json's `method`."""
        return {"name": self.name}

    # ------------------------------------------------------------------------------------ write path
    def write(self, run: MethodRun) -> None:
        cfg = self.cfg = self.path_config(run.cfg)
        self.reranker = load_reranker(cfg.rerank, cfg.index)
        self.encoder = load_bi_encoder(cfg.index)
        self.store = EpisodeStore(run.store_location(), cfg, self.encoder)
        held = set(self.store.memory_ids)
        new = [m for m in run.memories if m.memory_id not in held]
        if new and run.store_path is not None:
            raise FileNotFoundError(f"store {run.store_path} lacks memories {[m.memory_id for m in new[:5]]} "
                                    f"of {run.bench.name}")
        if new:
            self.store.add_memories(new, progress=run.progress)
            if run.out is not None:
                build = {**self.store.last_timings, "episodes": int(self.store.size),
                         "memories": len(self.store.memory_ids)}
                atomic_write_text(run.out / "build_timings.json", json.dumps(build, indent=2))
                faults.point("build_timings")
        # A reopened store that replayed its log's tail keeps that work: the next open loads it.
        self.store.snapshot()
        if cfg.summary.enabled and run.reader is not None:
            with run.stage("summaries"):
                generate = summary_generate(run.reader(), cfg)

                def generate_and_account(prompts: list[str]) -> list[str]:
                    texts = generate(prompts)
                    # Before the store logs the summaries: a kill in between costs cache hits on the
                    # rerun, never calls the ledger does not know of.
                    run.account("summaries.ledger")
                    return texts

                self.store.build_summaries(generate_and_account, memory_ids=[m.memory_id for m in run.memories],
                                           progress=run.progress)

    # ------------------------------------------------------------------------------------- read path
    def read(self, run: MethodRun) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        assert self.store is not None and self.encoder is not None and self.cfg is not None, "read before write"
        cfg, encoder = self.cfg, self.encoder
        view = ReadView.from_store(self.store)
        stage_seconds: dict[str, float] = {}
        questions = run.questions
        results = retrieve_batch(
            view, cfg, [q.question for q in questions], [q.memory_id for q in questions],
            embed=lambda texts: encoder.encode(texts, batch_size=cfg.index.encode_batch_size),
            reranker=self.reranker, progress=run.progress, timings=stage_seconds,
        )
        diagnostics, records = compute_diagnostics(results, questions, view, reranker_info(cfg.rerank, self.reranker))
        diagnostics["retrieve_stage_seconds"] = stage_seconds
        diagnostics["encoder"] = encoder.info()
        diagnostics["summaries_used"] = bool(cfg.retrieve.summaries and view.has_summaries)
        diagnostics["method"] = self.info()
        rows = []
        for q, result, record in zip(questions, results, records, strict=True):
            made = result.to_json(view)
            del made["memory_id"], made["question"]  # the question's own fields lead the row
            rows.append(pack_row(q, self.name, {**made, "retrieval": record}))
        return rows, diagnostics

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
