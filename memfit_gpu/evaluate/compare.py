"""Paired comparison of two runs (`memfit compare`): per-category and overall permutation tests.

Both runs' predictions.jsonl are read, evaluated questions are paired by question_id, and each
question contributes one value per run: its judge verdict (0/1) or its F1 under a metric variant.
A pair whose stored gold answer or question text differs is refused (check_same_questions): the two
runs asked other questions under one id, and a difference of their scores would compare other things.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import provenance
from memfit_gpu.config import MemFitConfig, load_config
from memfit_gpu.data._read import json_error_text
from memfit_gpu.evaluate.metrics import VARIANTS, rule_category, score
from memfit_gpu.evaluate.stats import bootstrap_category_mean_ci, bootstrap_mean_ci, paired_permutation_test
from memfit_gpu.evaluate.tables import category_name, category_order
from memfit_gpu.files import is_finite_number
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


def row_problem(row: Mapping[str, Any]) -> tuple[str, str] | None:
    """(field, what it holds) when an evaluated predictions row holds what the answer stage never writes:
    `scores` that is not {variant: {metric: a number in [0, 1]}}, or a judge verdict other than true, false or
    null (a verdict of "false" read as a truth value is a correct answer). None when it is sound. The score
    stage, `memfit compare`, `memfit report` and `memfit tables` read rows through this one check."""
    scores = row.get("scores")
    if scores is not None:
        if not isinstance(scores, dict):
            return "scores", f"{scores!r:.60}, not a mapping of each metric variant to its metrics"
        for variant, metrics in scores.items():
            if not isinstance(metrics, dict):
                return f"scores.{variant}", f"{metrics!r:.60}, not a mapping of metric names to numbers"
            for name, value in metrics.items():
                if not (is_finite_number(value) and 0.0 <= value <= 1.0):
                    return f"scores.{variant}.{name}", f"{value!r:.60}, not a number from 0 to 1"
    judge = row.get("judge")
    if judge is not None and not isinstance(judge, dict):
        return "judge", f"{judge!r:.60}, not the judge's record (an object with its verdict)"
    verdict = judge.get("verdict") if judge is not None else None
    if not (verdict is None or isinstance(verdict, bool)):
        return "judge.verdict", f"{verdict!r:.60}, not true, false or null"
    return None


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
                    f"{path}:{number}: not valid JSON ({json_error_text(exc, line=False)})"
                ) from None
            if not isinstance(row, dict):
                raise PredictionsError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            qid = row.get("question_id")
            if not isinstance(qid, str) or not qid:
                raise PredictionsError(f"{path}:{number}: field 'question_id' missing or not a string")
            if "category" not in row:
                raise PredictionsError(f"{path}:{number}: question {qid}: field 'category' missing")
            category = row["category"]
            if isinstance(category, bool) or not isinstance(category, (str, int)) or category == "":
                raise PredictionsError(f"{path}:{number}: question {qid}: field 'category' is {category!r:.60}, "
                                       "not a category label")
            if not row.get("evaluated", True):
                continue
            problem = row_problem(row)
            if problem is not None:
                raise PredictionsError(f"{path}:{number}: question {qid}: field '{problem[0]}' is {problem[1]}")
            if qid in rows:
                warnings.append(f"{path}:{number}: question {qid} appears again; the later line is used")
            row["_line"] = number
            rows[qid] = row
    if not rows:
        raise PredictionsError(f"{path}: no evaluated predictions")
    return path, rows, warnings


# What a question is: two runs that hold other texts under one id asked other questions (another data file, or a
# loader that numbers them otherwise), and their scores measure different things.
SAME_QUESTION_FIELDS = ("gold", "question")


def check_same_questions(path_a: Path, rows_a: Mapping[str, Mapping[str, Any]], path_b: Path,
                         rows_b: Mapping[str, Mapping[str, Any]]) -> None:
    """PredictionsError naming the first shared question id (in A's order) whose stored gold answer or question
    text differs between the two files (a field one row lacks is not compared: an older file's). A row's `_line`
    (read_predictions') is named with its file."""
    def where(path: Path, row: Mapping[str, Any]) -> str:
        return f"{path}:{row['_line']}" if "_line" in row else str(path)

    for qid, row_a in rows_a.items():
        row_b = rows_b.get(qid)
        if row_b is None:
            continue
        for name in SAME_QUESTION_FIELDS:
            if name in row_a and name in row_b and row_a[name] != row_b[name]:
                raise PredictionsError(
                    f"{where(path_a, row_a)} and {where(path_b, row_b)}: question {qid}: field '{name}' differs "
                    f"({row_a[name]!r:.60} against {row_b[name]!r:.60}): the runs asked other questions under one id "
                    "(other data), so their scores measure different things and are not compared")


def _has_judge(row: Mapping[str, Any]) -> bool:
    judge = row.get("judge")
    return isinstance(judge, Mapping) and judge.get("verdict") is not None


def _value(row: Mapping[str, Any], metric: str, variant: str, path: Path, benchmark: str | None) -> float:
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
    return float(score(row["prediction"], row["gold"], rule_category(row["category"], benchmark), variant)["f1"])


def compare_runs(
    run_a: str | Path,
    run_b: str | Path,
    metric: str | None = None,
    variant: str = "paper",
    n_permutations: int | None = None,
    seed: int | None = None,
    method: str = "monte_carlo",
    n_boot: int | None = None,
) -> dict[str, Any]:
    """Permutation tests of B against A, overall, per category and for the mean of category means, and each
    difference's percentile bootstrap interval.

    metric: "judge" | "f1" | None (judge verdicts when every paired question has one in both runs,
    else F1 under `variant`). method: "monte_carlo" | "exact" (see stats.paired_permutation_test).
    n_permutations / seed / n_boot: None = run A's eval.permutation_samples / eval.seed / eval.bootstrap_samples
    (its config.yaml; the config defaults when A is a bare predictions file).
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown metric variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if metric not in (None, "judge", "f1"):
        raise ValueError(f"unknown metric {metric!r}; choose judge or f1")
    path_a, rows_a, warn_a = read_predictions(run_a)
    path_b, rows_b, warn_b = read_predictions(run_b)
    config_a = _config_of(path_a)
    settings = (config_a or MemFitConfig()).eval
    n_permutations = settings.permutation_samples if n_permutations is None else n_permutations
    seed = settings.seed if seed is None else seed
    benchmark = _benchmark_of(config_a, rows_a)
    shared = [qid for qid in rows_a if qid in rows_b]
    only_a = [qid for qid in rows_a if qid not in rows_b]
    only_b = [qid for qid in rows_b if qid not in rows_a]
    if not shared:
        raise PredictionsError(f"{path_a} and {path_b} share no evaluated question_id")
    check_same_questions(path_a, rows_a, path_b, rows_b)

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

    values_a = np.array([_value(rows_a[q], metric, variant, path_a, benchmark) for q in shared])
    values_b = np.array([_value(rows_b[q], metric, variant, path_b, benchmark) for q in shared])
    categories = [str(rows_a[q]["category"]) for q in shared]

    n_boot = settings.bootstrap_samples if n_boot is None else n_boot
    if n_boot < 1:
        raise ValueError(f"bootstrap resamples must be at least 1, got {n_boot}")

    def test(mask: np.ndarray, weights: np.ndarray | None = None) -> dict[str, Any]:
        result = paired_permutation_test(
            values_a[mask],
            values_b[mask],
            n_permutations=n_permutations,
            seed=seed,
            method=method,
            weights=None if weights is None else weights[mask],
        )
        # the paired difference's percentile bootstrap interval (SPEC: comparisons get bootstrap 95 % intervals);
        # the mean of category means resamples within each category, as the tables' intervals do
        diffs = values_b[mask] - values_a[mask]
        lo, hi = (bootstrap_mean_ci(diffs, n_boot=n_boot, seed=seed) if weights is None
                  else bootstrap_category_mean_ci(diffs, labels[mask], n_boot=n_boot, seed=seed))
        return {**result, "ci95": [float(lo), float(hi)]}

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
        "n_boot": n_boot,
        "overall": test(everything),
        "category_mean": test(everything, weights),
        "by_category": by_category,
    }


def _config_of(predictions: Path) -> MemFitConfig | None:
    """The config.yaml beside a predictions file (its run's), or None for a bare predictions file."""
    saved = predictions.parent / "config.yaml"
    return load_config(saved) if saved.is_file() else None


def _benchmark_of(config: MemFitConfig | None, rows: Mapping[str, Mapping[str, Any]]) -> str | None:
    """The benchmark a run read: its config's data.benchmark, else guessed from the rows' categories."""
    return config.data.benchmark if config is not None else _guess_benchmark(rows.values())


def _guess_benchmark(rows: Sequence[Mapping[str, Any]] | Any) -> str | None:
    categories = {str(r.get("category")) for r in rows}
    if categories and categories <= {"1", "2", "3", "4", "5"}:
        return "locomo"
    if categories & {"TTL", "VS", "VR", "KR", "FR", "MR", "TR", "CD", "AR"}:
        return "memgallery"
    return None


def format_comparison(result: Mapping[str, Any]) -> str:
    """Plain-text table: per category and overall mean A, mean B, diff, its 95 % bootstrap interval, p, gained,
    lost."""
    scale = 100.0
    lines = [
        f"A: {result['run_a']}",
        f"B: {result['run_b']}",
        f"metric: {result['metric']} (x100); paired questions: {result['paired']}; "
        + (
            "exact sign-flip permutation test"
            if result["method"] == "exact"
            else f"sign-flip permutation test, {result['n_permutations']} permutations, seed {result['seed']}"
        )
        + f"; percentile bootstrap of the difference, {result['n_boot']} resamples",
        "",
    ]
    rows: list[list[str]] = []

    def row(label: str, r: Mapping[str, Any]) -> None:
        lo, hi = r["ci95"]
        rows.append([label, str(r["n"]), f"{scale * r['mean_a']:.2f}", f"{scale * r['mean_b']:.2f}",
                     f"{scale * r['diff']:+.2f}", f"[{scale * lo:+.2f}, {scale * hi:+.2f}]", f"{r['p_value']:.4f}",
                     str(r["gained"]), str(r["lost"])])

    for cat, r in result["by_category"].items():
        row(r["name"] if r["name"] == cat else f"{r['name']} ({cat})", r)
    row("overall", result["overall"])
    row("average of categories", result["category_mean"])  # its means are the category means' mean
    lines.append(console_table(["category", "n", "mean A", "mean B", "diff", "95 % CI of diff", "p", "gained", "lost"],
                               rows, ["left"] + ["right"] * 8))
    for side, key in (("A", "only_a"), ("B", "only_b")):
        ids = result[key]
        if ids:
            shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
            lines.append(f"only in {side}: {len(ids)} questions ({shown})")
    lines += [f"warning: {w}" for w in result["warnings"]]
    lines += list(result.get("provenance", []))
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------ over seeds
def _seed_values(runs: Sequence[str | Path], variant: str
                 ) -> tuple[list[Path], list[str], dict[str, str], np.ndarray, dict[str, dict[str, Any]]]:
    """(files, shared question ids, {id: category}, values [runs, questions], the first run's rows by id) of one
    side's seed runs."""
    files, tables = [], []
    for run in runs:
        path, rows, _ = read_predictions(run)
        files.append(path)
        tables.append(rows)
    ids = list(tables[0])
    for path, rows in zip(files, tables, strict=True):
        if set(rows) != set(ids):
            missing = sorted(set(ids) - set(rows))[:5]
            extra = sorted(set(rows) - set(ids))[:5]
            raise PredictionsError(f"{path}: answers other questions than {files[0]} (missing {missing}, extra "
                                   f"{extra}): seeds of one system must answer the same questions")
        check_same_questions(files[0], tables[0], path, rows)
    benchmarks = [_benchmark_of(_config_of(path), rows) for path, rows in zip(files, tables, strict=True)]
    values = np.array([[_value(rows[q], "f1", variant, path, benchmark) for q in ids]
                       for path, rows, benchmark in zip(files, tables, benchmarks, strict=True)])
    return files, ids, {q: str(tables[0][q]["category"]) for q in ids}, values, tables[0]


def compare_seeds(runs_a: Sequence[str | Path], runs_b: Sequence[str | Path], variant: str = "paper",
                  n_permutations: int | None = None, n_boot: int = 10_000, seed: int | None = None,
                  level: float = 0.95) -> dict[str, Any]:
    """System B (several seed runs) against system A (several seed runs), per category, overall and for the
    mean of category means, in the layout of the LightMem-SLM paper's Table 8.

    Per side and scope: F1 (variant `variant`) of each seed run, then their mean and sample standard
    deviation (ddof 1; None for one run). The difference is mean B - mean A. Its interval and p-value treat
    questions as the units: each question's F1 averaged over the side's seeds, the paired difference
    bootstrapped over questions (percentile, `n_boot` resamples; the category mean resampled within each
    category) and tested with the paired sign-flip permutation test (`n_permutations`, seeded). n_permutations /
    seed: None = the first A run's eval.permutation_samples / eval.seed, as compare_runs takes them."""
    if not runs_a or not runs_b:
        raise ValueError("compare --seeds needs at least one run on each side")
    if variant not in VARIANTS:
        raise ValueError(f"unknown metric variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    files_a, ids_a, cats, values_a, rows_a = _seed_values(runs_a, variant)
    settings = (_config_of(files_a[0]) or MemFitConfig()).eval
    n_permutations = settings.permutation_samples if n_permutations is None else n_permutations
    seed = settings.seed if seed is None else seed
    files_b, ids_b, _, values_b, rows_b = _seed_values(runs_b, variant)
    if set(ids_a) != set(ids_b):
        raise PredictionsError(f"{files_a[0]} and {files_b[0]} answer different questions "
                               f"({len(set(ids_a) - set(ids_b))} only in A, {len(set(ids_b) - set(ids_a))} only in B)")
    check_same_questions(files_a[0], rows_a, files_b[0], rows_b)
    order_b = [ids_b.index(q) for q in ids_a]
    values_b = values_b[:, order_b]
    labels = np.array([cats[q] for q in ids_a])
    categories = category_order(labels.tolist())

    def spread(per_run: np.ndarray) -> dict[str, Any]:
        return {"mean": float(per_run.mean()), "std": float(per_run.std(ddof=1)) if per_run.size > 1 else None,
                "per_seed": [float(v) for v in per_run]}

    def scope(mask: np.ndarray, weights: np.ndarray | None = None) -> dict[str, Any]:
        a, b = values_a[:, mask], values_b[:, mask]
        if weights is None:
            per_a, per_b = a.mean(axis=1), b.mean(axis=1)
        else:
            w = weights[mask]
            per_a, per_b = a @ w, b @ w
        mean_a, mean_b = a.mean(axis=0), b.mean(axis=0)  # per question, over seeds
        test = paired_permutation_test(mean_a, mean_b, n_permutations=n_permutations, seed=seed,
                                       weights=None if weights is None else weights[mask])
        if weights is None:
            lo, hi = bootstrap_mean_ci(mean_b - mean_a, n_boot=n_boot, seed=seed, level=level)
        else:
            lo, hi = bootstrap_category_mean_ci(mean_b - mean_a, labels[mask], n_boot=n_boot, seed=seed, level=level)
        return {"n": int(mask.sum()), "a": spread(per_a), "b": spread(per_b), "diff": float(per_b.mean() - per_a.mean()),
                "ci95": [float(lo), float(hi)], "p_value": test["p_value"]}

    sizes = {c: int(np.count_nonzero(labels == c)) for c in categories}
    weights = np.array([1.0 / (len(categories) * sizes[c]) for c in labels])
    everything = np.ones(labels.size, dtype=bool)
    benchmark = _guess_benchmark([{"category": c} for c in cats.values()])
    return {"runs_a": [str(f) for f in files_a], "runs_b": [str(f) for f in files_b], "metric": f"{variant} f1",
            "questions": int(labels.size), "level": level, "n_boot": n_boot, "n_permutations": n_permutations,
            "seed": seed,
            "by_category": {c: {"name": category_name(c, benchmark), **scope(labels == c)} for c in categories},
            "overall": scope(everything), "category_mean": scope(everything, weights)}


def format_seed_comparison(result: Mapping[str, Any], label_a: str = "A", label_b: str = "B") -> str:
    """Table 8's layout: per category the two systems' F1 mean +/- std over seeds, then the difference,
    its 95 % interval and p-value on B's line (x100)."""
    def pm(side: Mapping[str, Any]) -> str:
        std = side["std"]
        return f"{100 * side['mean']:.2f} ± {100 * std:.2f}" if std is not None else f"{100 * side['mean']:.2f}"

    lines = [f"A ({len(result['runs_a'])} seeds): {', '.join(result['runs_a'])}",
             f"B ({len(result['runs_b'])} seeds): {', '.join(result['runs_b'])}",
             f"metric: {result['metric']} x100 over {result['questions']} questions; std over seeds (ddof 1); diff = "
             f"B - A; {int(100 * result['level'])} % percentile bootstrap over questions ({result['n_boot']} "
             f"resamples) and paired sign-flip permutation test ({result['n_permutations']}, seed {result['seed']}) "
             "on each question's F1 averaged over its seeds", "",
             f"{'category':<28} {'method':<8} {'F1 (mean ± std)':>18} {'Δ F1':>8} {'95% CI of Δ':>20} {'p':>8}"]
    scopes = [(r["name"] if r["name"] == c else f"{r['name']} ({c})", r) for c, r in result["by_category"].items()]
    scopes += [("overall", result["overall"]), ("average of categories", result["category_mean"])]
    for label, r in scopes:
        lines.append(f"{label:<28} {label_a:<8} {pm(r['a']):>18} {'—':>8} {'—':>20} {'—':>8}")
        ci = f"[{100 * r['ci95'][0]:+.2f}, {100 * r['ci95'][1]:+.2f}]"
        lines.append(f"{'':<28} {label_b:<8} {pm(r['b']):>18} {100 * r['diff']:>+8.2f} {ci:>20} {r['p_value']:>8.4f}")
    return "\n".join(lines) + "\n"
