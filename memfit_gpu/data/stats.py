"""Counts over a loaded Benchmark: what `memfit data stats` prints."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from memfit_gpu.data.schema import Benchmark


def _natural_key(text: str) -> list[Any]:
    # "2" before "10" (LoCoMo categories, MemGallery points sort as text anyway)
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def benchmark_stats(benchmark: Benchmark, first_problems: int = 5) -> dict[str, Any]:
    """memories, sessions, turns, questions (all / evaluated / abstention), questions per category,
    images (in turns, on questions), evidence coverage, and the data quirks handled."""
    questions = benchmark.questions()
    turns = [t for m in benchmark.memories for t in m.turns()]
    by_category = Counter(q.category for q in questions)
    evaluated_by_category = Counter(q.category for q in questions if q.evaluated)
    categories = sorted(by_category, key=_natural_key)
    return {
        "benchmark": benchmark.name,
        "source": benchmark.source,
        "memories": len(benchmark.memories),
        "sessions": sum(len(m.sessions) for m in benchmark.memories),
        "turns": len(turns),
        "questions": len(questions),
        "evaluated_questions": sum(q.evaluated for q in questions),
        # an empty question, gold answer or conversation (data/_read.py check_questions): never scored
        "excluded_questions": sum("excluded" in q.extra for q in questions),
        "abstention_questions": sum(q.abstention for q in questions),
        "by_category": {c: by_category[c] for c in categories},
        "evaluated_by_category": {
            c: evaluated_by_category[c] for c in categories if evaluated_by_category[c]
        },
        "images": sum(len(t.images) for t in turns),
        "turns_with_images": sum(bool(t.images) for t in turns),
        "question_images": sum(q.image is not None for q in questions),
        "questions_without_evidence": sum(not q.evidence for q in questions),
        "problems": {"count": len(benchmark.problems), "first": benchmark.problems[:first_problems]},
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table of benchmark_stats output."""
    lines = [f"{stats['benchmark']}  ({stats['source']})"]
    for key in (
        "memories", "sessions", "turns", "questions", "evaluated_questions", "excluded_questions",
        "abstention_questions",
        "images", "turns_with_images", "question_images", "questions_without_evidence",
    ):  # fmt: skip
        lines.append(f"  {key:<28}{stats[key]:>8}")
    lines.append("  by category                  all  evaluated")
    for category, count in stats["by_category"].items():
        lines.append(f"    {category:<26}{count:>8}{stats['evaluated_by_category'].get(category, 0):>11}")
    problems = stats["problems"]
    lines.append(f"  data quirks handled         {problems['count']:>8}")
    lines.extend(f"    - {p}" for p in problems["first"])
    if problems["count"] > len(problems["first"]):
        lines.append(f"    ... {problems['count'] - len(problems['first'])} more (--problems N shows more)")
    return "\n".join(lines)
