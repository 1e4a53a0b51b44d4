"""run/answer.py's scoring of answers: the metric variants per benchmark."""

from __future__ import annotations

from dataclasses import replace

from memfit_gpu.config import EvalConfig
from memfit_gpu.data.registry import benchmark_spec
from memfit_gpu.methods.base import query
from memfit_gpu.readers.types import Response
from memfit_gpu.run.answer import Answering

# (category, gold, prediction): each right by LoCoMo's rule for its category, partly right by plain F1
CASES = [("5", "Not mentioned", "That is not mentioned in the conversation."),  # the adversarial indicator
         ("3", "Paris; the capital of France", "Paris"),  # the gold cut at ";"
         ("1", "cat, dog", "a dog, the cat, and a fish")]  # comma-split parts, each gold part matched alone


def _f1s(benchmark: str) -> list[float]:
    answering = Answering(EvalConfig(), None, None, None, benchmark=benchmark)  # type: ignore[arg-type]
    questions = [replace(query("u", "?"), answer=gold, category=category) for category, gold, _ in CASES]
    responses = [Response(prediction, 1, 1, 0.0) for _, _, prediction in CASES]
    return [a.scores["locomo"]["f1"] for a in answering.scored(questions, responses, [{}] * len(CASES))]


def test_the_locomo_variants_category_rules_apply_to_locomos_categories_only() -> None:
    """Own data labelled "5", "3" or "1" was scored by LoCoMo's rules for those categories (a right answer
    that does not say "not mentioned" scored 0 under "5")."""
    assert benchmark_spec("locomo").locomo_categories and not any(
        benchmark_spec(name).locomo_categories for name in ("jsonl", "longmemeval", "memgallery", "beam"))
    assert _f1s("locomo") == [1.0, 1.0, 1.0]
    assert all(0.0 < f1 < 1.0 for f1 in _f1s("jsonl"))
