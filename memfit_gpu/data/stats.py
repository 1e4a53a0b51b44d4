"""Counts over a loaded Benchmark: what `memfit data stats` prints."""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from memfit_gpu.data.registry import find_spec
from memfit_gpu.data.schema import Benchmark
from memfit_gpu.render import console_table

# `tokens_approx`: stored characters per token, the usual rule of thumb for English text under BPE
# tokenizers such as cl100k (no tokenizer is loaded: a count that needs no download or model)
CHARS_PER_TOKEN = 4.0


def _natural_key(text: str) -> list[Any]:
    # "2" before "10" (LoCoMo categories, MemGallery points sort as text anyway)
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def quirk_kind(problem: str) -> str:
    """A data quirk's message without what names its place (the question or memory before the first
    ": ", ids, quoted values, counts): the kind that `quirk_counts` counts."""
    text = problem.split(": ", 1)[1] if ": " in problem else problem
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "'...'", text)
    text = re.sub(r"\([^)]*\)", "(...)", text)
    text = re.sub(r"\[[^\]]*\]", "[...]", text)
    return re.sub(r"[\w-]*\d(?:[\w#.,-]|:(?=\w))*", "N", text)


def quirk_counts(problems: list[str]) -> dict[str, int]:
    """How many data quirks a loader handled, by kind (`quirk_kind`), most frequent first."""
    counts = Counter(quirk_kind(p) for p in problems)
    return dict(sorted(counts.items(), key=lambda item: (-item[1], item[0])))


def benchmark_stats(benchmark: Benchmark, first_problems: int = 5) -> dict[str, Any]:
    """memories, sessions, turns, tokens (approx.: stored characters / CHARS_PER_TOKEN), questions (all /
    evaluated / abstention), questions per category, images (in turns, on questions), evidence coverage, the
    data quirks handled, and `units`: what the benchmark calls memories, sessions, turns and categories."""
    questions = benchmark.questions()
    turns = [t for m in benchmark.memories for t in m.turns()]
    by_category = Counter(q.category for q in questions)
    evaluated_by_category = Counter(q.category for q in questions if q.evaluated)
    categories = sorted(by_category, key=_natural_key)
    spec = find_spec(benchmark.name)
    units = dict(spec.units) if spec is not None else {}
    return {
        "benchmark": benchmark.name,
        "source": benchmark.source,
        "memories": len(benchmark.memories),
        "sessions": sum(len(m.sessions) for m in benchmark.memories),
        "turns": len(turns),
        "tokens_approx": round(sum(len(t.text) for t in turns) / CHARS_PER_TOKEN),
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
        "units": {key: units.get(key, key) for key in ("memories", "sessions", "turns", "category")},
    }


def format_stats(stats: dict[str, Any]) -> str:
    """A readable table of benchmark_stats output (the one renderer's console tables)."""
    units = stats.get("units") or {}

    def label(key: str) -> str:  # the benchmark's own word where it has one (BEAM: conversations, messages)
        if key == "tokens_approx":
            return "tokens (approx.)"  # stored characters / CHARS_PER_TOKEN
        return units.get(key, key) if key in ("memories", "sessions", "turns") else key

    counts = [[label(key), f"{stats[key]}"] for key in (
        "memories", "sessions", "turns", "tokens_approx", "questions", "evaluated_questions", "excluded_questions",
        "abstention_questions",
        "images", "turns_with_images", "question_images", "questions_without_evidence",
    )]  # fmt: skip
    categories = [[category, f"{count}", f"{stats['evaluated_by_category'].get(category, 0)}"]
                  for category, count in stats["by_category"].items()]
    problems = stats["problems"]
    lines = [f"{stats['benchmark']}  ({stats['source']})", "",
             console_table(["count", "value"], counts + [["data quirks handled", f"{problems['count']}"]],
                           ["left", "right"]), "",
             console_table([units.get("category", "category"), "all", "evaluated"], categories,
                           ["left", "right", "right"])]
    if problems["first"]:
        lines += ["", "data quirks handled:"]
    lines.extend(f"  - {p}" for p in problems["first"])
    if problems["count"] > len(problems["first"]):
        lines.append(f"  ... {problems['count'] - len(problems['first'])} more (--problems N shows more)")
    return "\n".join(lines)
