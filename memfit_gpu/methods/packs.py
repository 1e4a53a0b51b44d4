"""packs.jsonl and diagnostics.json: the one row shape, the one question filter, the one writer.

Every method (MemFit's own path included) returns its rows through `pack_row`, `memfit run` and `memfit
retrieve` take their questions from `questions_of` and write with `write_packs`, so the two commands give
the same rows for the same configuration. The row schema is documented in README.md ("packs.jsonl").

A row: the question's own fields (question_id, memory_id, question, category, evidence, gold), the method
that made it, then what the method made: `pack` ({"episodes": [{row, turn_id, selected}], "selected":
[{row, turn_id}], "summaries": [...]}: the turns and summaries whose text the excerpts hold), `excerpts`
(the text the answer prompt quotes), `retrieval` (its per-question diagnostics: pack_hit, hit@k, rr, ...;
null without evidence) and the method's own fields (MemFit: ranked, prf_terms, reranker; naive_rag:
chunks; lightmem_slm: lightmem; any: method_notes, copied into the prediction, excerpt_chars_cut).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit_gpu import faults
from memfit_gpu.data.schema import Benchmark, Question
from memfit_gpu.files import atomic_write_text, read_jsonl, write_jsonl_atomic

log = logging.getLogger(__name__)

PACKS = "packs.jsonl"
DIAGNOSTICS = "diagnostics.json"
# What every row holds besides the question's fields; the answer stage reads pack, excerpts and retrieval.
REQUIRED = ("pack", "excerpts", "retrieval")


def questions_of(selected: Benchmark) -> list[Question]:
    """The questions a run or a retrieval makes packs for: every question data.* selected
    (data.select_from_config), memory by memory, in the benchmark's order."""
    return [q for memory in selected.memories for q in memory.questions]


def pack_row(question: Question, method: str, made: dict[str, Any]) -> dict[str, Any]:
    """One packs.jsonl row: the question's fields, the method's name, then what the method `made` (at
    least pack, excerpts and retrieval; the method's own fields after them)."""
    missing = [key for key in REQUIRED if key not in made]
    if missing:
        raise ValueError(f"method {method}: the pack row of {question.question_id} lacks {', '.join(missing)}")
    return {"question_id": question.question_id, "memory_id": question.memory_id, "question": question.question,
            "category": question.category, "evidence": question.evidence, "gold": question.answer,
            "method": method, **made}


def saved_packs(out: Path, questions: Sequence[Question]) -> dict[str, dict[str, Any]] | None:
    """packs.jsonl's rows by question id when it and diagnostics.json hold every question (a resumed
    run), else None."""
    path = out / PACKS
    if path.exists() and (out / DIAGNOSTICS).exists():
        rows = {r["question_id"]: r for r in read_jsonl(path)}
        if all(q.question_id in rows for q in questions):
            return rows
        log.info("%s lacks some questions: making the packs again", path)
    return None


def write_packs(out: Path, rows: Sequence[dict[str, Any]], diagnostics: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """diagnostics.json, then packs.jsonl (what marks the stage done), each written atomically; returns
    the rows by question id."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / DIAGNOSTICS, json.dumps(diagnostics, indent=2) + "\n")
    faults.point("diagnostics")
    write_jsonl_atomic(out / PACKS, rows)
    faults.point("packs")
    return {row["question_id"]: row for row in rows}


def read_diagnostics(out: str | Path) -> dict[str, Any]:
    """The diagnostics.json a run or `memfit retrieve` wrote in `out` (hit@k, pack hit, MRR, ...)."""
    return json.loads((Path(out) / DIAGNOSTICS).read_text(encoding="utf-8"))
