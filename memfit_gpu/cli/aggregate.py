"""`memfit aggregate DIR`: one table of a sweep's points (memfit_gpu/sweep/aggregate.py), as Markdown and CSV."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def user_errors() -> tuple[type[Exception], ...]:
    from memfit_gpu.provenance import ProvenanceError
    from memfit_gpu.sweep.spec import SweepError

    return (SweepError, ProvenanceError)


def cmd_aggregate(args: argparse.Namespace) -> int:
    from memfit_gpu.files import write_output
    from memfit_gpu.sweep.aggregate import (
        aggregate,
        aggregate_by,
        by_to_csv,
        by_to_markdown,
        predictions_dataset,
        provenance_drift,
        to_csv,
        to_markdown,
        unfinished_points,
    )

    sweep_dir = Path(args.dir)
    if args.by:
        columns, names, grouped = aggregate_by(sweep_dir, args.by)
        markdown, csv = by_to_markdown(columns, names, grouped), by_to_csv(columns, names, grouped)
        stem = f"aggregate_by_{args.by}"
    else:
        columns, rows = aggregate(sweep_dir)
        markdown, csv, stem = to_markdown(columns, rows), to_csv(columns, rows), "aggregate"
    drift = provenance_drift(sweep_dir)
    markdown += ("\n" + "\n".join(drift) + "\n") if drift else ""
    md_path = Path(args.md) if args.md else sweep_dir / f"{stem}.md"
    csv_path = Path(args.csv) if args.csv else sweep_dir / f"{stem}.csv"
    write_output(md_path, markdown)
    write_output(csv_path, csv)
    print(markdown, end="")
    log.info("wrote %s and %s", md_path, csv_path)
    if args.parquet:
        table = predictions_dataset(sweep_dir)
        table.to_parquet(args.parquet)
        log.info("wrote %d predictions of the sweep's finished points to %s", table.num_rows, args.parquet)
    unfinished = unfinished_points(sweep_dir)
    if unfinished and (args.by or args.parquet):  # the plain table lists them, with their status
        log.warning("%d of the sweep's points have not finished and are left out of %s: %s", len(unfinished),
                    " and ".join(w for w, on in (("the means", args.by), ("the Parquet table", args.parquet)) if on),
                    ", ".join(unfinished[:10]) + (" ..." if len(unfinished) > 10 else ""))
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "aggregate",
        help="one table of a sweep's points: sweep keys and main metrics",
        description="Read every point's metrics.json; print a markdown table; write aggregate.md/.csv. Below the "
                    "table: a line per provenance section that differs between the points (warning: data files, "
                    "category names, weights, judge, prompts; note: code version, python, packages, devices), a "
                    "model or judge the sweep varies marked as expected.",
    )
    p.add_argument("dir", help="sweep directory (has sweep.json)")
    p.add_argument("--csv", help="CSV path (default DIR/aggregate.csv)")
    p.add_argument("--md", help="markdown path (default DIR/aggregate.md)")
    p.add_argument("--by", metavar="KEY",
                   help="group the finished points by every sweep key but KEY and print each metric's mean ± std "
                        "(ddof 1) over a group: `--by seed` over repeated seeds (KEY: a sweep key or its last part, "
                        "seed = reader.seed); `points` of `of` finished (the others are named on stderr); writes "
                        "DIR/aggregate_by_KEY.md/.csv")
    p.add_argument("--parquet", metavar="FILE",
                   help="also write every finished point's predictions as one Parquet table (point, sweep keys, "
                        "flattened fields); load it with datasets.load_dataset('parquet', data_files=FILE) or pandas")
    p.set_defaults(func=cmd_aggregate, user_errors=user_errors)
