"""Failure attribution: why a question was lost, from a run's packs.jsonl and predictions.jsonl (the paper's
analysis of pack hit against answer correctness, Table 9, one question at a time).

Each question gets one outcome, the first of these that holds (`attribute`, the one function that decides):

- ``correct``: answered correctly: the judge's verdict where the prediction row has one, else token F1 (the run's
  table variant) >= 0.5 (CORRECT_F1, the threshold `memfit judge-audit` holds the judge against);
- ``no_evidence``: no evidence annotated: the question names no gold turn, or none of its ids is a turn of its
  memory (its pack row's `retrieval` is null: retrieval diagnostics cannot score it either);
- ``reader_missed``: in the pack but the reader missed it: an evidence turn is among the pack's selected turns
  (`retrieval.pack_hit`, chosen on its own merit as the paper counts it, neighbours aside);
- ``cut_from_pack``: retrieved but cut from the pack: an evidence turn is among the first N of the method's
  ranking (DEFAULT_TOP_N = 30, the widest hit@k of the diagnostics) but not selected. A method whose candidates
  are the whole history and that has no ranking (full_context: its pack row's `method_notes.truncation`) cut
  the evidence when it dropped turns to fit the reader;
- ``not_retrieved``: evidence not retrieved: no evidence turn in the first N of the ranking, or, for a method
  without a ranking, none in its pack (the pack is all it retrieved).

The ranking is the method's own (`evidence_of` reads it from the pack row): memfit and plain rank turns and
summaries (`ranked`; a turn's rank counts what the run's hit@k and MRR count: every item before it, summaries
included, with eval.hit_list=final, the turns alone with `episodes`), naive_rag ranks chunks
(`chunks`: a turn's rank is its first chunk's); full_context, lightmem_slm and a method that writes neither
have no ranking ("no ranking"). Evidence ids match a turn as the diagnostics match them: the id itself, or a
turn the loader renamed from it (`<id>#dup<n>`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from memfit_gpu.data.schema import written_turn_id

CORRECT_F1 = 0.5
DEFAULT_TOP_N = 30
# outcome -> what the report calls it, in the order of the rules above
OUTCOMES: dict[str, str] = {
    "correct": "answered correctly",
    "not_retrieved": "evidence not retrieved",
    "cut_from_pack": "retrieved but cut from the pack",
    "reader_missed": "in the pack but the reader missed it",
    "no_evidence": "no evidence annotated",
}
CORRECTNESS_RULE = (f"correct = the judge's verdict where the run judged the question, else token F1 >= "
                    f"{CORRECT_F1:g} under the run's table variant")


@dataclass(frozen=True)
class Evidence:
    """What a pack row says about its question's evidence turns."""

    annotated: bool  # some evidence id names a turn of the memory (the row's `retrieval` record exists)
    pack_hit: bool  # an evidence turn is among the pack's selected turns
    ranking: str | None  # what a rank counts: "turn" (memfit, plain), "chunk" (naive_rag); None: no ranking
    ranks: Mapping[str, int | None]  # evidence id -> its first rank (1 = first), None where the ranking lacks it
    in_pack: Mapping[str, bool]  # evidence id -> a turn of the pack's excerpts (selected or a neighbour)
    whole_history: bool = False  # no ranking, the whole history is the candidate list (full_context)

    @property
    def best_rank(self) -> int | None:
        ranked = [r for r in self.ranks.values() if r is not None]
        return min(ranked) if ranked else None


def matches(turn_id: str, evidence_id: str) -> bool:
    """A turn carries an evidence id: the id itself, or a later turn the loader renamed from it."""
    return turn_id == evidence_id or written_turn_id(turn_id) == evidence_id


def _first(ids: Iterable[Iterable[str]], evidence_id: str) -> int | None:
    for rank, turn_ids in enumerate(ids, start=1):
        if any(matches(t, evidence_id) for t in turn_ids):
            return rank
    return None


def evidence_of(pack: Mapping[str, Any], hit_list: str = "final") -> Evidence:
    """The evidence of one packs.jsonl row, in the method's own terms (module doc); hit_list: the run's
    eval.hit_list (final: a summary holds a rank, as in the run's hit@k; episodes: the turns alone)."""
    evidence = [str(e) for e in pack.get("evidence") or []]
    retrieval = pack.get("retrieval")
    if "ranked" in pack:
        ranking: str | None = "turn"
        order: list[list[str]] = ([[c["turn_id"]] if c.get("kind") == "episode" else [] for c in pack["ranked"]]
                                  if hit_list == "final" else
                                  [[c["turn_id"]] for c in pack["ranked"] if c.get("kind") == "episode"])
    elif "chunks" in pack:
        ranking, order = "chunk", [list(c.get("turn_ids") or []) for c in pack["chunks"]]
    else:
        ranking, order = None, []
    packed = [e["turn_id"] for e in (pack.get("pack") or {}).get("episodes") or []]
    notes = pack.get("method_notes") or {}
    return Evidence(
        annotated=retrieval is not None,
        pack_hit=bool(retrieval and retrieval.get("pack_hit")),
        ranking=ranking,
        ranks={e: _first(order, e) if ranking else None for e in evidence},
        in_pack={e: any(matches(t, e) for t in packed) for e in evidence},
        whole_history=ranking is None and isinstance(notes, Mapping) and "truncation" in notes,
    )


def is_correct(prediction: Mapping[str, Any], variant: str) -> bool:
    """The judge's verdict where the row has one, else F1 (under `variant`) >= CORRECT_F1."""
    judge = prediction.get("judge")
    if isinstance(judge, Mapping) and judge.get("verdict") is not None:
        return bool(judge["verdict"])
    return float(prediction["scores"][variant]["f1"]) >= CORRECT_F1


def attribute(correct: bool, evidence: Evidence, top_n: int = DEFAULT_TOP_N) -> str:
    """One question's outcome (a key of OUTCOMES): the first rule of the module doc that holds."""
    if correct:
        return "correct"
    if not evidence.annotated:
        return "no_evidence"
    if evidence.pack_hit:
        return "reader_missed"
    if evidence.ranking is None:
        return "cut_from_pack" if evidence.whole_history else "not_retrieved"
    best = evidence.best_rank
    return "cut_from_pack" if best is not None and best <= top_n else "not_retrieved"


@dataclass(frozen=True)
class Attributed:
    question_id: str
    category: str
    correct: bool
    outcome: str
    evidence: Evidence


def attribute_run(packs: Mapping[str, Mapping[str, Any]], predictions: Iterable[Mapping[str, Any]], variant: str,
                  top_n: int = DEFAULT_TOP_N, hit_list: str = "final") -> list[Attributed]:
    """Every evaluated prediction's outcome, in the predictions' order. packs: packs.jsonl rows by question id;
    a prediction without its pack row is an error naming the question. hit_list: the run's eval.hit_list."""
    out = []
    for row in predictions:
        if not row.get("evaluated", True):
            continue
        qid = row["question_id"]
        if qid not in packs:
            raise KeyError(f"question {qid} has a prediction but no packs.jsonl row")
        correct = is_correct(row, variant)
        evidence = evidence_of(packs[qid], hit_list)
        out.append(Attributed(qid, str(row["category"]), correct, attribute(correct, evidence, top_n), evidence))
    return out


def outcome_counts(attributed: Sequence[Attributed]) -> dict[str, dict[str, int]]:
    """{category: {outcome: questions}} with every outcome present (0 where none), categories as they come."""
    counts: dict[str, Counter[str]] = {}
    for item in attributed:
        counts.setdefault(item.category, Counter())[item.outcome] += 1
    return {cat: {o: c[o] for o in OUTCOMES} for cat, c in counts.items()}
