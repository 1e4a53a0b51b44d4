"""Growth analysis (the LightMem-SLM paper's Table 5, "stability under MTM growth"):
`memfit run ... eval.growth_points=[100,1000,5000,10000]`.

The same trajectory is scored cumulatively at several memory sizes, from one write of the whole
trajectory. A growth point p is an MTM size as LightMem counts it: the end of a memory's p-th MTM window
(`methods.common.mtm_windows`: lightmem.mtm_window_turns turns of one session each), so every method is
scored at the same points of each memory's dialogue (a memory with fewer windows is whole at p). At point p:

- the questions scored are those whose evidence turns all lie within the memory's first turns up to that
  point (a question without evidence, or whose evidence names no turn of the memory, only once its memory
  is whole): "cumulatively", the largest point that covers every memory scores every question;
- the method reads with its memory as it stood then (`Method.read_at`, from what its one write stored:
  LightMem's MTM entries of those windows and its LTM batches of those entries; naive RAG's chunks that lie
  there), and each of those questions gets one answer call (role `growth_answer`, key `growth:<p>:<id>`,
  phase eval: the main run's one-answer-per-question check is untouched), scored as the run scores.

`DIR/growth.jsonl` holds one row per point and question (appended a point at a time, after the ledger is
saved: a rerun skips the points it finds and serves the rest from the response cache); `DIR/growth.json`
the per-point means: questions, turns, the memory the method held (diagnostics.json's `method`), F1 /
BLEU-1 per metric variant and the text metrics. metrics.json carries it as `growth`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import faults
from memfit_gpu.config import ConfigError, MemFitConfig
from memfit_gpu.data.schema import Memory, Question
from memfit_gpu.files import append_jsonl, atomic_write_text
from memfit_gpu.methods.base import MethodRun
from memfit_gpu.methods.common import mtm_windows
from memfit_gpu.methods.registry import make_method, method_entry, methods_with
from memfit_gpu.run.answer import Answering
from memfit_gpu.run.directory import whole_groups

log = logging.getLogger(__name__)

ROLE = "growth_answer"


def check_growth(cfg: MemFitConfig) -> None:
    """eval.growth_points needs a method that can read its memory at a point (its registry entry's `growth`)."""
    if cfg.eval.growth_points and not method_entry(cfg.method).growth:
        raise ConfigError(f"eval.growth_points={cfg.eval.growth_points} needs method {' or '.join(sorted(methods_with('growth')))} "
                          f"(a memory that can be read as it stood at a point); method={cfg.method} cannot")


def growth_turns(memories: Sequence[Memory], points: Sequence[int], window: int) -> dict[int, dict[str, int]]:
    """{point: {memory id: turns up to that point}}: the end of the memory's point-th MTM window, or all of
    its turns when it has fewer windows."""
    out: dict[int, dict[str, int]] = {p: {} for p in points}
    for memory in memories:
        sessions = [i for i, session in enumerate(memory.sessions) for _ in session.turns]
        windows = mtm_windows(sessions, window, final=True)
        for p in points:
            out[p][memory.memory_id] = windows[p - 1][-1] + 1 if p <= len(windows) else len(sessions)
    return out


def due_questions(questions: Sequence[Question], memories: Sequence[Memory], turns: dict[str, int]) -> list[Question]:
    """The questions whose evidence lies within each memory's first `turns[memory]` turns (module doc).

    Evidence that names no turn of the memory (LoCoMo keeps a few such ids, its loader says which) is not
    waited for: a question all of whose evidence is such is due once its memory is whole, as one without
    evidence, so the point that holds every memory whole scores every question."""
    seen: dict[str, set[str]] = {}
    every: dict[str, set[str]] = {}
    for memory in memories:
        ids = [t.turn_id for session in memory.sessions for t in session.turns]
        seen[memory.memory_id] = set(ids[:turns[memory.memory_id]])
        every[memory.memory_id] = set(ids)
    due = []
    for q in questions:
        known = set(q.evidence) & every[q.memory_id]
        if known <= seen[q.memory_id] if known else seen[q.memory_id] == every[q.memory_id]:
            due.append(q)
    return due


def run_growth(out: Path, run: MethodRun, answering: Answering) -> dict[str, Any]:
    """Score every growth point not yet in DIR/growth.jsonl (module doc); returns growth.json's content."""
    cfg = run.cfg
    path = out / "growth.jsonl"
    rows = whole_groups(path, "point", "point")
    done = {int(r["point"]) for r in rows if r.get("t") == "point"}
    points = list(cfg.eval.growth_points)
    turns = growth_turns(run.memories, points, cfg.lightmem.mtm_window_turns)
    todo = [p for p in points if p not in done]
    if todo:
        method = make_method(cfg.method)
        try:
            method.write(run)  # the one write: already stored, so it asks for nothing and encodes only what it must
            for p in todo:
                questions = [q for q in due_questions(run.questions, run.memories, turns[p]) if q.evaluated]
                new = _score_point(run, method, answering, p, turns[p], questions)
                append_jsonl(path, new)
                faults.point("growth")
                rows += new
        finally:
            method.close()
    summary = growth_summary(cfg, rows, turns)
    atomic_write_text(out / "growth.json", json.dumps(summary, indent=2) + "\n")
    faults.point("growth.json")
    return summary


def _score_point(run: MethodRun, method: Any, answering: Answering, point: int, turns: dict[str, int],
                 questions: list[Question]) -> list[dict[str, Any]]:
    """One point: the method's packs at it, one answer call per due question, scored; the rows to append
    (one `point` row with what the memory held, then one per question)."""
    held: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if questions:
        at = dataclasses.replace(run, questions=questions, progress=False)
        packs, diagnostics = method.read_at(at, turns)
        held = diagnostics.get("method", {})
        answered = answering.answer(questions, packs, ROLE, lambda q: f"growth:{point}:{q.question_id}", "growth.ledger")
        for q, pack, a in zip(questions, packs, answered, strict=True):
            rows.append({"t": "question", "point": point, "question_id": q.question_id, "memory_id": q.memory_id,
                         "category": q.category, "gold": q.answer, "prediction": a.prediction, "scores": a.scores,
                         **a.text_fields(), "retrieval": pack.get("retrieval")})
    log.info("growth point %d: %d questions, %d turns", point, len(questions), sum(turns.values()))
    return [{"t": "point", "point": point, "questions": len(questions), "turns": sum(turns.values()),
             "memory": held}, *rows]


def growth_summary(cfg: MemFitConfig, rows: Sequence[dict[str, Any]], turns: dict[int, dict[str, int]]) -> dict[str, Any]:
    """growth.json: per point (in eval.growth_points order) the questions, turns, memory held and mean scores."""
    points = []
    for p in cfg.eval.growth_points:
        head = next((r for r in rows if r.get("t") == "point" and int(r["point"]) == p), None)
        if head is None:
            continue
        scored = [r for r in rows if r.get("t") == "question" and int(r["point"]) == p]
        entry: dict[str, Any] = {"point": p, "questions": len(scored), "turns": head["turns"], "memory": head["memory"]}
        for variant in cfg.eval.metrics:
            entry[variant] = ({m: float(np.mean([r["scores"][variant][m] for r in scored])) for m in ("f1", "bleu1")}
                              if scored else None)
        if cfg.eval.text_metrics and scored:
            entry["text"] = {m: float(np.mean([r["text_scores"][m] for r in scored])) for m in cfg.eval.text_metrics}
        points.append(entry)
    return {"method": cfg.method, "unit": f"MTM entries per memory ({cfg.lightmem.mtm_window_turns} turns of a session each)",
            "memories": len(next(iter(turns.values()), {})), "points": points}
