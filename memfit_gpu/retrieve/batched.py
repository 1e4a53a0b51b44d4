"""The batched read path (SPEC read path 1-9): every stage runs once for a whole batch of questions.

    results = retrieve_batch(view, cfg, questions, memory_ids, embed=encoder.encode, reranker=None)

`embed(texts) -> [n, d]` encodes questions and PRF queries (one call for each, for all questions);
pass `question_embeddings` to skip the first call (benchmarks share one untimed encoder pass).
Questions are processed in chunks of `retrieve.question_batch_size` to bound peak memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.index.encoders import PairScorer
from memfit_gpu.index.protocols import DenseSearch, LexicalIndex
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.kernels import resolve_backend
from memfit_gpu.kernels.hybrid_topk import BoostInputs, hybrid_topk_triton
from memfit_gpu.retrieve.boosts import add_boosts, boosted, constraint_tensors
from memfit_gpu.retrieve.dates import parse_constraints
from memfit_gpu.retrieve.hybrid import Hits, hybrid_search
from memfit_gpu.retrieve.pack import Pack, build_packs, format_excerpts_batch
from memfit_gpu.retrieve.pool import (
    EPISODE,
    SOURCE_NAMES,
    SUMMARY,
    Candidates,
    concat,
    prf_expansion,
    round_robin,
    summary_expansion,
)
from memfit_gpu.retrieve.prf import feedback_terms_batch
from memfit_gpu.retrieve.registry import run_stages
from memfit_gpu.retrieve.rerank import cross_encoder_scores, final_order, reranker_info, zscore
from memfit_gpu.retrieve.stages import StageKey, tick
from memfit_gpu.retrieve.view import ReadView

log = logging.getLogger(__name__)

Embed = Callable[[list[str]], torch.Tensor]


_RANKED_FIELDS = ("kind", "row", "turn_id", "bm25", "dense", "fused", "boost", "score", "source", "origin",
                  "rerank", "final")


@dataclass
class RetrievalResult:
    """One question's retrieval: the ranked candidates with stage scores, the pack, the excerpts.

    `ranked` is a list of dicts (kind, row, turn_id, bm25, dense, fused, boost, score, source, origin,
    rerank, final) in final order. The batched path keeps the batch's [Q, N] tensors
    (`ranked_columns`) and builds one question's dicts only when asked."""

    memory_id: str
    question: str
    ranked_list: list[dict[str, Any]] | None
    pack: Pack
    excerpts: str
    prf_terms: list[str] = field(default_factory=list)
    reranker: dict[str, Any] = field(default_factory=dict)
    ranked_columns: tuple[Any, int] | None = None  # (the batch's tensors, this question's row)
    excerpt_chars_cut: int = 0  # characters cut from excerpts longer than pack.max_excerpt_chars

    @property
    def ranked(self) -> list[dict[str, Any]]:
        if self.ranked_list is None:
            self.ranked_list = self.ranked_columns[0].question(self.ranked_columns[1]) if self.ranked_columns else []
        return self.ranked_list

    def pack_key(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        return tuple(self.pack.episodes), tuple(self.pack.selected), tuple(self.pack.summaries)

    def to_json(self, view: ReadView) -> dict[str, Any]:
        return {
            "memory_id": self.memory_id,
            "question": self.question,
            "reranker": self.reranker,
            StageKey.PRF_TERMS: self.prf_terms,
            "ranked": self.ranked,
            "pack": {
                "episodes": [{"row": r, "turn_id": view.ep_turn_id[r], "selected": r in self.pack.selected}
                             for r in self.pack.episodes],
                "selected": [{"row": r, "turn_id": view.ep_turn_id[r]} for r in self.pack.selected],
                "summaries": [{"row": s, "text": view.sm_text[s],
                               "members": [view.ep_turn_id[m] for m in view.sm_members[s]]}
                              for s in self.pack.summaries],
            },
            "excerpts": self.excerpts,
            # Only when something was cut: a pack row without the key holds every excerpt whole.
            **({"excerpt_chars_cut": self.excerpt_chars_cut} if self.excerpt_chars_cut else {}),
        }


class _ChunkColumns:
    """The final ranked candidates of a batch as [Q, N] tensors; one question's dicts on demand."""

    def __init__(self, cands: Candidates, final: torch.Tensor, rerank: torch.Tensor | None, turn_ids: Any):
        self.cands, self.final, self.rerank, self.turn_ids = cands, final, rerank, turn_ids
        self.table: torch.Tensor | None = None
        self.counts: list[int] | None = None  # valid candidates per question, once per batch

    def question(self, i: int) -> list[dict[str, Any]]:
        c = self.cands
        if self.counts is None:
            self.counts = c.valid.sum(1).tolist()
        n = self.counts[i]
        kinds, rows = c.kind[i, :n].tolist(), c.row[i, :n].tolist()
        rerank = self.rerank[i, :n].tolist() if self.rerank is not None else [None] * n
        ref = c.ref[i, :n]
        if self.table is None:
            self.table = c.stage_table()  # once per batch, on the first question asked for
        found = self.table[ref.clamp(min=0)] if self.table.shape[0] else torch.zeros((n, 4), dtype=torch.float64)
        bm25, dense, fused, boost = torch.where((ref >= 0)[:, None], found, 0.0).T.tolist()
        columns = zip(
            ["episode" if k == EPISODE else "summary" for k in kinds], rows,
            [self.turn_ids[r] if k == EPISODE else None for k, r in zip(kinds, rows, strict=True)],
            bm25, dense, fused, boost,
            c.score[i, :n].tolist(), [SOURCE_NAMES[s] for s in c.source[i, :n].tolist()],
            [o if o >= 0 else None for o in c.origin[i, :n].tolist()], rerank, self.final[i, :n].tolist(),
            strict=True,
        )
        return [dict(zip(_RANKED_FIELDS, item, strict=True)) for item in columns]


def _expand(hits: Hits, index: torch.Tensor, n_q: int) -> Hits:
    """Hits of a subset of questions (positions `index`) placed into an n_q-row batch of pads."""
    if index.numel() == n_q:  # every question (index is ascending and distinct)
        return hits
    width = hits.rows.shape[1]

    def full(t: torch.Tensor, fill: float | int) -> torch.Tensor:
        out = torch.full((n_q, width), fill, dtype=t.dtype)
        out[index] = t
        return out

    return Hits(full(hits.rows, -1), full(hits.bm25, 0.0), full(hits.dense, 0.0), full(hits.fused, 0.0),
                full(hits.boost, 0.0), full(hits.score, float("-inf")))


def _boost(hits: Hits, cfg: MemFitConfig, cons: tuple[torch.Tensor, ...], speaker_mask: np.ndarray | None,
           year: np.ndarray, month: np.ndarray, kind: str) -> Hits:
    """Boosted (when `boosted`) and ranked: score desc, ties by lower row."""
    if boosted(cfg, kind):
        hits = add_boosts(hits, cfg.retrieve.boosts, *cons, speaker_mask, year, month)
    return hits.ranked()


def kernel_backend(view: ReadView, setting: str) -> str:
    """`retrieve.kernels` for this view: "triton" or "torch" (auto = Triton when the BM25 index is on CUDA)."""
    return resolve_backend(setting, view.ep_bm25.device, supported=view.ep_bm25.has_kernels)


def _row_tables(view: ReadView, key: tuple[Any, ...], mask: np.ndarray, year: np.ndarray, month: np.ndarray,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The rows' boost metadata as tensors on the kernel's device, once per view."""
    tables = view.__dict__.setdefault("_kernel_row_tables", {})
    key = (*key, str(device))
    if key not in tables:
        tables[key] = tuple(torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)).to(device)
                            for a in (mask, year, month))
    return tables[key]


def _fused_search(bm25: LexicalIndex, dense: DenseSearch, tokens: Sequence[list[str]], embeddings: torch.Tensor,
                  memory_idx: Sequence[int], cfg: MemFitConfig, timings: dict[str, float],
                  boosts: BoostInputs | None = None, k: int | None = None, by_row: bool = False,
                  encoded: tuple[torch.Tensor, torch.Tensor] | None = None, timing_prefix: str = "") -> Hits:
    """The Triton path of `hybrid_search` (+ `_boost` and the cut to k): BM25 scored per question over
    its own memory, then union, fusion, boosts and top-k in one launch (`memfit_gpu.kernels`).
    Same Hits, bit for bit, as the torch path; `fuse` there is this launch (boosts included)."""
    rcfg = cfg.retrieve
    clock = time.perf_counter()
    if encoded is not None:
        b_scores, b_rows = bm25.search_encoded(encoded[0], encoded[1], list(memory_idx), rcfg.scan_top_k,
                                               kernels="triton")
    else:
        b_scores, b_rows = bm25.search(list(tokens), list(memory_idx), rcfg.scan_top_k, kernels="triton")
    device = b_rows.device
    clock = tick(timings, timing_prefix + StageKey.BM25, clock, device)
    d_scores, d_rows = dense.search(embeddings, list(memory_idx), rcfg.scan_top_k, min_score=rcfg.dense_min_cosine)
    clock = tick(timings, timing_prefix + StageKey.DENSE, clock, d_rows.device)
    columns = hybrid_topk_triton(b_scores, b_rows, d_scores.to(device), d_rows.to(device), rcfg.alpha, k=k,
                                 by_row=by_row, boosts=boosts)
    hits = Hits(*(t.cpu() for t in columns))
    tick(timings, timing_prefix + StageKey.FUSE, clock)
    return hits


def _boost_inputs(view: ReadView, cfg: MemFitConfig, cons: tuple[torch.Tensor, ...], kind: str,
                  device: torch.device) -> BoostInputs | None:
    rcfg = cfg.retrieve
    if not boosted(cfg, kind):
        return None
    min_chars, match = rcfg.boosts.min_speaker_chars, rcfg.boosts.speaker_match
    if kind == "ep":
        mask, (year, month) = view.episode_speaker_mask(min_chars, match), view.ep_year_month
    else:
        mask, (year, month) = view.summary_speaker_mask(min_chars, match), view.sm_year_month
    rows = _row_tables(view, (kind, min_chars, match), mask, year, month, device)
    b = rcfg.boosts
    return BoostInputs(b.speaker, b.month, b.year, *(t.to(device) for t in cons), *rows)


def retrieve_batch(view: ReadView, cfg: MemFitConfig, questions: Sequence[str], memory_ids: Sequence[str],
                   embed: Embed | None = None, question_embeddings: torch.Tensor | None = None,
                   reranker: PairScorer | None = None, progress: bool = False,
                   timings: dict[str, float] | None = None) -> list[RetrievalResult]:
    """Retrieve for every question; see module doc. reranker: a CrossEncoderModule or None (= backend none).

    timings: when given, wall seconds per stage are added to it (keys `stage_*`)."""
    if len(questions) != len(memory_ids):
        raise ValueError(f"retrieve_batch: {len(questions)} questions but {len(memory_ids)} memory ids")
    if cfg.rerank.backend == "cross-encoder" and reranker is None:
        raise ValueError("rerank.backend=cross-encoder needs the loaded cross-encoder (rerank.load_reranker)")
    if cfg.rerank.backend == "none":
        reranker = None  # backend none keeps the first-stage order whatever module was passed
    if question_embeddings is None and embed is None:
        raise ValueError("retrieve_batch needs embed (an encoder) or precomputed question_embeddings")
    step = max(1, cfg.retrieve.question_batch_size)
    out: list[RetrievalResult] = []
    for start in range(0, len(questions), step):
        stop = min(start + step, len(questions))
        q_emb = None if question_embeddings is None else question_embeddings[start:stop]
        out.extend(_retrieve_chunk(view, cfg, list(questions[start:stop]), list(memory_ids[start:stop]),
                                   embed, q_emb, reranker, progress, timings if timings is not None else {}))
    return out


def _retrieve_chunk(view: ReadView, cfg: MemFitConfig, questions: list[str], memory_ids: list[str],
                    embed: Embed | None, q_emb: torch.Tensor | None, reranker: PairScorer | None,
                    progress: bool, timings: dict[str, float]) -> list[RetrievalResult]:
    clock = time.perf_counter()
    rcfg = cfg.retrieve
    n_q = len(questions)
    mems = [view.memory_index(m) for m in memory_ids]
    if q_emb is None:
        assert embed is not None
        q_emb = embed(questions)
    q_emb = torch.as_tensor(q_emb, dtype=torch.float32).cpu()
    tokens = [tokenize(q) for q in questions]
    min_chars = rcfg.boosts.min_speaker_chars
    constraints = [parse_constraints(q, view.speakers[m], min_chars) for q, m in zip(questions, mems, strict=False)]
    cons = constraint_tensors(constraints, view.speakers_lower, mems)

    kernels = kernel_backend(view, rcfg.kernels)
    device = view.ep_bm25.device

    clock = tick(timings, StageKey.QUERIES, clock, device)
    # 1-2: episode hybrid + boosts
    if kernels == "triton":
        ep = _fused_search(view.ep_bm25, view.ep_dense, tokens, q_emb, mems, cfg, timings,
                           boosts=_boost_inputs(view, cfg, cons, "ep", device))
    else:
        ep = hybrid_search(view.ep_bm25, view.ep_dense, tokens, q_emb, mems, rcfg.scan_top_k, rcfg.alpha,
                           rcfg.dense_min_cosine, timings=timings)
        boost_start = time.perf_counter()
        ep = _boost(ep, cfg, cons, view.episode_speaker_mask(min_chars, rcfg.boosts.speaker_match), *view.ep_year_month,
                    "ep")
        tick(timings, StageKey.BOOST, boost_start, device)

    clock = tick(timings, StageKey.EPISODES, clock, device)
    # 3: summary hybrid + boosts, top summary_top_k
    sm: Hits | None = None
    if rcfg.summaries and view.has_summaries and kernels == "triton":
        sm = _fused_search(view.sm_bm25, view.sm_dense, tokens, q_emb, mems, cfg, {},
                           boosts=_boost_inputs(view, cfg, cons, "sm", device), k=rcfg.summary_top_k)
    elif rcfg.summaries and view.has_summaries:
        sm = hybrid_search(view.sm_bm25, view.sm_dense, tokens, q_emb, mems, rcfg.scan_top_k, rcfg.alpha,
                           rcfg.dense_min_cosine)
        mask = view.summary_speaker_mask(min_chars, rcfg.boosts.speaker_match) if boosted(cfg, "sm") else None
        sm = _boost(sm, cfg, cons, mask, *view.sm_year_month, "sm")
        sm = sm.head(rcfg.summary_top_k)

    clock = tick(timings, StageKey.SUMMARIES, clock, device)
    # 4-5: pool and summary expansion
    pool = round_robin(ep, sm, rcfg.pool_size)
    expansion = Candidates.empty(n_q)
    if rcfg.summary_expansion and sm is not None:
        expansion = summary_expansion(pool, sm, view.members_padded, rcfg.summary_expansion_top,
                                      rcfg.summary_expansion_weight)

    clock = tick(timings, StageKey.POOL, clock, device)
    # 6: PRF, a second batched hybrid pass
    prf_terms: list[list[str]] = [[] for _ in range(n_q)]
    prf = Candidates.empty(n_q)
    if rcfg.prf.enabled:
        prf_terms, pairs = feedback_terms_batch(view.ep_bm25, ep.head(rcfg.prf.docs).rows, rcfg.prf.min_token_chars,
                                                rcfg.prf.terms, rcfg.prf.term_order)
        asking = [i for i, terms in enumerate(prf_terms) if terms]
        if asking:
            if embed is None:
                raise ValueError("PRF needs embed to encode its queries (retrieve.prf.enabled=true)")
            asking_t = torch.tensor(asking, dtype=torch.long)
            # renumber the pairs' questions to their place among those asking
            place = torch.full((n_q,), -1, dtype=torch.long)
            place[asking_t] = torch.arange(len(asking))
            encoded = (place[pairs[0].cpu()], pairs[1])
            part = tick(timings, StageKey.PRF_TERMS, clock, device)
            prf_emb = torch.as_tensor(embed([" ".join(prf_terms[i]) for i in asking]), dtype=torch.float32).cpu()
            part = tick(timings, StageKey.PRF_EMBED, part, device)
            if kernels == "triton":  # row order, no boosts: what prf_expansion expects of `fuse`
                hits = _fused_search(view.ep_bm25, view.ep_dense, [prf_terms[i] for i in asking], prf_emb,
                                     [mems[i] for i in asking], cfg, timings, by_row=True, encoded=encoded,
                                     timing_prefix=StageKey.PRF_PREFIX)
            else:
                hits = hybrid_search(view.ep_bm25, view.ep_dense, [prf_terms[i] for i in asking], prf_emb,
                                     [mems[i] for i in asking], rcfg.scan_top_k, rcfg.alpha, rcfg.dense_min_cosine,
                                     timings=timings, encoded=encoded, timing_prefix=StageKey.PRF_PREFIX)
            part = time.perf_counter()
            hits = _expand(hits, asking_t, n_q)
            prf = prf_expansion(hits, pool, expansion, rcfg.prf.weight)
            tick(timings, StageKey.PRF_EXPANSION, part, device)

    clock = tick(timings, StageKey.PRF, clock, device)
    # 7: rerank candidates = pool[:rerank_pool] + every expansion
    cands = concat([pool.head(cfg.rerank.rerank_pool), expansion, prf])
    rerank_scores: torch.Tensor | None = None
    if reranker is not None:
        cands = cands.compact()  # each question's passages first, in candidate order
        kinds, rows = cands.kind.tolist(), cands.row.tolist()
        passages = []
        for kind_row, row_row in zip(kinds, rows, strict=False):
            ps = []
            for kind, row in zip(kind_row, row_row, strict=False):
                if kind == EPISODE:
                    ps.append(view.ep_text[row])
                elif kind == SUMMARY:
                    ps.append(view.sm_text[row] + cfg.rerank.summary_suffix.format(date=view.summary_date(row)))
            passages.append(ps)
        raw = cross_encoder_scores(reranker, questions, passages, cfg.rerank.batch_size, progress)
        rerank_scores = torch.zeros(cands.kind.shape, dtype=torch.float64)
        for i, vals in enumerate(raw):
            rerank_scores[i, : len(vals)] = torch.tensor(vals, dtype=torch.float64)
        final = zscore(rerank_scores, cands.kind, cfg.rerank.zscore_min)
    else:
        final = cands.score
    if rcfg.stages:  # the added stages (retrieve/registry.py), after SPEC's rerank
        clock = tick(timings, StageKey.RERANK, clock, device)
        final = run_stages(view, cfg, questions, mems, cands.kind, cands.row, cands.valid, final)
        clock = tick(timings, StageKey.ADDED, clock, device)
    # pads (anywhere when not compacted) sort last; equal scores keep candidate order
    order = final_order(final, cands.valid)[:, : int(cands.valid.sum(1).max()) if n_q else 0]
    ranked = cands.take(order)
    final = torch.where(ranked.valid, final.gather(1, order), 0.0)
    raw_rerank = rerank_scores.gather(1, order) if rerank_scores is not None else None

    clock = tick(timings, StageKey.RERANK, clock, device)
    # 8-9: pack and excerpts
    info = reranker_info(cfg.rerank, reranker)
    columns = _ChunkColumns(ranked, final, raw_rerank, view.ep_turn_id)
    k = cfg.pack.k
    results = [RetrievalResult(memory_ids[i], questions[i], None, pack, text, prf_terms[i], info, (columns, i),
                               excerpt_chars_cut=cut)
               for i, (pack, text, cut) in enumerate(packs_at(view, cfg, ranked.kind[:, :k], ranked.row[:, :k]))]
    tick(timings, StageKey.PACK, clock, device)
    return results


def packs_at(view: ReadView, cfg: MemFitConfig, top_kind: torch.Tensor, top_row: torch.Tensor
             ) -> list[tuple[Pack, str, int]]:
    """SPEC read path 8-9 for a batch: per question the pack of its top candidates (top_kind / top_row [Q, k]:
    kind 0 episode, 1 summary, anything else a pad), its excerpt text and the characters cut from it. The one
    assembly of the batched read path and of the other pack depths of a run (eval.pack_cutoffs)."""
    packs = build_packs(top_kind, top_row, view, cfg.pack.context_window)
    tails = view.__dict__.setdefault("_excerpt_tails", {}).setdefault(
        (cfg.pack.resolve_dates, cfg.pack.max_excerpt_chars), {})
    texts = format_excerpts_batch(packs, view, cfg.rerank.summary_suffix, cfg.pack.resolve_dates, tails,
                                  cfg.pack.max_excerpt_chars)
    return [(pack, text, cut) for pack, (text, cut) in zip(packs, texts, strict=True)]
