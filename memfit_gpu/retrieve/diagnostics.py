"""Retrieval diagnostics from gold evidence turn ids (SPEC Evaluation).

Per question, over the final ranked list (the order the reranker or the first stage left; a summary
holds its rank and is never gold): hit@5/10/20/30 (a gold turn in the first K), rr (1 / rank of the
first gold episode, 0 if none). `hit_list="episodes"` (eval.hit_list) ranks the episodes alone, summaries
removed. Over the pack: pack_hit (a gold turn among the k selected, before neighbours,
as the paper counts it), pack_hit_window (after neighbours), all_gold_pack / all_gold_pack_window
(every matched gold turn there).

Evidence ids are matched to turn ids of the question's own memory; an id the benchmark repeats within a
memory (renamed "#dup<n>" by the loader) matches every turn that carries it. Ids matching no turn are counted
(`unmatched_evidence`, with examples); questions without evidence, and questions none of whose
evidence ids match a turn, cannot be scored: they are counted separately and left out of the rates
(`questions` is the number scored), never silently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from memfit_gpu.config import HIT_LISTS
from memfit_gpu.data.schema import Question, written_turn_id
from memfit_gpu.retrieve.batched import RetrievalResult
from memfit_gpu.retrieve.view import ReadView

HIT_KS = (5, 10, 20, 30)
RATE_KEYS = tuple(f"hit@{k}" for k in HIT_KS) + ("pack_hit", "pack_hit_window", "all_gold_pack",
                                                  "all_gold_pack_window", "mrr")


def question_diagnostics(ranked_rows: Sequence[int], selected: Sequence[int], packed: Sequence[int],
                         gold: Sequence[set[int]]) -> dict[str, Any]:
    """One question's record. gold: the gold turns, each as the set of rows that carry its id (one row,
    or several when a benchmark repeats a turn id); must be non-empty."""
    groups = [set(g) for g in gold]
    any_gold = set().union(*groups)
    rank = next((i for i, r in enumerate(ranked_rows, start=1) if r in any_gold), None)
    record: dict[str, Any] = {f"hit@{k}": rank is not None and rank <= k for k in HIT_KS}
    record["rr"] = 1.0 / rank if rank is not None else 0.0
    chosen, window = set(selected), set(packed)
    record["pack_hit"] = bool(any_gold & chosen)
    record["pack_hit_window"] = bool(any_gold & window)
    record["all_gold_pack"] = all(group & chosen for group in groups)
    record["all_gold_pack_window"] = all(group & window for group in groups)
    return record


def _rates(records: list[dict[str, Any]]) -> dict[str, Any]:
    n = len(records)
    out: dict[str, Any] = {"questions": n}
    for key in RATE_KEYS:
        field = "rr" if key == "mrr" else key
        out[key] = sum(float(r[field]) for r in records) / n if n else None
    return out


def compute_diagnostics(results: Sequence[RetrievalResult], questions: Sequence[Question], view: ReadView,
                        reranker: dict[str, Any] | None = None,
                        hit_list: str = "final") -> tuple[dict[str, Any], list[dict[str, Any] | None]]:
    """(diagnostics.json content, per-question records aligned with `questions`; None = not scorable).

    results: RetrievalResult per question (ranked dicts with kind/row, pack); questions: schema
    Questions (memory_id, category, evidence); hit_list: final (summaries hold ranks) | episodes."""
    if len(results) != len(questions):
        raise ValueError(f"diagnostics: {len(results)} results for {len(questions)} questions")
    if hit_list not in HIT_LISTS:
        raise ValueError(f"diagnostics: hit_list must be one of {', '.join(HIT_LISTS)}, not {hit_list!r}")
    # A turn id the benchmark repeats names several rows (the loader renamed the later ones "#dup<n>"): a
    # gold id matches all of them, since nothing says which one the annotators meant.
    # An id that only looks renamed (a benchmark's own "x#dup2") still matches itself.
    # Built only when some question has evidence: a live query (methods/base.py `query`) has none, and
    # the map is a pass over every row of the view.
    rows_of: dict[tuple[int, str], list[int]] = {}
    if any(q.evidence for q in questions):
        for row, (memory, turn_id) in enumerate(zip(view.ep_memory.tolist(), view.ep_turn_id, strict=True)):
            if not view.ep_deleted[row]:
                for name in dict.fromkeys((turn_id, written_turn_id(turn_id))):
                    rows_of.setdefault((memory, name), []).append(row)
    records: list[dict[str, Any] | None] = []
    scored: list[tuple[str, dict[str, Any]]] = []
    unmatched: list[str] = []
    no_evidence: list[str] = []
    unmatched_only: list[str] = []
    for result, question in zip(results, questions, strict=True):
        memory = view.memory_index(question.memory_id)
        gold: list[set[int]] = []
        for turn_id in question.evidence:
            rows = rows_of.get((memory, turn_id))
            if rows is None:
                unmatched.append(f"{question.question_id}:{turn_id}")
            elif set(rows) not in gold:
                gold.append(set(rows))
        if not question.evidence:
            no_evidence.append(question.question_id)
            records.append(None)
            continue
        if not gold:
            unmatched_only.append(question.question_id)
            records.append(None)
            continue
        # a summary's rank holds no gold turn: -1 is no episode row
        ranked_rows = ([c["row"] if c["kind"] == "episode" else -1 for c in result.ranked] if hit_list == "final"
                       else [c["row"] for c in result.ranked if c["kind"] == "episode"])
        record = question_diagnostics(ranked_rows, result.pack.selected, result.pack.episodes, gold)
        records.append(record)
        scored.append((str(question.category), record))
    by_category = {}
    for category in sorted({c for c, _ in scored}, key=lambda c: (len(c), c)):
        by_category[category] = _rates([r for c, r in scored if c == category])
    diagnostics = {
        "overall": _rates([r for _, r in scored]),
        "by_category": by_category,
        "questions": len(scored),
        "questions_total": len(questions),
        "questions_without_evidence": len(no_evidence),
        "questions_without_evidence_ids": no_evidence[:50],
        "questions_with_only_unmatched_evidence": len(unmatched_only),
        "questions_with_only_unmatched_evidence_ids": unmatched_only[:50],
        "unmatched_evidence": len(unmatched),
        "unmatched_evidence_examples": unmatched[:50],
        "reranker": reranker,
        "hit_list": hit_list,
    }
    return diagnostics, records
