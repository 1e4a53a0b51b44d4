"""`memfit aggregate DIR`: one table of a sweep's points, their sweep keys, status and main metrics.

Read from OUT/sweep.json (the points, in sweep order) and each point's metrics.json; pack_hit falls
back to the point's predictions.jsonl when metrics.json has no retrieval block. Rates are printed as
percentages in the Markdown table, like results.md; the CSV keeps fractions.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit_gpu.evaluate.render import csv_text, markdown_table
from memfit_gpu.mappings import get_path
from memfit_gpu.sweep.spec import SweepError
from memfit_gpu.sweep.state import PointState, read_sweep_record

log = logging.getLogger(__name__)

METRIC_COLUMNS = ("f1", "bleu1", "judge", "pack_hit", "questions")
PERCENT_COLUMNS = ("f1", "bleu1", "judge", "pack_hit")
TEXT_COLUMNS = ("point", "status", "metric")  # left-aligned; sweep keys are too (their values may be text)


def pack_hit_rate(predictions: Path) -> float | None:
    """Share of evaluated questions whose pack holds gold evidence (None: no such question, or no file)."""
    hits = []
    if not predictions.exists():
        return None
    with predictions.open() as handle:
        for line in handle:
            if not line.strip():
                continue
            row = json.loads(line)
            if row.get("evaluated", True) and get_path(row, "retrieval", "pack_hit") is not None:
                hits.append(bool(row["retrieval"]["pack_hit"]))
    return sum(hits) / len(hits) if hits else None


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
        point_dir = Path(point.dir)
        if not point_dir.is_absolute() or not point_dir.exists():
            point_dir = sweep_dir / "points" / point.point_id
        row: dict[str, Any] = {"point": point.point_id}
        row.update({k: point.overrides.get(k) for k in keys})
        row["status"] = PointState.DONE.value if (point_dir / "DONE").exists() else point.state.value
        metrics_path = point_dir / "metrics.json"
        metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else None
        if metrics is not None:
            variant = metrics.get("metric_variant", "paper")
            row["metric"] = variant
            row["f1"] = get_path(metrics, "average", variant, "f1")
            row["bleu1"] = get_path(metrics, "average", variant, "bleu1")
            judge = get_path(metrics, "average", "judge")
            row["judge"] = judge if judge is not None else get_path(metrics, "overall", "judge")
            pack_hit = get_path(metrics, "retrieval", "overall", "pack_hit")
            row["pack_hit"] = pack_hit if pack_hit is not None else pack_hit_rate(point_dir / "predictions.jsonl")
            row["questions"] = metrics.get("questions")
        rows.append(row)
    columns = ["point", *keys, "status", "metric", *METRIC_COLUMNS]
    # a judge column with no judge anywhere is noise
    if all(r.get("judge") is None for r in rows):
        columns.remove("judge")
    return columns, rows


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


# ---------------------------------------------------------------------------------------- CLI


def cmd_aggregate(args: argparse.Namespace) -> int:
    sweep_dir = Path(args.dir)
    try:
        columns, rows = aggregate(sweep_dir)
    except SweepError as exc:
        print(f"memfit aggregate: error: {exc}", file=sys.stderr)
        return 2
    markdown = to_markdown(columns, rows)
    md_path = Path(args.md) if args.md else sweep_dir / "aggregate.md"
    csv_path = Path(args.csv) if args.csv else sweep_dir / "aggregate.csv"
    md_path.write_text(markdown)
    csv_path.write_text(to_csv(columns, rows))
    print(markdown, end="")
    log.info("wrote %s and %s", md_path, csv_path)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "aggregate",
        help="one table of a sweep's points: sweep keys and main metrics",
        description="Read every point's metrics.json; print a markdown table; write aggregate.md/.csv.",
    )
    p.add_argument("dir", help="sweep directory (has sweep.json)")
    p.add_argument("--csv", help="CSV path (default DIR/aggregate.csv)")
    p.add_argument("--md", help="markdown path (default DIR/aggregate.md)")
    p.set_defaults(func=cmd_aggregate)
