"""The reference read path: the same retrieval, one question at a time, in plain readable Python.

It shares only the pure rule helpers with the batched path (dates: constraint parsing and
relative dates; pack.format_excerpts: text layout; the added stages of retrieve.stages, which it runs
on a batch of one) and calls the indexes' searches with a batch of one. Every score is formed with the same
float64 operations in the same order, so both paths must produce identical packs given the same encoder
outputs; tests/retrieve/test_retrieve_reference.py and experiments/bench_retrieval.py check it. (The packed
encoders' floats depend on what else shares their batch, by up to ~2e-7 for the bi-encoder and ~4e-8 for the
cross-encoder: with live encoders, which encode one question here and all of them there, a near-tie may
rank otherwise. The checks therefore feed both paths the same embeddings and rerank scores.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from memfit_gpu.config import MemFitConfig
from memfit_gpu.index.encoders import PairScorer
from memfit_gpu.index.protocols import DenseSearch, LexicalIndex
from memfit_gpu.index.tokenize import tokenize
from memfit_gpu.names import normalise
from memfit_gpu.retrieve.batched import RetrievalResult
from memfit_gpu.retrieve.boosts import boosted
from memfit_gpu.retrieve.dates import parse_constraints, text_mentions
from memfit_gpu.retrieve.pack import Pack, format_excerpts
from memfit_gpu.retrieve.pool import EPISODE, SUMMARY
from memfit_gpu.retrieve.prf import choose_terms
from memfit_gpu.retrieve.registry import run_stages
from memfit_gpu.retrieve.rerank import reranker_info
from memfit_gpu.retrieve.view import ReadView


def _minmax(values: list[float]) -> list[float]:
    lo, hi = min(values), max(values)
    if hi - lo <= 0:
        return [1.0 if v > 0 else 0.0 for v in values]
    return [(v - lo) / (hi - lo) for v in values]


def hybrid_one(bm25: LexicalIndex, dense: DenseSearch, tokens: list[str], embedding: torch.Tensor, memory: int,
               scan_top_k: int, alpha: float, min_cosine: float) -> list[dict[str, Any]]:
    """Fused candidates of one query, best first (ties: lower row first)."""
    b_scores, b_rows = bm25.search([tokens], [memory], scan_top_k)
    d_scores, d_rows = dense.search(embedding.reshape(1, -1), [memory], scan_top_k, min_score=min_cosine)
    raw: dict[int, list[float]] = {}
    for score, row in zip(b_scores[0].tolist(), b_rows[0].tolist(), strict=False):
        if row >= 0:
            raw.setdefault(row, [0.0, 0.0])[0] = score
    for score, row in zip(d_scores[0].tolist(), d_rows[0].tolist(), strict=False):
        if row >= 0:
            raw.setdefault(row, [0.0, 0.0])[1] = score
    rows = sorted(raw)
    if not rows:
        return []
    bm25_norm = _minmax([raw[r][0] for r in rows])
    dense_norm = _minmax([raw[r][1] for r in rows])
    hits = []
    for row, bn, dn in zip(rows, bm25_norm, dense_norm, strict=False):
        fused = alpha * dn + (1 - alpha) * bn
        hits.append({"row": row, "bm25": raw[row][0], "dense": raw[row][1], "fused": fused, "boost": 0.0,
                     "score": fused})
    hits.sort(key=lambda h: (-h["score"], h["row"]))
    return hits


def _boost_value(cfg: MemFitConfig, speaker_hit: bool, month_hit: bool, year_hit: bool) -> float:
    boosts = cfg.retrieve.boosts
    value = 0.0
    value = value + (boosts.speaker if speaker_hit else 0.0)
    value = value + (boosts.month if month_hit else 0.0)
    value = value + (boosts.year if year_hit else 0.0)
    return value


def _add_boosts(hits: list[dict[str, Any]], cfg: MemFitConfig, wanted: Any, times: np.ndarray,
                names_speaker: Callable[[int, str], bool]) -> None:
    """Boost each hit (speaker, month, year), re-score it and re-rank: score desc, ties by lower row.
    names_speaker(row, name): whether that episode or summary matches the named speaker."""
    min_chars = cfg.retrieve.boosts.min_speaker_chars
    for hit in hits:
        row = hit["row"]
        when = times[row].astype(object)
        speaker_hit = any(len(name) >= min_chars and names_speaker(row, name) for name in wanted.speakers)
        dated = when is not None  # an undated turn or summary (NaT) matches no month or year
        hit["boost"] = _boost_value(cfg, speaker_hit, dated and when.month in wanted.months,
                                    dated and when.year in wanted.years)
        hit["score"] = hit["fused"] + hit["boost"]
    hits.sort(key=lambda h: (-h["score"], h["row"]))


def retrieve_one(view: ReadView, cfg: MemFitConfig, question: str, memory_id: str,
                 embed: Callable[[list[str]], torch.Tensor], question_embedding: torch.Tensor | None = None,
                 reranker: PairScorer | None = None) -> RetrievalResult:
    rcfg = cfg.retrieve
    if cfg.rerank.backend == "none":
        reranker = None
    elif reranker is None:
        raise ValueError("rerank.backend=cross-encoder needs the loaded cross-encoder (rerank.load_reranker)")
    memory = view.memory_ids.index(memory_id)
    if question_embedding is None:
        question_embedding = embed([question])[0]
    speakers = view.speakers[memory]
    min_chars = rcfg.boosts.min_speaker_chars
    wanted = parse_constraints(question, speakers, min_chars)
    tokens = tokenize(question)

    # 1-2: episodes
    episodes = hybrid_one(view.ep_bm25, view.ep_dense, tokens, question_embedding, memory, rcfg.scan_top_k,
                          rcfg.alpha, rcfg.dense_min_cosine)
    by_mention = rcfg.boosts.speaker_match == "mention"

    def episode_names(row: int, name: str) -> bool:
        return normalise(view.ep_speaker[row]) == name or (by_mention and text_mentions(view.ep_text[row], name))

    def summary_names(row: int, name: str) -> bool:
        if by_mention:
            return text_mentions(view.sm_text[row], name)
        return any(normalise(view.ep_speaker[m]) == name for m in view.sm_members[row])

    if boosted(cfg, "ep"):
        _add_boosts(episodes, cfg, wanted, view.ep_time, episode_names)

    # 3: summaries
    summaries: list[dict[str, Any]] = []
    use_summaries = rcfg.summaries and view.has_summaries
    if use_summaries:
        summaries = hybrid_one(view.sm_bm25, view.sm_dense, tokens, question_embedding, memory, rcfg.scan_top_k,
                               rcfg.alpha, rcfg.dense_min_cosine)
        if boosted(cfg, "sm"):  # SPEC read path 3: step 1's hybrid alone (by default)
            _add_boosts(summaries, cfg, wanted, view.sm_time, summary_names)
        summaries = summaries[: rcfg.summary_top_k]

    # 4: pool, round robin, episode first
    pool: list[dict[str, Any]] = []
    i = j = 0
    while len(pool) < rcfg.pool_size and (i < len(episodes) or j < len(summaries)):
        if i < len(episodes):
            pool.append({**episodes[i], "kind": "episode", "source": "pool", "origin": None})
            i += 1
        if len(pool) < rcfg.pool_size and j < len(summaries):
            pool.append({**summaries[j], "kind": "summary", "source": "pool", "origin": None})
            j += 1
    pooled = {c["row"] for c in pool if c["kind"] == "episode"}

    # 5: summary expansion
    expansion: dict[int, dict[str, Any]] = {}
    if rcfg.summary_expansion and use_summaries:
        for summary in summaries[: rcfg.summary_expansion_top]:
            score = rcfg.summary_expansion_weight * summary["score"]
            for member in view.sm_members[summary["row"]]:
                if member in pooled:
                    continue
                if member not in expansion or score > expansion[member]["score"]:
                    expansion[member] = {"row": member, "bm25": 0.0, "dense": 0.0, "fused": 0.0, "boost": 0.0,
                                         "score": score, "kind": "episode", "source": "summary_expansion",
                                         "origin": summary["row"]}
    expanded = sorted(expansion.values(), key=lambda c: (-c["score"], c["row"]))

    # 6: pseudo-relevance feedback
    terms: list[str] = []
    prf: list[dict[str, Any]] = []
    if rcfg.prf.enabled and episodes:
        feedback_rows = [h["row"] for h in episodes[: rcfg.prf.docs]]
        docs = [[t for t in doc if len(t) >= rcfg.prf.min_token_chars]
                for doc in view.ep_bm25.doc_tokens(feedback_rows)]
        candidates = sorted({t for doc in docs for t in doc})
        idf = None
        if rcfg.prf.term_order == "idf":
            idf = dict(zip(candidates, view.ep_bm25.idf([candidates], [memory])[0], strict=True)) if candidates else {}
        terms = choose_terms(docs, idf, rcfg.prf.terms, rcfg.prf.term_order)
        if terms:
            taken = pooled | set(expansion)
            prf_embedding = embed([" ".join(terms)])[0]
            for hit in hybrid_one(view.ep_bm25, view.ep_dense, terms, prf_embedding, memory, rcfg.scan_top_k,
                                  rcfg.alpha, rcfg.dense_min_cosine):
                if hit["row"] not in taken:
                    prf.append({**hit, "score": rcfg.prf.weight * hit["fused"], "kind": "episode",
                                "source": "prf", "origin": None})
            prf.sort(key=lambda c: (-c["score"], c["row"]))

    # 7: rerank pool[:rerank_pool] + every expansion
    candidates_list = pool[: cfg.rerank.rerank_pool] + expanded + prf
    if reranker is not None:
        passages = []
        for c in candidates_list:
            if c["kind"] == "episode":
                passages.append(view.ep_text[c["row"]])
            else:
                passages.append(view.sm_text[c["row"]] + cfg.rerank.summary_suffix.format(date=view.summary_date(c["row"])))
        raw = reranker.score([(question, p) for p in passages], batch_size=cfg.rerank.batch_size).double().tolist()
        for c, value in zip(candidates_list, raw, strict=False):
            c["rerank"] = value
            c["final"] = value
        for kind in ("episode", "summary"):
            group = [c for c in candidates_list if c["kind"] == kind]
            if len(group) < cfg.rerank.zscore_min:
                continue
            mean = sum(c["rerank"] for c in group) / len(group)
            std = (sum((c["rerank"] - mean) ** 2 for c in group) / len(group)) ** 0.5
            for c in group:
                c["final"] = (c["rerank"] - mean) / std if std > 0 else 0.0
    else:
        for c in candidates_list:
            c["rerank"] = None
            c["final"] = c["score"]
    if cfg.retrieve.stages and candidates_list:  # the added stages, on a batch of one (retrieve/registry.py)
        kinds = torch.tensor([[EPISODE if c["kind"] == "episode" else SUMMARY for c in candidates_list]])
        rows = torch.tensor([[c["row"] for c in candidates_list]])
        scores = torch.tensor([[c["final"] for c in candidates_list]], dtype=torch.float64)
        rescored = run_stages(view, cfg, [question], [memory], kinds, rows, torch.ones_like(rows, dtype=torch.bool),
                              scores)
        for c, value in zip(candidates_list, rescored[0].tolist(), strict=True):
            c["final"] = value
    ranked = sorted(candidates_list, key=lambda c: -c["final"])  # stable: ties keep candidate order
    for c in ranked:
        c["turn_id"] = view.ep_turn_id[c["row"]] if c["kind"] == "episode" else None

    # 8: pack
    top = ranked[: cfg.pack.k]
    selected = [c["row"] for c in top if c["kind"] == "episode"]
    packed = set()
    for row in selected:
        same_session = np.flatnonzero((view.ep_session == view.ep_session[row]) & ~view.ep_deleted).tolist()
        session_rows = sorted(same_session, key=lambda r: view.ep_position[r])
        at = session_rows.index(row)
        w = cfg.pack.context_window
        packed.update(session_rows[max(0, at - w): at + w + 1])
    ordered = sorted(packed, key=lambda r: (view.ep_memory[r], view.ep_time[r], view.ep_position[r]))
    pack = Pack(episodes=[int(r) for r in ordered], selected=selected,
                summaries=[c["row"] for c in top if c["kind"] == "summary"])
    text, cut = format_excerpts(pack, view, cfg.rerank.summary_suffix, cfg.pack.resolve_dates,
                                cfg.pack.max_excerpt_chars)
    return RetrievalResult(memory_id, question, ranked, pack, text, terms, reranker_info(cfg.rerank, reranker),
                           excerpt_chars_cut=cut)
