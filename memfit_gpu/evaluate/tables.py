"""Per-category tables: metrics.json (docs/how-to/benchmark-run.md), the paper's Markdown table, and CSV.

Scores are kept as fractions in [0, 1] in metrics.json and printed x100 in tables, as the paper
prints them. "Average" follows an explicit rule recorded in metrics.json["averaging"]:
``category_mean`` (LoCoMo's: the unweighted mean of the category means) or ``question_mean`` (every
question weighs the same). "Overall" is always the question-weighted mean.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from memfit_gpu import render
from memfit_gpu.config import TEXT_METRICS
from memfit_gpu.data.registry import benchmark_spec, find_spec
from memfit_gpu.data.spec import AVERAGING_RULES
from memfit_gpu.evaluate.metrics import VARIANTS
from memfit_gpu.evaluate.stats import bootstrap_category_mean_ci, bootstrap_mean_ci
from memfit_gpu.files import atomic_write_text

# The categories' names, the averaging rule and the title are each benchmark's (data/spec.py BenchmarkSpec).
LOCOMO_CATEGORIES: dict[str, str] = dict(benchmark_spec("locomo").categories)


def category_name(category: str, benchmark: str | None) -> str:
    spec = find_spec(benchmark)
    return spec.category_name(category) if spec is not None else str(category)


def benchmark_title(benchmark: str | None) -> str:
    spec = find_spec(benchmark)
    return spec.title if spec is not None else str(benchmark or "")


def category_order(categories: Iterable[str]) -> list[str]:
    # Numeric categories in numeric order (LoCoMo 1..4 as the paper's columns), then the rest sorted.
    unique = set(categories)
    numeric = sorted((c for c in unique if c.isdigit()), key=int)
    return numeric + sorted(c for c in unique if not c.isdigit())


def _judge_record(row: Mapping[str, Any]) -> Mapping[str, Any] | None:
    judge = row.get("judge")
    if isinstance(judge, Mapping) and judge.get("verdict") is not None:
        return judge
    return None


def _variants_of(rows: Sequence[Mapping[str, Any]]) -> list[str]:
    # A variant counts only when every row has it: a mean over a subset would not be comparable.
    common: set[str] | None = None
    for row in rows:
        names = set((row.get("scores") or {}).keys())
        common = names if common is None else common & names
    return [v for v in VARIANTS if v in (common or set())] + sorted((common or set()) - set(VARIANTS))


def _block(rows: Sequence[Mapping[str, Any]], variants: Sequence[str], judge: bool) -> dict[str, Any]:
    block: dict[str, Any] = {"n": len(rows)}
    for variant in variants:
        block[variant] = {
            metric: float(np.mean([row["scores"][variant][metric] for row in rows]))
            for metric in ("f1", "bleu1")
        }
    if judge:
        judged = [j for j in (_judge_record(r) for r in rows) if j is not None]
        block["judged"] = len(judged)
        # replies that stated no verdict (evaluate/judge.py): counted as not correct, and counted here
        block["judge_unparsed"] = sum(1 for j in judged if j.get("unparsed"))
        block["judge"] = float(np.mean([bool(j["verdict"]) for j in judged])) if judged else None
        block["judge_score"] = (
            float(np.mean([float(j.get("score", float(bool(j["verdict"])))) for j in judged]))
            if judged
            else None
        )
    return block


def summarize(
    rows: Sequence[Mapping[str, Any]],
    variant: str = "paper",
    judge: bool = True,
    benchmark: str | None = None,
    averaging: str | None = None,
    ci: bool = True,
    n_boot: int = 10_000,
    seed: int = 0,
) -> dict[str, Any]:
    """predictions.jsonl rows -> the metrics.json structure (rows with evaluated=false are left out).

    variant: the metric variant the tables report (every variant present in all rows is summarised).
    averaging: "category_mean" | "question_mean"; None = the benchmark's rule (LoCoMo: category_mean).
    ci: percentile bootstrap 95 % intervals (seeded) for overall and average.
    """
    spec = find_spec(benchmark)
    averaging = averaging or (spec.averaging if spec is not None else "question_mean")
    if averaging not in AVERAGING_RULES:
        raise ValueError(f"unknown averaging rule {averaging!r}; choose one of {', '.join(AVERAGING_RULES)}")
    evaluated = [r for r in rows if r.get("evaluated", True)]
    if not evaluated:
        raise ValueError("no evaluated predictions to summarize")
    variants = _variants_of(evaluated)
    if variant not in variants:
        raise ValueError(f"metric variant {variant!r} is not scored in every prediction (scored: {variants})")

    categories = [str(r.get("category")) for r in evaluated]
    order = category_order(categories)
    by_category: dict[str, Any] = {}
    for cat in order:
        members = [r for r, c in zip(evaluated, categories, strict=True) if c == cat]
        by_category[cat] = {"name": category_name(cat, benchmark), **_block(members, variants, judge)}

    overall = _block(evaluated, variants, judge)
    if averaging == "question_mean":
        average = {k: v for k, v in overall.items() if k not in ("judged", "judge_unparsed")}
    else:
        average = {"n": len(evaluated), "categories": len(order)}
        for v in variants:
            average[v] = {m: float(np.mean([by_category[c][v][m] for c in order])) for m in ("f1", "bleu1")}
        if judge:
            # Only when every category was judged: a mean over some categories is another quantity.
            complete = all(by_category[c]["judge"] is not None for c in order)
            average["judge"] = float(np.mean([by_category[c]["judge"] for c in order])) if complete else None
            average["judge_score"] = (
                float(np.mean([by_category[c]["judge_score"] for c in order])) if complete else None
            )

    metrics: dict[str, Any] = {
        "benchmark": benchmark,
        "questions": len(evaluated),
        # answers the reader failed alone (its error in the row's reader_error): scored as empty predictions
        "reader_errors": sum(1 for r in evaluated if r.get("reader_error")),
        "metric_variant": variant,
        "variants": variants,
        "averaging": averaging,
        "overall": overall,
        "by_category": by_category,
        "average": average,
    }
    if ci:
        metrics["ci95"] = _confidence(evaluated, categories, variants, judge, averaging, n_boot, seed)
    _add_text_blocks(metrics, evaluated, categories)
    return metrics


def _add_text_blocks(metrics: dict[str, Any], rows: Sequence[Mapping[str, Any]], categories: Sequence[str]) -> None:
    """The mean of each text metric (predictions' `text_scores`: ROUGE-L, ROUGE-2, METEOR, SBERT) as
    `text` in every category block, overall and average (by the same averaging rule), when every row has it."""
    common: set[str] | None = None
    for row in rows:
        names = set(row.get("text_scores") or {})
        common = names if common is None else common & names
    names = [m for m in TEXT_METRICS if m in (common or set())]
    if not names:
        return

    def means(members: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        return {m: float(np.mean([r["text_scores"][m] for r in members])) for m in names}

    for cat, block in metrics["by_category"].items():
        block["text"] = means([r for r, c in zip(rows, categories, strict=True) if c == cat])
    metrics["overall"]["text"] = means(rows)
    if metrics["averaging"] == "category_mean":
        blocks = list(metrics["by_category"].values())
        metrics["average"]["text"] = {m: float(np.mean([b["text"][m] for b in blocks])) for m in names}
    else:
        metrics["average"]["text"] = dict(metrics["overall"]["text"])
    metrics["text_metric_names"] = names


def _confidence(
    rows: Sequence[Mapping[str, Any]],
    categories: Sequence[str],
    variants: Sequence[str],
    judge: bool,
    averaging: str,
    n_boot: int,
    seed: int,
) -> dict[str, Any]:
    columns = [(v, m) for v in variants for m in ("f1", "bleu1")]
    values = np.array([[row["scores"][v][m] for v, m in columns] for row in rows], dtype=np.float64)

    def pack(lo: np.ndarray, hi: np.ndarray) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for i, (v, m) in enumerate(columns):
            out.setdefault(v, {})[m] = [float(lo[i]), float(hi[i])]
        return out

    def average_ci(matrix: np.ndarray, labels: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        if averaging == "category_mean":
            return bootstrap_category_mean_ci(matrix, labels, n_boot=n_boot, seed=seed)
        return bootstrap_mean_ci(matrix, n_boot=n_boot, seed=seed)

    result: dict[str, Any] = {
        "level": 0.95,
        "method": "percentile bootstrap"
        + ("; average resampled within each category" if averaging == "category_mean" else ""),
        "n_boot": n_boot,
        "seed": seed,
        "overall": pack(*bootstrap_mean_ci(values, n_boot=n_boot, seed=seed)),
        "average": pack(*average_ci(values, categories)),
    }
    if judge:
        judged = [
            (bool(j["verdict"]), c)
            for j, c in ((_judge_record(r), c) for r, c in zip(rows, categories, strict=True))
            if j
        ]
        if judged:
            verdicts = np.array([[float(v)] for v, _ in judged])
            lo, hi = bootstrap_mean_ci(verdicts, n_boot=n_boot, seed=seed)
            result["overall"]["judge"] = [float(lo[0]), float(hi[0])]
            if len(judged) == len(rows):
                lo, hi = average_ci(verdicts, [c for _, c in judged])
                result["average"]["judge"] = [float(lo[0]), float(hi[0])]
    return result


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100.0 * value:.2f}"


def _table_rows(metrics: Mapping[str, Any]) -> list[tuple[str, str, int, float, float, float | None]]:
    """(category, name, n, f1, bleu1, judge) for each category, Average, then Overall."""
    variant = metrics["metric_variant"]
    out = []
    for cat, block in metrics["by_category"].items():
        out.append(
            (
                cat,
                block["name"],
                block["n"],
                block[variant]["f1"],
                block[variant]["bleu1"],
                block.get("judge"),
            )
        )
    avg, overall = metrics["average"], metrics["overall"]
    out.append(("average", "Average", avg["n"], avg[variant]["f1"], avg[variant]["bleu1"], avg.get("judge")))
    if metrics["averaging"] == "category_mean":  # else Average is Overall already
        out.append(
            (
                "overall",
                "Overall",
                overall["n"],
                overall[variant]["f1"],
                overall[variant]["bleu1"],
                overall.get("judge"),
            )
        )
    return out


def render_markdown(metrics: Mapping[str, Any], benchmark: str | None = None) -> str:
    """The paper's table: one row per category (n, F1, BLEU-1, judge) and an Average row."""
    benchmark = benchmark or metrics.get("benchmark")
    title = benchmark_title(benchmark) or "results"
    variant = metrics["metric_variant"]
    if metrics["averaging"] == "category_mean":
        rule = f"Average = unweighted mean of the {len(metrics['by_category'])} category means; Overall = question-weighted"
    else:
        rule = "Average = question-weighted mean over all questions"
    cells = []
    for cat, name, n, f1, b1, jd in _table_rows(metrics):
        label = name if cat in ("average", "overall") else (name if name == cat else f"{name} ({cat})")
        if cat in ("average", "overall"):
            label = f"**{label}**"
        cells.append([label, str(n), _pct(f1), _pct(b1), _pct(jd)])
    lines = [
        f"### {title}: {metrics['questions']} questions",
        "",
        f"Metric variant: `{variant}` (F1 and BLEU-1 x100). {rule}. Judge = accuracy x100 "
        "(- when not judged).",
        "",
        render.markdown_table(["Category", "n", "F1", "BLEU-1", "Judge"], cells,
                              align=["left", "right", "right", "right", "right"]).rstrip("\n"),
    ]
    ci = metrics.get("ci95")
    if ci:
        avg_f1 = ci["average"][variant]["f1"]
        lines += ["", f"95 % bootstrap interval of the Average F1: [{_pct(avg_f1[0])}, {_pct(avg_f1[1])}]"]
        if "judge" in ci["average"]:
            lo, hi = ci["average"]["judge"]
            lines[-1] += f"; of the Average judge: [{_pct(lo)}, {_pct(hi)}]"
        lines[-1] += f" ({ci['n_boot']} resamples, seed {ci['seed']})."
    failed = metrics.get("reader_errors")
    if failed:
        lines += ["", f"{failed} of {metrics['questions']} answers failed at the reader and are scored as empty "
                  "predictions (each row's `reader_error` in predictions.jsonl says why)."]
    unparsed = metrics["overall"].get("judge_unparsed")
    if unparsed:  # not correct in the judge column, and said here so that a reader can tell
        lines += ["", f"{unparsed} of {metrics['overall']['judged']} judge replies stated no verdict the parser "
                  "could read: each is counted as not correct (`unparsed` in its predictions.jsonl row's judge "
                  "record; metrics.json `judge_unparsed`, also per category)."]
    lines += _text_table(metrics)
    return "\n".join(lines) + "\n"


TEXT_LABELS = {"rouge_l": "ROUGE-L", "rouge_2": "ROUGE-2", "meteor": "METEOR", "sbert": "SBERT"}


def _text_table(metrics: Mapping[str, Any]) -> list[str]:
    """The text metrics (x100) per category, Average and Overall, when the run scored them."""
    names = metrics.get("text_metric_names") or []
    if not names:
        return []
    blocks = [(f"{b['name']} ({c})" if b["name"] != c else c, b) for c, b in metrics["by_category"].items()]
    blocks.append(("**Average**", metrics["average"]))
    if metrics["averaging"] == "category_mean":
        blocks.append(("**Overall**", metrics["overall"]))
    cells = [[label, str(block["n"]), *(_pct(block["text"][m]) for m in names)] for label, block in blocks]
    settings = metrics.get("text_metrics") or {}
    how = [f"METEOR: `{settings['meteor_variant']}`"] if "meteor_variant" in settings else []
    if isinstance(settings.get("sbert_model"), Mapping):
        how.append(f"SBERT: cosine of `{settings['sbert_model'].get('name', '?')}` embeddings")
    return ["", "Text similarity (x100; ROUGE F-measure" + "".join(f"; {h}" for h in how) + "):", "",
            render.markdown_table(["Category", "n", *(TEXT_LABELS[m] for m in names)], cells,
                                  align=["left"] + ["right"] * (len(names) + 1)).rstrip("\n")]


def write_csv(metrics: Mapping[str, Any], path: str | Path) -> Path:
    """One row per category plus average (and overall): every variant's F1/BLEU-1, judge, n."""
    variants = metrics["variants"]
    header = ["benchmark", "metric_variant", "averaging", "category", "name", "n"]
    header += [f"{v}_{m}" for v in variants for m in ("f1", "bleu1")] + ["judge", "judge_score", "judged"]
    blocks = list(metrics["by_category"].items()) + [
        ("average", metrics["average"]),
        ("overall", metrics["overall"]),
    ]
    rows = []
    for cat, block in blocks:
        row = [metrics.get("benchmark") or "", metrics["metric_variant"], metrics["averaging"], cat,
               block.get("name", cat), block["n"]]
        row += [f"{block[v][m]:.6f}" for v in variants for m in ("f1", "bleu1")]
        for key in ("judge", "judge_score", "judged"):
            value = block.get(key)
            row.append("" if value is None else (f"{value:.6f}" if isinstance(value, float) else value))
        row += [f"{block['text'][m]:.6f}" for m in metrics.get("text_metric_names") or []]
        rows.append(row)
    header += list(metrics.get("text_metric_names") or [])
    atomic_write_text(path, render.csv_text(header, rows))
    return Path(path)
