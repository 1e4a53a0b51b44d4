"""BEAM's scoring, the protocol of mohammadtavakoli78/BEAM src/evaluation/ (compute_metrics.py, run_evaluation.py,
report_results.py), on memfit's reader (cached, accounted) and with BEAM's own prompts (readers/prompts.py
BeamPrompts: read from its src/ files at run time).

Per question (compute_metrics.py `evaluate_<ability>`): the judge scores every rubric item of the question with
`unified_llm_judge_base_prompt` (one call each: the item and the reader's whole reply) and answers
{"score": 1.0 | 0.5 | 0.0, "reason"}; the question's rubric score is the mean over its items. Event ordering
(`event_ordering_score`) also splits the reply into lines (`llm_response.split("\\n")`, blank lines included)
and aligns them to the rubric items, which are the reference order (`align_with_llm`): for each line in turn,
the first reference item not yet matched that `llm_equivalence` (its own two messages; a match is a reply
containing "yes", any case) calls the same event or fact replaces the line; then

    tp = |set(reference) & set(aligned)|, fp = aligned lines not in the reference, fn = reference items not aligned
    precision, recall, F1 from those (0 where a denominator is 0)
    ranks over union = reference + unmatched lines (first occurrence order); an item's rank is its position + 1
    in a list (its last occurrence), or len(union) + 1 when the list lacks it
    tau_b = Kendall's tau-b between the two rank vectors; tau_norm = (tau_b + 1) / 2; final_score = tau_norm x F1

(`kendall_tau_b` computes tau-b itself; tests/evaluate/test_evaluate_beam.py holds it to scipy.stats.kendalltau, which
compute_metrics.py calls. Where tau-b is undefined, a constant rank vector, scipy gives NaN and so would the
released code's mean; here tau_norm is 0 and `tau_undefined` says so.) compute_metrics.py also asks
`extract_facts` for the reply's facts and discards the result: that call changes no score and is not made.

Two things memfit does the same way for every judge, where BEAM's code does not: the reply under judgement is
the reader's reply less a reasoning model's thinking and the blank lines around it (readers/clean.py
`reply_text`; compute_metrics.py splits `.content` as it came, so a trailing newline there is one more, empty,
unmatched line), and inside the rubric prompt its lines after the first are indented (memfit_gpu/quoting.py), so
a reply cannot write a line of the judge's prompt. The event-ordering lines are the unquoted reply's.

The switches (config.BeamEvalConfig, eval.beam.*): `question` fill (the prompt's QUESTION slot holds the
question) | released (its `<question>` placeholder is left in, as compute_metrics.py sends it); `partial` keep
(an item graded 0.5 counts 0.5, the prompt's scale) | floor (counts 0: compute_metrics.py's int(score) for every
ability but event ordering); `event_ordering` tau_f1 (final_score) | tau (tau_norm: the column report_results.py
tabulates) | rubric (the rubric mean). `accept_at`: a question's verdict (memfit's, for `memfit compare` and the
judge audit) is score >= it.

The per-ability table (report_results.py): an ability's score is the mean over conversations of each
conversation's mean over its questions of that ability; Average = the mean of the ten abilities' scores.

Every call is a reader Request with role judge and a key under the question's (`judge:<id>:rubric:<i>`,
`judge:<id>:match:<line>:<item>`), so the response cache serves a rerun and the ledger counts each call once.
The rubric calls of every question go out in one batch, with the first match call of each event-ordering
question; each later batch holds the next match call of every alignment still running.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from memfit_gpu import render
from memfit_gpu.config import BeamEvalConfig
from memfit_gpu.data.beam import ABILITIES
from memfit_gpu.evaluate.judge import JudgeParseError, is_empty_prediction, parse_beam_reply
from memfit_gpu.quoting import quote_lines
from memfit_gpu.readers.prompts import BeamPrompts
from memfit_gpu.readers.types import Request, Response

EVENT_ORDERING = "event_ordering"
Generate = Callable[[list[Request]], list[Response]]


def kendall_tau_b(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Kendall's tau-b of two equally long sequences (ties in either counted as tau-b counts them); None when it
    is undefined (fewer than two items, or a sequence whose values are all equal)."""
    if len(x) != len(y):
        raise ValueError(f"kendall_tau_b: sequences of {len(x)} and {len(y)} items")
    a, b = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    upper = np.triu_indices(len(a), k=1)
    dx = np.sign(a[:, None] - a[None, :])[upper]
    dy = np.sign(b[:, None] - b[None, :])[upper]
    pairs = float(len(dx))
    untied_x, untied_y = float(np.count_nonzero(dx)), float(np.count_nonzero(dy))
    if pairs == 0 or untied_x == 0 or untied_y == 0:
        return None
    return float(np.sum(dx * dy) / math.sqrt(untied_x * untied_y))


def event_ordering_score(reference: Sequence[str], aligned: Sequence[str]) -> dict[str, Any]:
    """compute_metrics.py event_ordering_score on an aligned reply (its lines, each replaced by the reference
    item it matched): precision, recall, F1 of the aligned items, tau_b of their order, tau_norm, final_score."""
    reference, aligned = list(reference), list(aligned)
    tp = len(set(reference) & set(aligned))
    fp = len([x for x in aligned if x not in reference])
    fn = len([x for x in reference if x not in aligned])
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    union = list(dict.fromkeys(reference + aligned))
    tie_rank = len(union) + 1

    def ranks(sequence: list[str]) -> list[int]:
        rank = {item: i + 1 for i, item in enumerate(sequence)}  # a repeated item: its last position
        return [rank.get(item, tie_rank) for item in union]

    tau_b = kendall_tau_b(ranks(reference), ranks(aligned))
    tau_norm = (tau_b + 1) / 2 if tau_b is not None else 0.0
    return {"precision": precision, "recall": recall, "f1": f1, "tau_b": tau_b, "tau_norm": tau_norm,
            "tau_undefined": tau_b is None, "final_score": tau_norm * f1}


class Alignment:
    """compute_metrics.py align_with_llm, one question's, asked one pair at a time: `pending()` is the next
    (line, reference item) pair to ask, `answer(same)` records the matcher's reply."""

    def __init__(self, reference: Sequence[str], lines: Sequence[str]) -> None:
        self.reference, self.lines = list(reference), list(lines)
        self.line, self.item = 0, 0
        self.used: set[int] = set()
        self.aligned: list[str] = []
        self.matched: list[int | None] = []  # per line: the reference item it matched

    def pending(self) -> tuple[int, int] | None:
        while self.line < len(self.lines):
            while self.item < len(self.reference) and self.item in self.used:
                self.item += 1
            if self.item < len(self.reference):
                return self.line, self.item
            self.aligned.append(self.lines[self.line])  # no reference item left to match it: kept as written
            self.matched.append(None)
            self.line, self.item = self.line + 1, 0
        return None

    def answer(self, same: bool) -> None:
        if same:
            self.aligned.append(self.reference[self.item])
            self.matched.append(self.item)
            self.used.add(self.item)
            self.line, self.item = self.line + 1, 0
        else:
            self.item += 1


def align(reference: Sequence[str], lines: Sequence[str], same: Callable[[str, str], bool]) -> list[str]:
    """The aligned lines, asking `same(reference item, line)` in align_with_llm's order (for direct use and tests)."""
    alignment = Alignment(reference, lines)
    while (pair := alignment.pending()) is not None:
        alignment.answer(same(alignment.reference[pair[1]], alignment.lines[pair[0]]))
    return alignment.aligned


def is_match(reply: str) -> bool:
    """llm_equivalence's reading of the matcher's reply: "yes" anywhere in it, any case."""
    return "yes" in (reply or "").lower()


def item_score(score: float, ability: str, partial: str) -> float:
    """One rubric item's score as it enters the mean: `floor` is compute_metrics.py's int(score) (every ability
    but event ordering, whose rubric mean uses float(score))."""
    if partial == "floor" and ability != EVENT_ORDERING:
        return float(int(score))
    return float(score)


@dataclass
class BeamItem:
    """One reply to score: the question's id (request keys), text, ability, rubric; the reply as written."""

    key: str  # request keys start with it: judge:<question id> (the run), audit:<probe>:<question id>
    question: str
    ability: str
    rubric: list[str]
    reply: str


@dataclass
class _State:
    item: BeamItem
    rubric: list[dict[str, Any] | None]
    alignment: Alignment | None
    failed: bool = False


class BeamJudge:
    """BEAM's judge over a batch of replies, through `generate` (the run's judge reader, partial=True)."""

    def __init__(self, prompts: BeamPrompts, settings: BeamEvalConfig) -> None:
        self.prompts, self.settings = prompts, settings

    def _rubric_request(self, item: BeamItem, index: int) -> Request:
        question = item.question if self.settings.question == "fill" else None
        text = self.prompts.judge_text(question, item.rubric[index], quote_lines(item.reply))
        return Request([{"role": "user", "content": text}], role="judge", key=f"{item.key}:rubric:{index}")

    def _match_request(self, state: _State, line: int, reference: int) -> Request:
        assert state.alignment is not None
        messages = self.prompts.equivalence_messages(state.alignment.reference[reference],
                                                     state.alignment.lines[line])
        return Request(messages, role="judge", key=f"{state.item.key}:match:{line}:{reference}")

    def score(self, items: Sequence[BeamItem], generate: Generate) -> list[dict[str, Any] | None]:
        """One record per item ({"verdict", "score", "reason", "rubric": [...], "rubric_score", ...}); None where
        a call got no answer (a rerun asks it again, the others from the cache); an empty reply scores 0
        without a call (memfit's rule for every judge)."""
        states: list[_State | None | str] = []
        for item in items:
            if is_empty_prediction(item.reply) or not item.rubric:
                # an empty reply is wrong without a call; a question without rubric items has nothing to judge
                states.append("empty" if is_empty_prediction(item.reply) else "no rubric")
                continue
            alignment = Alignment(item.rubric, item.reply.split("\n")) if item.ability == EVENT_ORDERING else None
            states.append(_State(item, [None] * len(item.rubric), alignment))
        requests: list[Request] = []
        where: list[tuple[_State, int | tuple[int, int]]] = []
        for state in states:
            if not isinstance(state, _State):
                continue
            for index in range(len(state.item.rubric)):
                requests.append(self._rubric_request(state.item, index))
                where.append((state, index))
        while True:
            for state in states:
                if isinstance(state, _State) and state.alignment is not None and not state.failed:
                    pair = state.alignment.pending()
                    if pair is not None:
                        requests.append(self._match_request(state, *pair))
                        where.append((state, pair))
            if not requests:
                break
            for (state, slot), response in zip(where, generate(requests), strict=True):
                if not response.answered:
                    state.failed = True
                elif isinstance(slot, tuple):
                    assert state.alignment is not None
                    state.alignment.answer(is_match(response.text))
                else:
                    state.rubric[slot] = self._rubric_record(state.item, slot, response.text)
            requests, where = [], []
        return [self._record(state, item) for state, item in zip(states, items, strict=True)]

    def _rubric_record(self, item: BeamItem, index: int, reply: str) -> dict[str, Any]:
        try:
            parsed = parse_beam_reply(reply)
        except JudgeParseError as exc:
            return {"item": item.rubric[index], "score": 0.0, "reason": f"unparsed judge reply ({exc})",
                    "unparsed": True}
        return {"item": item.rubric[index], "score": item_score(parsed["score"], item.ability, self.settings.partial),
                "judged": parsed["score"], "reason": parsed["reason"]}

    def _record(self, state: _State | str, item: BeamItem) -> dict[str, Any] | None:
        if state == "empty":
            return {"verdict": False, "score": 0.0, "reason": "empty prediction (judged wrong without a call)",
                    "rubric": [], "rubric_score": 0.0}
        if not isinstance(state, _State):
            return {"verdict": False, "score": 0.0, "reason": "the question has no rubric items (BEAM's judge scores "
                    "only those; a benchmark other than BEAM's files has none)", "rubric": [], "rubric_score": 0.0}
        if state.failed or any(r is None for r in state.rubric):
            return None
        rubric = [r for r in state.rubric if r is not None]
        rubric_score = float(np.mean([r["score"] for r in rubric]))
        unparsed = sum(bool(r.get("unparsed")) for r in rubric)
        record: dict[str, Any] = {"rubric": rubric, "rubric_score": rubric_score}
        score = rubric_score
        if state.alignment is not None:
            ordering = event_ordering_score(state.alignment.reference, state.alignment.aligned)
            ordering["matched"] = state.alignment.matched
            record["event_ordering"] = ordering
            score = {"tau_f1": ordering["final_score"], "tau": ordering["tau_norm"],
                     "rubric": rubric_score}[self.settings.event_ordering]
        met = sum(r["score"] for r in rubric)
        reason = f"rubric {met:g} of {len(rubric)} item{'s' if len(rubric) != 1 else ''}"
        if state.alignment is not None:
            ordering = record["event_ordering"]
            reason += (f"; order: tau_norm {ordering['tau_norm']:.3f}, F1 {ordering['f1']:.3f} of "
                       f"{len(state.alignment.lines)} lines")
        record.update(verdict=score >= self.settings.accept_at, score=float(score), reason=reason,
                      **({"unparsed": True, "unparsed_items": unparsed} if unparsed else {}))
        return record


# ------------------------------------------------------------------------------------------------ the table
def _conversation_mean(rows: Sequence[Mapping[str, Any]], value: Callable[[Mapping[str, Any]], float]) -> float:
    """report_results.py's per-ability score: each conversation's mean, then their mean."""
    by_memory: dict[str, list[float]] = {}
    for row in rows:
        by_memory.setdefault(str(row.get("memory_id")), []).append(value(row))
    return float(np.mean([np.mean(values) for values in by_memory.values()]))


def summary(rows: Sequence[Mapping[str, Any]], variant: str = "paper",
            reference: Mapping[str, bool] | None = None) -> dict[str, Any]:
    """metrics.json's `beam` block from scored prediction rows (those with a judge record): per ability n,
    conversations, score (report_results.py's mean of conversation means), rubric score, F1 / BLEU-1 (the
    `variant`) and ROUGE-L when the rows have it, where the ability's gold is a reference answer
    (`reference`: ability -> bool, default every ability but instruction and preference following); for
    event ordering the alignment's tau_norm, F1 and final_score; Average = the mean over the abilities."""
    judged = [r for r in rows if r.get("evaluated", True) and isinstance(r.get("judge"), Mapping)
              and r["judge"].get("score") is not None]
    abilities = [a for a in ABILITIES if any(r["category"] == a for r in judged)]
    abilities += sorted({str(r["category"]) for r in judged} - set(abilities))
    refs = dict(reference) if reference is not None else {a: a not in ("instruction_following",
                                                                        "preference_following") for a in abilities}
    blocks: dict[str, Any] = {}
    for ability in abilities:
        members = [r for r in judged if r["category"] == ability]
        block: dict[str, Any] = {
            "name": ABILITIES.get(ability, ability), "n": len(members),
            "conversations": len({r.get("memory_id") for r in members}),
            "score": _conversation_mean(members, lambda r: float(r["judge"]["score"])),
            "rubric_score": _conversation_mean(members, lambda r: float(r["judge"].get("rubric_score",
                                                                                     r["judge"]["score"]))),
            "unparsed": sum(bool(r["judge"].get("unparsed")) for r in members),
            "reference_answer": bool(refs.get(ability, True)),
        }
        if block["reference_answer"]:
            if all(variant in (r.get("scores") or {}) for r in members):
                block["f1"] = _conversation_mean(members, lambda r: float(r["scores"][variant]["f1"]))
                block["bleu1"] = _conversation_mean(members, lambda r: float(r["scores"][variant]["bleu1"]))
            if all("rouge_l" in (r.get("text_scores") or {}) for r in members):
                block["rouge_l"] = _conversation_mean(members, lambda r: float(r["text_scores"]["rouge_l"]))
        ordering = [r for r in members if isinstance(r["judge"].get("event_ordering"), Mapping)]
        if ordering and len(ordering) == len(members):
            block["event_ordering"] = {key: _conversation_mean(ordering, lambda r, k=key: float(r["judge"]
                                                                                                ["event_ordering"][k]))
                                       for key in ("tau_norm", "f1", "final_score")}
        blocks[ability] = block
    average = float(np.mean([b["score"] for b in blocks.values()])) if blocks else None
    return {"abilities": blocks, "average": average, "abilities_scored": len(blocks), "questions": len(judged),
            "metric_variant": variant, "averaging": "mean of the abilities' scores; an ability's score is the mean "
                                                    "of its conversations' means (report_results.py)"}


def _cell(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def render_table(block: Mapping[str, Any], settings: Mapping[str, Any] | None = None) -> str:
    """The BEAM paper's layout: one row per ability and Average, scores as fractions (3 decimals), then F1,
    BLEU-1 and ROUGE-L where the ability's gold is a reference answer ('-' where it is not)."""
    rouge = any("rouge_l" in b for b in block["abilities"].values())
    header = ["Ability", "n", "Score", "F1", "BLEU-1", *(["ROUGE-L"] if rouge else [])]
    cells = []
    for b in block["abilities"].values():
        cells.append([b["name"], str(b["n"]), _cell(b["score"]), _cell(b.get("f1")), _cell(b.get("bleu1")),
                      *([_cell(b.get("rouge_l"))] if rouge else [])])
    cells.append(["**Average**", str(block["questions"]), _cell(block["average"]), "", "", *([""] if rouge else [])])
    how = dict(settings or {})
    ordering = {"tau_f1": "(Kendall tau-b + 1) / 2 x F1 of the aligned items",
                "tau": "(Kendall tau-b + 1) / 2 of the aligned items",
                "rubric": "the rubric mean"}.get(str(how.get("event_ordering")), "")
    lines = [f"### BEAM: {block['questions']} questions, {block['abilities_scored']} abilities", "",
             "Score = BEAM's LLM judge: per question the mean over its rubric items (each 1, 0.5 or 0"
             + (", 0.5 counted as 0" if how.get("partial") == "floor" else "") + ")"
             + (f"; Event Ordering = {ordering}" if ordering else "")
             + "; an ability's score is the mean of its conversations' means, Average the mean of the abilities. "
             f"F1 / BLEU-1 (`{block['metric_variant']}`) and ROUGE-L against the gold answer, where it is one "
             "(not for instruction and preference following, whose gold describes compliance).",
             "", render.markdown_table(header, cells, align=["left"] + ["right"] * (len(header) - 1)).rstrip("\n")]
    unparsed = sum(b["unparsed"] for b in block["abilities"].values())
    if unparsed:
        lines += ["", f"Questions with a rubric reply the judge gave no readable score in (that item scored 0): "
                      f"{unparsed}."]
    ordering_block = block["abilities"].get(EVENT_ORDERING, {}).get("event_ordering")
    if ordering_block:
        lines += ["", f"Event ordering: tau_norm {ordering_block['tau_norm']:.3f}, F1 {ordering_block['f1']:.3f}, "
                      f"tau_norm x F1 {ordering_block['final_score']:.3f}."]
    return "\n".join(lines) + "\n"
