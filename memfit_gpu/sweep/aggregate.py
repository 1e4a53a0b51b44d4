"""One table of a sweep's points, their sweep keys, status and main metrics.

Read from OUT/sweep.json (the points, in sweep order) and each point's metrics.json; pack_hit falls
back to the point's predictions.jsonl when metrics.json has no retrieval block. Rates are printed as
percentages in the Markdown table, like results.md; the CSV keeps fractions.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import datasets
import numpy as np

from memfit_gpu import provenance
from memfit_gpu.data.schema import DataError
from memfit_gpu.files import is_finite_number, read_json_object, read_jsonl
from memfit_gpu.mappings import flatten, get_path
from memfit_gpu.render import csv_text, markdown_table
from memfit_gpu.sweep.spec import SweepError
from memfit_gpu.sweep.state import PointState, point_dir, read_sweep_record

# beam: BEAM's Average (the mean of its abilities' rubric-judge scores, metrics.json `beam`), on BEAM's points
METRIC_COLUMNS = ("f1", "bleu1", "judge", "beam", "pack_hit", "questions")
PERCENT_COLUMNS = ("f1", "bleu1", "judge", "beam", "pack_hit")
TEXT_COLUMNS = ("point", "status", "metric")  # left-aligned; sweep keys are too (their values may be text)


def pack_hit_rate(predictions: Path) -> float | None:
    """Share of evaluated questions whose pack holds gold evidence (None: no such question, or no file)."""
    hits = [bool(row["retrieval"]["pack_hit"]) for row in read_jsonl(predictions, repair=False)
            if row.get("evaluated", True) and get_path(row, "retrieval", "pack_hit") is not None]
    return sum(hits) / len(hits) if hits else None


def _number(metrics: dict[str, Any], where: Path, *keys: str) -> float | None:
    """The number metrics.json holds at `keys` (None where it has none); a DataError naming the file and the
    field when it holds something else (a text "n/a" was printed as a rate, "0.5" as 0.5 in a percent column)."""
    value = get_path(metrics, *keys)
    if value is None:
        return None
    if not is_finite_number(value):
        raise DataError(str(where), None, ".".join(keys), f"{value!r:.60} is not a finite number")
    return float(value)


def aggregate(sweep_dir: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """One row per point: its sweep keys, status, and the main metrics of its metrics.json.

    Returns:
        (columns, rows): the column names (no judge column when no point was judged) and one dict
        per point, keyed by column; a missing value is None.
    """
    sweep_dir = Path(sweep_dir)
    record = read_sweep_record(sweep_dir / "sweep.json")
    keys = list(record.sweep_keys)
    rows: list[dict[str, Any]] = []
    for point in record.points:
        point_dir = _point_dir(sweep_dir, point)
        row: dict[str, Any] = {"point": point.point_id}
        row.update({k: point.overrides.get(k) for k in keys})
        row["status"] = PointState.DONE.value if (point_dir / "DONE").exists() else point.state.value
        if point.state is PointState.PENDING and (point_dir / "config.yaml").exists() and row["status"] != "done":
            # a driver-less task (`sbatch slurm/memfit-array.sbatch`) records no state: "pending" would say it
            # never started, where it started and has not finished (or failed: its task's log says)
            row["status"] = "started"
        metrics_path = point_dir / "metrics.json"
        # what the row reads (a metrics.json of an older memfit without them: refused naming the field)
        metrics = (read_json_object(metrics_path, {"metric_variant": str, "average": dict})
                   if metrics_path.exists() else None)
        if metrics is not None:
            variant = metrics["metric_variant"]
            row["metric"] = variant
            row["f1"] = _number(metrics, metrics_path, "average", variant, "f1")
            row["bleu1"] = _number(metrics, metrics_path, "average", variant, "bleu1")
            judge = _number(metrics, metrics_path, "average", "judge")
            row["judge"] = judge if judge is not None else _number(metrics, metrics_path, "overall", "judge")
            row["beam"] = _number(metrics, metrics_path, "beam", "average")
            pack_hit = _number(metrics, metrics_path, "retrieval", "overall", "pack_hit")
            row["pack_hit"] = pack_hit if pack_hit is not None else pack_hit_rate(point_dir / "predictions.jsonl")
            questions = _number(metrics, metrics_path, "questions")
            row["questions"] = None if questions is None else int(questions)
        rows.append(row)
    columns = ["point", *keys, "status", "metric", *METRIC_COLUMNS]
    # a judge (or BEAM) column with no judge (or BEAM point) anywhere is noise
    for column in ("judge", "beam"):
        if all(r.get(column) is None for r in rows):
            columns.remove(column)
    return columns, rows


def _point_dir(sweep_dir: Path, point: Any) -> Path:
    """A point's run directory: OUT/points/<id> (state.point_dir). sweep.json's absolute `dir` was read first:
    a sweep folder archived under another name, with a new sweep at the old one, reported the new sweep's
    numbers under the archived one's name."""
    return point_dir(sweep_dir, point.point_id)


def provenance_drift(sweep_dir: str | Path) -> list[str]:
    """provenance.drift over the points that have started (a provenance.json or a DONE), the first one the
    reference: which provenance fields differ between the runs the table combines; a model or judge the
    sweep's keys vary is marked as expected."""
    sweep_dir = Path(sweep_dir)
    record = read_sweep_record(sweep_dir / "sweep.json")
    records = {}
    for point in record.points:
        point_dir = _point_dir(sweep_dir, point)
        if (point_dir / provenance.FILE).exists() or (point_dir / "DONE").exists():
            records[point.point_id] = provenance.read(point_dir)
    return provenance.drift(records, varied=record.sweep_keys)


def _arrow_safe(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every row with every column (None where absent); a column whose values mix types (LoCoMo golds
    are strings and numbers) becomes text, since an Arrow column has one type."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    for column in columns:
        kinds = {type(row[column]) for row in rows if row.get(column) is not None}
        as_text = (len(kinds) > 1 and kinds != {int, float}) or bool(kinds & {list, dict})
        for row in rows:
            value = row.get(column)
            if as_text and value is not None:
                value = json.dumps(value) if isinstance(value, (list, dict)) else str(value)
            row[column] = value
    return rows


def predictions_dataset(sweep_dir: str | Path) -> datasets.Dataset:
    """Every point's predictions as one `datasets.Dataset` (Arrow): one row per point and question, with
    the point id and its sweep keys as columns and nested fields flattened (`scores.paper.f1`,
    `retrieval.pack_hit`, `judge.verdict`). `.to_pandas()`, `.to_parquet(path)`, `.filter(...)` from there;
    `memfit aggregate DIR --parquet FILE` writes it.

    Only finished points (DONE) are read: `unfinished_points` lists the others.

    Raises:
        SweepError: no point has finished yet.
    """
    sweep_dir = Path(sweep_dir)
    record = read_sweep_record(sweep_dir / "sweep.json")
    rows: list[dict[str, Any]] = []
    for point in record.points:
        path = _point_dir(sweep_dir, point) / "predictions.jsonl"
        # a point not finished holds some of its predictions (a failed or running one): a table of the sweep
        # is of finished points, as `--by` is (unfinished_points names the others)
        if not (_point_dir(sweep_dir, point) / "DONE").exists():
            continue
        sweep_values = {f"sweep.{k}": point.overrides.get(k) for k in record.sweep_keys}
        for prediction in read_jsonl(path, repair=False, finished=True):
            rows.append({"point": point.point_id, **sweep_values, **flatten(prediction)})
    if not rows:
        raise SweepError(f"{sweep_dir}: no point has finished yet (DONE): no predictions to write")
    return datasets.Dataset.from_list(_arrow_safe(rows))


def unfinished_points(sweep_dir: str | Path) -> list[str]:
    """The ids of the sweep's points without DONE, in sweep order: left out of `--by`'s means and `--parquet`."""
    sweep_dir = Path(sweep_dir)
    record = read_sweep_record(sweep_dir / "sweep.json")
    return [p.point_id for p in record.points if not (_point_dir(sweep_dir, p) / "DONE").exists()]


def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    return str(value)


def to_markdown(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """The aggregate as a Markdown table: rates x100 with two decimals (`f1 %`), other cells as text."""
    header = [f"{c} %" if c in PERCENT_COLUMNS else c for c in columns]
    cells = []
    for row in rows:
        cells.append([f"{100.0 * row[c]:.2f}" if c in PERCENT_COLUMNS and isinstance(row.get(c), (int, float))
                      else _text(row.get(c)) for c in columns])
    numeric = (*PERCENT_COLUMNS, "questions")
    return markdown_table(header, cells, align=["right" if c in numeric else "left" for c in columns])


def to_csv(columns: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """The aggregate as CSV: fractions as stored, lists and mappings as JSON, None as an empty cell."""
    return csv_text(columns, [[json.dumps(row[c]) if isinstance(row.get(c), (list, dict)) else row.get(c)
                               for c in columns] for row in rows])


# ------------------------------------------------------------------------------ --by seed
def _by_key(keys: Sequence[str], by: str, where: Path) -> str:
    """The sweep key `by` names: itself, or the one key whose last dotted part it is (`seed` -> reader.seed)."""
    if by in keys:
        return by
    tails = [k for k in keys if k.rsplit(".", 1)[-1] == by]
    if len(tails) != 1:
        raise SweepError(f"{where}: --by {by} names {'no' if not tails else 'more than one'} sweep key "
                         f"(sweep keys: {', '.join(keys) or 'none'})")
    return tails[0]


def point_values(metrics: dict[str, Any], where: Path) -> dict[str, float]:
    """The numbers `aggregate --by` summarises of one point (its metrics.json at `where`): average F1 / BLEU-1
    (its metric variant), judge, pack hit, the text metrics' averages and each category's F1."""
    variant = metrics.get("metric_variant", "paper")
    values = {"f1": _number(metrics, where, "average", variant, "f1"),
              "bleu1": _number(metrics, where, "average", variant, "bleu1"),
              "judge": _number(metrics, where, "average", "judge"),
              "pack_hit": _number(metrics, where, "retrieval", "overall", "pack_hit")}
    values.update((name, _number(metrics, where, "average", "text", name))
                  for name in (get_path(metrics, "average", "text") or {}))
    values.update((f"f1 {cat}", _number(metrics, where, "by_category", cat, variant, "f1"))
                  for cat in (get_path(metrics, "by_category") or {}))
    return {k: v for k, v in values.items() if v is not None}


def aggregate_by(sweep_dir: str | Path, by: str) -> tuple[list[str], list[str], list[dict[str, Any]]]:
    """Finished points grouped by every sweep key but `by` (e.g. seeds: `--by seed`), each metric's mean and
    sample standard deviation (ddof 1) over a group's points.

    Returns (group columns, metric names, rows): a row holds the group's key values, `by` (the values its
    finished points cover), `points` (how many finished) and `of` (how many the sweep has: a group none of
    whose points finished is a row too), and per metric `(mean, std)` (std None for a single point; None
    when one of the group's points lacks the metric, e.g. a judge off there, rather than a mean over the
    others)."""
    sweep_dir = Path(sweep_dir)
    record = read_sweep_record(sweep_dir / "sweep.json")
    key = _by_key(list(record.sweep_keys), by, sweep_dir / "sweep.json")
    others = [k for k in record.sweep_keys if k != key]
    groups: dict[str, dict[str, Any]] = {}
    for point in record.points:
        point_dir = _point_dir(sweep_dir, point)
        group = json.dumps([point.overrides.get(k) for k in others], default=str)
        entry = groups.setdefault(group, {"keys": {k: point.overrides.get(k) for k in others}, "by": [], "values": [],
                                          "of": 0})
        entry["of"] += 1
        if not (point_dir / "DONE").exists():
            continue
        metrics = read_json_object(point_dir / "metrics.json")
        entry["by"].append(point.overrides.get(key))
        entry["values"].append(point_values(metrics, point_dir / "metrics.json"))
    if not any(g["values"] for g in groups.values()):
        raise SweepError(f"{sweep_dir}: no finished point to aggregate")
    names = list(dict.fromkeys(n for g in groups.values() for v in g["values"] for n in v))
    rows = []
    for entry in groups.values():
        row: dict[str, Any] = {**entry["keys"], key: entry["by"], "points": len(entry["values"]), "of": entry["of"]}
        for name in names:
            # only over every point of the group: a mean of some of them is another quantity than `points` says
            seen = [v[name] for v in entry["values"] if name in v]
            row[name] = ((float(np.mean(seen)), float(np.std(seen, ddof=1)) if len(seen) > 1 else None)
                         if seen and len(seen) == len(entry["values"]) else None)
        rows.append(row)
    return [*others, key, "points", "of"], names, rows


def by_to_markdown(columns: Sequence[str], names: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """`aggregate --by` as Markdown: every metric x100 as `mean ± std`."""
    def cell(value: Any) -> str:
        if value is None:
            return ""
        mean, std = value
        return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")

    header = [*columns, *(f"{n} %" for n in names)]
    cells = [[_text(row.get(c)) for c in columns] + [cell(row.get(n)) for n in names] for row in rows]
    return markdown_table(header, cells, align=["left"] * len(columns) + ["right"] * len(names))


def by_to_csv(columns: Sequence[str], names: Sequence[str], rows: Sequence[dict[str, Any]]) -> str:
    """`aggregate --by` as CSV: fractions, `<metric>_mean` and `<metric>_std` per metric."""
    header = [*columns, *(f"{n}_{s}" for n in names for s in ("mean", "std"))]
    out = []
    for row in rows:
        line = [json.dumps(row[c]) if isinstance(row.get(c), (list, dict)) else row.get(c) for c in columns]
        for n in names:
            line += list(row[n]) if row.get(n) is not None else [None, None]
        out.append(line)
    return csv_text(header, out)
