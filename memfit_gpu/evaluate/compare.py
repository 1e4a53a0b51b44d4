"""Paired comparison of two runs (`memfit compare`): per-category and overall permutation tests.

Both runs' predictions.jsonl are read, evaluated questions are paired by question_id, and each
question contributes one value per run: its judge verdict (0/1) or its F1 under a metric variant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import provenance
from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.evaluate.metrics import VARIANTS, score
from memfit_gpu.evaluate.stats import paired_permutation_test
from memfit_gpu.evaluate.tables import category_name, category_order
from memfit_gpu.render import console_table


class PredictionsError(ValueError):
    """A predictions file that cannot be read: the message names the file, the line and the field."""


def predictions_path(run: str | Path) -> Path:
    """A run directory's predictions.jsonl, or the file itself when given one."""
    path = Path(run)
    if path.is_dir():
        path = path / "predictions.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no predictions file at {path}")
    return path


def read_predictions(run: str | Path) -> tuple[Path, dict[str, dict[str, Any]], list[str]]:
    """(file, {question_id: row} of evaluated rows, warnings). A later line for the same question
    replaces an earlier one (a resumed run may append a question twice) and is reported."""
    path = predictions_path(run)
    rows: dict[str, dict[str, Any]] = {}
    warnings: list[str] = []
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise PredictionsError(
                    f"{path}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
                ) from None
            if not isinstance(row, dict):
                raise PredictionsError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            qid = row.get("question_id")
            if not isinstance(qid, str) or not qid:
                raise PredictionsError(f"{path}:{number}: field 'question_id' missing or not a string")
            if "category" not in row:
                raise PredictionsError(f"{path}:{number}: question {qid}: field 'category' missing")
            if not row.get("evaluated", True):
                continue
            if qid in rows:
                warnings.append(f"{path}:{number}: question {qid} appears again; the later line is used")
            row["_line"] = number
            rows[qid] = row
    if not rows:
        raise PredictionsError(f"{path}: no evaluated predictions")
    return path, rows, warnings


def _has_judge(row: Mapping[str, Any]) -> bool:
    judge = row.get("judge")
    return isinstance(judge, Mapping) and judge.get("verdict") is not None


def _value(row: Mapping[str, Any], metric: str, variant: str, path: Path) -> float:
    if metric == "judge":
        return float(bool(row["judge"]["verdict"]))
    stored = (row.get("scores") or {}).get(variant)
    if isinstance(stored, Mapping) and "f1" in stored:
        return float(stored["f1"])
    # Older runs or another variant: score from the stored texts, which is what the scores mean.
    for key in ("prediction", "gold"):
        if key not in row:
            raise PredictionsError(
                f"{path}:{row['_line']}: question {row['question_id']}: no scores.{variant} and no '{key}' to score"
            )
    return float(score(row["prediction"], row["gold"], row["category"], variant)["f1"])


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    metric: str | None = None,
    variant: str = "paper",
    n_permutations: int | None = None,
    seed: int | None = None,
    method: str = "monte_carlo",
) -> dict[str, Any]:
    """Permutation tests of B against A, overall, per category and for the mean of category means.

    metric: "judge" | "f1" | None (judge verdicts when every paired question has one in both runs,
    else F1 under `variant`). method: "monte_carlo" | "exact" (see stats.paired_permutation_test).
    n_permutations / seed: None = run A's eval.permutation_samples / eval.seed (its config.yaml; the
    config defaults when A is a bare predictions file).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown metric variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if metric not in (None, "judge", "f1"):
        raise ValueError(f"unknown metric {metric!r}; choose judge or f1")
    path_a, rows_a, warn_a = read_predictions(run_a)
    path_b, rows_b, warn_b = read_predictions(run_b)
    if n_permutations is None or seed is None:
        saved = path_a.parent / "config.yaml"
        settings = (load_config(saved) if saved.is_file() else MemFitConfig()).eval
        n_permutations = settings.permutation_samples if n_permutations is None else n_permutations
        seed = settings.seed if seed is None else seed
    shared = [qid for qid in rows_a if qid in rows_b]
    only_a = [qid for qid in rows_a if qid not in rows_b]
    only_b = [qid for qid in rows_b if qid not in rows_a]
    if not shared:
        raise PredictionsError(f"{path_a} and {path_b} share no evaluated question_id")

    warnings = warn_a + warn_b
    for qid in shared:
        cat_a, cat_b = str(rows_a[qid]["category"]), str(rows_b[qid]["category"])
        if cat_a != cat_b:
            warnings.append(
                f"question {qid}: category {cat_a} in {path_a} but {cat_b} in {path_b}; using {cat_a}"
            )

    judged = all(_has_judge(rows_a[q]) and _has_judge(rows_b[q]) for q in shared)
    if metric is None:
        metric = "judge" if judged else "f1"
    elif metric == "judge" and not judged:
        for path, rows in ((path_a, rows_a), (path_b, rows_b)):
            missing = [q for q in shared if not _has_judge(rows[q])]
            if missing:
                raise PredictionsError(
                    f"{path}: {len(missing)} paired questions have no judge verdict "
                    f"(first: {missing[0]}, line {rows[missing[0]]['_line']}); use --metric f1"
                )

    values_a = np.array([_value(rows_a[q], metric, variant, path_a) for q in shared])
    values_b = np.array([_value(rows_b[q], metric, variant, path_b) for q in shared])
    categories = [str(rows_a[q]["category"]) for q in shared]
    benchmark = _guess_benchmark(rows_a.values())

    def test(mask: np.ndarray, weights: np.ndarray | None = None) -> dict[str, Any]:
        return paired_permutation_test(
            values_a[mask],
            values_b[mask],
            n_permutations=n_permutations,
            seed=seed,
            method=method,
            weights=None if weights is None else weights[mask],
        )

    by_category = {}
    labels = np.array(categories)
    order = category_order(categories)
    for cat in order:
        by_category[cat] = {"name": category_name(cat, benchmark), **test(labels == cat)}
    everything = np.ones(len(shared), dtype=bool)
    # Category-mean statistic: each question weighs 1 / (categories x its category's size).
    sizes = {cat: int(np.count_nonzero(labels == cat)) for cat in order}
    weights = np.array([1.0 / (len(order) * sizes[c]) for c in categories])
    return {
        "run_a": str(path_a),
        "run_b": str(path_b),
        "metric": metric if metric == "judge" else f"{variant} f1",
        "paired": len(shared),
        "only_a": only_a,
        "only_b": only_b,
        "warnings": warnings,
        # which provenance fields differ (provenance.drift: warnings for data, weights, judge, ...; notes)
        "provenance": provenance.drift({"A": provenance.read(path_a.parent), "B": provenance.read(path_b.parent)}),
        "seed": seed,
        "method": method,
        "n_permutations": n_permutations,
        "overall": test(everything),
        "category_mean": test(everything, weights),
        "by_category": by_category,
    }


def _guess_benchmark(rows: Sequence[Mapping[str, Any]] | Any) -> str | None:
    categories = {str(r.get("category")) for r in rows}
    if categories and categories <= {"1", "2", "3", "4", "5"}:
        return "locomo"
    if categories & {"TTL", "VS", "VR", "KR", "FR", "MR", "TR", "CD", "AR"}:
        return "memgallery"
    return None


def format_comparison(result: Mapping[str, Any]) -> str:
    """Plain-text table: per category and overall mean A, mean B, diff, p, gained, lost."""
    scale = 100.0
    lines = [
        f"A: {result['run_a']}",
        f"B: {result['run_b']}",
        f"metric: {result['metric']} (x100); paired questions: {result['paired']}; "
        + (
            "exact sign-flip permutation test"
            if result["method"] == "exact"
            else f"sign-flip permutation test, {result['n_permutations']} permutations, seed {result['seed']}"
        ),
        "",
    ]
    rows: list[list[str]] = []

    def row(label: str, r: Mapping[str, Any], mean_a: float, mean_b: float) -> None:
        rows.append([label, str(r["n"]), f"{scale * mean_a:.2f}", f"{scale * mean_b:.2f}", f"{scale * r['diff']:+.2f}",
                     f"{r['p_value']:.4f}", str(r["gained"]), str(r["lost"])])

    for cat, r in result["by_category"].items():
        row(r["name"] if r["name"] == cat else f"{r['name']} ({cat})", r, r["mean_a"], r["mean_b"])
    overall = result["overall"]
    row("overall", overall, overall["mean_a"], overall["mean_b"])
    cm = result["category_mean"]
    # The weighted statistic's means: diff is exact; A and B means are the category means' mean.
    cats = list(result["by_category"].values())
    row("average of categories", cm, float(np.mean([c["mean_a"] for c in cats])),
        float(np.mean([c["mean_b"] for c in cats])))
    lines.append(console_table(["category", "n", "mean A", "mean B", "diff", "p", "gained", "lost"], rows,
                               ["left"] + ["right"] * 7))
    for side, key in (("A", "only_a"), ("B", "only_b")):
        ids = result[key]
        if ids:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            lines.append(f"only in {side}: {len(ids)} questions ({shown})")
    lines += [f"warning: {w}" for w in result["warnings"]]
    lines += list(result.get("provenance", []))
    return "\n".join(lines) + "\n"
