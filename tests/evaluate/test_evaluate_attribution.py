"""The failure attribution (memfit_gpu/evaluate/attribution.py) on hand-made pack rows and predictions: one case
per outcome, the correctness rule (judge verdict, else F1 >= 0.5), every method's row shape (memfit / plain
`ranked`, naive_rag `chunks`, full_context's truncation, lightmem_slm without a ranking) and renamed turn ids."""

from __future__ import annotations

from typing import Any

import pytest

from memfit_gpu.evaluate.attribution import (
    OUTCOMES,
    Evidence,
    attribute,
    attribute_run,
    evidence_of,
    is_correct,
    outcome_counts,
)


def memfit_row(qid: str, evidence: list[str], ranked: list[str], selected: list[str],
               neighbours: tuple[str, ...] = ()) -> dict[str, Any]:
    """A memfit pack row: `ranked` turn ids in final order (a summary ranked second, which counts no turn),
    `selected` its top k's turns, `neighbours` the context window's extra turns."""
    items = [{"kind": "episode", "row": i, "turn_id": t} for i, t in enumerate(ranked)]
    items.insert(1, {"kind": "summary", "row": 0, "turn_id": None})
    chosen = set(selected)
    episodes = [{"row": i, "turn_id": t, "selected": t in chosen} for i, t in enumerate([*selected, *neighbours])]
    hit = any(t in evidence for t in selected)
    return {"question_id": qid, "memory_id": "m", "question": "?", "category": "1", "evidence": evidence, "gold": "x",
            "method": "memfit", "ranked": items, "pack": {"episodes": episodes,
                                                          "selected": [{"row": 0, "turn_id": t} for t in selected],
                                                          "summaries": []},
            "excerpts": "", "retrieval": None if not evidence else {"pack_hit": hit}}


def prediction(qid: str, f1: float, verdict: bool | None = None, category: str = "1") -> dict[str, Any]:
    return {"question_id": qid, "category": category, "evaluated": True,
            "scores": {"paper": {"f1": f1, "bleu1": f1}, "locomo": {"f1": 1.0 - f1, "bleu1": 0.0}},
            "judge": None if verdict is None else {"verdict": verdict, "reason": "", "score": float(verdict)}}


RANKED = ["D1:1", "D1:2", "D1:3", "D1:4", "D1:5", "D1:6"]


def test_one_hand_made_question_per_outcome() -> None:
    packs = {
        # D1:2 is selected and the answer is right
        "correct": memfit_row("correct", ["D1:2"], RANKED, ["D1:1", "D1:2"]),
        # no evidence: retrieval null; a wrong answer can only be put down to nothing
        "no_evidence": memfit_row("no_evidence", [], RANKED, ["D1:1", "D1:2"]),
        # D1:2 selected (pack hit), the answer wrong
        "reader_missed": memfit_row("reader_missed", ["D1:2"], RANKED, ["D1:1", "D1:2"]),
        # D1:5 ranked 6th (the summary at position 2 holds a rank, as in hit@k): within --top-n 6, not in the pack
        "cut_from_pack": memfit_row("cut_from_pack", ["D1:5"], RANKED, ["D1:1", "D1:2"]),
        # D1:6 ranked 7th: past --top-n 6; D9:9 not ranked at all
        "not_retrieved": memfit_row("not_retrieved", ["D1:6", "D9:9"], RANKED, ["D1:1", "D1:2"]),
    }
    predictions = [prediction("correct", 1.0), prediction("no_evidence", 0.0), prediction("reader_missed", 0.2),
                   prediction("cut_from_pack", 0.0), prediction("not_retrieved", 0.49)]
    found = attribute_run(packs, predictions, "paper", top_n=6)
    assert [(a.question_id, a.outcome) for a in found] == [(q, q) for q in packs]
    assert found[3].evidence.ranks == {"D1:5": 6} and found[4].evidence.ranks == {"D1:6": 7, "D9:9": None}
    assert found[4].evidence.best_rank == 7
    # one rank deeper and the 7th item counts as retrieved: cut from the pack
    assert attribute(False, found[4].evidence, top_n=7) == "cut_from_pack"
    assert set(OUTCOMES) == {a.outcome for a in found}
    assert outcome_counts(found) == {"1": dict.fromkeys(OUTCOMES, 1)}
    # a run that ranked the turns alone (eval.hit_list=episodes, and every run made before it): the summary holds
    # no rank, D1:5 is 5th
    alone = attribute_run(packs, predictions, "paper", top_n=5, hit_list="episodes")
    assert [a.outcome for a in alone] == [a.outcome for a in found]
    assert alone[3].evidence.ranks == {"D1:5": 5} and alone[4].evidence.best_rank == 6


def test_correct_is_the_judge_verdict_where_there_is_one_else_f1_at_least_a_half() -> None:
    assert is_correct(prediction("q", 0.5), "paper") and not is_correct(prediction("q", 0.4999), "paper")
    assert is_correct(prediction("q", 0.4), "locomo")  # the run's table variant decides (locomo: 1 - f1 here)
    assert not is_correct(prediction("q", 1.0, verdict=False), "paper")  # the judge wins over F1
    assert is_correct(prediction("q", 0.0, verdict=True), "paper")
    unparsed = {**prediction("q", 0.9), "judge": {"verdict": None, "reason": "no verdict"}}
    assert is_correct(unparsed, "paper")  # a record without a verdict is no verdict: F1 decides


def test_every_methods_row_shape() -> None:
    # naive_rag: chunks are the ranking; its pack is every chunk it retrieved, so a miss is not retrieved
    naive = {"evidence": ["S1:4"], "retrieval": {"pack_hit": False},
             "chunks": [{"chunk": 3, "turn_ids": ["S1:1", "S1:2"]}, {"chunk": 0, "turn_ids": ["S1:2", "S1:3"]}],
             "pack": {"episodes": [{"row": r, "turn_id": t} for r, t in enumerate(["S1:1", "S1:2", "S1:3"])]}}
    evidence = evidence_of(naive)
    assert (evidence.ranking, dict(evidence.ranks), evidence.pack_hit) == ("chunk", {"S1:4": None}, False)
    assert attribute(False, evidence) == "not_retrieved"
    evidence = evidence_of({**naive, "evidence": ["S1:3"], "retrieval": {"pack_hit": True}})
    assert dict(evidence.ranks) == {"S1:3": 2} and dict(evidence.in_pack) == {"S1:3": True}
    assert attribute(False, evidence) == "reader_missed"
    # full_context: no ranking, the whole history is its candidates; a turn it dropped was cut from the pack
    full = {"evidence": ["D1:1"], "retrieval": {"pack_hit": False}, "pack": {"episodes": [{"turn_id": "D2:1"}]},
            "method_notes": {"truncation": {"turns": 9, "turns_dropped": 8}}}
    evidence = evidence_of(full)
    assert (evidence.ranking, evidence.whole_history, dict(evidence.ranks)) == (None, True, {"D1:1": None})
    assert attribute(False, evidence) == "cut_from_pack"
    # lightmem_slm: no turn ranking, its pack is what it retrieved
    lightmem = {"evidence": ["D1:1"], "retrieval": {"pack_hit": False}, "lightmem": {"items": []},
                "pack": {"episodes": []}, "method_notes": {"hqs": []}}
    evidence = evidence_of(lightmem)
    assert (evidence.ranking, evidence.whole_history) == (None, False)
    assert attribute(False, evidence) == "not_retrieved"
    # an evidence id matches the turns the loader renamed from it (`<id>#dup<n>`), as the diagnostics match it
    renamed = memfit_row("q", ["D1:2"], ["D1:1", "D1:2#dup2"], ["D1:1"])
    assert dict(evidence_of(renamed).ranks) == {"D1:2": 3}  # after the summary at position 2
    assert dict(evidence_of(renamed, "episodes").ranks) == {"D1:2": 2}


def test_an_unannotated_wrong_answer_and_a_missing_pack_row() -> None:
    evidence = Evidence(annotated=False, pack_hit=False, ranking="turn", ranks={}, in_pack={})
    assert attribute(False, evidence) == "no_evidence" and attribute(True, evidence) == "correct"
    with pytest.raises(KeyError, match="question q9 has a prediction but no packs.jsonl row"):
        attribute_run({}, [prediction("q9", 1.0)], "paper")
    # a question a run does not score (evaluated false) gets no outcome
    assert attribute_run({}, [{**prediction("q9", 1.0), "evaluated": False}], "paper") == []
