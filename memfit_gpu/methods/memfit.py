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

live (memfit_gpu.Memory, methods/base.py LiveMethod): the live memory's store is MemFit's index, so
`attach` only loads the cross-encoder and `changed` has nothing to do; `read` keeps its ReadView while the
store's generation is unchanged (one view per write batch, not per search); `consolidate` summarises the
closed segments of each memory's new turns (EpisodeStore.summarise_closed_segments), off the query path.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import replace
from typing import Any

import torch

from memfit_gpu import faults
from memfit_gpu.config import MemFitConfig
from memfit_gpu.files import atomic_write_text
from memfit_gpu.index.encoders import PairScorer, TextEncoder, load_bi_encoder
from memfit_gpu.methods.base import Hit, MethodRun, episode_hit
from memfit_gpu.methods.packs import pack_row
from memfit_gpu.readers.types import Request, owner_of
from memfit_gpu.retrieve.batched import RetrievalResult, packs_at, retrieve_batch
from memfit_gpu.retrieve.diagnostics import compute_diagnostics
from memfit_gpu.retrieve.pool import EPISODE, SUMMARY
from memfit_gpu.retrieve.rerank import load_reranker, reranker_info
from memfit_gpu.retrieve.view import ReadView
from memfit_gpu.store.episodes import EpisodeStore
from memfit_gpu.store.summaries import summary_records


def summary_generate(reader: Any, cfg: MemFitConfig) -> Callable[[list[str]], list[str]]:
    """The store's `generate(list_of_prompts) -> list_of_texts`, through a cached reader (role summary)."""
    def generate(prompts: list[str]) -> list[str]:
        requests = [Request([{"role": "user", "content": str(p)}], role="summary",
                            max_new_tokens=cfg.summary.max_new_tokens, temperature=cfg.summary.temperature,
                            key=f"summary:{i}", owner=owner_of(p)) for i, p in enumerate(prompts)]
        return [r.text.strip() for r in reader.generate(requests)]

    return generate


class MemFit:
    name = "memfit"

    def __init__(self) -> None:
        self.store: EpisodeStore | None = None
        self.encoder: TextEncoder | None = None
        self.reranker: PairScorer | None = None
        self.cfg: MemFitConfig | None = None
        self._view: ReadView | None = None
        self._view_generation = -1

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
        # another run's store (`memfit retrieve --store`) is read, never written: no snapshot, no repair
        self.store = EpisodeStore(run.store_location(), cfg, self.encoder, read_only=run.store_path is not None)
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
        view = self.view()
        stage_seconds: dict[str, float] = {}
        questions = run.questions
        results = retrieve_batch(
            view, cfg, [q.question for q in questions], [q.memory_id for q in questions],
            embed=lambda texts: encoder.encode(texts, batch_size=cfg.index.encode_batch_size),
            reranker=self.reranker, progress=run.progress, timings=stage_seconds,
        )
        diagnostics, records = compute_diagnostics(results, questions, view, reranker_info(cfg.rerank, self.reranker),
                                                 cfg.eval.hit_list)
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

    def read_depth(self, run: MethodRun, rows: list[dict[str, Any]], k: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """The rows a read at pack.k=k makes, from `rows` (this method's packs.jsonl rows of run.questions, at the
        run's pack.k): the same ranked candidates, their top k packed and quoted by the batched path's own
        assembly (retrieve/batched.py packs_at), and their diagnostics. Nothing before the pack depends on k,
        so this equals retrieving again at pack.k=k, without the retrieval."""
        assert self.cfg is not None, "read_depth before write"
        cfg = replace(self.cfg, pack=replace(self.cfg.pack, k=k))
        view = self.view()
        top_kind = torch.full((len(rows), k), -1, dtype=torch.long)
        top_row = torch.full((len(rows), k), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            for j, item in enumerate(row["ranked"][:k]):
                top_kind[i, j] = EPISODE if item["kind"] == "episode" else SUMMARY
                top_row[i, j] = int(item["row"])
        results = [RetrievalResult(row["memory_id"], row["question"], row["ranked"], pack, text, row["prf_terms"],
                                   row["reranker"], excerpt_chars_cut=cut)
                   for row, (pack, text, cut) in zip(rows, packs_at(view, cfg, top_kind, top_row), strict=True)]
        diagnostics, records = compute_diagnostics(results, run.questions, view, rows[0]["reranker"] if rows else None,
                                                 cfg.eval.hit_list)
        diagnostics["method"] = {**self.info(), "pack_k": k}
        out = []
        for q, result, record in zip(run.questions, results, records, strict=True):
            made = result.to_json(view)
            del made["memory_id"], made["question"]  # the question's own fields lead the row
            out.append(pack_row(q, self.name, {**made, "retrieval": record}))
        return out, diagnostics

    def view(self) -> ReadView:
        """The store's ReadView, built again only after the store changed (a live memory's writes)."""
        assert self.store is not None
        self.store.index_pending()  # turns a live memory logged since the last read
        if self._view is None or self._view_generation != self.store.generation:
            self._view = ReadView.from_store(self.store, previous=self._view)
            self._view_generation = self.store.generation
        return self._view

    # ------------------------------------------------------------------------------ live
    def attach(self, run: MethodRun, store: EpisodeStore) -> None:
        self.cfg = self.path_config(run.cfg)
        self.reranker = load_reranker(self.cfg.rerank, self.cfg.index)
        self.encoder, self.store = store.encoder, store

    def changed(self, run: MethodRun, memory_ids: list[str]) -> None:
        """Nothing to do: the store is MemFit's index."""

    def hits(self, row: dict[str, Any], k: int) -> list[Hit]:
        """The first k of the row's ranked candidates (final order), with their stage scores."""
        assert self.store is not None
        out = []
        for item in row["ranked"][:k]:
            scores = {key: item[key] for key in ("bm25", "dense", "fused", "boost", "rerank")}
            if item["kind"] == "episode":
                out.append(episode_hit(self.store, int(item["row"]), float(item["final"]), scores))
            else:
                members = self.store.summaries.members[int(item["row"])]
                out.append(Hit("summary", self.store.summaries.text[int(item["row"])], float(item["final"]),
                               [str(self.store.turn_id[int(m)]) for m in members], scores))
        return out

    def consolidate(self, run: MethodRun, memory_ids: list[str],
                    holding: Callable[[], AbstractContextManager[Any]]) -> dict[str, int]:
        """Summaries of the closed segments of the memories' new turns: planned and committed while
        `holding()` the live memory, generated (the LLM calls) without it, so searches go on meanwhile."""
        assert self.store is not None and self.cfg is not None
        if not self.cfg.summary.enabled or run.reader is None:
            return {"summaries": 0}
        with holding():
            jobs = self.store.closed_segment_jobs(memory_ids)
        if not jobs:
            return {"summaries": 0}
        records = summary_records(jobs, summary_generate(run.reader(), self.cfg), self.cfg.summary, first_row=0)
        with holding():
            run.account("summaries.ledger")  # before the store logs them, as in write
            return {"summaries": self.store.commit_summaries(records)}

    def unconsolidated(self, memory_ids: list[str]) -> dict[str, int]:
        """The live turns after the last one a live summary covers (what closed_segment_jobs segments)."""
        assert self.store is not None and self.cfg is not None
        if not self.cfg.summary.enabled:
            return {}
        return self.store.unsummarised_counts(memory_ids)

    def compact(self, run: MethodRun, store: EpisodeStore, purged: list[str]) -> None:
        """Nothing of MemFit's own to rewrite: the compacted store is all."""
        self.attach(run, store)

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
