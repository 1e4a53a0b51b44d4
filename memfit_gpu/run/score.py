"""The score stage of `memfit run`: DIR/metrics.json and DIR/results.md from the run's predictions.

    score_run(inputs, out, bench, questions, ledger, timings, record, text_settings)

Every question selected must have exactly one prediction and one accounted answer call (the ledger's check);
the table is evaluate/tables.py's (per category, Average, Overall, the judge's), BEAM's per-ability table
before it for BEAM's judge, the pack-depth table after it when eval.pack_cutoffs asked.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from memfit_gpu import faults, provenance
from memfit_gpu.data import Benchmark, Question
from memfit_gpu.evaluate import beam as beam_scoring
from memfit_gpu.evaluate.compare import row_problem
from memfit_gpu.evaluate.tables import render_markdown, summarize
from memfit_gpu.files import atomic_write_text, read_json_object, read_jsonl
from memfit_gpu.methods.packs import DIAGNOSTICS
from memfit_gpu.readers.ledger import Ledger, LedgerCheckError
from memfit_gpu.run.depths import render_depths
from memfit_gpu.run.directory import RunError
from memfit_gpu.run.inputs import RunInputs


def _beam_references(questions: list[Question]) -> dict[str, bool]:
    """Per ability, whether its gold texts are reference answers (BEAM's loader says per question)."""
    references: dict[str, bool] = {}
    for q in questions:
        references[q.category] = references.get(q.category, True) and bool(q.extra.get("reference_answer", True))
    return references


def _check_row(path: Path, row: dict[str, Any], question: Question, variant: str, judged: bool) -> None:
    """RunError naming the question and the field when a predictions row does not say what the answer stage
    wrote for `question` (its category and whether it is scored, as the benchmark says; its scores numbers; a
    verdict true or false): the table would be built from it as it is, with other numbers and no error."""
    problem: tuple[str, str] | None = None
    scores = row.get("scores")
    table = scores.get(variant) if isinstance(scores, dict) else None
    verdict = row.get("judge").get("verdict") if isinstance(row.get("judge"), dict) else None
    if row.get("category") != question.category:
        problem = "category", f"{row.get('category')!r}, where the benchmark says {question.category!r}"
    elif row.get("evaluated", True) != question.evaluated:
        problem = "evaluated", f"{row.get('evaluated')!r}, where the benchmark says {question.evaluated!r}"
    else:  # numbers from 0 to 1 and a verdict true, false or null (what every reader of predictions checks),
        # then the ones this run's table reads
        problem = row_problem(row)
        if problem is None and not (isinstance(table, dict) and all(m in table for m in ("f1", "bleu1"))):
            problem = f"scores.{variant}", f"{table!r}, not its f1 and bleu1 numbers"
        elif problem is None and judged and question.evaluated and verdict is None:
            problem = "judge.verdict", "None, not true or false"
    if problem is not None:
        field, what = problem
        raise RunError(f"{path}: question {question.question_id}, field {field}: {what}; the row was edited or "
                       "damaged: delete the row and run the same command, which answers it again from the cache")


def score_run(inputs: RunInputs, out: Path, bench: Benchmark, questions: list[Question], ledger: Ledger,
           timings: dict[str, float], record: dict[str, Any], text_settings: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = inputs.cfg
    rows = read_jsonl(out / "predictions.jsonl")
    by_id: dict[str, dict[str, Any]] = {}
    for row in rows:
        if row["question_id"] in by_id:
            raise RunError(f"{out / 'predictions.jsonl'}: question {row['question_id']} appears twice")
        by_id[row["question_id"]] = row
    missing = [q.question_id for q in questions if q.question_id not in by_id]
    if missing:
        raise RunError(f"{out / 'predictions.jsonl'}: {len(missing)} questions have no prediction: {missing[:10]}")
    try:
        ledger.check_one_answer_per_question([q.question_id for q in questions])
    except LedgerCheckError as exc:
        raise RunError(f"{out / 'ledger.json'}: {exc}") from None
    ordered = [by_id[q.question_id] for q in questions]
    for q, row in zip(questions, ordered, strict=True):
        _check_row(out / "predictions.jsonl", row, q, cfg.eval.table_metric, inputs.judge is not None)
    metrics = summarize(ordered, variant=cfg.eval.table_metric, judge=inputs.judge is not None, benchmark=bench.name,
                        n_boot=cfg.eval.bootstrap_samples, seed=cfg.eval.seed)
    metrics["name"] = cfg.name
    metrics["benchmark"] = bench.name
    metrics["method"] = cfg.method
    metrics["questions"] = len(questions)
    metrics["metric_variant"] = cfg.eval.table_metric
    metrics["retrieval"] = read_json_object(out / DIAGNOSTICS)  # DataError naming it when damaged
    # what ranked the candidates, as the method recorded it (a method without a reranker: backend none)
    metrics["reranker"] = metrics["retrieval"].get("reranker", {"backend": "none"})
    metrics["timings"] = dict(timings)
    metrics["ledger"] = {"answer_calls": ledger.roles["answer"].calls + ledger.roles["answer"].cached}
    if cfg.eval.text_metrics and text_settings is not None:
        metrics["text_metrics"] = text_settings
    if (out / "growth.json").is_file():
        metrics["growth"] = read_json_object(out / "growth.json")
    if cfg.eval.pack_cutoffs:
        metrics["depths"] = read_json_object(out / "depths.json")
    if inputs.judge_kind == "beam":
        # BEAM's per-ability table (its paper's layout), from the rubric scores; memfit's table follows it
        metrics["beam"] = beam_scoring.summary(ordered, cfg.eval.table_metric, _beam_references(questions))
        metrics["beam"]["scoring"] = asdict(cfg.eval.beam)  # the BEAM scoring switches (config.BeamEvalConfig)
    atomic_write_text(out / "metrics.json", json.dumps(metrics, indent=2))
    faults.point("metrics")
    ledger.save(out / "ledger.json")
    faults.point("score.ledger")
    table = render_markdown(metrics, benchmark=bench.name) + "\n" + provenance.markdown_block(record)
    if "beam" in metrics:
        table = beam_scoring.render_table(metrics["beam"], metrics["beam"]["scoring"]) + "\n" + table
    if "depths" in metrics:
        table += "\n" + render_depths(metrics["depths"])
    atomic_write_text(out / "results.md", table)
    faults.point("results")
    return metrics
